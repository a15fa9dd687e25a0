import pytest
import torch

from moetrain.config.presets import small, tiny
from moetrain.model.flops import flops_per_token, param_counts
from moetrain.model.transformer import Transformer, build_model
from moetrain.nn.mlp import SwiGLU


def test_small_counts_equal_reference_numbers():
    counts = param_counts(small())
    assert counts.total == 942_441_472
    assert counts.active == 186_287_104
    assert flops_per_token(small()) == 1_218_385_920


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.num_dense_layers=1", "moe.num_shared_experts=1", "model.num_kv_heads=2"],
        # dense layers between MoE ones; per-head q/k norms (Qwen3), none (Mixtral)
        ["model.num_layers=4", "model.dense_layers=[1, 2]", "model.qk_norm=per_head"],
        ["model.qk_norm=none", "model.head_dim=24", "model.num_kv_heads=1"],
    ],
)
def test_counts_match_built_model(overrides):
    cfg = tiny().with_overrides(overrides)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg).total
    dense = [i for i, block in model.blocks.items() if isinstance(block.ffn, SwiGLU)]
    assert dense == [str(i) for i in range(cfg.model.num_layers) if cfg.model.is_dense(i)]
    experts = sum(p.numel() for n, p in model.named_parameters() if "experts.w_" in n)
    # active: every parameter but the unused experts and the input embedding (untied)
    unused = experts * (1 - cfg.moe.top_k / cfg.moe.num_experts)
    assert param_counts(cfg).active == param_counts(cfg).total - unused - model.embed.weight.numel()


def test_tiny_forward_backward_and_loss_goes_down():
    torch.manual_seed(0)
    model = build_model(tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 64, (4, 33))
    losses = []
    for _ in range(30):
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_init_is_a_function_of_seed():
    a, b = build_model(tiny()), build_model(tiny())
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    a.init_weights(seed=1)
    assert not torch.equal(a.embed.weight, b.embed.weight)
    w = b.blocks["0"].ffn.experts.w_up_eD2F
    assert not torch.equal(w[0], w[1])  # experts differ from each other


def test_document_masking_with_reset_positions_equals_each_document_alone():
    """Logits of packed rows, with document masking and positions reset per document, equal
    those of each document run alone as its own sequence by the same model without masking
    (GQA; EOS opens each document but the row's first)."""
    eos = 300
    cfg = tiny().with_overrides(["model.num_kv_heads=2"])
    masked = cfg.with_overrides(
        ["data.document_masking=true", "data.reset_positions=true", f"data.eos_id={eos}"]
    )
    torch.manual_seed(0)
    model = build_model(masked)
    plain = build_model(cfg)
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 256, (3, 48))
    tokens[torch.rand(tokens.shape) < 0.1] = eos
    tokens[1, 0], tokens[2] = eos, torch.arange(48)  # a row starting at an EOS; one without
    with torch.no_grad():
        packed = model.logits(model(tokens))
        for b, row in enumerate(tokens):
            starts = [0] + [s for s in range(1, 48) if row[s] == eos]
            for start, end in zip(starts, [*starts[1:], 48], strict=True):
                alone = plain.logits(plain(row[None, start:end]))[0]
                torch.testing.assert_close(packed[b, start:end], alone, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(packed, plain.logits(plain(tokens)), atol=1e-3)
