"""Process topology: the launch environment -> validated degrees -> process groups and mesh.

world = pp x dp; inside every pipeline stage the dp ranks form dp / ep expert-parallel groups of
ep contiguous ranks:

    rank = pp_rank * dp + edp_rank * ep + ep_rank        mesh axes ("pp", "edp", "ep")

`ep` ranks hold different experts, `edp` ranks replicas of the same experts, `dp` (= edp x ep)
ranks replicas of the dense weights. The layout is validated before any process-group work. A
group is None when its degree is 1, so callers test `group is None` instead of sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moetrain.config import RunConfig

MESH_AXES = ("pp", "edp", "ep")


@dataclass(kw_only=True)
class ParallelDims:
    """The defaults describe one process: no mesh, every group None, every rank 0."""

    device: torch.device
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    dp: int = 1
    ep: int = 1
    pp: int = 1
    mesh: DeviceMesh | None = None  # axes MESH_AXES
    dp_mesh: DeviceMesh | None = None  # ("edp", "ep") flattened to one axis "dp" (FSDP shards)
    dp_group: ProcessGroup | None = None
    ep_group: ProcessGroup | None = None
    edp_group: ProcessGroup | None = None
    pp_group: ProcessGroup | None = None
    dp_rank: int = 0
    ep_rank: int = 0
    edp_rank: int = 0
    pp_rank: int = 0

    @property
    def edp(self) -> int:
        return self.dp // self.ep


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int


def read_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK), else Slurm's (SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID, with MASTER_ADDR and MASTER_PORT set by the job script), else one process."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env.get("RANK", "0")),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
        )
    if "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
        if missing:
            raise ValueError(
                f"a Slurm launch with SLURM_NTASKS={env['SLURM_NTASKS']} needs "
                f"{' and '.join(missing)} in the environment (the address and port of rank 0)"
            )
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
        )
    return LaunchEnv(rank=0, world_size=1, local_rank=0)


def validate_layout(config: RunConfig, world_size: int) -> tuple[int, int, int]:
    """(dp, ep, pp) for this world size, or a ValueError that names the config field."""
    dp = config.dp_size(world_size)
    ep, num_experts = config.parallel.ep, config.moe.num_experts
    if num_experts % ep:
        raise ValueError(f"parallel.ep ({ep}) must divide moe.num_experts ({num_experts})")
    return dp, ep, config.parallel.pp


def init_distributed(config: RunConfig, device_type: str | None = None) -> ParallelDims:
    """Validate the layout, join the process group (reusing one that already exists), pick this
    rank's device and build the mesh. Backend: nccl on cuda, gloo on cpu."""
    launch = read_launch_env()
    dp, ep, pp = validate_layout(config, launch.world_size)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = resolve_backend(config, device_type, launch.world_size)
    if device_type == "cuda":
        index = cuda_device_index(backend, launch.local_rank)
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device(device_type)

    if launch.world_size == 1:
        return ParallelDims(local_rank=launch.local_rank, device=device)

    if not dist.is_initialized():
        os.environ.setdefault("RANK", str(launch.rank))
        os.environ.setdefault("WORLD_SIZE", str(launch.world_size))
        os.environ.setdefault("LOCAL_RANK", str(launch.local_rank))
        dist.init_process_group(
            backend=backend,
            rank=launch.rank,
            world_size=launch.world_size,
            device_id=device if backend == "nccl" else None,
        )
        if backend == "gloo" and device_type == "cuda" and launch.rank == 0:
            print(
                f"note: parallel.backend=gloo on CUDA: {launch.world_size} ranks on "
                f"{torch.cuda.device_count()} GPU(s), collectives staged through the host. For "
                "testing the multi-rank code on real kernels only: this run's speed means nothing"
            )
    if dist.get_world_size() != launch.world_size:
        raise ValueError(
            f"the process group has {dist.get_world_size()} ranks but the environment says "
            f"WORLD_SIZE={launch.world_size}"
        )
    mesh = init_device_mesh(device_type, (pp, dp // ep, ep), mesh_dim_names=MESH_AXES)
    dp_mesh = mesh["edp", "ep"]._flatten("dp")  # the documented way to merge axes (private API)
    pp_rank, edp_rank, ep_rank = (mesh.get_local_rank(axis) for axis in MESH_AXES)
    rank = dist.get_rank()
    assert rank == pp_rank * dp + edp_rank * ep + ep_rank, "mesh layout is not pp-major"

    def group_if(size: int, m: DeviceMesh) -> ProcessGroup | None:
        return m.get_group() if size > 1 else None

    return ParallelDims(
        world_size=launch.world_size,
        rank=rank,
        local_rank=launch.local_rank,
        dp=dp,
        ep=ep,
        pp=pp,
        device=device,
        mesh=mesh,
        dp_mesh=dp_mesh,
        dp_group=group_if(dp, dp_mesh),
        ep_group=group_if(ep, mesh["ep"]),
        edp_group=group_if(dp // ep, mesh["edp"]),
        pp_group=group_if(pp, mesh["pp"]),
        dp_rank=edp_rank * ep + ep_rank,
        ep_rank=ep_rank,
        edp_rank=edp_rank,
        pp_rank=pp_rank,
    )


def cuda_device_index(backend: str, local_rank: int) -> int:
    """This rank's GPU: nccl gives each local rank its own; gloo lets local ranks share the GPUs
    there are (rank r on GPU r mod #GPUs)."""
    return local_rank if backend == "nccl" else local_rank % torch.cuda.device_count()


def resolve_backend(config: RunConfig, device_type: str, world_size: int) -> str:
    """parallel.backend: auto is nccl on CUDA and gloo elsewhere; a choice this device or layout
    cannot run is an error naming the field."""
    choice = config.parallel.backend
    if choice == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if choice == "nccl" and device_type != "cuda":
        raise ValueError(f"parallel.backend (nccl) needs CUDA; the device is {device_type}")
    if choice == "gloo" and device_type == "cuda" and config.parallel.pp > 1 and world_size > 1:
        raise ValueError(
            "parallel.backend (gloo) on CUDA cannot run parallel.pp "
            f"({config.parallel.pp}): gloo has no point-to-point for CUDA tensors, which the "
            "pipeline schedules send between stages; use nccl (one GPU per rank) or the CPU"
        )
    return choice


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
