"""Topology: launch environments, layout validation before any process-group work, mesh axes and
groups (rank = pp_rank * dp + edp_rank * ep + ep_rank), and the log-time statistics reduction."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed

import moetrain.parallel.mesh as mesh_module
from moetrain.config import ModelConfig, MoEConfig, ParallelConfig, RunConfig
from moetrain.config.presets import tiny
from moetrain.parallel import all_reduce_stats, init_distributed
from moetrain.parallel.mesh import read_launch_env, validate_layout

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def config(**parallel) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4),
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=32),
        parallel=ParallelConfig(**parallel),
    )


@pytest.fixture
def no_launch_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_world_size_one_creates_no_process_group(no_launch_env):
    dims = init_distributed(config(), device_type="cpu")
    assert (dims.world_size, dims.dp, dims.ep, dims.pp, dims.rank) == (1, 1, 1, 1, 0)
    assert dims.mesh is None and dims.dp_mesh is None
    assert all(g is None for g in (dims.dp_group, dims.ep_group, dims.edp_group, dims.pp_group))
    assert dims.device == torch.device("cpu")
    assert not dist.is_initialized()
    stats = all_reduce_stats({"load": torch.arange(3)}, dims)
    assert torch.equal(stats["load"], torch.arange(3))


def test_launch_env_torchrun_then_slurm_then_single():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "SLURM_NTASKS": "8"}
    assert read_launch_env(env) == mesh_module.LaunchEnv(rank=3, world_size=4, local_rank=1)
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        read_launch_env(slurm)
    slurm |= {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert read_launch_env(slurm) == mesh_module.LaunchEnv(rank=5, world_size=8, local_rank=1)
    assert read_launch_env({"SLURM_NTASKS": "1"}).world_size == 1
    assert read_launch_env({}).world_size == 1


@pytest.mark.parametrize(
    ("world_size", "parallel", "field"),
    [
        (2, {"ep": 4}, "parallel.ep"),  # ep does not divide dp = 2
        (4, {"ep": 8}, "parallel.ep"),  # ep divides the experts, not dp = 4
        (4, {"pp": 3}, "parallel.pp"),  # pp does not divide the world
        (4, {"dp": 2}, "parallel.dp"),  # dp * pp != world
    ],
)
def test_bad_layout_fails_before_any_process_group_work(no_launch_env, world_size, parallel, field):
    def no_process_groups(*args, **kwargs):
        raise AssertionError("process-group work before validation")

    no_launch_env.setenv("WORLD_SIZE", str(world_size))
    no_launch_env.setenv("RANK", "0")
    no_launch_env.setattr(mesh_module.dist, "init_process_group", no_process_groups)
    no_launch_env.setattr(mesh_module, "init_device_mesh", no_process_groups)
    with pytest.raises(ValueError, match=field):
        init_distributed(config(**parallel), device_type="cpu")


def test_ep_must_divide_num_experts():
    with pytest.raises(ValueError, match=r"parallel\.ep \(3\) must divide moe\.num_experts"):
        config(ep=3)
    # validate_layout re-checks, even for a config that escaped construction-time validation
    bad = config()
    object.__setattr__(bad.parallel, "ep", 3)  # 3 divides dp = 6, not the 8 experts
    with pytest.raises(ValueError, match=r"moe\.num_experts"):
        validate_layout(bad, 6)


def _mesh_world4(rank, world_size):
    for dp, ep, pp in ((4, 2, 1), (4, 4, 1), (4, 1, 1), (2, 2, 2), (2, 1, 2)):
        dims = init_distributed(config(dp=dp, ep=ep, pp=pp), device_type="cpu")
        what = f"dp={dp} ep={ep} pp={pp}"
        assert (dims.dp, dims.ep, dims.pp, dims.edp) == (dp, ep, pp, dp // ep), what
        assert rank == dims.pp_rank * dp + dims.edp_rank * ep + dims.ep_rank, what
        assert dims.dp_rank == dims.edp_rank * ep + dims.ep_rank, what
        stage = dims.pp_rank * dp
        expected = {
            "dp_group": [stage + i for i in range(dp)],
            "ep_group": [stage + dims.edp_rank * ep + i for i in range(ep)],
            "edp_group": [stage + i * ep + dims.ep_rank for i in range(dp // ep)],
            "pp_group": [dims.dp_rank + i * dp for i in range(pp)],
        }
        for name, ranks in expected.items():
            group = getattr(dims, name)
            if len(ranks) == 1:
                assert group is None, f"{what}: {name} of one rank must be None"
            else:
                assert dist.get_process_group_ranks(group) == ranks, f"{what}: {name}"
        # Statistics sum in place over the data-parallel ranks of the stage, one call per dtype.
        count, loss = torch.tensor([1, rank]), torch.tensor(float(rank))
        assert all_reduce_stats({"count": count, "loss": loss}, dims)["count"] is count
        members = expected["dp_group"]
        assert count.tolist() == [len(members), sum(members)], what
        assert loss.item() == float(sum(members)), what
        assert all_reduce_stats([loss], dims)[0].item() == float(len(members) * sum(members))
    return True


@pytest.mark.distributed
def test_mesh_axes_and_groups_world4():
    assert run_distributed(_mesh_world4, 4) == [True] * 4


def test_backend_choice():
    """auto: nccl on CUDA, gloo on CPU; gloo on CUDA (several ranks on one GPU) is allowed
    except with a pipeline (no CUDA point-to-point in gloo); nccl needs CUDA."""
    from moetrain.parallel.mesh import resolve_backend

    config = tiny()
    assert resolve_backend(config, "cuda", 2) == "nccl"
    assert resolve_backend(config, "cpu", 2) == "gloo"
    gloo = config.with_overrides(["parallel.backend=gloo"])
    assert resolve_backend(gloo, "cuda", 2) == "gloo"
    with pytest.raises(
        ValueError, match=r"parallel.backend \(gloo\) on CUDA cannot run parallel.pp"
    ):
        resolve_backend(gloo.with_overrides(["parallel.pp=2"]), "cuda", 2)
    with pytest.raises(ValueError, match=r"parallel.backend \(nccl\) needs CUDA"):
        resolve_backend(config.with_overrides(["parallel.backend=nccl"]), "cpu", 2)
