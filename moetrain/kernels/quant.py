"""FP8 quantization in plain torch: the reference twins of the Triton kernels in `quant_triton`.

Two recipes, both producing `float8_e4m3fn` elements (max finite 448, no infinities):

- Row-scaled FP8: one float32 scale per slice along `dim`, the reduction dim of the GEMM that
  consumes the tensor. `amax` is the largest finite |x| of the slice (computed in fp32, clamped
  below by `AMAX_EPS` so an all-zero slice gets q = 0), `scale = amax / 448` and
  `q = e4m3(saturate(x * (448 / amax)))`. The reciprocal is taken once per slice so the
  per-element operation is one multiply, which torch and Triton round identically.
- MXFP8 (OCP Microscaling Formats v1.0): blocks of 32 contiguous elements along the last dim
  share an E8M0 power-of-two scale `2^X` with `X = floor(log2(amax_block)) - 8` (8 is the
  largest exponent of e4m3), stored biased by 127 in a uint8 and clamped to [0, 254]; elements
  are `e4m3(saturate(x / 2^X))`, exact up to the one e4m3 rounding.

Special values, identical in both recipes and in the Triton kernels:
- Conversion to e4m3 rounds to nearest, ties to even; finite values beyond +-448 saturate.
- NaN stays NaN (always the positive code 0x7F). +-inf saturates to +-448 in the row recipe, where
  infinities are left out of amax so they do not flush their row to zero. In the MX recipe a block
  holding a NaN or an infinity gets the NaN scale 0xFF (the spec's rule for a shared exponent above
  the E8M0 range) and NaN elements.
- Zeros keep their sign.

Invariants: `q` has the input's shape and is contiguous; row scales have the input's shape with
`dim` removed; MX scales have shape `(*x.shape[:-1], x.shape[-1] // 32)`.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
AMAX_EPS = 1e-12  # floor on a row's amax: an all-zero row gets a tiny scale and q = 0
MX_BLOCK = 32
E4M3_EMAX = 8  # floor(log2(448))
E8M0_MAX_FINITE = 254
E8M0_NAN = 255


def _saturate_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn: clamp to +-448 (torch's cast would turn larger values into NaN), then round
    to nearest even; NaN becomes the canonical positive NaN."""
    v = v.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)  # clamp keeps NaN
    v = torch.where(torch.isnan(v), torch.full_like(v, float("nan")), v)
    return v.to(torch.float8_e4m3fn)


def quantize_fp8_rowwise(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-scaled FP8: one scale per slice along `dim`. Returns (q e4m3fn, scale fp32 without `dim`)."""
    dim = dim % x.dim()
    x_f = x.float()
    finite_abs = torch.where(torch.isfinite(x_f), x_f.abs(), torch.zeros_like(x_f))
    amax = finite_abs.amax(dim=dim, keepdim=True).clamp_min(AMAX_EPS)
    # Tensor-by-tensor divisions on purpose: torch computes `scalar / t` as reciprocal(t) * scalar
    # and, on CUDA, `t / scalar` as t * (1 / scalar), both rounded twice; the kernels divide once.
    fp8_max = torch.full_like(amax, FP8_E4M3_MAX)
    q = _saturate_to_e4m3(x_f * (fp8_max / amax)).contiguous()
    scale = (amax / fp8_max).squeeze(dim)
    return q, scale


def dequantize_fp8_rowwise(
    q: torch.Tensor, scale: torch.Tensor, dim: int = -1, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_fp8_rowwise`: q * scale broadcast along `dim`."""
    dim = dim % q.dim()
    return (q.float() * scale.unsqueeze(dim)).to(dtype)


def _float_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def quantize_mxfp8(x: torch.Tensor, block: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (e4m3 elements, E8M0 scales) over blocks of `block` along the last dim.

    Returns (q e4m3fn with x's shape, biased scale exponents uint8 of shape (..., K // block)).
    """
    k = x.shape[-1]
    if k % block != 0:
        raise ValueError(
            f"quantize_mxfp8: last dim {k} must be a multiple of the block size {block}"
        )
    x_b = x.float().reshape(*x.shape[:-1], k // block, block)
    amax = x_b.abs().amax(dim=-1)  # NaN propagates; inf stays inf
    # floor(log2(amax)) is amax's unbiased exponent; an fp32-subnormal or zero amax has exponent
    # field 0, which the clamp maps to the smallest scale, as floor(log2) - 8 < -127 there too.
    exponent_field = (amax.view(torch.int32) >> 23) & 0xFF
    scale_biased = (exponent_field - E4M3_EMAX).clamp(0, E8M0_MAX_FINITE)
    nonfinite = ~torch.isfinite(amax)
    scale_biased = torch.where(nonfinite, torch.full_like(scale_biased, E8M0_NAN), scale_biased)
    # 1 / 2^X = 2^(127 - s) as an fp32 bit pattern; every finite s here is <= 246, so it is normal.
    inv_scale = _float_from_bits((E8M0_MAX_FINITE - scale_biased.clamp(max=E8M0_MAX_FINITE)) << 23)
    inv_scale = torch.where(nonfinite, torch.full_like(inv_scale, float("nan")), inv_scale)
    q = _saturate_to_e4m3(x_b * inv_scale.unsqueeze(-1)).reshape(x.shape).contiguous()
    return q, scale_biased.to(torch.uint8)


def mx_scale_to_float(scale_e8m0: torch.Tensor) -> torch.Tensor:
    """E8M0 byte s -> 2^(s - 127) in float32 (2^-127 is an fp32 subnormal, exact); 255 -> NaN."""
    s = scale_e8m0.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 1 << 22), s << 23)  # 2^-127 = 0x00400000
    out = _float_from_bits(bits)
    return torch.where(s == E8M0_NAN, torch.full_like(out, float("nan")), out)


def dequantize_mxfp8(
    q: torch.Tensor, scale_e8m0: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_mxfp8`: each block of elements times its power-of-two scale."""
    k = q.shape[-1]
    block = k // scale_e8m0.shape[-1]
    q_b = q.float().reshape(*q.shape[:-1], k // block, block)
    return (q_b * mx_scale_to_float(scale_e8m0).unsqueeze(-1)).reshape(q.shape).to(dtype)
