"""Fused qk-norm + RoPE: the torch reference against float64 autograd, the CPU path of `Attention`
unchanged, and the Triton ops against the reference on CUDA and, on CPU, through Triton's
interpreter."""

from __future__ import annotations

import functools

import conftest
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    TRITON_INSTALLED,
    assert_compiled_matches_eager,
    interpreted,
    needs_cuda_and_triton,
    needs_interpreter,
    run_interpreted_tests,
)

from moetrain.nn.attention import Attention, qk_norm_rope_reference
from moetrain.nn.rope import RotaryEmbedding, apply_rope

EPS = 1e-5
# fp32 error allowance, relative to the sum of the magnitudes of a result's terms: 2^7 fp32 ulps
# covers the dozen roundings of each formula plus tree sums over up to 2^14 rows or columns (an
# error growing with the depth of the tree, not the count), with headroom.
REL = 2.0**-17
assert_within = functools.partial(conftest.assert_within, rel=REL)


def randn(*shape, dtype=torch.float32, seed=0, device="cpu", scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen)).to(dtype=dtype, device=device)


def forward_rstd(x):
    """The forward's reciprocal RMS, (..., 1) in fp32 (fp64 for fp64 x)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)


# --- float64 ground truth and error scales -----------------------------------------------------


def rms_norm_scales(x, w, g):
    """Magnitudes of the terms of grad_x and grad_w, which bound their fp32 errors (the mean
    term cancels)."""
    x, w, g = x.double(), w.double(), g.double()
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
    x_hat, gw = (x * rstd).abs(), (g * w).abs()
    grad_x = rstd * (gw + x_hat * (gw * x_hat).mean(-1, keepdim=True))
    return grad_x, (g.abs() * x_hat).reshape(-1, x.shape[-1]).sum(0)


def rope64(y_BSD, cos_SH, sin_SH, head_dim):
    B, S, D = y_BSD.shape
    a, b = y_BSD.view(B, S, D // head_dim, head_dim).chunk(2, dim=-1)
    cos, sin = cos_SH[:S, None].double(), sin_SH[:S, None].double()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).view(B, S, D)


def exact_qk_norm_rope(x, w, g, cos_SH, sin_SH, head_dim):
    """float64 (y, grad_x, grad_w) of the norm then the rotation, on the same inputs."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + EPS) * w64
    y = rope64(y, cos_SH, sin_SH, head_dim)
    return (y.detach(), *torch.autograd.grad(y, (x64, w64), g.double()))


def pair_sums(t_BSD, head_dim):
    """|t_a| + |t_b| of each rotation pair, at both columns of the pair."""
    B, S, D = t_BSD.shape
    a, b = t_BSD.double().abs().view(B, S, D // head_dim, head_dim).chunk(2, dim=-1)
    return (a + b).repeat(1, 1, 1, 2).view(B, S, D)


def qk_norm_rope_scales(x, w, g, head_dim):
    """Term magnitudes of y, grad_x and grad_w: as for RMSNorm, with each pair's rotated values
    bounded by the sum of the pair's magnitudes."""
    rstd = torch.rsqrt(x.double().square().mean(-1, keepdim=True) + EPS)
    y = pair_sums(x.double() * rstd * w.double(), head_dim)
    grad_x, grad_w = rms_norm_scales(x, w, pair_sums(g, head_dim))
    return y, grad_x, grad_w


def tables(head_dim, max_positions, device="cpu"):
    rope = RotaryEmbedding(head_dim, max_positions=max_positions).to(device)
    return rope.cos_SH, rope.sin_SH


# --- references and the CPU paths --------------------------------------------------------------

QK_SHAPES = [(1, 1, 1, 2), (2, 7, 3, 16), (1, 13, 5, 20), (2, 9, 1, 96)]  # B, S, N, H


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,N,H", QK_SHAPES)
def test_qk_norm_rope_reference_matches_float64_autograd(B, S, N, H, dtype):
    cos_SH, sin_SH = tables(H, S + 3)
    x = randn(B, S, N * H, dtype=dtype, seed=4).requires_grad_()
    w = (1 + randn(N * H, seed=5) / 4).requires_grad_()
    g = randn(B, S, N * H, dtype=dtype, seed=6)
    y = qk_norm_rope_reference(x, w, EPS, cos_SH, sin_SH, H)
    grad_x, grad_w = torch.autograd.grad(y, (x, w), g)
    assert y.dtype == grad_x.dtype == dtype and grad_w.dtype == torch.float32
    exact_y, exact_x, exact_w = exact_qk_norm_rope(x.detach(), w.detach(), g, cos_SH, sin_SH, H)
    if dtype == torch.float64:
        for got, want in ((y, exact_y), (grad_x, exact_x)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        return
    scale_y, scale_x, scale_w = qk_norm_rope_scales(x.detach(), w.detach(), g, H)
    assert_within(y, exact_y, scale_y, dtype, ulps=0.5)
    assert_within(grad_x, exact_x, scale_x, dtype, ulps=0.5)
    assert_within(grad_w, exact_w, scale_w, torch.float32, ulps=0.5)


def test_qk_norm_rope_reference_is_the_attention_path_in_float64():
    """The twin's layout and rotation are those of q_norm, the head split and apply_rope."""
    attn = Attention(48, 3, 3, 16, max_positions=10).double()
    attn.q_norm.weight.data = 1 + randn(48, dtype=torch.float64, seed=7) / 4
    q = randn(2, 9, 48, dtype=torch.float64, seed=8)
    q_BNSH = attn.q_norm(q).view(2, 9, 3, 16).transpose(1, 2)
    expected = apply_rope(q_BNSH, *attn.rope.cos_sin(9, torch.float64)).transpose(1, 2)
    y = qk_norm_rope_reference(q, attn.q_norm.weight, EPS, attn.rope.cos_SH, attn.rope.sin_SH, 16)
    torch.testing.assert_close(y, expected.reshape(2, 9, 48), rtol=1e-12, atol=1e-12)


def test_attention_on_cpu_keeps_the_torch_path_bit_for_bit():
    """bf16 on CPU: q_norm / k_norm rounded to bf16, then apply_rope with bf16 tables, as
    before the fused op (forward and gradients)."""
    torch.manual_seed(0)
    attn = Attention(64, 4, 2, 16, max_positions=12).bfloat16()
    for norm in (attn.q_norm, attn.k_norm):
        norm.weight.data = (1 + torch.randn(norm.weight.shape) / 4).bfloat16()
    x = randn(2, 11, 64, dtype=torch.bfloat16, seed=12).requires_grad_()

    def torch_path(x_BSD):
        B, S, _ = x_BSD.shape
        q, k = attn.q_norm(attn.q_proj(x_BSD)), attn.k_norm(attn.k_proj(x_BSD))
        v = attn.v_proj(x_BSD).view(B, S, 2, 16).transpose(1, 2)
        cos, sin = attn.rope.cos_sin(S, q.dtype)
        q = apply_rope(q.view(B, S, 4, 16).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(B, S, 2, 16).transpose(1, 2), cos, sin)
        with attn._kernel_choice(x_BSD.device):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).reshape(B, S, -1))

    params = [x, *attn.parameters()]
    results = []
    for fn in (attn, torch_path):
        out = fn(x)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), params)))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_triton_module_imports_without_triton():
    from moetrain.kernels import qk_norm_rope_triton

    assert qk_norm_rope_triton.triton_available() == TRITON_INSTALLED


# --- Triton ops == references ------------------------------------------------------------------


def check_qk_norm_rope_op(B, S, N, H, dtype, device, seed=0, scale=2.0):
    """y, rstd and the gradients through autograd against the reference (the same fp32 formula,
    rounded once) and float64, x of typical magnitude `scale`; the SDPA-style gradient layout (B,
    N, S, H) contiguous, transposed back, gives the same bits as a contiguous one."""
    from moetrain.kernels.qk_norm_rope_triton import qk_norm_rope_triton

    cos_SH, sin_SH = tables(H, S + 5, device)
    D = N * H
    wide = randn(B, S, D + 16, dtype=dtype, seed=seed, device=device, scale=scale)
    x = wide[..., :D].contiguous().requires_grad_()
    w = (1 + randn(D, seed=seed + 1, device=device) / 4).requires_grad_()
    g = randn(B, S, D, dtype=dtype, seed=seed + 2, device=device)
    y = qk_norm_rope_triton(x, w, EPS, cos_SH, sin_SH, H)
    grad_x, grad_w = torch.autograd.grad(y, (x, w), g)
    assert y.dtype == grad_x.dtype == dtype and grad_w.dtype == w.dtype
    assert y.shape == grad_x.shape == (B, S, D) and y.is_contiguous() and grad_x.is_contiguous()

    y_ref = qk_norm_rope_reference(x, w, EPS, cos_SH, sin_SH, H)
    ref_x, ref_w = torch.autograd.grad(y_ref, (x, w), g)
    exact_y, exact_x, exact_w = exact_qk_norm_rope(x.detach(), w.detach(), g, cos_SH, sin_SH, H)
    scale_y, scale_x, scale_w = qk_norm_rope_scales(x.detach(), w.detach(), g, H)
    for got, ref, exact, scale, dt in (
        (y, y_ref, exact_y, scale_y, dtype),
        (grad_x, ref_x, exact_x, scale_x, dtype),
        (grad_w, ref_w, exact_w, scale_w, torch.float32),
    ):
        assert_within(got, ref, scale, dt)
        assert_within(got, exact, scale, dt)
    _, rstd = torch.ops.moetrain.qk_norm_rope(x.detach(), w.detach(), cos_SH, sin_SH, H, EPS)
    assert rstd.dtype == torch.float32 and rstd.shape == (B, S, 1)
    assert_within(rstd, forward_rstd(x.detach()), forward_rstd(x.detach()), torch.float32)

    strided = wide[..., :D].requires_grad_()  # row stride D + 16
    y_strided = qk_norm_rope_triton(strided, w, EPS, cos_SH, sin_SH, H)
    assert torch.equal(y_strided, y)
    g_BNSH = g.view(B, S, N, H).transpose(1, 2).contiguous()
    g_heads = g_BNSH.transpose(1, 2).reshape(B, S, D)  # what a view's backward hands over
    grads = torch.autograd.grad(y_strided, (strided, w), g_heads)
    assert all(torch.equal(a, b) for a, b in zip(grads, (grad_x, grad_w), strict=True))


@needs_interpreter
def test_triton_qk_norm_rope_ops_under_interpreter():
    """Runs this file's `interpreted` tests in a fresh process with TRITON_INTERPRET=1 (the ops
    run eagerly on CPU tensors there; their compile path is covered by the CUDA tests)."""
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,S,N,H", [*QK_SHAPES, (3, 40, 8, 64)])
def test_qk_norm_rope_op_matches_references_interpreted(B, S, N, H, dtype):
    """D = 2, 48, 100, 96: masked pair tails, half heads of 10 and 48 (not powers of two)."""
    check_qk_norm_rope_op(B, S, N, H, dtype, "cpu", seed=N * H)


@interpreted
@pytest.mark.parametrize(
    "B,S,N,H,dtype,scale",
    [
        (2, 5, 4, 32, torch.float16, 2.0),
        (1, 6, 2, 16, torch.float32, 1e-3),
        (2, 0, 3, 16, torch.bfloat16, 2.0),
    ],
)
def test_qk_norm_rope_op_edge_cases_interpreted(B, S, N, H, dtype, scale):
    """fp16; rows so small that eps counts in their norm; no rows at all."""
    check_qk_norm_rope_op(B, S, N, H, dtype, "cpu", seed=4, scale=scale)


# --- GPU: the compiled kernels -----------------------------------------------------------------

gpu = needs_cuda_and_triton


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "B,S,N,H", [(2, 7, 3, 16), (1, 13, 5, 20), (4, 512, 16, 64), (2, 300, 8, 128), (1, 64, 64, 128)]
)
def test_qk_norm_rope_op_matches_references_cuda(B, S, N, H, dtype):
    check_qk_norm_rope_op(B, S, N, H, dtype, "cuda", seed=N * H)


@pytest.mark.gpu
@gpu
def test_ops_pass_opcheck_and_qk_norm_rope_saves_its_inputs_not_y():
    ops = torch.ops.moetrain
    x = randn(2, 16, 128, dtype=torch.bfloat16, device="cuda")
    g = randn(2, 16, 128, dtype=torch.bfloat16, seed=1, device="cuda")
    w = randn(128, seed=2, device="cuda")
    cos_SH, sin_SH = tables(32, 20, "cuda")
    torch.library.opcheck(ops.qk_norm_rope.default, (x, w, cos_SH, sin_SH, 32, EPS))
    rstd = ops.qk_norm_rope(x, w, cos_SH, sin_SH, 32, EPS)[1]
    # the backward op has no autograd formula of its own (no double backward)
    torch.library.opcheck(ops.qk_norm_rope_backward.default, (g, x, w, rstd, cos_SH, sin_SH, 32))

    from moetrain.kernels.qk_norm_rope_triton import qk_norm_rope_triton

    x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = qk_norm_rope_triton(x_, w_, EPS, cos_SH, sin_SH, 32)
    storages = {t.untyped_storage().data_ptr() for t in saved}
    inputs = {t.untyped_storage().data_ptr() for t in (x_, w_, cos_SH, sin_SH)}
    assert inputs <= storages and y.untyped_storage().data_ptr() not in storages
    assert len(storages - inputs) == 1  # rstd, 4 bytes a row


@pytest.mark.gpu
@gpu
def test_attention_on_cuda_takes_the_fused_path():
    attn = Attention(256, 4, 2, 64, max_positions=64).cuda()
    for p in attn.parameters():  # as the trainer casts: the RoPE tables stay fp32
        p.data = p.data.bfloat16()
    for norm in (attn.q_norm, attn.k_norm):
        norm.weight.data = (1 + torch.randn_like(norm.weight, dtype=torch.float32) / 4).bfloat16()
    q = randn(2, 50, 256, dtype=torch.bfloat16, seed=3, device="cuda")
    k = randn(2, 50, 128, dtype=torch.bfloat16, seed=4, device="cuda")
    q_BNSH, k_BGSH = attn._normed_rotated_heads(q, k)
    rope = attn.rope
    for got, t, norm in ((q_BNSH, q, attn.q_norm), (k_BGSH, k, attn.k_norm)):
        want = qk_norm_rope_reference(t, norm.weight, norm.eps, rope.cos_SH, rope.sin_SH, 64)
        got = got.transpose(1, 2).reshape(t.shape)
        scale = pair_sums(t.double() * forward_rstd(t).double() * norm.weight.double(), 64)
        assert_within(got, want, scale, torch.bfloat16)


def compiled_vs_eager(layer, params, x_shape):
    def run(fn):  # fp32, so that eager and Inductor's GEMMs agree closely
        x = randn(*x_shape, seed=5, device="cuda").requires_grad_()
        out = fn(x)
        return out, *torch.autograd.grad(out.square().sum(), [x, *params])

    assert_compiled_matches_eager(layer, run)


@pytest.mark.gpu
@gpu
def test_attention_under_torch_compile_fullgraph():
    torch.manual_seed(0)
    attn = Attention(256, 4, 2, 64, max_positions=128, backend="efficient").cuda()
    compiled_vs_eager(attn, list(attn.parameters()), (2, 128, 256))
