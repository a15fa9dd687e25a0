"""Cross-entropy of one chunk of logits and its gradient, in two passes over each row (Triton).

Twin of `moetrain.nn.loss._chunk_loss_and_grad`: for logits (C, V) and targets (C,), the per-row
loss lse - logit[target] (fp32) and scale * (softmax - onehot) in the logits' dtype. One program
per row: pass 1 keeps a running max and sum of exponentials per lane (an online logsumexp, one
read of the row), pass 2 reads the row again (from L2: a 50k-vocabulary bf16 row is 100 KB) and
writes the gradient. Memory traffic is one read and one write of the chunk from DRAM, the floor
of the op; the compiled torch version it replaces made about 2.3x that traffic on an H200 (0.46
ms per 4096 x 50304 bf16 chunk, against 0.2 ms at copy bandwidth).

The vocabulary is walked in a constexpr number of blocks (runtime loop bounds trip the
interpreter). Math in fp32; the gradient is rounded once at the store.
"""

from __future__ import annotations

import torch

from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import tl, triton
from moetrain.kernels.triton_support import triton_available as triton_available

BLOCK_V = 4096


@_jit
def _ce_rows_kernel(
    logits_ptr, targets_ptr, grad_ptr, loss_ptr, V, scale,
    BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    src = logits_ptr + row * V
    dst = grad_ptr + row * V
    cols = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    for b in tl.static_range(NUM_BLOCKS):  # pass 1: per-lane online logsumexp
        c = b * BLOCK + cols
        x = tl.load(src + c, mask=c < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, x)
        # a lane that has seen only -inf (padding) shifts by 0, so its sum stays 0 without NaN
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(x - shift)
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    lse = row_max + tl.log(tl.sum(run_sum * tl.exp(run_max - row_max), axis=0))
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = (target >= 0) & (
        target < V
    )  # a bad id gives a NaN loss (a skipped step), no stray read
    x_target = tl.load(src + target, mask=valid, other=float("nan")).to(tl.float32)
    tl.store(loss_ptr + row, lse - x_target)
    for b in tl.static_range(NUM_BLOCKS):  # pass 2: scale * (softmax - onehot)
        c = b * BLOCK + cols
        x = tl.load(src + c, mask=c < V, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(c == target, 1.0, 0.0)) * scale
        tl.store(dst + c, g.to(grad_ptr.dtype.element_ty), mask=c < V)


def chunk_loss_and_grad_triton(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss as an fp32 scalar, gradient (C, V) in the logits' dtype)."""
    if triton is None:
        raise RuntimeError("Triton is not installed: use moetrain.nn.loss's torch chunk instead")
    if logits_CV.dim() != 2 or not logits_CV.is_contiguous():
        raise ValueError(f"logits must be a contiguous (C, V) matrix, got {tuple(logits_CV.shape)}")
    C, V = logits_CV.shape
    loss_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    grad_CV = torch.empty_like(logits_CV)
    block = min(BLOCK_V, triton.next_power_of_2(V))
    _ce_rows_kernel[(C,)](
        logits_CV, targets_C, grad_CV, loss_C, V, scale,
        BLOCK=block, NUM_BLOCKS=triton.cdiv(V, block), num_warps=8,
    )  # fmt: skip
    return loss_C.sum(), grad_CV
