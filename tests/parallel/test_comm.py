"""The collectives' payloads in a group of one (moetrain.parallel.comm): what the rows come back
as, eager and compiled, is what an exchange returns: the payload's rows encoded and decoded, the
gradient straight through (multi-rank exchanges: tests/parallel/test_ep_dispatch.py)."""

from __future__ import annotations

import pytest
import torch

from moetrain.moe.payload import BF16_PAYLOAD, FP8_PAYLOAD, decode_fp8_rows, encode_fp8_rows
from moetrain.parallel.comm import AsyncExchange, all_to_all, exchange_blocks


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 64, generator=generator) * torch.logspace(-2, 2, 24)[:, None]
    return x.to(torch.bfloat16), torch.randn(24, 64, generator=generator).to(torch.bfloat16)


def _forward_backward(fn, x, g):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(g[: y.shape[0]])
    return y.detach(), x.grad


@pytest.mark.parametrize("payload", [BF16_PAYLOAD, FP8_PAYLOAD], ids=["bf16", "fp8"])
def test_all_to_all_in_a_group_of_one_is_the_exchange(payload):
    """With no sink rows the rows skip the buffers of an exchange, keeping its values and
    gradient (bf16: the input itself)."""
    x, g = _rows(0)
    got = _forward_backward(lambda t: all_to_all(t, None, payload=payload), x, g)
    exchange = _forward_backward(
        lambda t: AsyncExchange(None, payload=payload).begin(t).end(), x, g
    )
    for a, b in zip(got, exchange, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got[1], g)  # straight through
    assert all_to_all(x, None, payload=BF16_PAYLOAD) is x


def test_compiled_exchange_in_a_group_of_one_is_the_packed_rows_decoded():
    """Compiled (one graph), the FP8 rows of a group of one are the packed rows decoded, as
    eager: bit for bit, the gradient straight through, the sink row zero."""
    x, g = _rows(1)
    g = torch.cat([g, torch.randn(1, 64).to(g.dtype)])

    def exchange(t):
        return exchange_blocks(t, None, sink_rows=1, payload=FP8_PAYLOAD)

    compiled = torch.compile(exchange, fullgraph=True, backend="aot_eager")
    eager = _forward_backward(exchange, x, g)
    got = _forward_backward(compiled, x, g)
    for a, b in zip(got, eager, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got[0][:-1], decode_fp8_rows(encode_fp8_rows(x), x.dtype))
    assert torch.equal(got[0][-1], torch.zeros(64, dtype=x.dtype))
    assert torch.equal(got[1], g[:-1])
