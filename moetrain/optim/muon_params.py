"""Which parameters Muon updates, and how each one is a batch of matrices.

Muon orthogonalizes the update of every weight matrix that maps hidden features to hidden
features: the attention projections q, k, v, o, and the gate, up and down projections of the
dense MLPs, the shared experts and every routed expert. AdamW keeps what is not such a map: the
embedding (a lookup table: each row moves only with its own token), the LM head (a classifier
over the vocabulary, whose rows Muon's equalized singular values would mix), the router gate
(one row per expert: an orthogonalized update would move every expert's row by the same amount
whatever its gradient) and every 1-D parameter (norm weights).

Gate and up are stored as one tensor (`w_gate_up.weight` (2H, D) of the dense SwiGLU, rows
[gate; up]; `w_up_eD2F` (e, D, 2F) of the experts, columns [gate | up]) but are two linear maps,
so they are orthogonalized as two matrices. A `MatrixLayout` turns a parameter (or the
gradient-shaped tensors of its state, or a dim-0 slice of an expert weight: some of its
experts) into a batch (B, rows, cols) and back, with no loop over experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ADAMW_MATRICES = ("embed.weight", "lm_head.weight", "router.gate.weight")
FUSED_COLUMNS = "w_up_eD2F"  # (..., D, 2F): gate | up along the last dim
FUSED_ROWS = "w_gate_up.weight"  # (2H, D): gate rows, then up rows


@dataclass(frozen=True)
class MatrixLayout:
    """A tensor of shape (..., R, C) as a batch of matrices. `split`: the dim (-1 or -2) along
    which two matrices are concatenated (gate and up), or None."""

    split: int | None = None

    def matrix_shape(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
        rows, cols = shape[-2], shape[-1]
        if self.split == -1:
            return rows, cols // 2
        if self.split == -2:
            return rows // 2, cols
        return rows, cols

    def num_matrices(self, shape: torch.Size | tuple[int, ...]) -> int:
        return math.prod(shape[:-2]) * (1 if self.split is None else 2)

    def to_matrices(self, t: torch.Tensor) -> torch.Tensor:
        """(B, rows, cols); a view where the layout allows (all but FUSED_COLUMNS)."""
        rows, cols = self.matrix_shape(t.shape)
        if self.split == -1:  # (..., R, 2, C/2) -> (..., 2, R, C/2)
            t = t.unflatten(-1, (2, cols)).movedim(-2, -3)
        return t.reshape(-1, rows, cols)

    def from_matrices(self, u_bmn: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The inverse of `to_matrices` for a tensor of `shape`."""
        if self.split == -1:
            rows, cols = self.matrix_shape(shape)
            return u_bmn.reshape(*shape[:-2], 2, rows, cols).movedim(-3, -2).reshape(shape)
        return u_bmn.reshape(shape)

    def update_scale(self, shape: torch.Size | tuple[int, ...], update_rms: float) -> float:
        """Moonlight's factor: an orthogonal rows x cols matrix has RMS 1 / sqrt(max(rows,
        cols)), so update_rms x sqrt(max(rows, cols)) gives the update the RMS `update_rms`
        (about AdamW's), and AdamW's learning rate and weight decay carry over."""
        return update_rms * math.sqrt(max(self.matrix_shape(shape)))


def matrix_layout(name: str, ndim: int) -> MatrixLayout | None:
    """The layout of parameter `name` if Muon updates it, else None (AdamW's)."""
    if ndim < 2 or name.endswith(ADAMW_MATRICES):
        return None
    if name.endswith(FUSED_COLUMNS):
        return MatrixLayout(split=-1)
    if name.endswith(FUSED_ROWS):
        return MatrixLayout(split=-2)
    return MatrixLayout()


def split_param_groups(
    param_groups: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`build_param_groups` output as (Muon's groups, AdamW's groups): each group's parameters
    divided by `matrix_layout`, every other key kept; empty groups dropped."""
    muon, adamw = [], []
    for group in param_groups:
        pairs = list(zip(group["param_names"], group["params"], strict=True))
        for out, keep in ((muon, True), (adamw, False)):
            chosen = [(n, p) for n, p in pairs if (matrix_layout(n, p.ndim) is not None) == keep]
            if chosen:
                out.append(
                    {
                        **group,
                        "param_names": [n for n, _ in chosen],
                        "params": [p for _, p in chosen],
                    }
                )
    return muon, adamw
