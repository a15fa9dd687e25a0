"""Shared test helpers. `run_distributed(fn, world_size, *args)` runs `fn(rank, world_size, *args)`
in `world_size` real processes joined in a gloo process group (CPU), and re-raises the first
failure with the failing rank's traceback. `fn` must be a module-level (picklable) function; its
return value on each rank comes back as a list ordered by rank."""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results[rank] = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        out = []
        for rank in range(world_size):
            status, value = results.get(
                rank, ("error", f"rank {rank} died (exit code {procs[rank].exitcode})")
            )
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out.append(value)
        return out


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """An empty MOETRAIN_CACHE for tests that must not touch the user's cache."""
    path = tmp_path / "cache"
    monkeypatch.setenv("MOETRAIN_CACHE", str(path))
    return path


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """Like tmp_cache, shared by a module's tests, so the embedded corpus is built once."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOETRAIN_CACHE", str(path))
        yield path


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
