"""Routes files: a run's expert choices recorded (`moe.record_routes`) and replayed
(`moe.replay_routes`).

Letters: N forwards (steps x accumulation micro-batches), L MoE layers, T tokens of a
micro-batch, K top-k.
A routes file is `RUN/routes/rank{r:03d}-steps{a:07d}-{b:07d}.pt`: `torch.save` of a dict with
`routes` (int16 [N, L, T, K], each training forward's expert ids of rank r's micro-batch, steps a
to b, a step's micro-batches in order) and the shape it was recorded at: `first_step`, `steps`,
`accum_steps`, `num_experts`, `top_k`, `tokens`, `layers`, `rank`.

Recording keeps the step on the device: each MoE layer hands its training forward's ids to
`RouteRecorder.write`, which copies them into a fixed per-step buffer (the same addresses every
step, so a CUDA-graph replay writes them too); after each step the buffer is copied into a ring
of `train.log_every` steps, and at the log cadence the ring goes to the host and to one file.
Replay installs a `ReplayRouter` (moe/replay_router.py) in every MoE layer of the meta model,
holding that layer's recorded ids on the run's device; a recording of another shape is refused,
naming the field. Pipeline parallelism is refused (a rank would hold only its stages' layers).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moetrain.config import RunConfig
from moetrain.model.transformer import Transformer
from moetrain.moe.replay_router import ReplayRouter

ROUTES_DIR = "routes"


def _refuse_pipeline(field: str, pp: int) -> None:
    if pp > 1:
        raise ValueError(
            f"{field} is not supported with parallel.pp ({pp}) > 1: a rank holds only its "
            "stages' MoE layers; record or replay routes without pipeline parallelism"
        )


class RouteRecorder:
    """Records every training forward's expert ids of `model`'s MoE layers (this rank's) and
    writes them under `run_dir/routes/` at `flush`."""

    def __init__(
        self,
        model: Transformer,
        config: RunConfig,
        run_dir: Path,
        *,
        accum_steps: int,
        rank: int,
        pp: int,
        start: int,
    ) -> None:
        """`start`: the step the run starts at (this rank's files of later steps are removed:
        the run redoes them)."""
        _refuse_pipeline("moe.record_routes", pp)
        t, layers = config.train, model.moe_layers()
        self.accum_steps = accum_steps
        self.shape = {
            "accum_steps": self.accum_steps,
            "num_experts": config.moe.num_experts,
            "top_k": config.moe.top_k,
            "tokens": t.micro_batch_size * t.seq_len,
            "layers": len(layers),
            "rank": rank,
        }
        device = layers[0].router.gate.weight.device
        A, L, T, K = self.accum_steps, len(layers), self.shape["tokens"], config.moe.top_k
        self.step_ALTK = torch.zeros(A, L, T, K, dtype=torch.int16, device=device)
        self.ring_SALTK = torch.zeros(t.log_every, A, L, T, K, dtype=torch.int16, device=device)
        self.filled, self.first_step = 0, start + 1
        self.micro_L = [0] * L  # the micro-batch each layer's next training forward is
        self.dir = run_dir / ROUTES_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(f"rank{rank:03d}-*.pt"):  # steps this run redoes
            if _first_step(stale) > start:
                stale.unlink()
        for index, layer in enumerate(layers):
            layer.route_recorder = lambda ids_TK, index=index: self.write(index, ids_TK)

    @torch.compiler.disable  # host work: which micro-batch's slot
    def write(self, layer: int, ids_TK: torch.Tensor) -> None:
        micro = self.micro_L[layer]
        self.step_ALTK[micro, layer].copy_(ids_TK)
        self.micro_L[layer] = (micro + 1) % self.accum_steps

    def end_of_step(self) -> None:
        """After each step, outside any captured graph: the step's ids into the ring (a device
        copy); a full ring is written out."""
        if self.filled == self.ring_SALTK.shape[0]:
            self.flush()
        self.ring_SALTK[self.filled].copy_(self.step_ALTK)
        self.filled += 1

    def flush(self) -> Path | None:
        """Write the ring's steps to one file (a host read: the log cadence's)."""
        if self.filled == 0:
            return None
        routes_NLTK = self.ring_SALTK[: self.filled].flatten(0, 1).cpu()
        a, b = self.first_step, self.first_step + self.filled - 1
        path = self.dir / f"rank{self.shape['rank']:03d}-steps{a:07d}-{b:07d}.pt"
        torch.save(
            {"routes": routes_NLTK, "first_step": a, "steps": self.filled, **self.shape}, path
        )
        self.first_step, self.filled = b + 1, 0
        return path


class NoRecording:
    """moe.record_routes off: nothing to copy or write."""

    def end_of_step(self) -> None:
        pass

    def flush(self) -> None:
        pass


def route_recorder(
    model: Transformer, config: RunConfig, run_dir: Path, dims, accum_steps: int, start: int
) -> RouteRecorder | NoRecording:
    """The recorder `moe.record_routes` asks for on this rank (`dims`: its ParallelDims), or one
    that does nothing."""
    if not config.moe.record_routes:
        return NoRecording()
    return RouteRecorder(
        model, config, run_dir, accum_steps=accum_steps, rank=dims.rank, pp=dims.pp, start=start
    )


def _first_step(path: Path) -> int:
    return int(path.stem.split("-steps")[1].split("-")[0])


def load_routes(source: str | Path, rank: int = 0) -> dict:
    """A routes file, or this rank's files of a routes directory joined in step order (they must
    follow each other from the first): the dict of the format above."""
    source = Path(source)
    if source.is_dir():
        paths = sorted(source.glob(f"rank{rank:03d}-*.pt"), key=_first_step)
        if not paths:
            raise ValueError(f"moe.replay_routes ({source}) holds no routes file of rank {rank}")
    elif source.is_file():
        paths = [source]
    else:
        raise ValueError(f"moe.replay_routes ({source}) is neither a routes file nor a directory")
    parts = [torch.load(path, weights_only=True) for path in paths]
    for before, after, path in zip(parts, parts[1:], paths[1:], strict=False):
        if after["first_step"] != before["first_step"] + before["steps"]:
            raise ValueError(
                f"moe.replay_routes: {path.name} starts at step {after['first_step']}, not "
                f"{before['first_step'] + before['steps']}: the recording has a gap"
            )
    whole = dict(parts[0])
    whole["routes"] = torch.cat([p["routes"] for p in parts])
    whole["steps"] = sum(p["steps"] for p in parts)
    return whole


def check_shape(recorded: dict, config: RunConfig, num_layers: int) -> None:
    """Refuse a recording of another shape than this run's, naming the field that differs."""
    t, moe = config.train, config.moe
    ours = {
        "num_experts": ("moe.num_experts", moe.num_experts),
        "top_k": ("moe.top_k", moe.top_k),
        "tokens": ("train.micro_batch_size x train.seq_len", t.micro_batch_size * t.seq_len),
        "layers": ("the MoE layers of model.num_layers", num_layers),
    }
    for key, (field, value) in ours.items():
        if recorded[key] != value:
            raise ValueError(
                f"moe.replay_routes ({moe.replay_routes}) was recorded with {key} "
                f"{recorded[key]}, this run has {field} = {value}: replay it in a run of the "
                "recorded shape"
            )


def install_replay(model: Transformer, config: RunConfig, rank: int, pp: int, device) -> None:
    """Every MoE layer's router becomes a `ReplayRouter` of its recorded ids (on `device`). On
    the meta model, before parallelizing and materializing: the gate is built and initialized as
    the learned router's."""
    _refuse_pipeline("moe.replay_routes", pp)
    recorded = load_routes(config.moe.replay_routes, rank)
    layers = model.moe_layers()
    check_shape(recorded, config, len(layers))
    routes_NLTK = recorded["routes"].to(device)
    for index, layer in enumerate(layers):
        old = layer.router
        with torch.device("meta"):
            layer.router = ReplayRouter(
                old.gate.in_features, old.config, routes_NLTK[:, index].contiguous()
            )
