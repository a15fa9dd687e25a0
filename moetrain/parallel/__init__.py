"""Parallelism as transforms of a built model; the only package that imports torch.distributed.

mesh.py (topology) -> comm.py (differentiable collectives) -> ep_dispatch.py (EP dispatchers)
-> expert.py (apply_ep) -> data.py (gradient sync, FSDP2) -> pipeline.py (stages, schedules)
-> parallelize.py (the recipe).
"""

from moetrain.parallel.data import GradientSync, all_reduce_stats, apply_fsdp
from moetrain.parallel.ep_dispatch import AllToAllDispatcher, NoSyncDispatcher
from moetrain.parallel.expert import apply_ep, is_expert_param, read_dispatch_stats
from moetrain.parallel.mesh import ParallelDims, destroy_distributed, init_distributed
from moetrain.parallel.parallelize import parallelize
from moetrain.parallel.pipeline import Pipeline

__all__ = [
    "AllToAllDispatcher",
    "GradientSync",
    "NoSyncDispatcher",
    "ParallelDims",
    "Pipeline",
    "all_reduce_stats",
    "apply_ep",
    "apply_fsdp",
    "destroy_distributed",
    "init_distributed",
    "is_expert_param",
    "parallelize",
    "read_dispatch_stats",
]
