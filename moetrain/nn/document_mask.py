"""Document masking of packed sequences: a position attends only to the earlier positions of its
own document.

Letters: B batch, S sequence, N query heads, G key/value heads, H head dim, K blocks of BLOCK
positions along a row (ceil(S / BLOCK)).
A document starts at each EOS (which plays the next document's beginning-of-sequence token) and
at the row's first position, so every position predicts its target from its own document alone.
Document ids (non-decreasing along a row) and positions are derived on the device from the token
ids (`DocumentMask.from_tokens`): no host sync, fixed shapes, CUDA-graphable. With
`reset_positions` RoPE positions restart at 0 at each document start.

Two ways to attend, equal up to rounding (`DocumentMask.attend`):
- block-sparse (CUDA): FlexAttention with a `BlockMask` from each block's first and last
  document id (empty, full or partial blocks; O(B K^2) work, never an S x S mask);
- dense (CPU, and the reference): SDPA with a (B, 1, S, S) boolean mask.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 128  # FlexAttention's default sparse block size: the granularity of skipped work
# The dense path on CUDA (the reference there): no fused kernel takes an fp32 boolean mask with
# GQA, so math stays allowed. On the CPU the caller's choice stands (its flash kernel takes it).
_DENSE_CUDA_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


@functools.cache
def compiled_flex_attention():
    """flex_attention under torch.compile, for eager callers: eager, flex_attention materializes
    the scores; compiled, it is one fused Triton kernel each way. Compiled blocks call
    flex_attention directly (dynamo inlines it)."""
    return torch.compile(flex_attention, dynamic=False)


@dataclass(frozen=True)
class DocumentMask:
    """The documents of a batch of packed rows: what attention and RoPE need to keep them apart."""

    ids_BS: torch.Tensor  # int32 document index of each position within its row
    positions_BS: torch.Tensor | None  # int32 position within its document; None: 0..S-1
    block_mask: BlockMask | None  # the block-sparse path's mask; None: the dense path

    @classmethod
    def from_tokens(
        cls, tokens_BS: torch.Tensor, eos_id: int, *, reset_positions: bool, block_sparse: bool
    ) -> DocumentMask:
        S = tokens_BS.shape[1]
        is_eos_BS = tokens_BS == eos_id
        ids_BS = is_eos_BS.cumsum(1, dtype=torch.int32)
        positions_BS = None
        if reset_positions:
            s_S = torch.arange(S, dtype=torch.int32, device=tokens_BS.device)
            starts_BS = torch.where(is_eos_BS, s_S, 0).cummax(1).values
            positions_BS = s_S - starts_BS
        block_mask = document_block_mask(ids_BS) if block_sparse else None
        return cls(ids_BS, positions_BS, block_mask)

    def dense_mask(self) -> torch.Tensor:
        """(B, 1, S, S) boolean: query s may attend key t (t <= s, same document)."""
        S = self.ids_BS.shape[1]
        causal_SS = torch.ones(S, S, dtype=torch.bool, device=self.ids_BS.device).tril()
        same_BSS = self.ids_BS[:, :, None] == self.ids_BS[:, None, :]
        return (same_BSS & causal_SS)[:, None]

    def attend(
        self, q_BNSH: torch.Tensor, k_BGSH: torch.Tensor, v_BGSH: torch.Tensor
    ) -> torch.Tensor:
        """Softmax attention of each query over the keys its document shows it, (B, N, S, H)."""
        gqa = q_BNSH.shape[1] != k_BGSH.shape[1]
        if self.block_mask is not None:
            q_BNSH, k_BGSH, v_BGSH = (_own_rows(t) for t in (q_BNSH, k_BGSH, v_BGSH))
            # inside a compiled block dynamo inlines flex_attention itself; eager, it is compiled
            flex = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
            return flex(q_BNSH, k_BGSH, v_BGSH, block_mask=self.block_mask, enable_gqa=gqa)
        dense_kernels = (
            sdpa_kernel(_DENSE_CUDA_BACKENDS) if q_BNSH.is_cuda else contextlib.nullcontext()
        )
        with dense_kernels:
            return F.scaled_dot_product_attention(
                q_BNSH, k_BGSH, v_BGSH, attn_mask=self.dense_mask(), enable_gqa=gqa
            )


def _own_rows(x_BNSH: torch.Tensor) -> torch.Tensor:
    """x itself, or a copy when its rows are a view into wider ones (v split off the qkv
    projection): compiled, FlexAttention read such a v wrongly (torch 2.13, Inductor on CPU)."""
    B, N, S, H = x_BNSH.shape
    if x_BNSH.stride(2) == N * H and x_BNSH.stride(3) == 1 or x_BNSH.is_contiguous():
        return x_BNSH
    return x_BNSH.transpose(1, 2).contiguous().transpose(1, 2)


def document_block_mask(ids_BS: torch.Tensor, block: int = BLOCK) -> BlockMask:
    """FlexAttention's BlockMask of causal attention within documents, from the non-decreasing
    document ids of each row (see the module docstring), built with device ops only. A row whose
    length is not a multiple of `block` is padded with one more document, which no real query
    sees."""
    B, S = ids_BS.shape
    K = -(-S // block)
    pad = K * block - S
    ids_BT = torch.cat([ids_BS, (ids_BS[:, -1:] + 1).expand(B, pad)], 1) if pad else ids_BS
    first_BK, last_BK = ids_BT.view(B, K, block)[..., 0], ids_BT.view(B, K, block)[..., -1]
    k_K = torch.arange(K, device=ids_BS.device)
    below_KK = k_K[None, :] <= k_K[:, None]  # [query block i, key block j]: j <= i
    meets_BKK = (first_BK[:, :, None] <= last_BK[:, None, :]) & (
        first_BK[:, None, :] <= last_BK[:, :, None]
    )
    full_BKK = (k_K[None, :] < k_K[:, None]) & (first_BK[:, None, :] == last_BK[:, :, None])
    partial_BKK = meets_BKK & below_KK & ~full_BKK

    def same_document_causal(b, h, q_idx, kv_idx):
        return (ids_BT[b, q_idx] == ids_BT[b, kv_idx]) & (q_idx >= kv_idx)

    kv_num, kv_indices = _ordered(partial_BKK)
    full_kv_num, full_kv_indices = _ordered(full_BKK)
    q_num, q_indices = _ordered(partial_BKK.transpose(1, 2))
    full_q_num, full_q_indices = _ordered(full_BKK.transpose(1, 2))
    return BlockMask(
        seq_lengths=(S, S),
        kv_num_blocks=kv_num,
        kv_indices=kv_indices,
        full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_indices,
        q_num_blocks=q_num,
        q_indices=q_indices,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_indices,
        BLOCK_SIZE=(block, block),
        mask_mod=same_document_causal,
    )


def _ordered(blocks_BKK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) of the set blocks of each row, set ones first in ascending order, as
    BlockMask holds them: (B, 1, K) and (B, 1, K, K) int32, contiguous (FlexAttention reads a
    row of indices as consecutive memory whatever the strides: a transposed argsort gave wrong
    dk, dv)."""
    blocks = blocks_BKK.to(torch.int32)[:, None]
    indices = torch.argsort(blocks, dim=-1, descending=True, stable=True)
    count = blocks.sum(-1, dtype=torch.int32)
    return (
        count.to(memory_format=torch.contiguous_format),
        indices.to(torch.int32, memory_format=torch.contiguous_format),
    )
