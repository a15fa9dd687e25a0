"""Document masking: document ids and positions, the dense reference against each document run
alone, and the block-sparse path's BlockMask against FlexAttention's own `create_block_mask`
and, compiled on CPU (forward only: FlexAttention has no CPU backward), against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from moetrain.nn.attention import Attention
from moetrain.nn.document_mask import DocumentMask

EOS = 7


def packed_tokens(B: int, S: int, eos_rate: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOS, (B, S), generator=gen)
    return torch.where(torch.rand(B, S, generator=gen) < eos_rate, EOS, tokens)


def segments(row: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each document of a row: a new one at every EOS (and at position 0)."""
    starts = [0] + [s for s, t in enumerate(row) if t == EOS and s > 0]
    return list(zip(starts, [*starts[1:], len(row)], strict=True))


def test_ids_and_reset_positions_follow_the_eos_tokens():
    tokens = packed_tokens(3, 50, 0.15, seed=0)
    tokens[0, 0], tokens[1] = EOS, torch.arange(50) % 3  # a row that starts at an EOS; none
    docs = DocumentMask.from_tokens(tokens, EOS, reset_positions=True, block_sparse=False)
    for b, row in enumerate(tokens.tolist()):
        ids, positions = [], []
        for doc, (start, end) in enumerate(segments(row)):
            ids += [doc + (row[0] == EOS)] * (end - start)
            positions += list(range(end - start))
        assert docs.ids_BS[b].tolist() == ids and docs.positions_BS[b].tolist() == positions
    plain = DocumentMask.from_tokens(tokens, EOS, reset_positions=False, block_sparse=False)
    assert plain.positions_BS is None and torch.equal(plain.ids_BS, docs.ids_BS)


@pytest.mark.parametrize("N,G", [(4, 4), (4, 2), (6, 1)])
def test_dense_reference_equals_each_document_alone_with_gradients(N, G):
    """float64, fresh random inputs: outputs and the gradients of q, k, v."""
    B, S, H = 3, 40, 8
    tokens = packed_tokens(B, S, 0.12, seed=N + G)
    docs = DocumentMask.from_tokens(tokens, EOS, reset_positions=False, block_sparse=False)
    gen = torch.Generator().manual_seed(N * G)
    q, k, v = (torch.randn(B, n, S, H, generator=gen, dtype=torch.float64) for n in (N, G, G))
    grad_out = torch.randn(B, N, S, H, generator=gen, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = docs.attend(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out)
    expected = torch.zeros_like(out)
    for b, row in enumerate(tokens.tolist()):
        for start, end in segments(row):
            part = [t[b : b + 1, :, start:end] for t in leaves]
            expected[b, :, start:end] = F.scaled_dot_product_attention(
                *part, is_causal=True, enable_gqa=N != G
            )[0]
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


BLOCK_CASES = [  # B, S, EOS rate: rows of whole blocks and not, no boundaries, many, one block
    (2, 256, 0.01),
    (3, 300, 0.02),
    (1, 64, 0.1),
    (2, 1024, 0.004),
    (2, 512, 0.0),
    (1, 384, 0.5),
]


@pytest.mark.parametrize("B,S,rate", BLOCK_CASES)
def test_block_mask_equals_flex_attentions_create_block_mask(B, S, rate):
    """Every tensor of the BlockMask (partial and full blocks, by key and by query) equals the
    one create_block_mask derives from the full S x S mask of the same documents."""
    tokens = packed_tokens(B, S, rate, seed=S)
    docs = DocumentMask.from_tokens(tokens, EOS, reset_positions=False, block_sparse=True)
    ids = docs.ids_BS

    def same_document_causal(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    expected = create_block_mask(same_document_causal, B, None, S, S, device="cpu")
    got = docs.block_mask
    assert got.seq_lengths == expected.seq_lengths and got.BLOCK_SIZE == expected.BLOCK_SIZE
    for name in (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    ):
        a, b = getattr(got, name), getattr(expected, name)
        assert a.shape == b.shape and torch.equal(a, b), name
        # FlexAttention's kernels read a row of block indices as consecutive memory, whatever
        # the strides: a transposed layout gave wrong dk and dv on the GPU
        assert a.is_contiguous(), name


@pytest.mark.slow  # ~25 s: one CPU compilation of an attention layer with FlexAttention
def test_compiled_attention_with_block_sparse_documents_matches_the_dense_reference():
    """The block-sparse path end to end, as a compiled block runs it: an attention layer
    compiled with FlexAttention inlined (which reads the block lists: skipped blocks included)
    against the eager layer with the dense mask, positions reset, GQA, rows that are not a whole
    number of blocks, two document layouts (no recompilation); forward only (FlexAttention has
    no CPU backward). Without qk-norm, v is a view into the projection, which Inductor's CPU
    FlexAttention misread before `_own_rows`."""
    torch.manual_seed(0)
    B, S = 2, 200
    attn = Attention(64, 4, 2, 16, qk_norm="none", max_positions=S)
    compiled = torch.compile(attn)
    for seed, rate in ((0, 0.02), (1, 0.1)):
        tokens = packed_tokens(B, S, rate, seed=seed)
        x = torch.randn(B, S, 64, generator=torch.Generator().manual_seed(seed))
        sparse, dense = (
            DocumentMask.from_tokens(tokens, EOS, reset_positions=True, block_sparse=b)
            for b in (True, False)
        )
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, sparse), attn(x, dense), rtol=1e-5, atol=1e-5)
