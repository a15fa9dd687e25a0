"""Cross-entropy of one chunk of logits and its gradient, in one Triton kernel.

Twin of `moetrain.nn.loss._chunk_loss_and_grad`, which moetrain/nn/loss.py replaces with it on
CUDA: for logits (C, V) and targets (C,), the summed loss sum_c lse_c - logit[c, target_c] (fp32
scalar) and a new gradient scale * (softmax - onehot) in the logits' dtype.

One program of 32 warps per row: pass 1 reads the row for its logsumexp and the target's logit,
pass 2 reads it again and writes the gradient. Pass 2 reads from L2 only while few rows are in
flight: 1024-thread programs allow at most two an SM, and L2 eviction hints (`hints`) keep the
rows there between the passes.
- The exponential unit bounds it too: the online logsumexp keeps its max and sum per SUB-element
  group (one thread's load), so the rescale is paid once a group.
- Runtime loops over the vocabulary; int64 row offsets; masked tails. A target outside [0, V) is
  not read and gives its row a NaN loss (a skipped step upstream).
- Gradient: exp(x - lse) * scale, minus scale at the target, in fp32, rounded once; exp is the
  hardware's approximation (one ulp of the output dtype from the torch chunk). Row losses go to a
  (C,) buffer summed by torch (no atomics).
- No calls between jitted functions (torch's mutation analysis gives up on them: docs/design.md).
Without Triton the module imports, `triton_available()` is False and the entry point raises.
"""

from __future__ import annotations

import torch

from moetrain.kernels.triton_support import interpreting as _interpreting
from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import loop_bound as _loop_bound
from moetrain.kernels.triton_support import tl, triton
from moetrain.kernels.triton_support import triton_available as triton_available

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@_jit
def _ce_rows_kernel(
    logits_ptr, targets_ptr, grad_ptr, loss_ptr, V, scale,
    BLOCK_R: tl.constexpr, SUB: tl.constexpr, KEEP: tl.constexpr, STREAM: tl.constexpr,
):  # fmt: skip
    """Row pid: pass 1 its lse and loss, pass 2 its gradient."""
    row = tl.program_id(0).to(tl.int64)
    src = logits_ptr + row * V
    dst = grad_ptr + row * V
    offs_RS = tl.arange(0, BLOCK_R)[:, None] * SUB + tl.arange(0, SUB)[None, :]
    # pass 1: per SUB-group online logsumexp over the row
    max_R = tl.full([BLOCK_R], float("-inf"), tl.float32)
    sum_R = tl.zeros([BLOCK_R], tl.float32)
    for start in tl.range(0, V, BLOCK_R * SUB):
        cols_RS = start + offs_RS
        x_RS = tl.load(
            src + cols_RS, mask=cols_RS < V, other=float("-inf"), eviction_policy=KEEP
        ).to(tl.float32)
        new_max_R = tl.maximum(max_R, tl.max(x_RS, axis=1))
        # a group that has seen only -inf (the masked tail) shifts by 0: its sum stays 0
        shift_R = tl.where(new_max_R == float("-inf"), 0.0, new_max_R)
        sum_R = sum_R * tl.exp(max_R - shift_R) + tl.sum(tl.exp(x_RS - shift_R[:, None]), 1)
        max_R = new_max_R
    row_max = tl.max(max_R, axis=0)
    lse = row_max + tl.log(tl.sum(sum_R * tl.exp(max_R - row_max), axis=0))
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = (target >= 0) & (target < V)  # a bad id: NaN loss, no stray read
    x_target = tl.load(src + target, mask=valid, other=float("nan")).to(tl.float32)
    tl.store(loss_ptr + row, lse - x_target)
    # pass 2: scale * (softmax - onehot), each element read and written by one thread
    for start in tl.range(0, V, BLOCK_R * SUB):
        cols_RS = start + offs_RS
        mask_RS = cols_RS < V
        x_RS = tl.load(src + cols_RS, mask=mask_RS, other=0.0, eviction_policy=STREAM)
        g_RS = tl.exp(x_RS.to(tl.float32) - lse) * scale
        g_RS -= tl.where(cols_RS == target, scale, 0.0)
        g_RS = g_RS.to(grad_ptr.dtype.element_ty)
        tl.store(dst + cols_RS, g_RS, mask=mask_RS, eviction_policy=STREAM)


def chunk_loss_and_grad_triton(
    logits_CV: torch.Tensor,
    targets_C: torch.Tensor,
    scale: float,
    *,
    block: int = 8192,
    sub: int = 8,
    num_warps: int = 32,
    hints: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss as an fp32 scalar, gradient (C, V) in the logits' dtype).

    block: columns per loop step, sub: columns per online-logsumexp group (powers of two; block
    is capped at V's next power of two); num_warps per program (one program per row); hints: L2
    eviction hints."""
    if triton is None:
        raise RuntimeError("Triton is not installed: use moetrain.nn.loss's torch chunk instead")
    if logits_CV.device.type == "cpu" and not _interpreting():
        raise ValueError("Triton needs a CUDA tensor (or TRITON_INTERPRET=1)")
    if logits_CV.dtype not in KERNEL_DTYPES:
        raise TypeError(f"expected bf16, fp16 or fp32 logits, got {logits_CV.dtype}")
    if logits_CV.dim() != 2 or not logits_CV.is_contiguous():
        raise ValueError(f"logits must be a contiguous (C, V) matrix, got {tuple(logits_CV.shape)}")
    C, V = logits_CV.shape
    if targets_C.shape != (C,):
        raise ValueError(f"targets must have shape ({C},), got {tuple(targets_C.shape)}")
    if block & (block - 1) or sub & (sub - 1):
        raise ValueError(f"block ({block}) and sub ({sub}) must be powers of two")
    grad_CV = torch.empty_like(logits_CV)
    loss_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    if C and V:
        block = max(1, min(block, triton.next_power_of_2(V)))
        sub = min(sub, block)
        evict = dict(KEEP="evict_last", STREAM="evict_first") if hints else dict(KEEP="", STREAM="")
        _ce_rows_kernel[(C,)](
            logits_CV, targets_C.contiguous(), grad_CV, loss_C, _loop_bound(V), float(scale),
            BLOCK_R=block // sub, SUB=sub, num_warps=num_warps, **evict,
        )  # fmt: skip
    elif C:  # no classes: every target is out of range
        loss_C.fill_(float("nan"))
    return loss_C.sum(), grad_CV
