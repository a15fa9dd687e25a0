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


def rope64(y_BSD, cos_SH, sin_SH, head_dim, positions=None):
    B, S, D = y_BSD.shape
    a, b = y_BSD.view(B, S, D // head_dim, head_dim).chunk(2, dim=-1)
    if positions is None:
        cos, sin = cos_SH[:S, None].double(), sin_SH[:S, None].double()
    else:  # one table row per (row, position): (B, S, 1, H / 2)
        cos, sin = cos_SH[positions][:, :, None].double(), sin_SH[positions][:, :, None].double()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).view(B, S, D)


def exact_qk_norm_rope(x, w, g, cos_SH, sin_SH, head_dim, positions=None):
    """float64 (y, grad_x, grad_w) of the norm then the rotation, on the same inputs."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + EPS) * w64
    y = rope64(y, cos_SH, sin_SH, head_dim, positions)
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


def random_positions(B, S, num_positions, seed):
    """int32 (B, S) positions in [0, num_positions): any table row, in any order."""
    return torch.randint(0, num_positions, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("with_positions", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,N,H", QK_SHAPES)
def test_qk_norm_rope_reference_matches_float64_autograd(B, S, N, H, dtype, with_positions):
    cos_SH, sin_SH = tables(H, S + 3)
    pos = random_positions(B, S, S + 3, seed=S).int() if with_positions else None
    x = randn(B, S, N * H, dtype=dtype, seed=4).requires_grad_()
    w = (1 + randn(N * H, seed=5) / 4).requires_grad_()
    g = randn(B, S, N * H, dtype=dtype, seed=6)
    y = qk_norm_rope_reference(x, w, EPS, cos_SH, sin_SH, H, pos)
    grad_x, grad_w = torch.autograd.grad(y, (x, w), g)
    assert y.dtype == grad_x.dtype == dtype and grad_w.dtype == torch.float32
    exact_y, exact_x, exact_w = exact_qk_norm_rope(
        x.detach(), w.detach(), g, cos_SH, sin_SH, H, pos
    )
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
    before the fused op (forward and gradients), on the fused projection's q, k and v."""
    torch.manual_seed(0)
    attn = Attention(64, 4, 2, 16, max_positions=12).bfloat16()
    for norm in (attn.q_norm, attn.k_norm):
        norm.weight.data = (1 + torch.randn(norm.weight.shape) / 4).bfloat16()
    x = randn(2, 11, 64, dtype=torch.bfloat16, seed=12).requires_grad_()

    def torch_path(x_BSD):
        B, S, _ = x_BSD.shape
        qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        q, k, v = F.linear(x_BSD, qkv_weight).split([64, 32, 32], dim=-1)
        q, k = attn.q_norm(q), attn.k_norm(k)
        v = v.view(B, S, 2, 16).transpose(1, 2)
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


@pytest.mark.skipif(not TRITON_INSTALLED, reason="needs Triton")
def test_supports_takes_q_and_k_rows_up_to_max_d_only():
    from moetrain.kernels.qk_norm_rope_triton import MAX_D, supports

    cos = torch.zeros(8, 32)
    for q_width, kv_width, ok in ((MAX_D, MAX_D, True), (MAX_D + 64, 64, False), (64, MAX_D + 64, False)):  # fmt: skip
        qkv = torch.empty(1, 4, q_width + 2 * kv_width, dtype=torch.bfloat16, device="meta")
        assert supports(qkv, cos, kv_width) == ok
    assert not supports(torch.empty(1, 9, 192, dtype=torch.bfloat16), cos, 64)  # tables too short


def test_triton_module_imports_without_triton():
    from moetrain.kernels import qk_norm_rope_triton

    assert qk_norm_rope_triton.triton_available() == TRITON_INSTALLED


# --- Triton ops == references ------------------------------------------------------------------


def check_qkv_norm_rope_op(B, S, N, G, H, dtype, device, seed=0, scale=2.0, positions=False):
    """q, k, v and the gradients through autograd against the per-tensor reference (the same
    fp32 formula, rounded once) and float64 on q's and k's columns of a fused projection qkv of
    typical magnitude `scale`, whose rows are strided (a slice of a wider buffer, as a view of a
    GEMM output can be); v and its gradient are copies, exact. The SDPA-style gradient layout
    (B, heads, S, H) contiguous, transposed back, gives the same bits as a contiguous one.
    positions: each row rotated at a random position of the tables (int32) instead of s."""
    from moetrain.kernels.qk_norm_rope_triton import qkv_norm_rope_triton

    cos_SH, sin_SH = tables(H, S + 5, device)
    pos = random_positions(B, S, S + 5, seed).to(device, torch.int32) if positions else None
    qkv_norm_rope_triton = functools.partial(qkv_norm_rope_triton, positions_BS=pos)
    D, Dk = N * H, G * H
    C = D + 2 * Dk
    wide = randn(B, S, C + 16, dtype=dtype, seed=seed, device=device, scale=scale)
    qkv = wide[..., :C].requires_grad_()  # row stride C + 16
    wq = (1 + randn(D, seed=seed + 1, device=device) / 4).requires_grad_()
    wk = (1 + randn(Dk, seed=seed + 2, device=device) / 4).requires_grad_()
    gq = randn(B, S, D, dtype=dtype, seed=seed + 3, device=device)
    gk = randn(B, S, Dk, dtype=dtype, seed=seed + 4, device=device)
    gv = randn(B, S, Dk, dtype=dtype, seed=seed + 5, device=device)
    q, k, v = qkv_norm_rope_triton(qkv, wq, wk, EPS, cos_SH, sin_SH, H, Dk)
    grad_qkv, grad_wq, grad_wk = torch.autograd.grad((q, k, v), (qkv, wq, wk), (gq, gk, gv))
    assert q.dtype == k.dtype == v.dtype == grad_qkv.dtype == dtype
    assert grad_wq.dtype == wq.dtype and grad_wk.dtype == wk.dtype
    assert q.shape == (B, S, D) and k.shape == v.shape == (B, S, Dk) and grad_qkv.shape == (B, S, C)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    x = qkv.detach()
    assert torch.equal(v, x[..., D + Dk :])
    assert torch.equal(grad_qkv[..., D + Dk :], gv)
    for y, grad_x, grad_w, x_part, w, g in (
        (q, grad_qkv[..., :D], grad_wq, x[..., :D], wq, gq),
        (k, grad_qkv[..., D : D + Dk], grad_wk, x[..., D : D + Dk], wk, gk),
    ):
        x_part = x_part.contiguous().requires_grad_()
        y_ref = qk_norm_rope_reference(x_part, w, EPS, cos_SH, sin_SH, H, pos)
        ref_x, ref_w = torch.autograd.grad(y_ref, (x_part, w), g)
        wd = w.detach()
        exact_y, exact_x, exact_w = exact_qk_norm_rope(
            x_part.detach(), wd, g, cos_SH, sin_SH, H, pos
        )
        scale_y, scale_x, scale_w = qk_norm_rope_scales(x_part.detach(), wd, g, H)
        for got, ref, exact, scale_, dt in (
            (y, y_ref, exact_y, scale_y, dtype),
            (grad_x, ref_x, exact_x, scale_x, dtype),
            (grad_w, ref_w, exact_w, scale_w, torch.float32),
        ):
            assert_within(got, ref, scale_, dt)
            assert_within(got, exact, scale_, dt)
    _, _, _, rstd_q, rstd_k = torch.ops.moetrain.qkv_norm_rope(
        x, wq.detach(), wk.detach(), cos_SH, sin_SH, H, Dk, EPS, pos
    )
    for rstd, x_part in ((rstd_q, x[..., :D]), (rstd_k, x[..., D : D + Dk])):
        assert rstd.dtype == torch.float32 and rstd.shape == (B, S, 1)
        assert_within(rstd, forward_rstd(x_part), forward_rstd(x_part), torch.float32)

    dense = x.contiguous().requires_grad_()
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            qkv_norm_rope_triton(dense, wq, wk, EPS, cos_SH, sin_SH, H, Dk), (q, k, v), strict=True
        )
    )
    heads = [  # what the views' backwards hand over from SDPA's (B, heads, S, H) gradients
        t.view(B, S, t.shape[-1] // H, H)
        .transpose(1, 2)
        .contiguous()
        .transpose(1, 2)
        .reshape(t.shape)
        for t in (gq, gk, gv)
    ]
    out = qkv_norm_rope_triton(dense, wq, wk, EPS, cos_SH, sin_SH, H, Dk)
    grads = torch.autograd.grad(out, (dense, wq, wk), heads)
    assert all(torch.equal(a, b) for a, b in zip(grads, (grad_qkv, grad_wq, grad_wk), strict=True))


QKV_SHAPES = [(1, 1, 1, 1, 2), (2, 7, 3, 3, 16), (1, 13, 5, 5, 20), (2, 9, 1, 1, 96), (2, 6, 4, 2, 16)]  # fmt: skip


@needs_interpreter
def test_triton_qk_norm_rope_ops_under_interpreter():
    """Runs this file's `interpreted` tests in a fresh process with TRITON_INTERPRET=1 (the ops
    run eagerly on CPU tensors there; their compile path is covered by the CUDA tests)."""
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,S,N,G,H", [*QKV_SHAPES, (3, 40, 8, 8, 64)])
def test_qkv_norm_rope_op_matches_references_interpreted(B, S, N, G, H, dtype):
    """D = 2, 48, 100, 96: masked pair tails, half heads of 10 and 48 (not powers of two); GQA
    (k and v narrower than q)."""
    check_qkv_norm_rope_op(B, S, N, G, H, dtype, "cpu", seed=N * H + G)


@interpreted
@pytest.mark.parametrize(
    "B,S,N,H,dtype,scale",
    [
        (2, 5, 4, 32, torch.float16, 2.0),
        (1, 6, 2, 16, torch.float32, 1e-3),
        (2, 0, 3, 16, torch.bfloat16, 2.0),
    ],
)
def test_qkv_norm_rope_op_edge_cases_interpreted(B, S, N, H, dtype, scale):
    """fp16; rows so small that eps counts in their norm; no rows at all."""
    check_qkv_norm_rope_op(B, S, N, N, H, dtype, "cpu", seed=4, scale=scale)


@interpreted
@pytest.mark.parametrize("B,S,N,G,H", [(2, 7, 3, 3, 16), (2, 6, 4, 2, 16), (1, 13, 5, 5, 20)])
def test_qkv_norm_rope_op_with_positions_matches_references_interpreted(B, S, N, G, H):
    """Rows rotated at given positions (document masking's reset positions), in both
    directions; GQA and half heads that are not powers of two."""
    check_qkv_norm_rope_op(B, S, N, G, H, torch.float32, "cpu", seed=N + G, positions=True)


# --- GPU: the compiled kernels -----------------------------------------------------------------

gpu = needs_cuda_and_triton


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "B,S,N,G,H",
    [(2, 7, 3, 3, 16), (1, 13, 5, 5, 20), (4, 512, 16, 16, 64), (2, 300, 8, 2, 128), (1, 64, 64, 64, 128)],
)  # fmt: skip
def test_qkv_norm_rope_op_matches_references_cuda(B, S, N, G, H, dtype):
    check_qkv_norm_rope_op(B, S, N, G, H, dtype, "cuda", seed=N * H + G)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,S,N,G,H", [(2, 7, 3, 3, 16), (4, 512, 16, 16, 64), (2, 300, 8, 2, 128)])
def test_qkv_norm_rope_op_with_positions_matches_references_cuda(B, S, N, G, H):
    check_qkv_norm_rope_op(B, S, N, G, H, torch.bfloat16, "cuda", seed=N + G, positions=True)


@pytest.mark.gpu
@gpu
def test_ops_pass_opcheck_and_qkv_norm_rope_saves_its_inputs_not_its_outputs():
    ops = torch.ops.moetrain
    qkv = randn(2, 16, 256, dtype=torch.bfloat16, device="cuda")  # q 128, k and v 64 wide
    g = [randn(2, 16, n, dtype=torch.bfloat16, seed=s, device="cuda") for s, n in enumerate((128, 64, 64), 1)]  # fmt: skip
    wq, wk = randn(128, seed=4, device="cuda"), randn(64, seed=5, device="cuda")
    cos_SH, sin_SH = tables(32, 20, "cuda")
    torch.library.opcheck(ops.qkv_norm_rope.default, (qkv, wq, wk, cos_SH, sin_SH, 32, 64, EPS))
    _, _, _, rstd_q, rstd_k = ops.qkv_norm_rope(qkv, wq, wk, cos_SH, sin_SH, 32, 64, EPS)
    # the backward op has no autograd formula of its own (no double backward)
    torch.library.opcheck(
        ops.qkv_norm_rope_backward.default,
        (*g, qkv, wq, wk, rstd_q, rstd_k, cos_SH, sin_SH, 32),
    )

    from moetrain.kernels.qk_norm_rope_triton import qkv_norm_rope_triton

    qkv_, wq_, wk_ = (t.clone().requires_grad_() for t in (qkv, wq, wk))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outputs = qkv_norm_rope_triton(qkv_, wq_, wk_, EPS, cos_SH, sin_SH, 32, 64)
    storages = {t.untyped_storage().data_ptr() for t in saved}
    inputs = {t.untyped_storage().data_ptr() for t in (qkv_, wq_, wk_, cos_SH, sin_SH)}
    assert inputs <= storages
    assert not storages & {t.untyped_storage().data_ptr() for t in outputs}
    assert len(storages - inputs) == 2  # rstd of q and of k, 4 bytes a row each


@pytest.mark.gpu
@gpu
def test_attention_on_cuda_takes_the_fused_path():
    attn = Attention(256, 4, 2, 64, max_positions=64).cuda()
    for p in attn.parameters():  # as the trainer casts: the RoPE tables stay fp32
        p.data = p.data.bfloat16()
    for norm in (attn.q_norm, attn.k_norm):
        norm.weight.data = (1 + torch.randn_like(norm.weight, dtype=torch.float32) / 4).bfloat16()
    qkv = randn(2, 50, 512, dtype=torch.bfloat16, seed=3, device="cuda")
    q_BNSH, k_BGSH, v_BGSH = attn._heads(qkv)
    rope = attn.rope
    q, k, v = qkv.split([256, 128, 128], dim=-1)
    assert torch.equal(v_BGSH.transpose(1, 2).reshape(v.shape), v)
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
    attn = Attention(256, 4, 2, 64, max_positions=128, backend="math").cuda()
    compiled_vs_eager(attn, list(attn.parameters()), (2, 128, 256))
