"""FSDP2 (parallel.data_parallel=fsdp) checkpoints, the trainer's way on two gloo ranks: a run
saved and resumed continues bit for bit as the uninterrupted run, at ep 1 (every weight sharded
over dp) and at ep 2 (experts sharded over ep, then by FSDP2 over edp); and its checkpoint holds
global tensors, which one process (resident experts, replicated AdamW) loads exactly."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed
from torch.distributed.tensor import DTensor

from moetrain.config.presets import tiny
from moetrain.parallel.expert import is_expert_param
from moetrain.train.trainer import Trainer

pytestmark = pytest.mark.distributed

SEQ, STEPS, SAVE_AT = 64, 4, 2


def _config(ep: int, data_parallel: str):
    # 8 sequences a step in micro-batches of 2: two accumulated micro-batches a rank at world 2
    return tiny().with_overrides(
        [
            f"parallel.data_parallel={data_parallel}",
            f"parallel.ep={ep}",
            "train.micro_batch_size=2",
            f"train.global_batch_tokens={8 * SEQ}",
            "train.log_every=1",
            "train.eval_every=0",
            f"train.checkpoint_every={SAVE_AT}",
            f"train.steps={STEPS}",  # within the warmup: the part run's LR is the same
        ]
    )


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r["kind"] == "train"}


def _global_state(trainer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor as the global tensor, assembled with collectives
    independently of the checkpoint code: FSDP2's `full_tensor()`, then, for experts at ep > 1,
    the ep ranks' slices in ep-rank order."""
    dims = trainer.dims

    def full(name: str, value: torch.Tensor) -> torch.Tensor:
        if not isinstance(value, DTensor):
            return value.detach().clone()
        value = value.full_tensor()
        if dims.ep > 1 and is_expert_param(name):
            slices = [torch.empty_like(value) for _ in range(dims.ep)]
            dist.all_gather(slices, value, group=dims.ep_group)
            value = torch.cat(slices)
        return value

    state = {f"model.{k}": full(k, v) for k, v in trainer.model.state_dict().items()}
    for name, entry in trainer.optimizer.state_dict().items():
        state.update({f"optim.{name}.{key}": full(name, v) for key, v in entry.items()})
    return state


def _straight_and_resumed(rank, world, root, cache):
    os.environ["MOETRAIN_CACHE"] = cache
    states = {}
    for ep in (1, 2):
        config, run = _config(ep, "fsdp"), Path(root) / f"ep{ep}"
        straight = Trainer(config, run / "straight", progress=False)
        straight.train()
        part = config.with_overrides([f"train.steps={SAVE_AT}"])
        Trainer(part, run / "part", progress=False).train()
        resumed = Trainer(config, run / "part", resume=True, progress=False)
        assert resumed.step == SAVE_AT
        resumed.train()
        states[ep] = {"straight": _global_state(straight), "resumed": _global_state(resumed)}
    return states


def test_fsdp_resume_is_bitwise_and_one_process_loads_its_checkpoint(tmp_path, module_cache):
    """Two ranks, FSDP2 with AdamW at ep 1 and at ep 2, two micro-batches each: 4 steps
    straight, and 2 steps, save, resume, 2 more: the same loss at every step and the same
    weights and AdamW moments, bit for bit. Then one process resumes from the straight run's
    last checkpoint and holds exactly the global weights and moments the two ranks had."""
    states = run_distributed(_straight_and_resumed, 2, str(tmp_path), str(module_cache))[0]
    for ep, state in states.items():
        run = tmp_path / f"ep{ep}"
        straight, part = _losses(run / "straight"), _losses(run / "part")
        assert sorted(straight) == sorted(part) == list(range(1, STEPS + 1)), ep
        assert straight == part, (ep, straight, part)
        want, resumed = state["straight"], state["resumed"]
        assert want.keys() == resumed.keys()
        for key, value in want.items():
            assert torch.equal(resumed[key], value), (ep, key)

        shutil.copytree(run / "straight" / "checkpoints", run / "one_process" / "checkpoints")
        one = Trainer(_config(1, "ddp"), run / "one_process", resume=True, progress=False)
        assert one.step == STEPS and one.dims.world_size == 1
        got = _global_state(one)
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), (ep, key)
