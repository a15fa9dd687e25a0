"""Orthogonalization by the quintic Newton-Schulz iteration, Muon's core: a batch of matrices
G_bmn, each mapped to about U V^T of its SVD G = U S V^T (every singular value pushed towards 1).

Each matrix is divided by its Frobenius norm (all singular values in [0, 1]), then X <- a X +
(b A + c A^2) X with A = X X^T, `steps` times, on the wide orientation (m <= n, so A is the
smaller m x m Gram matrix). The coefficients (a, b, c) = (3.4445, -4.7750, 2.0315) are Keller
Jordan's: they raise small singular values fast (slope a = 3.4 at 0) at the price of not
converging exactly; after 5 steps the singular values of a well-conditioned input sit in about
[0.7, 1.2] (the tests measure it), which is all Muon needs. `newton_schulz` runs the products in
bf16 as batched GEMMs (no loop over matrices); `newton_schulz_reference` is its slow twin, one
matrix at a time in fp32 with plain products.
"""

from __future__ import annotations

import torch

QUINTIC = (3.4445, -4.7750, 2.0315)
NORM_EPS = 1e-7  # keeps a zero matrix (an expert that received no token) at zero


def newton_schulz(
    g_bmn: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The orthogonalized batch (b, m, n), in `dtype`: norms in fp32, then `steps` quintic
    iterations whose products run in `dtype` (each step is two batched GEMMs with the
    scale-and-add fused in: `baddbmm`)."""
    a, b, c = QUINTIC
    x = g_bmn.float()
    x = (x / (torch.linalg.matrix_norm(x, keepdim=True) + NORM_EPS)).to(dtype)
    wide = x.size(-2) <= x.size(-1)
    if not wide:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return x if wide else x.mT


def newton_schulz_reference(g_mn: torch.Tensor, steps: int) -> torch.Tensor:
    """One matrix (m, n), fp32 throughout, the iteration written out: the twin of
    `newton_schulz`."""
    a, b, c = QUINTIC
    x = g_mn.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (x.norm() + NORM_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x
