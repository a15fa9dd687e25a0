"""moe.overlap=two_chunk equals the plain block: the same loss and gradients, several ranks.

Each case builds two models the trainer's way (meta -> parallelize -> to_empty -> init_weights)
from one seed, with and without the overlap (the recipe's step: the first MoE layer's router runs
twice as often), runs one forward and backward of this rank's batch through each, and compares
the loss and the first MoE layer's gradients (router, the rank's
experts, the shared expert where there is one): fp32 within 1e-5 of each tensor's largest value
(sums in other orders), bf16 within the multi-rank tolerances of tests/gpu/test_gpu_multirank.py
(loss 1e-3 relative, gradients 2% in norm). The `gpu` tests run the same cases with ranks
sharing one GPU over gloo (bf16 compiled, as users train; fp32 eagerly: compiled grouped GEMMs
take bf16 only), and the loopback transport, whose stream waits gloo would hide (it waits on the
host), under the CUDA stream sanitizer in a subprocess: no race reported, and a race reported
when the wait is left out.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_distributed

from moetrain.config import (
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
)
from moetrain.config.presets import get_preset
from moetrain.model.transformer import Transformer, build_model
from moetrain.moe.layer import MoELayer
from moetrain.moe.payload import FP8_PAYLOAD
from moetrain.parallel import init_distributed, parallelize
from moetrain.parallel.ep_dispatch import NoSyncDispatcher
from moetrain.parallel.loopback import LoopbackTransport
from moetrain.parallel.overlap import two_chunk_forward

pytestmark = pytest.mark.distributed

BATCH, SEQ, VOCAB = 4, 16, 64


def overlap_config(overlap: str, ep: int, dispatcher: str, **extra) -> RunConfig:
    parallel = {k: extra.pop(k) for k in ("activation_checkpointing", "backend", "compile") if k in extra}  # fmt: skip
    return RunConfig(
        model=ModelConfig(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4),
        moe=MoEConfig(
            num_experts=8,
            top_k=2,
            expert_hidden=32,
            dispatcher=dispatcher,
            capacity_factor=4.0 if dispatcher == "no_sync" else None,  # E / K: never drops
            overlap=overlap,
            num_shared_experts=extra.pop("shared", 0),
        ),
        parallel=ParallelConfig(ep=ep, **{"compile": False, **parallel}),
        train=TrainConfig(seq_len=SEQ, micro_batch_size=BATCH, seed=5),
        precision=PrecisionConfig(dispatch=extra.pop("payload", "bf16")),
    )


def _loss_and_grads(config: RunConfig, dtype: torch.dtype, device: str, batch: torch.Tensor):
    dims = init_distributed(config, device_type=device)
    with torch.device("meta"):
        model = Transformer(config)
    parallelize(model, config, dims)
    model.to_empty(device=dims.device)
    model.init_weights()
    model.to(dtype)
    batch = batch.to(dims.device)
    layer = model.moe_layers()[0]
    calls = []
    layer.router.register_forward_hook(lambda *_: calls.append(1))
    loss = model.loss(model(batch[:, :-1]), batch[:, 1:])
    loss.backward()
    grads = {n: p.grad.float().cpu() for n, p in layer.named_parameters()}
    return loss.detach().float().cpu(), grads, len(calls)


def two_chunked(model: Transformer) -> Transformer:
    """`model` with moe.overlap's block forward installed by hand (the recipe's
    `apply_two_chunk` without its capacity check), for dispatchers installed by hand."""
    for block in model.blocks.values():
        if isinstance(block.ffn, MoELayer):
            block.forward = two_chunk_forward(block)
    return model


def run_cases(rank: int, world: int, cases: list, device: str = "cpu") -> int:
    """`cases`: (ep, dispatcher, dtype, extra config fields). Returns how many ran."""
    generator = torch.Generator().manual_seed(1234 + rank)
    for ep, dispatcher, dtype, extra in cases:
        batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        plain, overlapped = (
            _loss_and_grads(overlap_config(o, ep, dispatcher, **extra), dtype, device, batch)
            for o in ("none", "two_chunk")
        )
        what = f"rank {rank} ep {ep} {dispatcher} {dtype} {extra}"
        assert overlapped[2] == 2 * plain[2] > 0, (what, plain[2], overlapped[2])
        exact = dtype == torch.float32
        loss_err = (plain[0] - overlapped[0]).abs() / plain[0].abs()
        assert loss_err <= (1e-6 if exact else 1e-3), (what, loss_err)
        assert plain[1].keys() == overlapped[1].keys()
        for name, expected in plain[1].items():
            actual = overlapped[1][name]
            if exact:
                err = (actual - expected).abs().max() / expected.abs().max()
                assert err <= 1e-5, (what, name, err)
            else:
                err = (actual - expected).norm() / expected.norm()
                assert err <= 2e-2, (what, name, err)
    return len(cases)


CPU_CASES = [
    (2, "all_to_all", torch.float32, {}),
    (2, "no_sync", torch.float32, {"activation_checkpointing": "full"}),
    (2, "all_to_all", torch.float32, {"payload": "fp8", "shared": 1}),
    (4, "no_sync", torch.float32, {"payload": "fp8"}),
    (4, "all_to_all", torch.float32, {"activation_checkpointing": "full", "shared": 1}),
    (2, "no_sync", torch.bfloat16, {}),
    (4, "all_to_all", torch.bfloat16, {}),
]


def test_two_chunk_equals_plain_block_at_ep_2_and_4():
    assert run_distributed(run_cases, 4, CPU_CASES) == [len(CPU_CASES)] * 4


def test_two_chunk_with_the_loopback_transport_in_one_process():
    """The loopback transport (a group of one) behind NoSync, with a shared expert and the FP8
    payload: the same loss and gradients as the plain block with the same dispatcher."""
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    results = []
    for overlap in ("none", "two_chunk"):
        model = build_model(overlap_config(overlap, 1, "local", shared=1, payload="fp8"))
        for layer in model.moe_layers():
            layer.dispatcher = NoSyncDispatcher(
                8, None, 0, 4.0, transport=LoopbackTransport(), payload=FP8_PAYLOAD
            )
        if overlap == "two_chunk":
            two_chunked(model)
        loss = model.loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert (loss_a - loss_b).abs() <= 1e-6 * loss_a.abs()
    for a, b in zip(grads_a, grads_b, strict=True):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("train.micro_batch_size=1", "train.micro_batch_size"),
        ("parallel.activation_checkpointing=moe", "parallel.activation_checkpointing"),
        ("parallel.data_parallel=fsdp", "parallel.data_parallel"),
        ("data.document_masking=true", "data.document_masking"),
    ],
)
def test_two_chunk_start_up_errors_name_the_field(override, field):
    with pytest.raises(ValueError, match=f"^{field} .*moe.overlap is two_chunk"):
        get_preset("tiny").with_overrides(["moe.overlap=two_chunk", override])


def _drops_and_loss(model: Transformer, batch: torch.Tensor) -> tuple[int, float]:
    loss = model.loss(model(batch[:, :-1]), batch[:, 1:]).item()
    dropped = sum(layer.dispatcher.read_stats()["dropped_routes"] for layer in model.moe_layers())
    return int(dropped), loss


def test_two_chunk_in_capacity_mode_with_drops_is_a_start_up_error():
    """NoSync decides each chunk's drops on the chunk's own capacity, half the micro-batch's: at
    a factor below E / K (4) the chunks drop other routes than the whole micro-batch (shown with
    the dispatchers installed by hand), so the recipe refuses the combination; at E / K nothing
    is dropped and it runs (the equivalence cases above)."""
    config = overlap_config("two_chunk", 1, "no_sync")
    config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, capacity_factor=1.25))
    dims = init_distributed(config, device_type="cpu")
    with torch.device("meta"):
        model = Transformer(config)
    refused = r"^moe\.overlap \('two_chunk'\) cannot run on the no_sync dispatcher at moe\.cap"
    with pytest.raises(ValueError, match=refused + r".* \(4: nothing is dropped\)"):
        parallelize(model, config, dims)

    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    results = []
    for overlap in ("none", "two_chunk"):
        model = build_model(overlap_config(overlap, 1, "local"))
        for layer in model.moe_layers():
            layer.dispatcher = NoSyncDispatcher(8, None, 0, 1.25, transport=LoopbackTransport())
        if overlap == "two_chunk":
            two_chunked(model)
        results.append(_drops_and_loss(model, batch))
    (drops, loss), (chunked_drops, chunked_loss) = results
    assert 0 < drops < chunked_drops and loss != chunked_loss


GPU_CASES = [
    (2, "no_sync", torch.float32, {"backend": "gloo"}),
    (4, "all_to_all", torch.float32, {"backend": "gloo", "shared": 1}),
    (2, "all_to_all", torch.bfloat16, {"backend": "gloo", "compile": True, "payload": "fp8"}),
    (4, "no_sync", torch.bfloat16, {"backend": "gloo", "compile": True}),
]


@pytest.mark.gpu
def test_two_chunk_equals_plain_block_on_one_gpu():
    assert run_distributed(run_cases, 4, GPU_CASES, "cuda") == [len(GPU_CASES)] * 4


def _loopback_model(device: str = "cuda") -> Transformer:
    """The overlapped tiny model (bf16, a shared expert) whose MoE layers exchange through the
    loopback transport."""
    model = build_model(overlap_config("two_chunk", 1, "local", shared=1), device=device)
    for layer in model.moe_layers():
        layer.dispatcher = NoSyncDispatcher(8, None, 0, 4.0, transport=LoopbackTransport())
    return two_chunked(model).to(torch.bfloat16)


def _sanitized_step(skip_wait: bool, device: str = "cuda") -> None:
    """One forward and backward of `_loopback_model` (eager); `skip_wait` leaves out the wait of
    every exchange."""
    if skip_wait:
        launch = LoopbackTransport._launch
        LoopbackTransport._launch = lambda *args: (launch(*args), lambda: None)[1]
    model = _loopback_model(device)
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=device)
    model.loss(model(batch[:, :-1]), batch[:, 1:]).backward()
    if device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("skip_wait", [False, True])
def test_loopback_exchanges_pass_the_cuda_stream_sanitizer(skip_wait):
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    paths = [str(Path(__file__).parents[2]), str(Path(__file__).parents[1]), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))  # the repo, tests/ (conftest)
    cmd = [sys.executable, __file__, "skip_wait" if skip_wait else "wait"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    raced = "CSAN detected a possible data race" in result.stderr
    assert raced == skip_wait, result.stderr[-4000:]
    assert (result.returncode != 0) == skip_wait, result.stderr[-4000:]


@pytest.mark.gpu
def test_overlapped_step_with_loopback_is_captured_as_a_cuda_graph():
    """The side stream joins and leaves a CUDA-graph capture as train/graph.py captures a step:
    warm-up on a side stream, capture, replay; the replay equals an eager step."""
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device="cuda")
    eager, graphed = _loopback_model(), _loopback_model()

    def step(model):
        loss = model.loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        return loss

    expected = step(eager)
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(2):
            graphed.zero_grad(set_to_none=True)
            step(graphed)
    torch.cuda.current_stream().wait_stream(warm)
    graphed.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step(graphed)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(loss.float(), expected.float(), rtol=1e-3)
    for a, b in zip(graphed.parameters(), eager.parameters(), strict=True):
        assert (a.grad.float() - b.grad.float()).norm() <= 1e-2 * b.grad.float().norm()


if __name__ == "__main__":  # the sanitizer test's subprocess
    _sanitized_step(sys.argv[1] == "skip_wait")
