"""Shared test helpers. `run_distributed(fn, world_size, *args)` runs `fn(rank, world_size, *args)`
in `world_size` real processes joined in a gloo process group (CPU), and re-raises the first
failure with the failing rank's traceback. `fn` must be a module-level (picklable) function; its
return value on each rank comes back as a list ordered by rank.

Triton kernels on CPU: a file marks its interpreter tests `interpreted` and runs them with
`run_interpreted_tests(__file__)` from one launcher test marked `needs_interpreter`."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

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


TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
# Triton's interpreter must be chosen before triton is first imported (its standard library is
# jitted at import), so the interpreted tests run in a child pytest started with it set.
INTERPRETER_CHILD = os.environ.get("MOETRAIN_TRITON_INTERPRETER_CHILD") == "1"
interpreted = pytest.mark.skipif(
    not INTERPRETER_CHILD, reason="runs in the child started by this file's interpreter test"
)
needs_cuda_and_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and TRITON_INSTALLED), reason="needs a CUDA GPU and Triton"
)
needs_interpreter = pytest.mark.skipif(
    not TRITON_INSTALLED or torch.cuda.is_available() or INTERPRETER_CHILD,
    reason="needs Triton, no GPU",
)


def run_interpreted_tests(test_file: str, timeout: float = 300) -> None:
    """Runs the `interpreted` tests of `test_file` in a fresh pytest with TRITON_INTERPRET=1 and
    asserts that they ran (none skipped) and passed."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", MOETRAIN_TRITON_INTERPRETER_CHILD="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    result = subprocess.run(
        [*cmd, "-k", "interpreted"], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]


def assert_compiled_matches_eager(layer, run, rel: float = 1e-5) -> None:
    """`run(fn)` calls `fn` (`layer`, or `layer` under torch.compile(fullgraph=True)) on fresh
    inputs and returns its outputs and gradients; the two runs must agree within `rel` of each
    tensor's largest magnitude (fp32 sums in other orders)."""
    torch._dynamo.reset()
    compiled = run(torch.compile(layer, fullgraph=True))
    eager = run(layer)
    for c, e in zip(compiled, eager, strict=True):
        assert c.shape == e.shape and (c - e).abs().max() <= rel * e.abs().max(), (
            (c - e).abs().max()
        )


# --- tolerances of kernels against references -------------------------------------------------

PRECISION = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}  # significand bits


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |x| (float64), that of its smallest normal below."""
    _, exponent = torch.frexp(x.abs().clamp(min=torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(x), exponent - PRECISION[dtype])


def assert_within(actual, expected, scale, dtype, ulps: float = 1.0, rel: float = 1e-5) -> None:
    """|actual - expected| <= `ulps` `dtype` ulps at the larger of the two + rel * scale, in
    float64; `scale` bounds the magnitudes of the terms whose fp32 rounding errors add up."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.double(), expected.double()
    bound = ulps * ulp(torch.maximum(a.abs(), e.abs()), dtype) + rel * scale.double()
    err = (a - e).abs()
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0, f"error exceeds its bound by {worst:.3g} (max error {err.max().item():.3g})"


def two_source_mix(tmp_path: Path, repeats: int = 40, num_docs: int = 40) -> str:
    """Two small byte-level token directories, as a data.sources override (70/30): num_docs
    documents each, of a phrase said `repeats` times (~20 bytes a time)."""
    from moetrain.data import prepare

    paths = []
    for name, word in (("web", "the quick brown fox"), ("code", "def f(x): return x + 1")):
        src = tmp_path / f"{name}.jsonl"
        docs = (json.dumps({"text": f"{word} {i} " * repeats}) + "\n" for i in range(num_docs))
        src.write_text("".join(docs))
        paths.append(prepare([src], tmp_path / name, progress=False))
    return f"data.sources=[{{path: {paths[0]}, weight: 0.7}}, {{path: {paths[1]}, weight: 0.3}}]"


def train_bpe(path: Path, texts: list[str], vocab_size: int, byte_alphabet: bool = True) -> Path:
    """A byte-level BPE tokenizer.json at `path` trained on `texts` to at most `vocab_size` ids,
    with <|endoftext|>; without the byte alphabet it can be smaller than 257 ids."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_alphabet else [],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def assert_failed_prepare_left(directory: Path, before: list[Path], out: Path) -> None:
    """After a failed `prepare` into `out`: no output, nothing new in `directory` but the work
    directory ``out.partial``, and in that only finished units (nothing partly written)."""
    work = out.with_name(f"{out.name}.partial")
    assert not out.exists()
    assert [p for p in sorted(directory.iterdir()) if p != work] == sorted(before)
    if work.exists():
        names = sorted(p.name for p in work.iterdir())
        units = {n.removesuffix(".tokens") for n in names if n.endswith(".tokens")}
        files = [f"{u}.{kind}" for u in units for kind in ("tokens", "lengths", "json")]
        assert units, "a work directory without finished units is removed"
        assert names == sorted(["lock", "settings.json", *files])
