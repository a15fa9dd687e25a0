"""ShardedAdamW against one process running torch.optim.AdamW + clip_grad_norm_.

Every layout trains the same tiny MoE transformer on the same global batch of 8 micro-batches
(dp=4: 2 accumulation micro-steps per rank; dp=2: 4; one process: 8), with clipping that binds,
and must match the single-process reference to 1e-6 relative (per-tensor norm of the
difference). Expert parallelism is emulated without moetrain.parallel: every rank keeps the full
expert weights for the forward pass, sums their gradients over its ep group (what the all-to-all
backward delivers to the owner of an expert), and hands the optimizer only its local slice as a
parameter of its own; after the step the slices are all-gathered back into the full weights.
Rank layout as in ParallelDims: rank = edp_rank * ep + ep_rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from moetrain.checkpoint import manager
from moetrain.config import RunConfig, presets
from moetrain.dist_compat import all_gather_flat_name, reduce_scatter_flat_name
from moetrain.model.transformer import Transformer, build_model
from moetrain.optim.buckets import SHARD_ALIGN
from moetrain.optim.param_groups import build_param_groups
from moetrain.optim.schedule import lr_at
from moetrain.optim.sharded import ShardedAdamW, expert_global_slices
from moetrain.optim.sharded_state import ShardState

pytestmark = pytest.mark.distributed

MICRO_BATCHES = 4  # per optimizer step, over all ranks
MICRO_BATCH_SIZE, SEQ_LEN = 2, 16
STEPS, SAVE_AT = 5, 2
MAX_NORM = 0.5  # the gradient norm of this model starts near 7 and stays above 1: clipping binds
REL_TOL = 1e-6


def _config() -> RunConfig:
    base = presets.tiny()
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, d_model=32),
        moe=dataclasses.replace(base.moe, expert_hidden=32, lb_loss_weight=0.0, z_loss_weight=0.0),
        train=dataclasses.replace(
            base.train,
            lr=3e-3,
            eps=1e-6,
            warmup_steps=2,
            steps=STEPS,
            weight_decay=0.1,
            expert_lr_mult=2.0,
            router_lr_mult=0.5,
        ),
    )


def _batches() -> torch.Tensor:
    """(steps, micro-batches, batch, seq + 1) token ids, the same in every process."""
    generator = torch.Generator().manual_seed(1234)
    shape = (STEPS, MICRO_BATCHES, MICRO_BATCH_SIZE, SEQ_LEN + 1)
    return torch.randint(0, 320, shape, generator=generator)


def _micro_loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    return model.loss(model(tokens[:, :-1]), tokens[:, 1:])


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _assert_state_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    errors = {name: _rel_err(got[name], want[name]) for name in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= REL_TOL, f"{what}: {worst} differs by {errors[worst]:.2e} (relative)"


# ---- the single-process reference ---------------------------------------------------------------
def _reference() -> dict:
    """torch.optim.AdamW(foreach=False) + clip_grad_norm_ on the whole batch, in one process."""
    config = _config()
    torch.manual_seed(0)
    model = build_model(config)
    groups = build_param_groups(model, config.train)
    t = config.train
    optimizer = torch.optim.AdamW(
        [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        foreach=False,
        fused=False,
    )
    batches, norms, snapshots = _batches(), [], {}
    for step in range(STEPS):
        for micro in range(MICRO_BATCHES):
            (_micro_loss(model, batches[step, micro]) / MICRO_BATCHES).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        for torch_group, group in zip(optimizer.param_groups, groups, strict=True):
            torch_group["lr"] = lr_at(step, t) * group["lr_mult"]
        optimizer.step()
        optimizer.zero_grad()
        snapshots[step + 1] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"norms": norms, "params": snapshots}


# ---- one training run under a (dp, ep) layout ----------------------------------------------------
@dataclasses.dataclass
class _Groups:
    dp: int = 1
    ep: int = 1
    rank: int = 0
    dense: dist.ProcessGroup | None = None
    edp: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None


def _make_groups(rank: int, dp: int, ep: int) -> _Groups:
    """Every rank creates every group, in the same order, as new_group requires."""
    if dp == 1:
        return _Groups()
    groups = _Groups(dp=dp, ep=ep, rank=rank, dense=dist.new_group(list(range(dp))))
    for ep_rank in range(ep):
        group = dist.new_group([i * ep + ep_rank for i in range(dp // ep)])
        if rank % ep == ep_rank and dp // ep > 1:
            groups.edp = group
    for edp_rank in range(dp // ep):
        group = dist.new_group([edp_rank * ep + j for j in range(ep)])
        if rank // ep == edp_rank and ep > 1:
            groups.ep_group = group
    return groups


class _Run:
    """A model, its (possibly emulated expert-parallel) parameters and a ShardedAdamW."""

    def __init__(self, g: _Groups, bucket_mb: float = 0.02) -> None:
        self.g, self.config = g, _config()
        torch.manual_seed(0)
        self.model = build_model(self.config)
        groups = build_param_groups(self.model, self.config.train)
        num_experts = self.config.moe.num_experts
        self.local_experts: dict[str, nn.Parameter] = {}  # emulated EP: name -> local slice
        if g.ep > 1:
            per_rank = num_experts // g.ep
            offset = (g.rank % g.ep) * per_rank
            for group in groups:
                for i, (name, full) in enumerate(
                    zip(group["param_names"], group["params"], strict=True)
                ):
                    if group["kind"] == "expert":
                        local = nn.Parameter(full.detach()[offset : offset + per_rank].clone())
                        self.local_experts[name] = group["params"][i] = local
            slices = {
                name: ((num_experts, *p.shape[1:]), slice(offset, offset + per_rank))
                for name, p in self.local_experts.items()
            }
        else:
            slices = expert_global_slices(self.model, num_experts)
        t = self.config.train
        self.optimizer = ShardedAdamW(
            groups,
            dense_group=g.dense if g.dp > 1 else None,
            expert_group=g.edp,
            expert_grad_divisor=g.dp,
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            bucket_mb=bucket_mb,
            global_slices=slices,
            param_order=[name for name, _ in self.model.named_parameters()],
        )
        self.params = dict(self.model.named_parameters())

    def global_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def checkpoint_state(self) -> dict:
        """What a checkpoint holds: the global weights and the optimizer's state dict."""
        return {"model": self.global_params(), "optim": self.optimizer.state_dict()}

    def train_step(self, step: int, counts: dict[str, int] | None = None) -> float:
        """One optimizer step; `counts` receives the optimizer's collectives of this step."""
        g, accum = self.g, MICRO_BATCHES // self.g.dp
        counts = {} if counts is None else counts
        batches = _batches()[step]
        with _counting(counts):
            for micro in range(accum):
                last = micro == accum - 1
                with contextlib.nullcontext() if last else self.optimizer.no_sync():
                    loss = _micro_loss(self.model, batches[g.rank * accum + micro]) / accum
                    loss.backward()
            counts["launched_in_backward"] = counts["reduce_scatter"]
        if self.local_experts:  # emulated EP backward: owners receive their ep group's sums
            for name, local in self.local_experts.items():
                full = self.params[name]
                dist.all_reduce(full.grad, group=g.ep_group)
                offset = local.shape[0] * (g.rank % g.ep)
                local.grad = full.grad[offset : offset + local.shape[0]].clone()
                full.grad = None
        with _counting(counts):
            norm = self.optimizer.step(lr_at(step, self.config.train), MAX_NORM)
            self.optimizer.zero_grad()
        with torch.no_grad():
            for name, local in self.local_experts.items():
                pieces = [torch.empty_like(local) for _ in range(g.ep)]
                dist.all_gather(pieces, local.detach(), group=g.ep_group)
                self.params[name].copy_(torch.cat(pieces))
        return norm.item()

    def load(self, checkpoint: dict) -> None:
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(checkpoint["model"][name])
            for name, local in self.local_experts.items():
                offset = local.shape[0] * (self.g.rank % self.g.ep)
                local.copy_(checkpoint["model"][name][offset : offset + local.shape[0]])
        self.optimizer.load_state_dict(checkpoint["optim"])


@contextlib.contextmanager
def _counting(counts: dict[str, int]):
    """Count the optimizer's reduce-scatters, all-gathers and all-reduces into `counts`."""
    for key in ("reduce_scatter", "all_gather", "all_reduce"):
        counts.setdefault(key, 0)
    names = reduce_scatter_flat_name(), all_gather_flat_name(), "all_reduce"
    originals = tuple(getattr(dist, name) for name in names)

    def counted(key, original):
        def call(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        return call

    for key, name, original in zip(("reduce_scatter", "all_gather", "all_reduce"), names, originals, strict=True):  # fmt: skip
        setattr(dist, name, counted(key, original))
    try:
        yield
    finally:
        for name, original in zip(names, originals, strict=True):
            setattr(dist, name, original)


def _held(optimizer: ShardedAdamW, state: dict) -> dict:
    """What this rank's optimizer state dict holds, in elements: `held` in its tensors (a
    ShardState's chunks), `owned` by this rank (its pieces of every bucket, x 3 state tensors),
    `global` (the state's global size); `views`: every held tensor is a view of the optimizer's
    own shards (nothing was copied); `shard`: the largest shard of a bucket."""
    buffers = {
        t.untyped_storage().data_ptr()
        for b in optimizer.buckets
        for t in (b.master, b.exp_avg, b.exp_avg_sq)
    }
    tensors = [value for entry in state["state"].values() for value in entry.values()]
    chunks = [data for value in tensors for _, data in _chunks(value)]
    return {
        "held": sum(c.numel() for c in chunks),
        "owned": 3 * sum(p.hi - p.lo for b in optimizer.buckets for p in b.pieces),
        "global": sum(value.numel() for value in tensors),
        "views": all(c.untyped_storage().data_ptr() in buffers for c in chunks),
        "shard": max(b.master.numel() for b in optimizer.buckets),
        "io_largest": 0,
        "io_total": 0,
    }


@contextlib.contextmanager
def _recording_io(stats: dict):
    """Record in `stats` the largest and the total element count of the optimizer-state tensors
    DCP writes from (a save) or copies into (a load) on this rank."""
    originals = DefaultSavePlanner.resolve_data, DefaultLoadPlanner.resolve_tensor

    def record(fqn: str, tensor):
        if fqn.startswith("optim.state.") and isinstance(tensor, torch.Tensor):
            stats["io_largest"] = max(stats["io_largest"], tensor.numel())
            stats["io_total"] += tensor.numel()
        return tensor

    DefaultSavePlanner.resolve_data = lambda self, item: record(
        item.index.fqn, originals[0](self, item)
    )
    DefaultLoadPlanner.resolve_tensor = lambda self, item: record(
        item.dest_index.fqn, originals[1](self, item)
    )
    try:
        yield
    finally:
        DefaultSavePlanner.resolve_data, DefaultLoadPlanner.resolve_tensor = originals


def _chunks(value: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets, data) of what a state tensor holds; a plain tensor is global, one chunk."""
    return value.chunks() if isinstance(value, ShardState) else [((0,) * value.dim(), value)]


def _global_state(optimizer: ShardedAdamW, g: _Groups) -> dict[str, torch.Tensor]:
    """The optimizer state as full global tensors, assembled the way `state_dict` did before it
    kept to the shard (zeros plus the owned chunks, summed over the data-parallel world)."""
    state = optimizer.state_dict()
    out = {"step": torch.tensor(state["step"])}
    for name, entry in state["state"].items():
        for key, value in entry.items():
            full = torch.zeros(value.shape, dtype=value.dtype)
            for offsets, data in _chunks(value):
                box = tuple(slice(o, o + n) for o, n in zip(offsets, data.shape, strict=True))
                full[box] = data
            if g.dense is not None and isinstance(value, ShardState):
                dist.all_reduce(full, group=g.dense)
            out[f"{name}.{key}"] = full
    return out


def _one_layout(g: _Groups, resume_from: str | None, save_to: str | None) -> dict:
    """A fresh run of STEPS steps (saving a checkpoint after SAVE_AT if asked), then optionally
    a second run that resumes from a checkpoint after SAVE_AT steps and finishes. Checkpoints go
    through the checkpoint manager (DCP), as the trainer's do."""
    run = _Run(g)
    out: dict = {
        "norms": [],
        "counts": [],
        "num_buckets": len(run.optimizer.buckets),
        "synced_buckets": sum(b.group is not None for b in run.optimizer.buckets),
        "state_bytes": run.optimizer.state_bytes_per_rank(),
    }
    for step in range(STEPS):
        counts: dict[str, int] = {}
        out["norms"].append(run.train_step(step, counts))
        out["counts"].append(counts)
        if step + 1 == SAVE_AT and save_to is not None:
            checkpoint = run.checkpoint_state()
            out["saved"] = _held(run.optimizer, checkpoint["optim"])
            with _recording_io(out["saved"]):
                manager.save(save_to, SAVE_AT, checkpoint, {}, "")
            out["saved_global"] = _global_state(run.optimizer, g)
    out["params"] = run.global_params()
    if resume_from is not None:
        resumed = _Run(g)
        checkpoint = resumed.checkpoint_state()
        out["loaded"] = _held(resumed.optimizer, checkpoint["optim"])
        with _recording_io(out["loaded"]):
            manager.load(Path(resume_from) / f"step-{SAVE_AT}", checkpoint)
        resumed.load(checkpoint)
        out["loaded_global"] = _global_state(resumed.optimizer, g)
        out["resumed_norms"] = [resumed.train_step(step) for step in range(SAVE_AT, STEPS)]
        out["resumed_params"] = resumed.global_params()
    return out


def _layouts_worker(rank: int, world_size: int, jobs: list[tuple]) -> list[dict]:
    """Runs (ep, resume_from, save_to) jobs in order at dp = world_size."""
    outs = []
    for ep, resume_from, save_to in jobs:
        outs.append(_one_layout(_make_groups(rank, world_size, ep), resume_from, save_to))
        dist.barrier()  # the checkpoint is on disk before the next job reads it
    return outs


@contextlib.contextmanager
def _one_thread():
    """Tiny ops on a busy 2-core machine: intra-op threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference() -> dict:
    with _one_thread():
        return _reference()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[int, int], dict]:
    """Every layout, fresh and resumed. Checkpoints after SAVE_AT steps: one process -> (4, 2);
    (4, 2) -> (4, 1), (2, 1), (2, 2) and one process. Each layout's "per_rank" lists every
    rank's record; "checkpoint" is the directory of the checkpoint it saved."""
    directory = tmp_path_factory.mktemp("checkpoints")
    ws1, dp4_ep2 = str(directory / "ws1"), str(directory / "dp4_ep2")
    with _one_thread():
        one = _one_layout(_Groups(), None, ws1)
        four = run_distributed(_layouts_worker, 4, [(2, ws1, dp4_ep2), (1, dp4_ep2, None)])
        two = run_distributed(_layouts_worker, 2, [(1, dp4_ep2, None), (2, dp4_ep2, None)])
        one.update(_one_layout(_Groups(), dp4_ep2, None))
    out = {(1, 1): one | {"per_rank": [one]}}
    jobs = {(4, 2): (four, 0), (4, 1): (four, 1), (2, 1): (two, 0), (2, 2): (two, 1)}
    for layout, (ranks, job) in jobs.items():
        out[layout] = ranks[0][job] | {"per_rank": [r[job] for r in ranks]}
    out[1, 1]["checkpoint"] = Path(ws1) / f"step-{SAVE_AT}"
    out[4, 2]["checkpoint"] = Path(dp4_ep2) / f"step-{SAVE_AT}"
    return out


LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]
RESUMED_FROM = {(4, 2): "one process", (1, 1): "(dp=4, ep=2)"}


@pytest.mark.parametrize("dp, ep", LAYOUTS)
def test_layout_matches_single_process_adamw_with_clipping(dp, ep, reference, runs):
    out = runs[dp, ep]
    for step, (got, want) in enumerate(zip(out["norms"], reference["norms"], strict=True)):
        assert want > MAX_NORM  # clipping binds
        assert abs(got - want) <= REL_TOL * want, f"step {step}: grad norm {got} != {want}"
    _assert_state_close(out["params"], reference["params"][STEPS], f"(dp={dp}, ep={ep})")


@pytest.mark.parametrize("dp, ep", LAYOUTS)
def test_resume_in_another_layout_matches_uninterrupted_run(dp, ep, reference, runs):
    out, source = runs[dp, ep], RESUMED_FROM.get((dp, ep), "(dp=4, ep=2)")
    what = f"{source} -> (dp={dp}, ep={ep})"
    for got, want in zip(out["resumed_norms"], reference["norms"][SAVE_AT:], strict=True):
        assert abs(got - want) <= REL_TOL * want, f"{what}: grad norm {got} != {want}"
    _assert_state_close(out["resumed_params"], reference["params"][STEPS], what)


@pytest.mark.parametrize("dp, ep", LAYOUTS)
def test_resumed_state_equals_the_saved_global_state_bitwise(dp, ep, runs):
    """Resharding loses nothing: the state a layout loaded, assembled as global tensors, is the
    global state of the layout that saved it, bit for bit (the step count too)."""
    got = runs[dp, ep]["loaded_global"]
    want = runs[(1, 1) if (dp, ep) == (4, 2) else (4, 2)]["saved_global"]
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("dp, ep", LAYOUTS)
def test_checkpoint_save_and_load_hold_only_this_ranks_shard(dp, ep, runs):
    """ZeRO-1 memory at a checkpoint: every rank's optimizer state dict holds exactly the
    elements it owns (about 1/dp of the state), as views of its own shards, and DCP writes from
    and copies into nothing larger than one bucket's shard; the files hold chunks no larger
    than a shard, so what the reader materializes is bounded by the saver's shard too."""
    for rank, record in enumerate(runs[dp, ep]["per_rank"]):
        for what in ("saved", "loaded"):
            if what not in record:
                continue
            held, where = record[what], f"rank {rank} ({what}, dp={dp}, ep={ep})"
            assert held["held"] == held["owned"] == held["io_total"], (where, held)
            assert held["views"], f"{where}: the state dict holds copies"
            padding = 3 * SHARD_ALIGN * runs[dp, ep]["num_buckets"]
            assert held["owned"] <= held["global"] / dp + padding, (where, held)
            assert held["io_largest"] <= held["shard"], (where, held)
    if "checkpoint" in runs[dp, ep]:
        shard = max(r["saved"]["shard"] for r in runs[dp, ep]["per_rank"])
        saved = manager.read_metadata(runs[dp, ep]["checkpoint"]).state_dict_metadata
        chunks = [c for k, md in saved.items() if k.startswith("optim.state.") for c in md.chunks]
        assert max(math.prod(c.sizes) for c in chunks) <= shard


@pytest.mark.parametrize("dp, ep", LAYOUTS)
def test_state_bytes_and_collectives_per_step(dp, ep, runs):
    out = runs[dp, ep]
    replicated = 12 * sum(p.numel() for p in Transformer(_config()).parameters())  # fp32 x 3
    padding = 12 * SHARD_ALIGN * out["num_buckets"]
    assert replicated / dp <= out["state_bytes"] <= replicated / dp + padding
    assert out["num_buckets"] > 2  # small buckets, so ordering and launching are exercised
    for counts in out["counts"]:  # per synced bucket one reduce-scatter and one all-gather,
        assert counts["reduce_scatter"] == counts["all_gather"] == out["synced_buckets"]
        assert counts["all_reduce"] == (1 if dp > 1 else 0)  # and one all-reduce for the norm
        if dp > 1 and ep == 1:  # real backward hooks launch reductions before backward ends
            assert counts["launched_in_backward"] > 0


# ---- single-process behaviour --------------------------------------------------------------------
def _plain_groups(model: nn.Module) -> list[dict]:
    return [
        {
            "params": list(model.parameters()),
            "param_names": [n for n, _ in model.named_parameters()],
            "kind": "dense",
            "weight_decay": 0.1,
            "lr_mult": 1.0,
        }
    ]


def test_world_size_one_is_torch_adamw_without_clipping():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ref_model = copy.deepcopy(model)
    optimizer = ShardedAdamW(
        _plain_groups(model), dense_group=None, expert_group=None, lr=1e-2, bucket_mb=0.001
    )
    ref = torch.optim.AdamW(
        ref_model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False
    )
    for _ in range(4):
        x = torch.randn(8, 16)
        for m in (model, ref_model):
            m(x).square().mean().backward()
        norm = optimizer.step(1e-2)
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref_model.parameters()])
        ref.step()
        optimizer.zero_grad()
        ref.zero_grad()
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert _rel_err(p, q) <= REL_TOL


def test_skip_leaves_everything_unchanged_and_nonfinite_norm_skips():
    model = nn.Linear(4, 4)
    optimizer = ShardedAdamW(_plain_groups(model), dense_group=None, expert_group=None, lr=1e-2)
    model(torch.randn(2, 4)).square().sum().backward()
    optimizer.step(skip=torch.tensor(False))
    optimizer.zero_grad()
    before = _global_state(optimizer, _Groups())
    weights = [p.detach().clone() for p in model.parameters()]

    model(torch.randn(2, 4)).square().sum().backward()
    optimizer.step(skip=torch.tensor(True))  # skipped on request
    optimizer.zero_grad()
    model.weight.grad[0, 0] = float("nan")
    norm = optimizer.step(skip=torch.tensor(False))  # skipped: the norm is not finite
    assert not torch.isfinite(norm)

    after = _global_state(optimizer, _Groups())
    assert after["step"] == before["step"] == 1
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    for p, w in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p, w)


def test_bf16_params_with_fp32_master_and_fp32_gradient_accumulation():
    """bf16 parameters, fp32 master weights and fp32 gradient buckets: two accumulation
    micro-steps equal fp32 AdamW on the fp32 sum of the bf16 gradients; params = bf16(master)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(torch.bfloat16)
    twin = copy.deepcopy(model)  # computes the same bf16 gradients, micro-step by micro-step
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    optimizer = ShardedAdamW(
        _plain_groups(model),
        dense_group=None,
        expert_group=None,
        lr=1e-2,
        grad_dtype=torch.float32,
    )
    for _ in range(3):
        xs = [torch.randn(8, 16, dtype=torch.bfloat16) for _ in range(2)]
        with optimizer.no_sync():
            model(xs[0]).float().square().mean().backward()
        model(xs[1]).float().square().mean().backward()
        for x in xs:
            twin(x).float().square().mean().backward()
            for p, m in zip(twin.parameters(), master, strict=True):
                m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                p.grad = None
        assert all(p.grad is None for p in model.parameters())  # moved into the fp32 buckets
        optimizer.step(1e-2, max_grad_norm=1.0)
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        ref.step()
        ref.zero_grad()
        optimizer.zero_grad()
        with torch.no_grad():
            for p, m in zip(twin.parameters(), master, strict=True):
                p.copy_(m)
    state = _global_state(optimizer, _Groups())
    for (name, p), m in zip(model.named_parameters(), master, strict=True):
        assert _rel_err(state[f"{name}.master"], m) <= REL_TOL, name
        assert torch.equal(p, state[f"{name}.master"].to(torch.bfloat16)), name


def test_load_state_dict_rejects_wrong_global_shape():
    model = nn.Linear(4, 4)
    optimizer = ShardedAdamW(_plain_groups(model), dense_group=None, expert_group=None, lr=1e-3)
    state = optimizer.state_dict()
    state["state"]["weight"]["exp_avg"] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="weight.exp_avg has shape"):
        optimizer.load_state_dict(state)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fused_update_matches_torch_fused_adamw():
    """The users' path on a GPU: bf16 parameters, fp32 masters and gradient buckets, clipping,
    torch's fused CUDA AdamW on the flat shards, against torch.optim.AdamW(fused=True) on fp32
    copies. (A float64 step count read as float by the CUDA kernel gave NaN from step 1.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 16))
    model = model.to("cuda", torch.bfloat16)
    twin = copy.deepcopy(model)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    optimizer = ShardedAdamW(
        _plain_groups(model), dense_group=None, expert_group=None, lr=1e-2, grad_dtype=torch.float32
    )
    for _ in range(4):
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
        model(x).float().square().mean().backward()
        twin(x).float().square().mean().backward()
        for p, m in zip(twin.parameters(), master, strict=True):
            m.grad, p.grad = p.grad.float(), None
        norm = optimizer.step(1e-2, max_grad_norm=0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(master, 0.5)
        ref.step()
        ref.zero_grad()
        optimizer.zero_grad()
        with torch.no_grad():
            for p, m in zip(twin.parameters(), master, strict=True):
                p.copy_(m)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    for p, m in zip(model.parameters(), master, strict=True):
        assert torch.isfinite(p).all()
        assert torch.equal(p, m.to(torch.bfloat16)) or _rel_err(p, m) <= 4e-3
