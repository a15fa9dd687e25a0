"""Launch tables of the multi-tensor Triton kernels (AdamW, sum of squares).

Program c of a launch updates chunk c: `block` elements of tensor i from element `start`. The
chunk table (c -> (i, start)) depends only on the numels and the block: built once, cached on the
device. Addresses change every step (gradients are new tensors) and are uploaded at each launch
from pinned memory, asynchronously: no host sync. A captured upload re-reads its pinned source at
every CUDA-graph replay, so such sources live for the process and their tables are never evicted.
"""

from __future__ import annotations

import torch

_LAYOUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}
_MAX_LAYOUTS = 64
_CAPTURED: set[tuple] = set()  # layout keys a CUDA graph reads
_CAPTURED_SOURCES: list[torch.Tensor] = []  # pinned sources of copies inside CUDA graphs


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host table -> device without a host sync (pinned source, asynchronous copy)."""
    if device.type != "cuda":
        return t
    pinned = t.pin_memory()
    if _capturing(device):
        _CAPTURED_SOURCES.append(pinned)
    return pinned.to(device, non_blocking=True)


def chunk_layout(numels: tuple[int, ...], block: int, device: torch.device):
    """(chunk table (n_chunks, 2) int64, numels (n,) int64, n_chunks), cached by numels, block
    and device."""
    key = (device, block, numels)
    hit = _LAYOUTS.get(key)
    if hit is None:
        numel_n = torch.tensor(numels, dtype=torch.int64)
        chunks_n = (numel_n + block - 1) // block
        tensor_c = torch.repeat_interleave(torch.arange(len(numels)), chunks_n)
        first_chunk_n = torch.cumsum(chunks_n, 0) - chunks_n
        n_chunks = int(chunks_n.sum())
        start_c = (torch.arange(n_chunks) - first_chunk_n[tensor_c]) * block
        chunk_c2 = torch.stack([tensor_c, start_c], dim=1)
        hit = (upload(chunk_c2, device), upload(numel_n, device), n_chunks)
        if len(_LAYOUTS) >= _MAX_LAYOUTS:  # evict all but the tables graphs hold
            for stale in [k for k in _LAYOUTS if k not in _CAPTURED]:
                del _LAYOUTS[stale]
        _LAYOUTS[key] = hit
    if _capturing(device):
        _CAPTURED.add(key)
    return hit
