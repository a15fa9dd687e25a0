"""GPU checks of document masking (run on the H200 with `pytest -m gpu`): the block-sparse
FlexAttention path against the dense reference in bf16, and a masked training step of `small`
without a host sync."""

import pytest
import torch

from moetrain.config.presets import small
from moetrain.nn.document_mask import DocumentMask

pytestmark = pytest.mark.gpu

EOS = 7


@pytest.mark.parametrize(
    "B,N,G,S,H,rate",
    [(2, 16, 16, 2048, 64, 1 / 500), (2, 8, 2, 300, 128, 1 / 40)],
    ids=["small-shape", "gqa-h128-partial-block"],
)
def test_flex_path_matches_the_dense_reference_in_bf16(B, N, G, S, H, rate):
    """Outputs and gradients of q, k, v: the block-sparse path against SDPA with the dense mask,
    both in bf16, compared to the fp32 reference with the same error bound (a few bf16 ulps of
    the outputs' scale)."""
    gen = torch.Generator(device="cuda").manual_seed(S)
    tokens = torch.randint(0, EOS, (B, S), device="cuda", generator=gen)
    tokens[torch.rand(B, S, device="cuda", generator=gen) < rate] = EOS
    sparse = DocumentMask.from_tokens(tokens, EOS, reset_positions=False, block_sparse=True)
    dense = DocumentMask.from_tokens(tokens, EOS, reset_positions=False, block_sparse=False)
    inputs = [torch.randn(B, n, S, H, device="cuda", generator=gen) for n in (N, G, G)]
    grad_out = torch.randn(B, N, S, H, device="cuda", generator=gen)

    def run(docs, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in inputs]
        out = docs.attend(*leaves)
        return [out, *torch.autograd.grad(out, leaves, grad_out.to(dtype))]

    exact = run(dense, torch.float32)
    for name, got, ref, want in zip(
        ("out", "dq", "dk", "dv"),
        run(sparse, torch.bfloat16),
        run(dense, torch.bfloat16),
        exact,
        strict=True,
    ):
        flex_err = (got.float() - want).abs().max().item()
        sdpa_err = (ref.float() - want).abs().max().item()
        scale = want.abs().max().item()
        assert flex_err <= max(2 * sdpa_err, 2**-7 * scale), (name, flex_err, sdpa_err, scale)


@pytest.mark.parametrize(
    "qk_norm", ["full", "per_head", "none"], ids=["fused", "per_head-torch", "torch"]
)
def test_compiled_attention_layer_with_documents_matches_eager_dense(qk_norm):
    """An attention layer of `small`'s shape (GQA here) compiled as a block is, with positions
    reset: FlexAttention inlined, the fused qk-norm+RoPE kernel at given positions (or the torch
    path, whose v is a view of the projection: per-head qk-norm, or none); against the same layer eager with the dense
    mask, in fp32: outputs and the gradients of the input and every weight."""
    from moetrain.nn.attention import Attention

    torch.manual_seed(0)
    B, S, D = 2, 1024, 1024
    attn = Attention(D, 16, 4, 64, qk_norm=qk_norm, max_positions=S).cuda()
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, EOS, (B, S), device="cuda", generator=gen)
    tokens[torch.rand(B, S, device="cuda", generator=gen) < 1 / 200] = EOS
    x = torch.randn(B, S, D, device="cuda", generator=gen)
    params = list(attn.parameters())

    def run(fn, block_sparse):
        docs = DocumentMask.from_tokens(
            tokens, EOS, reset_positions=True, block_sparse=block_sparse
        )
        leaf = x.clone().requires_grad_()
        out = fn(leaf, docs)
        return [out, *torch.autograd.grad(out.square().sum(), [leaf, *params])]

    torch._dynamo.reset()
    compiled = run(torch.compile(attn), True)
    eager = run(attn, False)
    for got, want in zip(compiled, eager, strict=True):
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert err <= 1e-4 * scale, (err, scale)


class _DocumentTokens:
    """Random ids with EOS at rate 1 / mean_len, as the loaders' (inputs, targets) pairs."""

    def __init__(self, B, S, vocab, mean_len):
        self.shape, self.vocab, self.rate = (B, S + 1), vocab, 1 / mean_len

    def __iter__(self):
        return self

    def __next__(self):
        tokens = torch.randint(0, self.vocab, self.shape, device="cuda")
        tokens[torch.rand(self.shape, device="cuda") < self.rate] = EOS
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graphed"])
def test_masked_training_steps_of_small_have_no_host_sync(tmp_path, graph):
    """Eager steps under sync-debug "error" (the work a graph captures), and a captured graph
    (strict: a capture that syncs fails) replayed with a changing document layout."""
    from moetrain.train.trainer import Trainer

    config = small().with_overrides(
        [
            "model.num_layers=2",
            "train.micro_batch_size=2",
            "data.random_tokens=true",
            "data.document_masking=true",
            "data.reset_positions=true",
            f"data.eos_id={EOS}",
            "train.eval_every=0",
            f"train.cuda_graph={'true' if graph else 'false'}",
        ]
    )
    trainer = Trainer(config, tmp_path, device="cuda", progress=False)
    it = _DocumentTokens(2, config.train.seq_len, config.model.vocab_size, mean_len=300)
    for _ in range(3 if graph else 1):  # graphed: 2 eager warm-up steps, then the capture
        trainer.train_step(it)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [trainer.train_step(it).clone() for _ in range(2)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if graph:
        assert trainer.step_graph.graph is not None
    assert all(torch.isfinite(loss).item() for loss in losses)
