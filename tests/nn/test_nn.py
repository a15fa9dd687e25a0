import pytest
import torch
import torch.nn.functional as F

from moetrain.nn.attention import Attention
from moetrain.nn.linear import concat_linear
from moetrain.nn.loss import chunked_linear_cross_entropy
from moetrain.nn.norm import RMSNorm, rms_norm, rms_norm_reference
from moetrain.nn.rope import RotaryEmbedding, apply_rope


def test_rmsnorm_formula():
    x = torch.randn(4, 10)
    n = RMSNorm(10, eps=1e-5)
    n.weight.data.normal_()
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * n.weight
    torch.testing.assert_close(n(x), expected)


def test_rmsnorm_gradients_match_the_reference():
    """The hand-written backward against autograd of the plain formula: float64 exactly (and
    gradcheck), bf16 against the fp32-computed reference within bf16 rounding."""
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    n = RMSNorm(16, eps=1e-5).double()
    n.weight.data.copy_(w.detach())
    g = torch.randn(3, 5, 16, dtype=torch.float64)
    n(x).backward(g)
    grads = x.grad.clone(), n.weight.grad.clone()
    x.grad = None
    rms_norm_reference(x, w, 1e-5).backward(g)
    torch.testing.assert_close(grads[0], x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[1], w.grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-5), (x, w))

    xb = (torch.randn(64, 256) * 3).bfloat16().requires_grad_()
    nb = RMSNorm(256).bfloat16()
    nb.weight.data.normal_()
    gb = torch.randn(64, 256).bfloat16()
    nb(xb).backward(gb)
    xr = xb.detach().float().requires_grad_()
    wr = nb.weight.detach().float().requires_grad_()
    rms_norm_reference(xr, wr, nb.eps).backward(gb.float())
    torch.testing.assert_close(xb.grad.float(), xr.grad, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(nb.weight.grad.float(), wr.grad, rtol=2e-2, atol=1e-1)


def test_rmsnorm_saves_its_input_and_one_float_per_row():
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    n = RMSNorm(32).bfloat16()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        n(x)
    nbytes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    own = {p.untyped_storage().data_ptr() for p in n.parameters()}
    assert sum(v for k, v in nbytes.items() if k not in own) == 8 * 32 * 2 + 8 * 4


def test_rope_rotates_pairs_and_preserves_norm():
    rope = RotaryEmbedding(8, theta=10_000.0)
    cos, sin = rope.cos_sin(5, torch.float64)
    x = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[..., 0, :], x[..., 0, :])  # position 0 is not rotated
    p, i = 3, 1
    angle = p * 10_000.0 ** (-2 * i / 8)
    a, b = x[0, 0, p, i], x[0, 0, p, i + 4]
    expected = torch.stack(
        [
            a * torch.cos(torch.tensor(angle)) - b * torch.sin(torch.tensor(angle)),
            b * torch.cos(torch.tensor(angle)) + a * torch.sin(torch.tensor(angle)),
        ]
    )
    torch.testing.assert_close(
        torch.stack([y[0, 0, p, i], y[0, 0, p, i + 4]]), expected.to(torch.float64)
    )


def test_rope_tables_match_fresh_computation_and_survive_meta_build():
    with torch.device("meta"):
        rope = RotaryEmbedding(16, theta=500.0, max_positions=12)
    rope.to_empty(device="cpu")
    rope.init_weights()  # what Transformer.init_buffers does after to_empty
    fresh = RotaryEmbedding(16, theta=500.0)  # no tables: computed on the spot
    for seq_len in (1, 12, 20):  # 20 > max_positions: computed, not cached
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            got, want = rope.cos_sin(seq_len, dtype), fresh.cos_sin(seq_len, dtype)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == dtype and g.shape == (seq_len, 16)
                assert torch.equal(g, w)


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def _per_head(t, weight, eps, head_dim):
    """Each head's head_dim features normed on their own, one head at a time."""
    heads = t.split(head_dim, dim=-1)
    return torch.cat([_rms(h, weight, eps) for h in heads], dim=-1)


def _manual_attention(attn: Attention, x):
    B, S, _ = x.shape
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    eps, H = 1e-5, attn.head_dim
    if attn.qk_norm == "full":
        q, k = _rms(q, attn.q_norm.weight, eps), _rms(k, attn.k_norm.weight, eps)
    elif attn.qk_norm == "per_head":
        q, k = _per_head(q, attn.q_norm.weight, eps, H), _per_head(k, attn.k_norm.weight, eps, H)
    q = q.view(B, S, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = k.view(B, S, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    v = v.view(B, S, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    cos, sin = attn.rope.cos_sin(S, x.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / attn.head_dim**0.5
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
    out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
    return attn.o_proj(out.transpose(1, 2).reshape(B, S, -1))


def test_attention_gqa_and_qk_norm_against_manual():
    """Each qk-norm (full: over the projection; per_head: over each head, one weight for all
    heads; none) with MHA and GQA, random norm weights, against the loop formula (float64)."""
    torch.manual_seed(0)
    for kv_heads, qk_norm, head_dim in [
        (4, "full", 8), (2, "none", 8), (1, "full", 8), (4, "per_head", 8), (2, "per_head", 12),
    ]:  # fmt: skip
        attn = Attention(32, 4, kv_heads, head_dim, qk_norm=qk_norm).double()
        norms = [attn.q_norm, attn.k_norm] if qk_norm != "none" else []
        with torch.no_grad():
            for norm in norms:
                norm.weight.uniform_(0.5, 1.5)
        if qk_norm == "per_head":  # one head's width, for q and k alike
            assert [n.weight.shape for n in norms] == [(head_dim,), (head_dim,)]
        x = torch.randn(2, 7, 32, dtype=torch.float64)
        torch.testing.assert_close(attn(x), _manual_attention(attn, x))


def test_attention_gradients_match_manual_with_separate_projections():
    """The fused q/k/v projection's gradients (all parameters and x) equal those of the manual
    attention, whose three projections are separate GEMMs (float64)."""
    torch.manual_seed(1)
    attn = Attention(32, 4, 2, 8).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 7, 32, dtype=torch.float64)
    params = [x, *attn.parameters()]
    fused = torch.autograd.grad(attn(x), params, g)
    manual = torch.autograd.grad(_manual_attention(attn, x), params, g)
    for a, b in zip(fused, manual, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_concat_linear_saves_its_inputs_not_the_concatenated_weight():
    x = torch.randn(5, 16, requires_grad=True)
    ws = [torch.randn(n, 16, requires_grad=True) for n in (16, 8, 8)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = concat_linear(x, ws)
    storages = {t.untyped_storage().data_ptr() for t in saved}
    assert storages == {t.untyped_storage().data_ptr() for t in (x, *ws)}
    assert torch.equal(y, F.linear(x, torch.cat(ws)))
    grads = torch.autograd.grad(y, (x, *ws), torch.ones_like(y))
    assert [g.shape for g in grads] == [x.shape, *(w.shape for w in ws)]
    frozen = [w.detach() for w in ws]  # only x needs a gradient: no weight-gradient GEMM
    (grad_x,) = torch.autograd.grad(concat_linear(x, frozen), x, torch.ones_like(y))
    assert torch.equal(grad_x, grads[0])


@pytest.mark.parametrize("chunk_size", [8, 37, 64])  # five chunks, one exact, one larger
def test_chunked_cross_entropy_matches_full_logits(chunk_size):
    torch.manual_seed(chunk_size)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    loss = chunked_linear_cross_entropy(h, w, t, chunk_size=chunk_size)
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.T, t)
    torch.testing.assert_close(loss, ref)
    (2.5 * loss).backward()
    (2.5 * ref).backward()
    torch.testing.assert_close(h.grad, h2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
