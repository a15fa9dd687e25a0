"""Data parallelism: gradient synchronization for a plain optimizer, log-time statistics, FSDP2.

Gradients equal one process's over every dp rank's micro-batch: dense gradients (router included)
are summed over dp and divided by dp; an expert's gradient already sums its ep group's sources
(through the all-to-all backward), so it is summed over edp and divided by dp. `GradientSync`
does it DDP-style on the bucket protocol of optim/grad_buckets.py (all-reduce per bucket);
`finish()` after the last backward launches what backward did not, waits and divides.
`apply_fsdp` is the FSDP2 baseline; `FSDPAccumulation` keeps it gathered between micro-batches
(`parallel.fsdp_reshard` step).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from moetrain.config import RunConfig
from moetrain.moe.layer import MoELayer
from moetrain.optim.grad_buckets import BucketedGrads, GradBucket, split_into_buckets
from moetrain.parallel.expert import is_expert_param
from moetrain.parallel.mesh import ParallelDims


class GradientSync(BucketedGrads):
    """DDP-style gradient synchronization for a model whose parameters are all local (apply_ep
    may have sharded the experts), in the gradients' accumulation dtype.

    `grad_dtype` None: `.grad` is a view of its bucket (view mode), reduced in the parameters'
    dtype; a no-op at dp 1. A wider dtype (fp32 for bf16 parameters, as Megatron's main_grad):
    accumulate mode, also at dp 1; after `finish()` each gradient is `param.main_grad`, a view of
    the buffer (autograd refuses a `.grad` of another dtype), read through `optim.clip.grad_of`."""

    def __init__(
        self,
        model: nn.Module,
        dims: ParallelDims,
        bucket_mb: float = 25.0,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        self.dims = dims
        self._divide_only: list[nn.Parameter] = []  # experts without replicas (edp 1), no buffer
        accumulate = grad_dtype is not None
        members: list[tuple[nn.Parameter, bool]] = []  # (parameter, is an expert's)
        if dims.dp > 1 or accumulate:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            if any(isinstance(p, DTensor) for _, p in named):
                raise ValueError(
                    "GradientSync is for parallel.data_parallel 'ddp'; this model is sharded "
                    "(fsdp), which reduces its own gradients"
                )
            for name, param in reversed(named):
                expert = is_expert_param(name)
                if expert and dims.edp_group is None and not accumulate:
                    self._divide_only.append(param)
                else:
                    members.append((param, expert))
        buckets = []
        for bucket_members in split_into_buckets(
            members,
            key=lambda m: (m[1], grad_dtype or m[0].dtype, m[0].device),
            nbytes=lambda m: m[0].numel() * m[0].element_size(),
            size=bucket_mb * 2**20,
        ):
            params = [param for param, _ in bucket_members]
            starts = list(itertools.accumulate((p.numel() for p in params), initial=0))
            flat = torch.zeros(
                starts.pop(), dtype=grad_dtype or params[0].dtype, device=params[0].device
            )
            group = dims.edp_group if bucket_members[0][1] else dims.dp_group
            buckets.append(
                GradBucket(
                    params=params,
                    grads_flat=flat,
                    starts=starts,
                    accumulate=accumulate,
                    group=group,
                )
            )
        self._init_buckets(buckets)

    def _launch(self, bucket: GradBucket):
        if bucket.group is None:  # accumulation only
            return None
        return dist.all_reduce(bucket.grads_flat, group=bucket.group, async_op=True)

    def finish(self) -> None:
        """After the last backward of a step: every gradient becomes the synchronized one."""
        # 1. Launch the buckets backward did not complete (no_sync steps, unused parameters).
        self.launch_remaining()
        # 2. Experts without replicas only need the division (their sum happened in the a2a).
        for param in self._divide_only:
            if param.grad is not None:
                param.grad.div_(self.dims.dp)
        # 3. Wait, divide (the mean over dp), hand the gradients over; reset for the next step.
        self.wait()
        for bucket in self.buckets:
            if self.dims.dp > 1:
                bucket.grads_flat.div_(self.dims.dp)
            if bucket.accumulate:  # read through moetrain.optim.clip.grad_of
                for slot, param in enumerate(bucket.params):
                    param.main_grad = bucket.grad_view(slot)
        self.end_step()


def all_reduce_stats(
    tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], dims: ParallelDims
) -> Mapping[str, torch.Tensor] | Sequence[torch.Tensor]:
    """Sum device tensors over dp IN PLACE (one all-reduce per dtype) and return them (expert
    load, the aux-loss-free bias's counts). Every dp rank must join; no host sync."""
    values = list(tensors.values()) if isinstance(tensors, Mapping) else list(tensors)
    if dims.dp_group is None:
        return tensors
    for dtype in dict.fromkeys(v.dtype for v in values):
        members = [v for v in values if v.dtype == dtype]
        flat = torch.cat([v.detach().reshape(-1) for v in members])
        dist.all_reduce(flat, group=dims.dp_group)
        with torch.no_grad():
            for v, part in zip(members, flat.split([v.numel() for v in members]), strict=True):
                v.copy_(part.view_as(v))
    return tensors


def apply_fsdp(
    model: nn.Module, dims: ParallelDims, config: RunConfig, reduce_dtype: torch.dtype | None
) -> None:
    """FSDP2 baseline: shard every block, then the root (embedding, final norm, head), over dp,
    or HSDP over `parallel.fsdp_shard_size`. Blocks reshard as `parallel.fsdp_reshard` says (the
    root keeps FSDP2's default); gradients are reduced in `reduce_dtype` (the precision plan's:
    precision.grad_dtype; None: the parameters' dtype, which the shards keep). Each experts module is sharded over edp on its own, with gradient
    divide factor dp (as in GradientSync)."""
    if dims.dp == 1:
        return
    p = config.parallel
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    mesh = fsdp_mesh(dims, p.fsdp_shard_size)
    reshard = p.fsdp_reshard == "forward"
    for block in model.blocks.values():
        if isinstance(block.ffn, MoELayer) and dims.ep > 1:
            experts = block.ffn.experts
            fully_shard(
                experts, mesh=dims.mesh["edp"], reshard_after_forward=reshard, mp_policy=policy
            )
            experts.set_gradient_divide_factor(float(dims.dp))
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def fsdp_mesh(dims: ParallelDims, shard_size: int | None) -> DeviceMesh:
    """The dp ranks' mesh for FSDP2: one axis, or (replicate, shard) for HSDP with shards of
    `shard_size` consecutive ranks (a node's GPUs when it is the node size)."""
    if shard_size is None or shard_size == dims.dp:
        return dims.dp_mesh
    if dims.dp % shard_size:
        raise ValueError(
            f"parallel.fsdp_shard_size ({shard_size}) must divide parallel.dp ({dims.dp})"
        )
    if dims.ep > 1:
        raise ValueError(
            f"parallel.fsdp_shard_size ({shard_size}) with parallel.ep ({dims.ep}): HSDP shards "
            "the dense weights only at ep 1 (the experts would need a mesh of their own); "
            "drop one of them"
        )
    shape = (dims.dp // shard_size, shard_size)
    return init_device_mesh(dims.device.type, shape, mesh_dim_names=("replicate", "shard"))


class FSDPAccumulation:
    """`parallel.fsdp_reshard` step: under `no_sync` the FSDP2 model keeps its gathered
    parameters and accumulates whole, unreduced gradients; the step's last backward reduces and
    reshards. GradientSync's `no_sync()` / `finish()`, for the optimizer."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._last_backward(False)
        try:
            yield
        finally:
            self._last_backward(True)

    def _last_backward(self, last: bool) -> None:
        self.model.set_requires_gradient_sync(last)
        self.model.set_reshard_after_backward(last)

    def finish(self) -> None:
        """Nothing left: the last backward reduced the gradients."""
