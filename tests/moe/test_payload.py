"""FP8 dispatch payload: packing, the straight-through round trip, and the local dispatcher."""

from __future__ import annotations

import torch

from moetrain.kernels import quant
from moetrain.moe.dispatch import LocalDispatcher
from moetrain.moe.payload import (
    BF16_PAYLOAD,
    FP8_PAYLOAD,
    SCALE_BYTES,
    decode_fp8_rows,
    encode_fp8_rows,
    fp8_round_trip,
    fp8_round_trip_reference,
)
from moetrain.moe.router import RouterConfig, TopKRouter


def test_packed_rows_hold_the_fp8_elements_and_the_row_scale():
    x = torch.randn(37, 64, dtype=torch.bfloat16) * torch.logspace(-3, 3, 37)[:, None]
    x[5] = 0  # an all-zero row keeps a finite scale and decodes to zeros
    packed = encode_fp8_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (37, 64 + SCALE_BYTES)
    q, scale = quant.quantize_fp8_rowwise(x, dim=-1)
    assert torch.equal(packed[:, :64], q.view(torch.uint8))
    assert torch.equal(packed[:, 64:].contiguous().view(torch.float32).view(-1), scale)
    decoded = decode_fp8_rows(packed, torch.float32)
    assert torch.equal(decoded, quant.dequantize_fp8_rowwise(q, scale))
    assert torch.equal(decoded[5], torch.zeros(64))
    # row-scaled e4m3: relative error per element at most 2^-4 of the row's largest magnitude
    err = (decoded - x.float()).abs().amax(-1) / x.float().abs().amax(-1).clamp_min(1e-30)
    assert float(err.max()) <= 2.0**-4
    # padding and sink rows of an exchange are zero bytes: they decode to zero rows
    assert torch.equal(
        decode_fp8_rows(torch.zeros(3, 68, dtype=torch.uint8), torch.bfloat16),
        torch.zeros(3, 64, dtype=torch.bfloat16),
    )


def test_round_trip_is_straight_through():
    x = torch.randn(20, 32, requires_grad=True)
    g = torch.randn(20, 32)
    y = fp8_round_trip(x)
    assert torch.equal(y.detach(), fp8_round_trip_reference(x.detach()))
    assert not torch.equal(y.detach(), x.detach())  # it does round
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_loop_back_is_the_packed_rows_decoded_straight_through():
    """What a group of one hands back: FP8 the packed rows decoded (the round trip's values),
    the gradient unchanged; bf16 the rows themselves."""
    x = torch.randn(20, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(20, 32, dtype=torch.bfloat16)
    y = FP8_PAYLOAD.loop_back(x)
    assert y.dtype == x.dtype
    assert torch.equal(y.detach(), decode_fp8_rows(encode_fp8_rows(x.detach()), x.dtype))
    assert torch.equal(y.detach(), fp8_round_trip_reference(x.detach()))
    y.backward(g)
    assert torch.equal(x.grad, g)
    assert BF16_PAYLOAD.loop_back(x) is x and BF16_PAYLOAD.round_trip(x) is x


def test_local_dispatcher_fp8_rows_are_the_rounded_tokens():
    T, D, E, K = 24, 32, 8, 2
    router = TopKRouter(D, RouterConfig(num_experts=E, top_k=K))
    torch.nn.init.normal_(router.gate.weight)
    x = torch.randn(T, D)
    with torch.no_grad():
        routing = router(x)
    rows8, offs8, _ = LocalDispatcher(FP8_PAYLOAD).dispatch(x, routing)
    rows16, offs16, _ = LocalDispatcher().dispatch(fp8_round_trip_reference(x), routing)
    assert torch.equal(rows8, rows16) and torch.equal(offs8, offs16)
    # gradients pass the rounding unchanged: d(sum of rows)/dx = K for every element
    x_ = x.clone().requires_grad_()
    rows, _, _ = LocalDispatcher(FP8_PAYLOAD).dispatch(x_, routing)
    rows.sum().backward()
    torch.testing.assert_close(x_.grad, torch.full((T, D), float(K)))
