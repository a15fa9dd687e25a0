"""Multi-tensor AdamW in one Triton launch, near copy bandwidth; twin of `adamw_reference`.

AdamW is bound by memory traffic (read grad, param or fp32 master, m and v once; write them
once), so one launch covers every tensor of a call (one dtype signature, one set of
hyper-parameters), each program updating BLOCK elements of one tensor (chunk tables and address
uploads without a host sync: kernels/multi_tensor.py).
- Vector width: loaded pointers carry no alignment facts and a mask against a loaded numel no
  divisibility, either of which makes loads scalar; so when every address is 16-byte aligned
  (checked on the host) the kernel asserts it with `tl.multiple_of` and masks only each tensor's
  last chunk. The default block is one 16-byte vector of each state tensor a thread at 4 warps.
- Per-step scalars (step size lr / bc1, sqrt(bc2), decay 1 - lr * wd) come from the device step
  in fp64 (in fp32, 1 - 0.999**1 loses three digits), once a launch in a one-program prologue;
  its fp64 inputs travel as hi/lo fp32 pairs (Python floats reach Triton as fp32).
- Precision: fp32 per element in the reference's order, no multiply-add contraction, but the
  hardware's square root and division (within 2 fp32 ulps; IEEE-rounded ones made the kernel
  issue-bound). The tests hold it to the reference within one bf16 ulp or fp32 relative 1e-6.
- A nonzero `found_inf` (read on the device) makes the step write nothing.
- The interpreter (TRITON_INTERPRET=1) truncates fp32 -> bf16, so there the rounding to nearest
  even is done on the bits.
Without Triton the module imports, `triton_available()` is False and the entry point raises.
"""

from __future__ import annotations

import math
import struct

import torch

from moetrain.kernels.multi_tensor import chunk_layout, upload
from moetrain.kernels.triton_support import interpreting as _interpreting
from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import tl, triton
from moetrain.kernels.triton_support import triton_available as triton_available

_PARAM_DTYPES = (torch.float32, torch.bfloat16)


# --- kernel ------------------------------------------------------------------------------------


@_jit
def _round_to(x, DTYPE: tl.constexpr, SOFTWARE_ROUND: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even (on the bits for bf16 when SOFTWARE_ROUND)."""
    if SOFTWARE_ROUND and DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = tl.where(x != x, bits | 0x400000, rounded)  # NaN stays a (quiet) NaN
        return (rounded >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@_jit
def _f64(hi, lo):
    """The double carried by an fp32 (hi, lo) pair (see `_hi_lo`)."""
    return tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)


@_jit
def _update(
    p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, mask,
    grad_scale, step_size, bc2_sqrt, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
    PARAM: tl.constexpr, STATE: tl.constexpr, HAS_MASTER: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
):  # fmt: skip
    """One chunk: read grad, weight (master or param), m, v; write them back (and param)."""
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    if HAS_GRAD_SCALE:
        g = g / grad_scale
    if HAS_MASTER:
        w = tl.load(w_ptr + offs, mask=mask)
    else:
        w = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    w = w * decay
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.sqrt(v) / bc2_sqrt + eps
    w = w - (step_size * m) / denom
    tl.store(m_ptr + offs, _round_to(m, STATE, SOFTWARE_ROUND), mask=mask)
    tl.store(v_ptr + offs, _round_to(v, STATE, SOFTWARE_ROUND), mask=mask)
    if HAS_MASTER:
        tl.store(w_ptr + offs, w, mask=mask)
    tl.store(p_ptr + offs, _round_to(w, PARAM, SOFTWARE_ROUND), mask=mask)


@_jit
def _adamw_scalars_kernel(
    out_ptr, step_ptr, lr_ptr, lr_hi, lr_lo, wd_hi, wd_lo,
    log2_beta1_hi, log2_beta1_lo, log2_beta2_hi, log2_beta2_lo, LR_ON_DEVICE: tl.constexpr,
):  # fmt: skip
    """One program: the launch's per-step scalars (step size, sqrt of the second bias
    correction, decay factor) into out_ptr[0:3] as fp32, from fp64 math on the device step."""
    # bias corrections in fp64 from the device step: 1 - beta**step = 1 - 2**(step * log2(beta))
    step = tl.load(step_ptr).to(tl.float64)
    bc1 = 1.0 - tl.exp2(step * _f64(log2_beta1_hi, log2_beta1_lo))
    bc2 = 1.0 - tl.exp2(step * _f64(log2_beta2_hi, log2_beta2_lo))
    if LR_ON_DEVICE:
        lr = tl.load(lr_ptr).to(tl.float64)
    else:
        lr = _f64(lr_hi, lr_lo)
    tl.store(out_ptr, (lr / bc1).to(tl.float32))
    tl.store(out_ptr + 1, tl.sqrt(bc2).to(tl.float32))
    tl.store(out_ptr + 2, (1.0 - lr * _f64(wd_hi, wd_lo)).to(tl.float32))


@_jit
def _adamw_kernel(
    addr_ptr, chunk_ptr, numel_ptr, n_tensors, scalars_ptr, grad_scale_ptr, found_inf_ptr,
    beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
    PARAM: tl.constexpr, GRAD: tl.constexpr, STATE: tl.constexpr, HAS_MASTER: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, ALIGNED: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """addr: int64 (4 or 5, n_tensors) addresses of param, grad, m, v[, master]; chunk: int64
    (n_chunks, 2) tensor index and first element; numel: int64 (n_tensors,); scalars: the fp32
    step size, sqrt(bias correction 2) and decay factor of `_adamw_scalars_kernel`."""
    pid = tl.program_id(0).to(tl.int64)
    i = tl.load(chunk_ptr + 2 * pid)
    start = tl.load(chunk_ptr + 2 * pid + 1)
    numel = tl.load(numel_ptr + i)
    p_ptr = tl.load(addr_ptr + i).to(tl.pointer_type(PARAM))
    g_ptr = tl.load(addr_ptr + n_tensors + i).to(tl.pointer_type(GRAD))
    m_ptr = tl.load(addr_ptr + 2 * n_tensors + i).to(tl.pointer_type(STATE))
    v_ptr = tl.load(addr_ptr + 3 * n_tensors + i).to(tl.pointer_type(STATE))
    w_ptr = p_ptr
    if HAS_MASTER:
        w_ptr = tl.load(addr_ptr + 4 * n_tensors + i).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # checked on the host: every address is a multiple of 16 bytes
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        w_ptr = tl.multiple_of(w_ptr, 16)
        start = tl.multiple_of(start, BLOCK)
    step_size = tl.load(scalars_ptr)
    bc2_sqrt = tl.load(scalars_ptr + 1)
    decay = tl.load(scalars_ptr + 2)
    grad_scale = 1.0
    if HAS_GRAD_SCALE:
        grad_scale = tl.load(grad_scale_ptr)
    run = True
    if HAS_FOUND_INF:
        run = tl.load(found_inf_ptr) == 0
    if run:
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= numel:  # a whole chunk: no element mask, full-width vectors
            _update(
                p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, None,
                grad_scale, step_size, bc2_sqrt, decay, beta1, one_minus_beta1, beta2,
                one_minus_beta2, eps, PARAM, STATE, HAS_MASTER, HAS_GRAD_SCALE, SOFTWARE_ROUND,
            )  # fmt: skip
        else:
            _update(
                p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, offs < numel,
                grad_scale, step_size, bc2_sqrt, decay, beta1, one_minus_beta1, beta2,
                one_minus_beta2, eps, PARAM, STATE, HAS_MASTER, HAS_GRAD_SCALE, SOFTWARE_ROUND,
            )  # fmt: skip


# --- launcher ----------------------------------------------------------------------------------


def _hi_lo(x: float) -> tuple[float, float]:
    """A double as two fp32 values whose sum (in fp64) holds about 48 bits of it."""
    if not math.isfinite(x):
        return x, 0.0
    hi = struct.unpack("f", struct.pack("f", x))[0]
    return hi, x - hi


def _common_dtype(tensors: list[torch.Tensor], what: str, allowed) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or next(iter(dtypes)) not in allowed:
        raise ValueError(f"multi_tensor_adamw_: {what} must share one dtype of {allowed}: {dtypes}")
    return dtypes.pop()


def _check_scalar(t: torch.Tensor | None, name: str, device: torch.device) -> None:
    if t is not None and (t.dtype != torch.float32 or t.numel() != 1 or t.device != device):
        raise ValueError(f"multi_tensor_adamw_: {name} must be a float32 scalar on {device}")


def multi_tensor_adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    masters: list[torch.Tensor] | None,
    step: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    weight_decay: float,
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    block: int | None = None,
    num_warps: int = 4,
) -> None:
    """AdamW (decoupled weight decay) on every tensor of the lists, in one launch, in place.

    `step`: the device step count after this step's increment (`step += 1 - found_inf`); grads
    are divided by `grad_scale` as read; a nonzero `found_inf` leaves every tensor untouched.
    With `masters` the fp32 masters carry the update and params get their rounded copies. All
    tensors contiguous on one CUDA device (CPU under TRITON_INTERPRET=1), one dtype per list.
    `lr` may be an fp64 device scalar (CUDA graph capture).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed: use moetrain.kernels.adamw_reference instead")
    lists = [params, grads, exp_avgs, exp_avg_sqs] + ([masters] if masters is not None else [])
    if any(len(x) != len(params) for x in lists):
        raise ValueError("multi_tensor_adamw_: the tensor lists differ in length")
    if not params:
        return
    device = params[0].device
    for group in zip(*lists, strict=True):
        if any(t.shape != group[0].shape for t in group):
            raise ValueError(f"multi_tensor_adamw_: shapes differ: {[t.shape for t in group]}")
        if any(not t.is_contiguous() for t in group):
            raise ValueError("multi_tensor_adamw_: every tensor must be contiguous")
        if any(t.device != device for t in group):
            raise ValueError(f"multi_tensor_adamw_: every tensor must be on {device}")
    if device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"multi_tensor_adamw_ needs CUDA tensors (or TRITON_INTERPRET=1): {device}"
        )
    for name, t in (("step", step), ("grad_scale", grad_scale), ("found_inf", found_inf)):
        _check_scalar(t, name, device)
    lr_on_device = isinstance(lr, torch.Tensor)
    if lr_on_device and (lr.dtype != torch.float64 or lr.numel() != 1 or lr.device != device):
        raise ValueError(f"multi_tensor_adamw_: a tensor lr must be a float64 scalar on {device}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"multi_tensor_adamw_: betas must be in [0, 1): {beta1}, {beta2}")
    param_dtype = _common_dtype(params, "params", _PARAM_DTYPES)
    grad_dtype = _common_dtype(grads, "grads", _PARAM_DTYPES)
    state_dtype = _common_dtype(exp_avgs + exp_avg_sqs, "exp_avgs and exp_avg_sqs", _PARAM_DTYPES)
    if masters is not None:
        _common_dtype(masters, "masters", (torch.float32,))
    if block is None:
        block = 32 * num_warps * 16 // exp_avgs[0].element_size()
    if block & (block - 1) or block < 16:
        raise ValueError(f"multi_tensor_adamw_: block {block} must be a power of two >= 16")

    chunk_c2, numel_n, n_chunks = chunk_layout(tuple(p.numel() for p in params), block, device)
    if n_chunks == 0:
        return
    addrs = [[t.data_ptr() for t in x] for x in lists]
    aligned = all(a % 16 == 0 for row in addrs for a in row)
    addr_rn = upload(torch.tensor(addrs, dtype=torch.int64), device)
    lr_hi, lr_lo = (0.0, 0.0) if lr_on_device else _hi_lo(lr)
    wd_hi, wd_lo = _hi_lo(weight_decay)
    b1_hi, b1_lo = _hi_lo(math.log2(beta1) if beta1 > 0 else -math.inf)
    b2_hi, b2_lo = _hi_lo(math.log2(beta2) if beta2 > 0 else -math.inf)
    scalars = torch.empty(3, dtype=torch.float32, device=device)
    _adamw_scalars_kernel[(1,)](
        scalars, step, lr if lr_on_device else None, lr_hi, lr_lo, wd_hi, wd_lo,
        b1_hi, b1_lo, b2_hi, b2_lo, LR_ON_DEVICE=lr_on_device, num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip
    tl_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}
    _adamw_kernel[(n_chunks,)](
        addr_rn, chunk_c2, numel_n, len(params), scalars, grad_scale, found_inf,
        beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps,
        PARAM=tl_dtype[param_dtype], GRAD=tl_dtype[grad_dtype], STATE=tl_dtype[state_dtype],
        HAS_MASTER=masters is not None, HAS_GRAD_SCALE=grad_scale is not None,
        HAS_FOUND_INF=found_inf is not None, ALIGNED=aligned, SOFTWARE_ROUND=device.type != "cuda",
        BLOCK=block, num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip
