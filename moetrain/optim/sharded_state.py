"""ShardedAdamW's checkpoint state: each rank's owned pieces of every global tensor, described to
torch.distributed.checkpoint (DCP) by their offsets, so nothing global is ever built.

A rank owns one contiguous range of each flattened global tensor: at most 2 * ndim - 1 boxes
(`flat_range_boxes`), each a DCP chunk. `ShardState` holds them as views of the optimizer's
buffers and speaks DCP's `_Checkpointable` protocol (DTensor's hook into DCP); resharding on load
is DCP's. On disk the names and shapes are those of plain global tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global shape


def flat_range_boxes(shape: Sequence[int], lo: int, hi: int) -> Iterator[Box]:
    """The boxes, in flat order, whose union is the elements [lo, hi) of a row-major tensor of
    `shape` flattened; each box is contiguous in that order (at most 2 * ndim - 1 of them)."""
    shape = tuple(shape)
    if lo >= hi:
        return
    if len(shape) <= 1:
        yield (lo,) * len(shape), (hi - lo,) * len(shape)
        return
    inner = math.prod(shape[1:])
    row = lo // inner
    if lo % inner:  # a partial first row
        end = min(hi, (row + 1) * inner)
        for offsets, sizes in flat_range_boxes(shape[1:], lo - row * inner, end - row * inner):
            yield (row, *offsets), (1, *sizes)
        lo, row = end, row + 1
    rows = (hi - lo) // inner
    if rows:  # whole rows
        yield (row,) + (0,) * (len(shape) - 1), (rows, *shape[1:])
        lo, row = lo + rows * inner, row + rows
    if lo < hi:  # a partial last row
        for offsets, sizes in flat_range_boxes(shape[1:], 0, hi - lo):
            yield (row, *offsets), (1, *sizes)


class ShardState(torch.Tensor):
    """This rank's boxes of one global tensor, for DCP: a storage-less tensor of the global shape
    and dtype whose chunks view the optimizer's flat shards; other tensor operations are refused.
    `chunks`: disjoint (offsets, tensor of the box's sizes) pairs."""

    _chunks: list[tuple[torch.Size, torch.Tensor]]
    _by_offsets: dict[torch.Size, torch.Tensor]

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        global_shape: Sequence[int],
        chunks: Sequence[tuple[Sequence[int], torch.Tensor]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> ShardState:
        self = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(global_shape), dtype=dtype, device=device
        )
        self._chunks = [(torch.Size(offsets), data) for offsets, data in chunks]
        self._by_offsets = dict(self._chunks)
        for offsets, data in self._chunks:
            if data.dtype != dtype or len(offsets) != len(global_shape):
                raise ValueError(f"chunk at {tuple(offsets)} does not match {global_shape}")
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(
            f"{func} is not supported on a ShardState: it holds one rank's chunks of a global "
            "tensor for torch.distributed.checkpoint; use .chunks()"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a ShardState holds one rank's chunks of a global tensor: save it with "
            "torch.distributed.checkpoint (every rank), not torch.save or pickle"
        )

    def chunks(self) -> list[tuple[torch.Size, torch.Tensor]]:
        """(offsets in the global tensor, data) of every box held here."""
        return list(self._chunks)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        boxes = ", ".join(f"{tuple(o)}+{tuple(d.shape)}" for o, d in self._chunks)
        return f"ShardState(size={tuple(self.shape)}, dtype={self.dtype}, chunks=[{boxes}])"

    # ---- DCP's _Checkpointable protocol ------------------------------------------------------
    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets, i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=data.shape),
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.shape,
                ),
            )
            for i, (offsets, data) in enumerate(self._chunks)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=d.shape) for o, d in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        data = self._by_offsets.get(torch.Size(index.offset or ()))
        if data is None:
            raise ValueError(f"{index.fqn} has no chunk at offsets {index.offset} on this rank")
        return data


def shard_state(
    global_shape: Sequence[int], shard: torch.Tensor, ranges: Sequence[tuple[int, int, int]]
) -> ShardState:
    """The ShardState of a global tensor of which `shard[lo:hi]` (a 1-D tensor) holds the
    flattened elements [start, start + hi - lo), for each (start, lo, hi) of `ranges`."""
    chunks = []
    for start, lo, hi in ranges:
        for offsets, sizes in flat_range_boxes(global_shape, start, start + hi - lo):
            numel = math.prod(sizes)
            chunks.append((offsets, shard[lo : lo + numel].view(sizes)))
            lo += numel
    return ShardState(global_shape, chunks, shard.dtype, shard.device)


def copy_chunks(source: ShardState, target: ShardState) -> None:
    """Copy each of `target`'s chunks from `source`'s chunk at the same offsets (nothing where
    they are the same memory, as after DCP loaded into `target`'s own state dict)."""
    for offsets, data in target.chunks():
        found = source._by_offsets.get(offsets)
        if found is None or found.shape != data.shape:
            raise ValueError(
                f"the state holds no chunk {tuple(offsets)}+{tuple(data.shape)} of this layout: "
                "load a checkpoint of another layout with torch.distributed.checkpoint into this "
                "optimizer's state_dict()"
            )
        if found.data_ptr() != data.data_ptr():
            data.copy_(found)
