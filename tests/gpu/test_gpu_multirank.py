"""Several ranks on one GPU (parallel.backend=gloo): the distributed code on real CUDA kernels.

NCCL refuses two ranks on one GPU, but gloo moves CUDA tensors for every collective moetrain's
expert, data and ZeRO-1 paths use. Each case trains with the Trainer (compiled blocks, Triton
kernels, bf16 unless stated) in `world` processes on the one GPU, and the same global batch in
one process (gradient accumulation over the same micro-batches), then compares: the first MoE
layer's gradients (router and all experts, gathered over ep) on the first global batch, from the
same initial weights, and the loss at every step after. The bf16 paths round at different points
(the expert-parallel dispatchers weight the routes in their fp32 combine, the local one inside
the experts' SwiGLU), so bf16 is held to the loss within 1e-3 relative and the gradients within
2% in norm. (After a few steps near-tied router scores pick other experts for some tokens, so
later gradients are not comparable elementwise; on the CPU in fp32 these layouts agree to 1e-6.)
The fp32 case (held to 1e-5) runs eagerly: compiled, torch._grouped_mm takes bf16 only on CUDA
(fp32 parameters with compiled blocks on a GPU are a start-up error). The pipeline is left out: gloo has no point-to-point for CUDA tensors
(parallel.backend=gloo with pp > 1 is a start-up error)."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS, MICRO = 5, 2


def _base(preset: str, world: int) -> list[str]:
    common = [
        f"train.steps={STEPS}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        f"train.micro_batch_size={MICRO}",
        "train.lr=1e-3",
    ]
    if preset == "tiny":  # seq 64: the global batch of `world` micro-batches
        return [*common, "train.seq_len=64", f"train.global_batch_tokens={world * MICRO * 64}"]
    # `small` reduced: its widths, 16 experts, 2 layers, short sequences
    return [
        *common,
        "model.num_layers=2",
        "moe.num_experts=16",
        "train.seq_len=256",
        f"train.global_batch_tokens={world * MICRO * 256}",
    ]


def _config(preset: str, overrides: list[str]):
    from moetrain.config.presets import get_preset

    return get_preset(preset).with_overrides(overrides)


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r["kind"] == "train"}


def _probe_gradients(trainer) -> dict[str, torch.Tensor]:
    """The first MoE layer's synced gradients on the first global batch (experts: global)."""
    from moetrain.optim.clip import grad_of
    from moetrain.train import step as train_step

    trainer.optimizer.zero_grad()
    it = iter(trainer.train_loader)
    train_step.forward_backward(trainer.model, it, trainer.accum_steps, trainer.optimizer.no_sync)
    trainer.optimizer.finish_grad_sync()
    layer = next(iter(trainer.model.moe_layers()))
    out = {"router": grad_of(layer.router.gate.weight)}
    for name in ("w_up_eD2F", "w_down_eFD"):
        grad = grad_of(getattr(layer.experts, name)).contiguous()
        group = trainer.dims.ep_group
        if group is not None:
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, grad, group=group)
            grad = torch.cat(parts)
        out[name] = grad
    return {k: v.float().cpu() for k, v in out.items()}


def _run(rank, world, preset, overrides, run_dir, cache, resume, probe):
    os.environ["MOETRAIN_CACHE"] = cache
    from moetrain.train.trainer import Trainer

    config = _config(preset, overrides)
    trainer = Trainer(config, run_dir, resume=resume, device="cuda", progress=False)
    grads = _probe_gradients(trainer) if probe else None
    trainer.optimizer.zero_grad()
    with warnings.catch_warnings():  # a step that cannot be graphed is refused, never tried
        warnings.filterwarnings("error", message="capturing the training step")
        trainer.train()
    return grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


_REFERENCES: dict[tuple, tuple] = {}


def _reference(tmp_path_factory, preset: str, world: int, extra: list[str]):
    """One process on the same global batch (cached per preset, world and precision)."""
    key = (preset, world, tuple(extra))
    if key not in _REFERENCES:
        run_dir = tmp_path_factory.mktemp("reference")
        cache = str(tmp_path_factory.getbasetemp() / "cache")
        grads = run_distributed(
            _run, 1, preset, _base(preset, world) + extra, str(run_dir), cache, False, True
        )[0]
        _REFERENCES[key] = (_losses(run_dir), grads)
    return _REFERENCES[key]


def _compare(losses, grads, ref_losses, ref_grads, fp32: bool) -> None:
    loss_tol, grad_tol = (1e-5, 1e-5) if fp32 else (1e-3, 2e-2)
    assert sorted(losses) == sorted(ref_losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        assert abs(loss - ref_losses[step]) <= loss_tol * abs(ref_losses[step]), (
            step, loss, ref_losses[step])  # fmt: skip
    for name, ref in ref_grads.items():
        assert grads[name].shape == ref.shape, name
        assert _rel(grads[name], ref) <= grad_tol, (name, _rel(grads[name], ref))


CASES = {
    # id: (preset, world, layout and precision overrides)
    "tiny-dp2-ep2-nosync": (
        "tiny",
        2,
        ["parallel.ep=2", "moe.dispatcher=no_sync", "moe.capacity_factor=4"],
    ),  # fmt: skip
    "tiny-dp2-ep2-alltoall-fp8": (
        "tiny",
        2,
        ["parallel.ep=2", "moe.dispatcher=all_to_all", "precision.dispatch=fp8"],
    ),  # fmt: skip
    "tiny-dp2-ep2-nosync-fp8": (
        "tiny",
        2,
        [
            "parallel.ep=2",
            "moe.dispatcher=no_sync",
            "moe.capacity_factor=4",
            "precision.dispatch=fp8",
        ],
    ),  # fmt: skip
    "tiny-dp2": ("tiny", 2, []),
    "tiny-dp2-ep2-nosync-fp32": (
        "tiny",
        2,
        [
            "parallel.ep=2",
            "moe.dispatcher=no_sync",
            "moe.capacity_factor=4",
            "precision.param_dtype=fp32",
            "parallel.compile=false",
        ],
    ),  # fmt: skip
    "tiny-dp4-ep2-alltoall": ("tiny", 4, ["parallel.ep=2", "moe.dispatcher=all_to_all"]),
    "small-dp2-ep2-nosync": (
        "small",
        2,
        ["parallel.ep=2", "moe.dispatcher=no_sync", "moe.capacity_factor=4"],
    ),  # fmt: skip
    "small-dp4-ep4-alltoall": ("small", 4, ["parallel.ep=4", "moe.dispatcher=all_to_all"]),
}
_PRECISION = ("precision.dispatch=fp8", "precision.param_dtype=fp32", "parallel.compile=false")


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_on_one_gpu_match_one_process(case, tmp_path, tmp_path_factory):
    preset, world, overrides = CASES[case]
    extra = [o for o in overrides if o in _PRECISION]
    ref_losses, ref_grads = _reference(tmp_path_factory, preset, world, extra)
    cache = str(tmp_path_factory.getbasetemp() / "cache")
    layout = [*_base(preset, world), *overrides, "parallel.backend=gloo"]
    grads = run_distributed(_run, world, preset, layout, str(tmp_path), cache, False, True)
    _compare(
        _losses(tmp_path), grads[0], ref_losses, ref_grads, "precision.param_dtype=fp32" in extra
    )
    for other in grads[1:]:  # every rank holds the same synced gradients
        for name, value in other.items():
            assert torch.equal(value, grads[0][name]), name


def test_zero1_on_one_gpu_matches_one_process_and_resumes_in_one_process(
    tmp_path, tmp_path_factory
):
    """ZeRO-1 (torch's fused CUDA AdamW on the flat shards) at (dp 4, ep 2) against one process,
    and its step-2 checkpoint resumed at world size 1 on the GPU."""
    preset, world = "tiny", 4
    cache = str(tmp_path_factory.getbasetemp() / "cache")
    sharded = ["train.optimizer=sharded", "train.checkpoint_every=2", "train.keep_checkpoints=5"]
    ref_dir = tmp_path / "one"
    run_distributed(_run, 1, preset, _base(preset, world) + sharded, str(ref_dir), cache, False, False)  # fmt: skip
    layout = [*_base(preset, world), *sharded, "parallel.ep=2", "moe.dispatcher=all_to_all", "parallel.backend=gloo"]  # fmt: skip
    run_distributed(_run, world, preset, layout, str(tmp_path / "four"), cache, False, False)
    ref, four = _losses(ref_dir), _losses(tmp_path / "four")
    for step in ref:
        assert abs(four[step] - ref[step]) <= 1e-3 * abs(ref[step]), (step, four[step], ref[step])
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "four" / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")  # fmt: skip
    run_distributed(_run, 1, preset, _base(preset, world) + sharded, str(resumed), cache, True, False)  # fmt: skip
    after = _losses(resumed)
    assert sorted(after) == [3, 4, 5]
    for step in after:
        assert abs(after[step] - four[step]) <= 1e-3 * abs(four[step]), (step, after[step], four[step])  # fmt: skip


def test_fsdp_ep2_on_one_gpu_resumes_and_loads_in_one_process(tmp_path, tmp_path_factory):
    """FSDP2 at (dp 2, ep 2) with bf16 parameters, fp32 masters and the CUDA AdamW: 2 steps,
    save, resume, 3 more track the uninterrupted run (bf16 kernels on a GPU are held to 1e-3,
    as above), and one process resumes the step-2 checkpoint and tracks it too."""
    preset, world = "tiny", 2
    cache = str(tmp_path_factory.getbasetemp() / "cache")
    saves = ["train.checkpoint_every=2", "train.keep_checkpoints=5"]
    fsdp = ["parallel.data_parallel=fsdp", "parallel.ep=2", "moe.dispatcher=all_to_all", "parallel.backend=gloo"]  # fmt: skip
    layout = [*_base(preset, world), *saves, *fsdp]
    run_distributed(_run, world, preset, layout, str(tmp_path / "straight"), cache, False, False)
    part = [*layout, "train.steps=2"]
    run_distributed(_run, world, preset, part, str(tmp_path / "part"), cache, False, False)
    run_distributed(_run, world, preset, layout, str(tmp_path / "part"), cache, True, False)
    one = tmp_path / "one"
    (one / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "part" / "checkpoints" / "step-2", one / "checkpoints" / "step-2")
    run_distributed(_run, 1, preset, [*_base(preset, world), *saves], str(one), cache, True, False)
    straight = _losses(tmp_path / "straight")
    for run in ("part", "one"):
        resumed = _losses(tmp_path / run)
        assert sorted(resumed) == (list(range(1, STEPS + 1)) if run == "part" else [3, 4, 5])
        for step, loss in resumed.items():
            assert abs(loss - straight[step]) <= 1e-3 * abs(straight[step]), (run, step, loss)


def _dispatch_under_sync_debug(rank, world, kind, payload):
    """One dispatch + combine, forward and backward, under sync-debug "error", with the transport
    calls (gloo stages CUDA tensors through the host) and the AllToAll dispatcher's one designed
    sync (its split sizes) exempted: everything else is the dispatcher's own work."""
    from unittest import mock

    from moetrain.moe.payload import BF16_PAYLOAD, FP8_PAYLOAD
    from moetrain.moe.router import RoutingResult
    from moetrain.parallel import comm, ep_dispatch

    payload = {"bf16": BF16_PAYLOAD, "fp8": FP8_PAYLOAD}[payload]
    torch.cuda.set_device(0)
    group = dist.new_group(list(range(world)))
    T, K, E, D = 512, 4, 16, 256
    generator = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(T, D, device="cuda", generator=generator, dtype=torch.bfloat16)
    ids = torch.rand(T, E, device="cuda", generator=generator).topk(K, dim=-1).indices
    weights = torch.rand(T, K, device="cuda", generator=generator).softmax(-1)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    if kind == "no_sync":
        dispatcher = ep_dispatch.NoSyncDispatcher(E, group, rank, capacity_factor=1.25, payload=payload)  # fmt: skip
    else:
        dispatcher = ep_dispatch.AllToAllDispatcher(E, group, payload=payload)

    def step():
        x_ = x.clone().requires_grad_()
        w_ = weights.clone().requires_grad_()
        zero = torch.zeros((), device="cuda")
        routing = RoutingResult(ids, w_, counts, torch.empty(0, device="cuda"), zero, zero)
        rows, offsets, handle = dispatcher.dispatch(x_, routing)
        dispatcher.combine(rows * 2, handle).backward(torch.ones_like(x_))
        return x_.grad, w_.grad

    def exempt(fn):
        def call(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("default")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("error")

        return call

    step()  # warm-up: lazy initialization is not a per-step sync
    torch.cuda.synchronize()
    launch_collective = comm._launch_collective  # the launch and the wait of each exchange
    exempt_launch = lambda group: lambda *a: exempt(exempt(launch_collective(group))(*a))  # noqa: E731
    patches = [mock.patch.object(comm, "_launch_collective", exempt_launch)]
    for name in ("all_gather_counts", "all_to_all_counts", "_sync_split_sizes"):
        patches.append(mock.patch.object(ep_dispatch, name, exempt(getattr(ep_dispatch, name))))
    for p in patches:
        p.start()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        for p in patches:
            p.stop()
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("kind", ["no_sync", "all_to_all"])
@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_dispatchers_own_work_has_no_host_sync_at_world_size_2(kind, payload):
    run_distributed(_dispatch_under_sync_debug, 2, kind, payload)


def _graph_over_gloo(rank, world, run_dir, cache):
    os.environ["MOETRAIN_CACHE"] = cache
    from moetrain.train.trainer import Trainer

    overrides = [*CASES["tiny-dp2-ep2-nosync"][2], "parallel.backend=gloo", "train.cuda_graph=true"]
    with pytest.raises(ValueError, match="parallel.backend is gloo"):
        Trainer(_config("tiny", [*_base("tiny", world), *overrides]), run_dir, progress=False)
    return True


def test_cuda_graph_over_gloo_is_a_start_up_error(tmp_path, tmp_path_factory):
    """gloo stages CUDA tensors through the host: no capture; train.cuda_graph=true says so."""
    cache = str(tmp_path_factory.getbasetemp() / "cache")
    assert run_distributed(_graph_over_gloo, 2, str(tmp_path), cache) == [True, True]
