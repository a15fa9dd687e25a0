"""Muon against slow references on fresh random inputs: the batched bf16 Newton-Schulz against
one matrix at a time in fp32, the singular values it leaves, and the whole optimizer (built by
the trainer's `build_optimizer`) against a per-parameter, per-expert loop with torch's AdamW for
the rest; plus the config's checks and the FLOP count the planner uses."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moetrain.config import RunConfig
from moetrain.config.presets import tiny
from moetrain.model.flops import muon_flops, muon_matrices, newton_schulz_flops
from moetrain.model.transformer import build_model
from moetrain.optim.muon import Muon
from moetrain.optim.muon_params import matrix_layout, split_param_groups
from moetrain.optim.newton_schulz import newton_schulz, newton_schulz_reference
from moetrain.optim.param_groups import build_param_groups
from moetrain.optim.schedule import lr_at
from moetrain.parallel.mesh import ParallelDims
from moetrain.train.optimizer_build import build_optimizer

SHAPES = [(6, 48, 96), (5, 96, 40), (3, 64, 64), (1, 24, 160)]  # wide, tall, square, one
# bf16 rounds X, the Gram matrix and the polynomial at each of the 5 steps (2^-9 relative each):
# measured 1.4-1.9% (relative Frobenius) against the fp32 reference on these shapes, and 2.9% on
# a weight's movement over the optimizer test's 4 steps; a wrong step count is off by over 30%
BF16_REL = 4e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative Frobenius error of each matrix of a batch."""
    return torch.linalg.matrix_norm(a.double() - b.double()) / torch.linalg.matrix_norm(b.double())


def _with_spectrum(batch: int, rows: int, cols: int, low: float, generator) -> torch.Tensor:
    """Random matrices U diag(s) V^T with singular values s log-uniform in [low, 1]."""
    k = min(rows, cols)
    u = torch.linalg.qr(torch.randn(batch, rows, k, generator=generator)).Q
    v = torch.linalg.qr(torch.randn(batch, cols, k, generator=generator)).Q
    s = low ** torch.rand(batch, k, generator=generator)
    return u @ torch.diag_embed(s) @ v.mT


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_newton_schulz_matches_the_per_matrix_fp32_reference(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    g = torch.randn(shape, generator=generator) * 3.0
    reference = torch.stack([newton_schulz_reference(m, 5) for m in g])
    fast = newton_schulz(g, 5)
    assert fast.dtype == torch.bfloat16 and fast.shape == g.shape
    assert _rel(fast, reference).max() <= BF16_REL
    # in fp32 the batched products are the reference's to rounding: the batching is exact
    assert _rel(newton_schulz(g, 5, torch.float32), reference).max() <= 1e-5
    # one step fewer is far outside the bf16 tolerance: the test sees the iteration count
    assert _rel(newton_schulz(g, 4), reference).min() > 5 * BF16_REL


def test_orthogonalized_update_has_singular_values_near_one():
    """Inputs with singular values spread over a factor 30: after 5 bf16 steps every singular
    value lies in [0.65, 1.2] (the quintic maps [0, 1] into [0, 1.2024]) and the singular
    vectors are the input's (U^T O V is diagonal to within 3%: O = U f(S) V^T)."""
    generator = torch.Generator().manual_seed(7)
    for rows, cols in ((48, 96), (96, 48), (64, 64)):
        g = _with_spectrum(4, rows, cols, 1 / 30, generator) * 5.0
        out = newton_schulz(g, 5).double()
        sv = torch.linalg.svdvals(out)
        assert sv.min() >= 0.65 and sv.max() <= 1.2, (rows, cols, sv.min(), sv.max())
        u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
        core = u.mT @ out @ vh.mT
        off = core - torch.diag_embed(torch.diagonal(core, dim1=-2, dim2=-1))
        assert (torch.linalg.matrix_norm(off) / torch.linalg.matrix_norm(core)).max() <= 0.03
    # a zero matrix (an expert without tokens) stays zero
    assert newton_schulz(torch.zeros(2, 8, 16), 5).abs().max() == 0


# ---- the optimizer against a slow reference ----------------------------------------------------
STEPS, MICRO, BATCH, SEQ, CLIP = 4, 2, 2, 16, 0.5


def _config(*overrides: str) -> RunConfig:
    """tiny with a dense layer, a shared expert and grouped-query attention, so that every kind
    of Muon matrix is present; uneven lr multipliers."""
    base = [
        "model.d_model=32",
        "model.num_kv_heads=2",
        "model.num_dense_layers=1",
        "model.dense_hidden=48",
        "moe.expert_hidden=24",
        "moe.num_shared_experts=1",
        "train.optimizer=muon",
        "train.expert_lr_mult=2.0",
        "train.router_lr_mult=0.5",
        "train.warmup_steps=2",
        f"train.steps={STEPS}",
        f"train.grad_clip={CLIP}",
    ]
    return tiny().with_overrides([*base, *overrides])


def _matrices_of(name: str, w: torch.Tensor) -> list[tuple[tuple, ...]]:
    """Index tuples of every matrix Muon orthogonalizes in parameter `name`, one at a time."""
    if name.endswith("w_up_eD2F"):
        half = w.shape[-1] // 2
        return [(e, slice(None), s) for e in range(w.shape[0]) for s in (slice(None, half), slice(half, None))]  # fmt: skip
    if name.endswith("w_gate_up.weight"):
        half = w.shape[0] // 2
        return [(slice(None, half),), (slice(half, None),)]
    if w.ndim == 3:
        return [(e,) for e in range(w.shape[0])]
    return [()]


class _Reference:
    """Muon written out: per parameter, per matrix (per expert, gate and up apart), fp32
    Newton-Schulz; torch's AdamW (foreach off) for the rest, after clip_grad_norm_."""

    def __init__(self, model, config: RunConfig) -> None:
        t = config.train
        self.t, self.model = t, model
        groups = build_param_groups(model, t)
        self.muon, adamw = split_param_groups(groups)
        self.adamw = torch.optim.AdamW(
            [{k: g[k] for k in ("params", "weight_decay", "lr_mult")} for g in adamw],
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            foreach=False,
        )
        self.buffers = {p: torch.zeros_like(p) for g in self.muon for p in g["params"]}

    @torch.no_grad()
    def step(self, step: int) -> float:
        t = self.t
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip).item()
        lr = lr_at(step, t)
        for group in self.adamw.param_groups:
            group["lr"] = lr * group["lr_mult"]
        self.adamw.step()
        for group in self.muon:
            step_lr = lr * group["lr_mult"]
            for name, p in zip(group["param_names"], group["params"], strict=True):
                buf = self.buffers[p]
                buf.mul_(t.muon_momentum).add_(p.grad)
                u = p.grad + t.muon_momentum * buf if t.muon_nesterov else buf
                p.mul_(1 - step_lr * group["weight_decay"])
                for index in _matrices_of(name, p):
                    m = u[index]
                    scale = t.muon_update_rms * math.sqrt(max(m.shape))
                    p[index] -= step_lr * scale * newton_schulz_reference(m, t.muon_ns_steps)
        return norm


def _train(config: RunConfig, use_reference: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(config)
    if use_reference:
        optimizer = _Reference(model, config)
    else:
        optimizer = build_optimizer(model, config, ParallelDims(local_rank=0, device=torch.device("cpu")))  # fmt: skip
        assert isinstance(optimizer, Muon)
    generator = torch.Generator().manual_seed(11)
    norms = []
    for step in range(STEPS):
        for _ in range(MICRO):
            tokens = torch.randint(0, 320, (BATCH, SEQ + 1), generator=generator)
            (model.loss(model(tokens[:, :-1]), tokens[:, 1:]) / MICRO).backward()
        if use_reference:
            norms.append(optimizer.step(step))
        else:
            norms.append(optimizer.step(lr_at(step, config.train), CLIP).item())
        model.zero_grad() if use_reference else optimizer.zero_grad()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_muon_matches_the_per_matrix_reference(ns_dtype):
    """fp32 products: the optimizer's batched math is the reference's to fp32 rounding (1e-5 of
    each weight). bf16 (the default): what each weight moved over the steps is within BF16_REL
    of what it moved under the reference (the bf16 error of each update, accumulated)."""
    config = _config(f"train.muon_ns_dtype={ns_dtype}")
    norms, params = _train(config, use_reference=False)
    ref_norms, ref_params = _train(config, use_reference=True)
    assert all(n > CLIP for n in ref_norms), "clipping binds at every step"
    rel = 1e-5 if ns_dtype == "fp32" else BF16_REL
    for a, b in zip(norms, ref_norms, strict=True):
        assert abs(a - b) <= rel * b, (norms, ref_norms)
    initial = dict(build_model_at_seed(config).named_parameters())
    for name, p in params.items():
        moved = (ref_params[name] - initial[name].detach()).norm()
        err = (p - ref_params[name]).norm()
        bound = rel * (ref_params[name].norm() if ns_dtype == "fp32" else moved)
        assert moved > 0 and err <= bound, (name, err.item(), moved.item())


def build_model_at_seed(config: RunConfig):
    torch.manual_seed(0)
    return build_model(config)


def test_muon_updates_the_matrices_and_adamw_the_rest():
    """Every attention, MLP and expert matrix is Muon's; embedding, head, router gate and norms
    are AdamW's; the two halves partition the parameters."""
    model = build_model(_config())
    muon, adamw = split_param_groups(build_param_groups(model, _config().train))
    muon_names = {n for g in muon for n in g["param_names"]}
    adamw_names = {n for g in adamw for n in g["param_names"]}
    assert muon_names.isdisjoint(adamw_names)
    assert muon_names | adamw_names == {n for n, _ in model.named_parameters()}
    for name in adamw_names:
        assert name in ("embed.weight", "lm_head.weight") or name.endswith(("norm.weight", "router.gate.weight"))  # fmt: skip
    suffixes = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "w_gate_up.weight", "w_down.weight", "w_up_eD2F", "w_down_eFD")  # fmt: skip
    assert all(n.endswith(suffixes) for n in muon_names)
    assert any("shared_expert" in n for n in muon_names) and any("blocks.0.ffn.w_gate_up" in n for n in muon_names)  # fmt: skip


def test_skipped_step_changes_nothing():
    """A true skip, or a non-finite gradient, leaves weights and buffers bitwise as they were."""
    config = _config()
    torch.manual_seed(0)
    model = build_model(config)
    optimizer = build_optimizer(model, config, ParallelDims(local_rank=0, device=torch.device("cpu")))  # fmt: skip
    tokens = torch.randint(0, 320, (BATCH, SEQ + 1))
    for poison in (False, True):
        model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        if poison:
            model.blocks["1"].attn.q_proj.weight.grad[0, 0] = float("nan")
        before = {k: v.clone() for k, v in _flat_state(model, optimizer).items()}
        norm = optimizer.step(1e-2, CLIP, skip=torch.tensor(not poison))
        assert torch.isfinite(norm) != poison
        after = _flat_state(model, optimizer)
        assert all(torch.equal(before[k], after[k]) for k in before), poison
        optimizer.zero_grad()


def _flat_state(model, optimizer: Muon) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p.detach() for n, p in model.named_parameters()}
    for name, entry in optimizer.state_dict()["muon"].items():
        out[f"momentum.{name}"] = entry["momentum"]
    for name, entry in optimizer.state_dict()["adamw"].items():
        out.update({f"adamw.{name}.{k}": v for k, v in entry.items()})
    return out


def test_muon_flops_count_the_models_matrices():
    """model/flops.py's Muon matrices (what the planner counts) are the built model's."""
    config = _config()
    model = build_model(config)
    muon, _ = split_param_groups(build_param_groups(model, config.train))
    counted = {}
    for name, p in ((n, p) for g in muon for n, p in zip(g["param_names"], g["params"], strict=True)):  # fmt: skip
        layout = matrix_layout(name, p.ndim)
        shape = tuple(sorted(layout.matrix_shape(p.shape)))
        counted[shape] = counted.get(shape, 0) + layout.num_matrices(p.shape)
    expected = {}
    for count, rows, cols in muon_matrices(config):
        shape = tuple(sorted((rows, cols)))
        expected[shape] = expected.get(shape, 0) + count
    assert counted == expected
    steps = config.train.muon_ns_steps
    assert muon_flops(config) == sum(n * newton_schulz_flops(*s, steps) for s, n in counted.items())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.optimizer=muon", "parallel.data_parallel=fsdp"], "parallel.data_parallel"),
        (["train.optimizer=muon_sharded", "parallel.data_parallel=fsdp"], "whole matrices"),
        (["train.optimizer=muon_sharded", "train.adamw_kernel=triton"], "train.adamw_kernel"),
        (["train.muon_momentum=1.0"], r"train.muon_momentum \(1.0\) must be in \[0, 1\)"),
        (["train.muon_ns_steps=0"], r"train.muon_ns_steps \(0\) must be between 1 and"),
        (["train.muon_update_rms=0"], r"train.muon_update_rms \(0.0\) must be > 0"),
        (["train.muon_ns_dtype=fp16"], "train.muon_ns_dtype"),
    ],
)
def test_muon_config_errors_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny().with_overrides(overrides)


def test_settings_reach_the_optimizer():
    config = dataclasses.replace(
        _config(), train=dataclasses.replace(_config().train, muon_ns_dtype="fp32", muon_ns_steps=3)
    )
    optimizer = build_optimizer(build_model(config), config, ParallelDims(local_rank=0, device=torch.device("cpu")))  # fmt: skip
    assert optimizer.settings.ns_dtype == torch.float32 and optimizer.settings.ns_steps == 3


def test_whole_matrix_layout_partitions_and_balances():
    """The sharded Muon's buckets at every group size: each dense matrix whole on exactly one
    rank, inside that rank's region, FLOPs balanced to within the largest matrix (greedy LPT);
    an expert weight split by whole experts, each expert owned once."""
    from moetrain.optim.muon_buckets import dense_layout, expert_layout, ns_cost

    config = _config()
    model = build_model(config)
    muon, _ = split_param_groups(build_param_groups(model, config.train))
    entries = [
        (n, p, 0, "expert" if p.ndim == 3 else "dense", matrix_layout(n, p.ndim))
        for g in muon
        for n, p in zip(g["param_names"], g["params"], strict=True)
    ]
    dense = [e for e in entries if e[3] == "dense"]
    costs = [ns_cost(e[1], e[4]) for e in dense]
    for size in (1, 2, 3, 4):
        layouts = [dense_layout(dense, size, rank) for rank in range(size)]
        starts, region = layouts[0][0], layouts[0][1]
        owners = {}
        for rank, (_, _, pieces) in enumerate(layouts):
            for piece in pieces:
                assert piece.slot not in owners and piece.hi <= region
                assert starts[piece.slot] == rank * region + piece.lo
                assert piece.shape == tuple(dense[piece.slot][1].shape)
                owners[piece.slot] = rank
        assert sorted(owners) == list(range(len(dense)))
        loads = [sum(c for i, c in enumerate(costs) if owners[i] == r) for r in range(size)]
        assert max(loads) - min(loads) <= max(costs), (size, loads)
        for entry in (e for e in entries if e[3] == "expert"):
            rows = []
            for rank in range(size):
                for piece in expert_layout(entry, size, rank)[2]:
                    rows += range(piece.first_row, piece.first_row + piece.shape[0])
            assert rows == list(range(entry[1].shape[0])), (entry[0], size)


def test_resume_may_change_muons_hyperparameters_not_the_optimizer():
    from moetrain.train.resume_config import check_resumable

    saved = tiny().with_overrides(["train.optimizer=muon"])
    changed = saved.with_overrides(
        [
            "train.muon_momentum=0.9",
            "train.muon_ns_steps=6",
            "train.muon_nesterov=false",
            "train.muon_update_rms=0.3",
            "train.muon_ns_dtype=fp32",
        ]  # fmt: skip
    )
    assert len(check_resumable(saved, changed, "config.yaml")) == 5
    for other in ("muon_sharded", "adamw"):
        with pytest.raises(ValueError, match="train.optimizer cannot change on --resume"):
            check_resumable(saved, saved.with_overrides([f"train.optimizer={other}"]), "x")
