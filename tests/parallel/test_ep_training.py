"""Expert + data parallel training equals one process accumulating every rank's micro-batches.

Each case builds the model the trainer's way (meta -> parallelize -> to_empty -> init_weights),
checks that the experts it holds are the ep=1 model's global experts, then runs 3 AdamW steps and
compares, at every step, each rank's loss and every synchronized gradient with a single-process
reference (LocalDispatcher, gradient accumulation over the dp ranks' micro-batches, each with its
own load-balancing loss), in float64. At world 4, FSDP2 checkpoints of ep-sharded experts are
also checked against the one-process model. Several cases share one spawned process group to
keep the suite fast.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import run_distributed
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.config import (
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
)
from moetrain.model.transformer import Transformer, build_model
from moetrain.optim.adamw import AdamW
from moetrain.optim.param_groups import build_param_groups
from moetrain.parallel import GradientSync, init_distributed, is_expert_param, parallelize
from moetrain.parallel.data import fsdp_mesh
from moetrain.parallel.expert import globalize_experts, read_dispatch_stats
from moetrain.parallel.mesh import ParallelDims
from moetrain.parallel.precision import apply_precision, resolve_precision
from moetrain.train.optimizer_build import build_optimizer

pytestmark = pytest.mark.distributed

STEPS, BATCH, SEQ, VOCAB = 3, 2, 16, 64


def tiny_config(dp: int, ep: int, dispatcher: str, payload: str = "bf16", **parallel) -> RunConfig:
    # NoSync is capacity mode; a factor of E / K (4) never drops, so it matches one process
    capacity_factor = 4.0 if dispatcher == "no_sync" else None
    return RunConfig(
        model=ModelConfig(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4),
        moe=MoEConfig(
            num_experts=8,
            top_k=2,
            expert_hidden=32,
            dispatcher=dispatcher,
            capacity_factor=capacity_factor,
        ),
        parallel=ParallelConfig(dp=dp, ep=ep, **parallel),
        train=TrainConfig(seq_len=SEQ, micro_batch_size=BATCH, seed=3, eps=1e-6),
        precision=PrecisionConfig(dispatch=payload),
    )


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, what: str, rel=1e-5) -> None:
    """max |actual - expected| <= rel * max |expected| (fp32 summation orders differ)."""
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale + 1e-12, f"{what}: max error {err:.3e}, scale {scale:.3e}"


def make_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    # AdamW divides each element by its own gradient scale, so an element whose gradient is near
    # rounding level moves by up to lr either way, depending on that rounding. A small lr, and
    # an eps above fp32 rounding noise (2e-10 at these gradients' 2e-3), keep the FSDP case's
    # fp32 noise within the 1e-5 tolerance over the 3 steps (with eps = 1e-8 it reached 1.3e-5
    # on one CPU). The expert-parallel cases run in float64 (`_world2`, `_world4`).
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6, foreach=False)


def run_case(config: RunConfig, accum: int = 1, bucket_mb: float = 25.0) -> None:
    dims = init_distributed(config)
    dp, ep = dims.dp, dims.ep
    # Build the trainer's way, and a single-process reference from the same seed.
    with torch.device("meta"):
        model = Transformer(config)
    parallelize(model, config, dims)
    model.to_empty(device="cpu")
    model.init_weights()
    reference = build_model(dataclasses.replace(config, parallel=ParallelConfig()))
    ref_params = dict(reference.named_parameters())
    # the same precision plan (FP8 payload: the same rounding, nothing moved)
    apply_precision(reference, resolve_precision(config, torch.device("cpu")))
    for name, param in model.named_parameters():
        expected = ref_params[name].detach()
        if is_expert_param(name) and dims.ep_group is not None:
            shards = [torch.empty_like(param) for _ in range(ep)]
            dist.all_gather(shards, param.detach().contiguous(), group=dims.ep_group)
            assert torch.equal(torch.cat(shards), expected), f"global experts of {name}"
        else:
            assert torch.equal(param.detach(), expected), name

    sync = GradientSync(model, dims, bucket_mb=bucket_mb)
    opt, ref_opt = make_adamw(model), make_adamw(reference)
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (STEPS, accum, dp, BATCH, SEQ + 1), generator=generator)
    for layer in model.moe_layers():
        layer.aux_grad_scale = 1.0 / accum
    for layer in reference.moe_layers():
        layer.aux_grad_scale = 1.0 / (accum * dp)

    for step in range(STEPS):
        # Reference: accumulate over every micro-batch of every dp rank.
        ref_losses = torch.zeros(accum, dp)
        for micro in range(accum):
            for rank in range(dp):
                batch = tokens[step, micro, rank]
                loss = reference.loss(reference(batch[:, :-1]), batch[:, 1:])
                (loss / (accum * dp)).backward()
                ref_losses[micro, rank] = loss.detach()
        # This rank: its own micro-batches, synchronized once.
        for micro in range(accum):
            batch = tokens[step, micro, dims.dp_rank]
            with sync.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                loss = model.loss(model(batch[:, :-1]), batch[:, 1:])
                (loss / accum).backward()
            assert_close_rel(loss.detach(), ref_losses[micro, dims.dp_rank], f"loss {step}")
        sync.finish()
        for name, param in model.named_parameters():
            expected = ref_params[name].grad
            if is_expert_param(name):
                offset = model.get_submodule(name.rsplit(".", 1)[0]).expert_offset
                expected = expected[offset : offset + param.shape[0]]
            assert_close_rel(param.grad, expected, f"step {step} grad {name}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # Dispatcher statistics: nothing dropped, and recomputation does not count routes twice.
    layers = model.moe_layers()
    if config.moe.dispatcher == "no_sync":
        routes = sum(int(layer.dispatcher._stats[2]) for layer in layers)
        assert routes == STEPS * accum * len(layers) * BATCH * SEQ * config.moe.top_k
        stats = read_dispatch_stats(model)
        assert sum(int(v) for k, v in stats.items() if k.endswith("dropped_routes")) == 0


def _world2(rank, world_size):
    # float64: expert parallelism changes the order of sums, and where the router weights are
    # applied (the expert-parallel combine weights the routes, the LocalDispatcher leaves them
    # to the experts' SwiGLU); in fp32 that rounding, amplified by AdamW, reached 1.9e-5 of the
    # largest gradient at step 1, over the 1e-5 tolerance that float64 meets with a wide margin
    torch.set_default_dtype(torch.float64)
    for dispatcher in ("all_to_all", "no_sync"):
        run_case(tiny_config(2, 2, dispatcher))
    # Gradient accumulation with one bucket per parameter, and activation checkpointing.
    run_case(tiny_config(2, 2, "no_sync"), accum=2, bucket_mb=0.002)
    run_case(tiny_config(2, 2, "no_sync", activation_checkpointing="moe"))
    run_case(tiny_config(2, 2, "all_to_all", activation_checkpointing="full"))
    run_case(tiny_config(2, 1, "auto"), accum=2)  # plain data parallel
    for dispatcher in ("all_to_all", "no_sync"):  # FP8 payload (precision.dispatch)
        run_case(tiny_config(2, 2, dispatcher, payload="fp8"))


def _world4(rank, world_size, path):
    torch.set_default_dtype(torch.float64)
    for ep in (2, 4):
        for dispatcher in ("all_to_all", "no_sync"):
            run_case(tiny_config(4, ep, dispatcher))
    for num_experts in (8, 6):  # FSDP2 splits each rank's 4 experts 2 + 2, its 3 experts 2 + 1
        config = tiny_config(4, 2, "all_to_all", data_parallel="fsdp")
        check_fsdp_checkpoint(config.with_overrides([f"moe.num_experts={num_experts}"]), path)


def check_fsdp_checkpoint(config: RunConfig, path: str) -> None:
    """FSDP2 at dp 4, ep 2 shards each ep rank's experts over edp 2 as well: the checkpoint
    `globalize_experts` describes holds the one-process model's tensors under their global names
    and shapes, and loading it into a zeroed model of the same layout restores every shard."""
    dims = init_distributed(config)
    one_process = dataclasses.replace(config, parallel=ParallelConfig())
    reference = build_model(one_process)
    source = parallelize(build_model(one_process), config, dims)
    target = parallelize(build_model(one_process), config, dims)
    with torch.no_grad():
        for param in target.parameters():
            param.to_local().zero_()
    path = f"{path}/experts{config.moe.num_experts}"
    dcp.save(globalize_experts(source.state_dict(), dims), checkpoint_id=path)
    if dims.rank == 0:
        saved = {k: torch.zeros_like(v) for k, v in reference.state_dict().items()}
        dcp.load(saved, checkpoint_id=path, no_dist=True)
        for name, value in reference.state_dict().items():
            assert torch.equal(saved[name], value), f"checkpoint of {name}"
    dcp.load(globalize_experts(target.state_dict(), dims), checkpoint_id=path)
    for (name, got), want in zip(target.named_parameters(), source.parameters(), strict=True):
        assert torch.equal(got.to_local(), want.to_local()), f"loaded {name}"


def test_ep_dp_training_matches_single_process_world2():
    run_distributed(_world2, 2)


def test_ep_dp_training_matches_single_process_and_fsdp_checkpoints_world4(tmp_path):
    run_distributed(_world4, 4, str(tmp_path))


class CollectiveLog(TorchDispatchMode):
    """The c10d collectives run under it, with the dtype of each one's first tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            self.calls.append((name, tensors[0].dtype if tensors else None))
        return func(*args, **(kwargs or {}))

    def count(self, what: str) -> int:
        return sum(what in name for name, _ in self.calls)

    def dtypes(self, what: str) -> set:
        return {dtype for name, dtype in self.calls if what in name}


def expected_fsdp_collectives(config: RunConfig, dp: int, accum: int) -> dict[str, int]:
    """Per step at ep 1: each block and the root is one FSDP2 group, gathered in every forward
    (step: the first only); blocks that reshard after forward gather again for the backward;
    every group reduce-scatters in each backward (step: the last only), and under HSDP then
    all-reduces across the replicas. A shard of one rank gathers and scatters nothing."""
    groups, blocks = config.model.num_layers + 1, config.model.num_layers
    reshard = config.parallel.fsdp_reshard
    shard = config.parallel.fsdp_shard_size or dp
    passes = 1 if reshard == "step" else accum
    gathers = passes * groups + (accum * blocks if reshard == "forward" else 0)
    return {
        "allgather": gathers if shard > 1 else 0,
        "reduce_scatter": passes * groups if shard > 1 else 0,
        "allreduce": passes * groups if shard < dp else 0,
    }


def run_fsdp_case(config: RunConfig, accum: int = 1, steps: int = STEPS) -> None:
    """FSDP2 baseline: shard a materialized model, train with the trainer's optimizer and
    gradient-norm clipping (which binds), compare with one process (loss, every gradient, the
    norm, the weights after each step); at ep 1 count its collectives in every step
    (parallel.fsdp_reshard, HSDP)."""
    dims = init_distributed(config)
    reference = build_model(dataclasses.replace(config, parallel=ParallelConfig()))
    model = parallelize(
        build_model(dataclasses.replace(config, parallel=ParallelConfig())), config, dims
    )
    ref_params = dict(reference.named_parameters())
    opt = build_optimizer(model, config, dims)
    no_sync = opt.no_sync  # the trainer's accumulation
    ref_grads = lambda: [p.grad for p in reference.parameters()]  # noqa: E731
    ref_opt = AdamW(
        build_param_groups(reference, config.train),
        betas=(config.train.beta1, config.train.beta2),
        eps=config.train.eps,
        master_weights=False,
        fused=False,
        norm_fn=lambda: torch.nn.utils.get_total_norm(ref_grads()),
    )
    ref_opt.init_state()
    generator = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, VOCAB, (steps, accum, dims.dp, BATCH, SEQ + 1), generator=generator)
    for layer in reference.moe_layers():
        layer.aux_grad_scale = 1.0 / (accum * dims.dp)
    for layer in model.moe_layers():
        layer.aux_grad_scale = 1.0 / accum
    for step in range(steps):
        ref_losses = torch.zeros(accum, dims.dp)
        for micro in range(accum):
            for rank in range(dims.dp):
                batch = tokens[step, micro, rank]
                loss = reference.loss(reference(batch[:, :-1]), batch[:, 1:])
                (loss / (accum * dims.dp)).backward()
                ref_losses[micro, rank] = loss.detach()
        log = CollectiveLog()
        with log:
            for micro in range(accum):
                batch = tokens[step, micro, dims.dp_rank]
                with no_sync() if micro < accum - 1 else contextlib.nullcontext():
                    loss = model.loss(model(batch[:, :-1]), batch[:, 1:])
                    (loss / accum).backward()
                assert_close_rel(loss.detach(), ref_losses[micro, dims.dp_rank], f"loss {step}")
        if dims.ep == 1:
            counts = {
                what: log.count(what) for what in ("allgather", "reduce_scatter", "allreduce")
            }
            assert counts == expected_fsdp_collectives(config, dims.dp, accum), counts
        for name, param in model.named_parameters():
            expected = ref_params[name].grad
            if is_expert_param(name):
                offset = model.get_submodule(name.rsplit(".", 1)[0]).expert_offset
                expected = expected[offset : offset + config.moe.num_experts // dims.ep]
            assert_close_rel(param.grad.full_tensor(), expected, f"fsdp step {step} {name}")
        max_norm = 0.5 * torch.nn.utils.get_total_norm(ref_grads()).item()  # clipping binds
        norm = opt.step(1e-3, max_norm)
        ref_norm = ref_opt.step(1e-3, max_norm)
        assert not isinstance(norm, DTensor)
        assert_close_rel(norm, ref_norm, f"fsdp step {step} gradient norm")
        for name, param in model.named_parameters():
            expected = ref_params[name].detach()
            if is_expert_param(name):
                offset = model.get_submodule(name.rsplit(".", 1)[0]).expert_offset
                expected = expected[offset : offset + config.moe.num_experts // dims.ep]
            assert_close_rel(param.full_tensor(), expected, f"fsdp step {step} weight {name}")
        opt.zero_grad()
        ref_opt.zero_grad()


def _fsdp_world2(rank, world_size):
    for ep, dispatcher, checkpointing in ((1, "auto", "none"), (2, "all_to_all", "full")):
        config = tiny_config(
            2, ep, dispatcher, data_parallel="fsdp", activation_checkpointing=checkpointing
        )
        run_fsdp_case(config)
    # parallel.fsdp_reshard step over two micro-batches, and HSDP (replicas of one shard)
    options = {"data_parallel": "fsdp"}
    run_fsdp_case(tiny_config(2, 1, "auto", fsdp_reshard="step", **options), accum=2, steps=2)
    run_fsdp_case(
        tiny_config(2, 1, "auto", fsdp_reshard="backward", fsdp_shard_size=1, **options), steps=2
    )
    for grad_dtype, reduced in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        check_fsdp_reduce_dtype(tiny_config(2, 1, "auto", **options), grad_dtype, reduced)


def check_fsdp_reduce_dtype(config: RunConfig, grad_dtype: str, reduced: torch.dtype) -> None:
    """bf16 parameters reduce their gradients in precision.grad_dtype; the shards stay bf16."""
    config = config.with_overrides([f"precision.grad_dtype={grad_dtype}"])
    model = build_model(dataclasses.replace(config, parallel=ParallelConfig())).bfloat16()
    model = parallelize(model, config, init_distributed(config))
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    log = CollectiveLog()
    with log:
        model.loss(model(batch[:, :-1]), batch[:, 1:]).backward()
    assert log.dtypes("reduce_scatter") == {reduced}
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}


def test_fsdp_matches_single_process_world2():
    run_distributed(_fsdp_world2, 2)


def test_hsdp_layouts_that_cannot_run_name_the_field():
    dims = ParallelDims(**{f.name: None for f in dataclasses.fields(ParallelDims)})
    dims.dp, dims.ep = 4, 1
    with pytest.raises(ValueError, match=r"parallel.fsdp_shard_size \(3\) must divide"):
        fsdp_mesh(dims, 3)
    dims.ep = 2
    with pytest.raises(ValueError, match=r"fsdp_shard_size \(2\) with parallel.ep \(2\)"):
        fsdp_mesh(dims, 2)


@pytest.mark.parametrize(
    ("checkpointing", "dispatcher", "compile"),
    [("moe", "no_sync", False), ("full", "all_to_all", False), ("moe", "no_sync", True)],
)
def test_parallelize_recipe_in_one_process(monkeypatch, checkpointing, dispatcher, compile):
    """World size 1 runs the same recipe: activation checkpointing (recomputation counts each
    route once), torch.compile per block, EP dispatchers with the transport skipped."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    config = tiny_config(1, 1, dispatcher, activation_checkpointing=checkpointing, compile=compile)
    dims = init_distributed(config, device_type="cpu")
    with torch.device("meta"):
        model = Transformer(config)
    parallelize(model, config, dims)
    compiled = [m._compiled_call_impl is not None for m in (*model.blocks.values(), model.norm)]
    assert compiled == [compile] * (len(model.blocks) + 1)
    model.to_empty(device="cpu")
    model.init_weights()
    reference = build_model(config)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    for net in (model, reference):
        net.loss(net(batch[:, :-1]), batch[:, 1:]).backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert_close_rel(param.grad, ref.grad, name)
    if dispatcher == "no_sync":
        for layer in model.moe_layers():
            assert int(layer.dispatcher._stats[2]) == BATCH * SEQ * config.moe.top_k
