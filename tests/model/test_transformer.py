import torch

from moetrain.model.flops import flops_per_token, param_counts
from moetrain.model.transformer import Transformer, build_model
from moetrain.presets import small, tiny


def test_small_counts_equal_reference_numbers():
    counts = param_counts(small())
    assert counts.total == 942_441_472
    assert counts.active == 186_287_104
    assert flops_per_token(small()) == 1_218_385_920


def test_counts_match_built_model():
    cfg = tiny().with_overrides(
        ["model.num_dense_layers=1", "moe.num_shared_experts=1", "model.num_kv_heads=2"]
    )
    with torch.device("meta"):
        model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg).total


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
