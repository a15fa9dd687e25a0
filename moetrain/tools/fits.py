"""Will this run fit in this machine's memory? The planner's predicted peak for the run's
data-parallel family (`plan.run_memory`, what `moetrain plan` and `--dry-run` print) against the
CUDA device's free memory, or on CPU MemAvailable shared by this node's processes, checked
before any allocation. It errs towards letting a run start; a layout the planner cannot model
skips the check, and `force` skips it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moetrain.config import RunConfig
from moetrain.parallel.mesh import cuda_device_index, read_launch_env, resolve_backend
from moetrain.tools.dry_run import layout_from_config, on_device
from moetrain.tools.plan.layout import GIB, OVERHEAD_GIB, num_microbatches
from moetrain.tools.plan.run_memory import run_memory


def predicted_peak(config: RunConfig, world_size: int, device_type: str) -> int:
    """Bytes at the peak of the most loaded rank, under the parameter dtype `device_type` gets."""
    config = on_device(config, device_type)  # what "auto" means there
    layout = layout_from_config(config, world_size)
    t = config.train
    tokens = t.global_batch_tokens or t.micro_batch_size * t.seq_len * layout.dp
    num_micro = num_microbatches(config, layout, tokens)
    overhead = int(OVERHEAD_GIB * GIB) if device_type == "cuda" else GIB // 4
    return max(
        run_memory(config, layout, stage, num_micro, overhead=overhead).peak
        for stage in range(layout.pp)
    )


def available_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, description) free for one rank on `device`."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, f"free on {device} ({total / GIB:.1f} GiB in all)"
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = _mem_available()
    what = "available RAM" + (f" / {local_ranks} processes on this node" if local_ranks > 1 else "")
    return available // local_ranks, what


def _mem_available() -> int:
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(config: RunConfig, device: str | None, force: bool = False) -> None:
    """A ValueError with both numbers when the predicted peak exceeds the free memory."""
    if force:
        return
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if target.type not in ("cuda", "cpu"):
        return
    launch = read_launch_env()
    try:
        backend = resolve_backend(config, target.type, launch.world_size)
        needed = predicted_peak(config, launch.world_size, target.type)
    except ValueError:  # a layout the planner does not model: the trainer judges it
        return
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", cuda_device_index(backend, launch.local_rank))
    free, what = available_memory(target)
    if target.type == "cuda" and backend == "gloo":  # several ranks share each GPU
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        sharing = -(-local_ranks // torch.cuda.device_count())
        free, what = free // sharing, f"{what} / {sharing} ranks on it"
    if needed > free:
        raise ValueError(
            f"this run needs about {needed / GIB:.1f} GiB per process (the planner's estimate for "
            f"{config.name}: `moetrain train --dry-run` itemizes it), more than the "
            f"{free / GIB:.1f} GiB {what}; make the model or train.micro_batch_size smaller, "
            "spread it over more devices, or pass --force to try anyway"
        )
