"""Fault injection: every fault moetrain claims to survive, injected, counted, and checked for loss.

Each scenario plants one kind of fault in a CPU run of the `tiny` preset (a SIGKILL at a random
moment or in the middle of a checkpoint, a rank dying under torchrun, a full disk, bit rot, a
hostile checkpoint, NaN/inf and loss spikes, broken inputs, data replaced under a run, a second
run in a used run directory, corrupt checkpoints at rotation) and compares the outcome with a
fault-free run: "data lost" counts steps whose final logged loss differs from the fault-free
run's or is missing (all steps when the final weights differ bitwise), "work redone" the steps
computed twice because they came after the last complete checkpoint. The markdown table it prints
is the one in docs/reliability.md:

    python benchmarks/reliability.py                  # about a minute on a 2-core CPU
    python benchmarks/reliability.py --kills 20 --fuzz 2000 --out /tmp/reliability

tests/reliability/ runs the same scenarios with small counts and asserts that nothing is lost.
The faults are planted through moetrain/faults.py (environment variables) or by patching a
function for the duration of one call; nothing here changes how moetrain runs otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import os
import pickle
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moetrain.checkpoint import manager
from moetrain.config import SECTIONS, RunConfig
from moetrain.convert.io import export_checkpoint
from moetrain.data import ByteTokenizer, prepare, write_token_dir
from moetrain.presets import tiny
from moetrain.train import step as train_step
from moetrain.train.observe import read_metrics
from moetrain.train.trainer import Trainer, TrainingStopped

# Every run logs each step (the loss of each step is compared) and checkpoints every 2 steps.
CHECKPOINT_EVERY = 2
BASE = ["train.log_every=1", "train.eval_every=0", f"train.checkpoint_every={CHECKPOINT_EVERY}"]


@dataclass
class Outcome:
    """One row of the table, plus what the tests look at."""

    fault: str
    injection: str
    injected: int = 0
    survived: int = 0
    lost: int = 0  # steps whose result is gone or differs from the fault-free run
    redone: int = 0  # steps recomputed after a resume
    details: dict[str, Any] = field(default_factory=dict)


# ---- running and comparing ---------------------------------------------------------------------
def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOETRAIN_FAULT")}
    return {**env, "MOETRAIN_CACHE": str(cache), "OMP_NUM_THREADS": "1", **extra}


def _cli(run_dir: Path, steps: int, *overrides: str) -> list[str]:
    """`moetrain train --resume`: the command a requeued job repeats, also on its first start."""
    sets = [x for o in [*BASE, f"train.steps={steps}", *overrides] for x in ("--set", o)]
    flags = ["--preset", "tiny", "--quiet", "--resume", "--run-dir", str(run_dir)]
    return ["-m", "moetrain", "train", *flags, *sets]


def _torchrun(nproc: int, *args: str) -> list[str]:
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def _python(args: list[str], env: dict[str, str], timeout: float = 300) -> None:
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def losses(run_dir: Path) -> dict[int, float]:
    """The last-written loss of each step in RUN_DIR/metrics.jsonl."""
    train, _ = read_metrics(run_dir)
    return {r["step"]: r["loss"] for r in train}


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model, optimizer, RNG), by its DCP name."""
    stored = manager.read_metadata(path).state_dict_metadata
    state = {
        name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for name, meta in stored.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    manager.load(path, state)
    return state


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model and optimizer tensors of the newest checkpoint. (Its "rng" entry is the
    process's global torch generator, which training never draws from and which every new
    process seeds at random: it is carried across a resume but is not compared.)"""
    tensors = checkpoint_tensors(manager.latest(run_dir / "checkpoints"))
    return {k: v for k, v in tensors.items() if k.startswith(("model.", "optim."))}


def lost_steps(run_dir: Path, reference: Path) -> int:
    """Steps of `reference` whose loss `run_dir` lacks or differs in (bitwise); all of them when
    the final weights differ (bitwise)."""
    ours, theirs = losses(run_dir), losses(reference)
    lost = sum(1 for step, loss in theirs.items() if ours.get(step) != loss)
    a, b = final_weights(run_dir), final_weights(reference)
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return lost if same else len(theirs)


def _newest_step(run_dir: Path) -> int:
    path = manager.latest(run_dir / "checkpoints")
    return int(path.name.removeprefix("step-")) if path else 0


def _last_logged(run_dir: Path) -> int:
    try:
        train, _ = read_metrics(run_dir)
    except ValueError:  # no metrics file yet
        return 0
    return train[-1]["step"] if train else 0


def _steps_after(run_dir: Path, offset: int) -> list[int]:
    """The steps of the records written after byte `offset` of metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    steps = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
            steps.append(int(json.loads(line)["step"]))
    return steps


def _metrics_size(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.stat().st_size if path.exists() else 0


def train_tiny(run_dir: Path, steps: int, *overrides: str, resume: bool = True) -> Trainer:
    """An in-process run (world size 1) of `tiny` with the BASE cadence and a constant LR after
    warmup, so that a run stopped early by a smaller `steps` follows the same trajectory."""
    config = tiny().with_overrides(
        [*BASE, "train.schedule=constant", f"train.steps={steps}", *overrides]
    )
    trainer = Trainer(config, run_dir, resume=resume, progress=False)
    trainer.train()
    return trainer


# ---- 1. kill anywhere --------------------------------------------------------------------------
def kill_anywhere(work: Path, cache: Path, kills: int = 4, steps: int = 24, seed: int = 0):
    """SIGKILL the CLI at random moments, then once inside a save (after the DCP shards, before
    the manifest), restarting it with --resume after each kill; then let it finish. Each restart
    must resume from the newest complete checkpoint, so it redoes at most CHECKPOINT_EVERY steps,
    and the run must end with the fault-free run's losses and weights."""
    rng = random.Random(seed)
    reference, run = work / "kill_reference", work / "kill_run"
    _python(_cli(reference, steps), _env(cache))
    # every save takes 50 ms longer, so that random kills often land inside one
    env = _env(cache, MOETRAIN_FAULT_SAVE_DELAY="0.05")
    restarts: list[dict[str, Any]] = []

    def restart(**fault: str) -> subprocess.Popen:
        newest, offset = _newest_step(run), _metrics_size(run)
        restarts.append({"newest": newest, "offset": offset, "redo": _last_logged(run) - newest})
        return subprocess.Popen(
            [sys.executable, *_cli(run, steps)],
            env={**env, **fault},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    mid_save = 0
    for _ in range(kills):
        newest = _newest_step(run)
        if newest + 1 > steps - 6:  # room for the kill and the kill inside a save to come
            break
        target = rng.randint(newest + 1, min(newest + 2 * CHECKPOINT_EVERY, steps - 6))
        started = time.time()
        proc = restart()
        while proc.poll() is None and time.time() < started + 120:
            if max(_steps_after(run, restarts[-1]["offset"]), default=0) >= target:
                break
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.1))
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before its kill: {proc.stderr.read()[-3000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        partial = (run / "checkpoints").glob("step-*.tmp")
        mid_save += any(p.stat().st_mtime >= started for p in partial)

    # one kill certainly inside a save: the next checkpoint after the newest complete one
    in_save_step = _newest_step(run) + CHECKPOINT_EVERY
    marker = work / "kill_in_save.fired"
    proc = restart(MOETRAIN_FAULT=f"kill-in-save:{in_save_step}", MOETRAIN_FAULT_ONCE=str(marker))
    proc.wait(timeout=120)
    killed_in_save = proc.returncode == -signal.SIGKILL and marker.exists()
    partial_left = (run / "checkpoints" / f"step-{in_save_step}.tmp").is_dir()

    _, err = restart().communicate(timeout=300)
    if _last_logged(run) != steps:
        raise RuntimeError(f"the final run did not finish: {err[-3000:]}")

    for r in restarts:  # a restart logs first the step after the checkpoint it resumed from
        r["resumed_from_newest"] = _steps_after(run, r["offset"])[:1] == [r["newest"] + 1]
    after_kill = restarts[1:]  # restarts[0] is the first start
    lost = lost_steps(run, reference)
    details = {
        "restarts": restarts,
        "mid_save_random_kills": mid_save,
        "killed_in_save": killed_in_save,
        "partial_left": partial_left,
    }
    random_ok = [r["resumed_from_newest"] and lost == 0 for r in after_kill[:-1]]
    last = after_kill[-1]
    in_save_ok = killed_in_save and partial_left and last["resumed_from_newest"] and lost == 0
    return [
        Outcome(
            "SIGKILL at a random moment",
            f"kill -9 of the CLI ({mid_save} inside a save)",
            len(random_ok),
            sum(random_ok),
            lost,
            sum(r["redo"] for r in after_kill[:-1]),
            details,
        ),
        Outcome(
            "SIGKILL inside a checkpoint save",
            "self-kill after the DCP shards, before the manifest",
            1,
            int(in_save_ok),
            lost,
            last["redo"],
            details,
        ),
    ]


# ---- 2. a rank dies ----------------------------------------------------------------------------
def rank_death(work: Path, cache: Path, steps: int = 8, die_after: int = 5) -> Outcome:
    """Under torchrun --max-restarts=1, rank 1 exits (os._exit(1)) after step `die_after`;
    torchrun restarts both ranks, which resume from the newest complete checkpoint."""
    reference, run = work / "ranks_reference", work / "ranks_run"
    _python(_torchrun(2, *_cli(reference, steps)), _env(cache))
    marker = work / "rank_death.fired"
    # a torchrun restart with its shared TCPStore hands stale gloo addresses to the new
    # workers (pytorch/pytorch#135712); docs/reliability.md has the details
    fault = {"MOETRAIN_FAULT": f"exit:{die_after}:1", "MOETRAIN_FAULT_ONCE": str(marker)}
    env = _env(cache, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **fault)
    started = time.time()
    _python(_torchrun(2, "--max-restarts=1", *_cli(run, steps)), env)
    lost = lost_steps(run, reference)
    resumed_at = die_after - die_after % CHECKPOINT_EVERY
    details = {"died": marker.exists(), "seconds": time.time() - started}
    return Outcome(
        "a rank dies (2 processes)",
        "os._exit(1) on rank 1; torchrun restarts",
        1,
        int(marker.exists() and lost == 0),
        lost,
        die_after - resumed_at,
        details,
    )


# ---- 3. storage --------------------------------------------------------------------------------
@contextlib.contextmanager
def disk_full_in(where: str) -> Iterator[None]:
    """Writes fail with ENOSPC: in the DCP shards (after 1 KiB of a shard is written), or in
    trainer.json (after the shards)."""
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if where == "shards":

        def write_item(transforms, stream, data, *args, **kwargs):
            stream.write(b"\0" * 1024)
            raise full

        with mock.patch.object(dcp_filesystem, "_write_item", write_item):
            yield
        return
    real_write_text = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == manager.TRAINER_STATE:
            raise full
        return real_write_text(self, *args, **kwargs)

    with mock.patch.object(Path, "write_text", write_text):
        yield


def disk_full(work: Path) -> Outcome:
    """The disk fills during the save of step 4, in the shards or in trainer.json: a clear error,
    step-2 stays the newest complete checkpoint and loads, and --resume continues from it."""
    reference = work / "disk_reference"
    train_tiny(reference, 6)
    out = Outcome("disk full during a save", "ENOSPC from a shard write / trainer.json write")
    for where in ("shards", "trainer.json"):
        run = work / f"disk_full_{where}"
        train_tiny(run, 2)
        out.injected += 1
        message = ""
        with disk_full_in(where):
            try:
                train_tiny(run, 4)
            except manager.CheckpointError as exc:
                message = str(exc)
        names = sorted(p.name for p in (run / "checkpoints").iterdir())
        clear = "no space left on device" in message and "step-2" in message
        intact = names == ["step-2"] and manager.latest(run / "checkpoints").name == "step-2"
        train_tiny(run, 6)  # the disk has room again
        lost = lost_steps(run, reference)
        out.survived += int(clear and intact and lost == 0)
        out.lost += lost
        out.redone += 2
        out.details[where] = {"message": message, "left": names}
    return out


def unwritable_run_dir(work: Path) -> Outcome:
    """A run directory that cannot be created (its parent is a file): an error naming it, raised
    before the model is built."""
    blocker = work / "not_a_directory"
    blocker.write_text("")
    message = ""
    try:
        Trainer(tiny().with_overrides(BASE), blocker / "run", progress=False)
    except manager.CheckpointError as exc:
        message = str(exc)
    ok = "cannot write checkpoints to" in message and str(blocker / "run") in message
    return Outcome(
        "unwritable run directory",
        "run dir below a regular file",
        1,
        int(ok),
        details={"message": message},
    )


def bit_rot(work: Path) -> Outcome:
    """One flipped byte or a truncated shard in the newest checkpoint: --resume skips it (hash
    mismatch), resumes from the one before, and ends where a fault-free run ends."""
    reference = work / "rot_reference"
    train_tiny(reference, 6)
    out = Outcome("bit rot / truncation in the newest checkpoint", "flip a byte / cut a shard")
    for damage in ("flip", "truncate"):
        run = work / f"rot_{damage}"
        train_tiny(run, 4)
        shard = next((run / "checkpoints" / "step-4").glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            data = data[: len(data) // 2]
        shard.write_bytes(bytes(data))
        out.injected += 1
        with contextlib.redirect_stdout(io.StringIO()):  # the "skipping checkpoint" warning
            resumed = train_tiny(run, 6)
        lost = lost_steps(run, reference)
        out.survived += int(resumed.resumed_from.name == "step-2" and lost == 0)
        out.lost += lost
        out.redone += 2
    return out


# ---- 4. hostile checkpoints --------------------------------------------------------------------
class Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def rewrite_manifest(checkpoint: Path) -> None:
    """Make the manifest match the files again, as an attacker who controls the directory can."""
    manifest = json.loads((checkpoint / manager.MANIFEST).read_text())
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / manager.MANIFEST).write_text(json.dumps(manifest))


def plant_metadata_payload(checkpoint: Path, marker: Path, nested: bool) -> None:
    """Replace `.metadata` by a pickle that runs `Payload`: bare, or hidden inside otherwise
    valid DCP metadata."""
    if nested:
        metadata = manager.read_metadata(checkpoint)
        metadata.storage_meta.modules = [Payload(marker)]
        data = pickle.dumps(metadata)
    else:
        data = pickle.dumps(Payload(marker))
    (checkpoint / ".metadata").write_bytes(data)
    rewrite_manifest(checkpoint)


def plant_value_payload(checkpoint: Path, fqn: str, marker: Path) -> None:
    """Point the non-tensor entry `fqn` at torch.save(Payload) bytes appended to its shard."""
    metadata = manager.read_metadata(checkpoint)
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    shard = checkpoint / info.relative_path
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[index] = dataclasses.replace(
        info, offset=offset, length=len(buffer.getvalue())
    )
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(checkpoint)


def hostile_checkpoints(work: Path) -> Outcome:
    """Checkpoints whose pickles would run a command: loading (resume, --init-from, export's
    reader) refuses them with a CheckpointError, and the command never runs."""
    out = Outcome("checkpoint with a code-running pickle", "os.system in .metadata / a value")
    source = work / "hostile_source"
    train_tiny(source, 2, "train.optimizer=sharded")  # the sharded optimizer saves an int "step"
    resume = lambda run: train_tiny(run, 4, "train.optimizer=sharded")  # noqa: E731
    cases: list[tuple[str, Callable[[Path, Path], None], Callable[[Path], Any]]] = [
        ("metadata, --resume", lambda c, m: plant_metadata_payload(c, m, nested=False), resume),
        (
            "metadata, --init-from",
            lambda c, m: plant_metadata_payload(c, m, nested=True),
            lambda run: Trainer(
                tiny(), run.with_name(run.name + "_new"), init_from=run, progress=False
            ),
        ),
        (
            "metadata, export",
            lambda c, m: plant_metadata_payload(c, m, nested=True),
            lambda run: export_checkpoint(run, run.with_name(run.name + "_hf")),
        ),
        ("optimizer value, --resume", lambda c, m: plant_value_payload(c, "optim.step", m), resume),
    ]
    for name, plant, load in cases:
        slug = re.sub(r"\W+", "_", name)
        run = work / f"hostile_{slug}"
        shutil.copytree(source, run)
        marker = work / f"{slug}.pwned"
        plant(run / "checkpoints" / "step-2", marker)
        out.injected += 1
        try:
            load(run)
            rejected = False
        except manager.CheckpointError:
            rejected = True
        out.survived += int(rejected and not marker.exists())
        out.details[name] = {"rejected": rejected, "payload_ran": marker.exists()}
    return out


# ---- 5. numerical faults -----------------------------------------------------------------------
def poison(kind: str, at_calls: set[int], seen: list[dict[str, torch.Tensor]]):
    """A forward_backward that corrupts the loss or the gradients on the given calls (1-based)
    and snapshots the weights at every call, so a skipped update shows as two equal snapshots.
    Kinds: "inf loss", "nan loss", "nan grad", "spike" (the loss x 10, gradients untouched) and
    "none" (snapshots only)."""
    real = train_step.forward_backward
    calls = [0]

    def poisoned(model, *args, **kwargs):
        calls[0] += 1
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        loss = real(model, *args, **kwargs)
        if calls[0] not in at_calls or kind == "none":
            return loss
        if kind == "nan grad":
            for p in model.parameters():
                p.grad.fill_(float("nan"))
            return loss
        return {
            "inf loss": loss * float("inf"),
            "nan loss": loss * float("nan"),
            "spike": loss * 10,
        }[kind]

    return mock.patch.object(train_step, "forward_backward", poisoned)


SPIKE = ["train.spike_sigma=3", "train.spike_window=8"]


def numerical_faults(work: Path) -> list[Outcome]:
    """NaN/inf in the loss or the gradients, and a loss spike, at step 12: that step's update is
    skipped (the weights do not change), it is counted, and training goes on. Then K = 3 bad
    steps in a row: the run saves and stops with a message naming the cause."""
    rows = []
    for kind in ("inf loss", "nan loss", "nan grad", "spike"):
        seen: list[dict[str, torch.Tensor]] = []
        with poison(kind, {12}, seen):
            trainer = train_tiny(work / f"numeric_{kind.replace(' ', '_')}", 16, *SPIKE)
        records = {r["step"]: r for r in read_metrics(trainer.run_dir)[0]}
        skipped = all(torch.equal(seen[11][k], seen[12][k]) for k in seen[11])
        moved = any(not torch.equal(seen[12][k], seen[13][k]) for k in seen[12])
        counted = records[16]["skipped_steps"] == 1
        if kind == "spike":
            counted = counted and records[16]["spike_steps"] == 1
        ok = skipped and moved and counted and trainer.step == 16
        rows.append(Outcome(f"{kind} at one step", f"{kind} injected into step 12", 1, int(ok)))
    stop = Outcome("K bad steps in a row", "3 spikes / 3 inf losses, max_bad_steps=3")
    for kind in ("spike", "inf loss"):
        run = work / f"numeric_stop_{kind.replace(' ', '_')}"
        seen = []
        message = ""
        with poison(kind, {12, 13, 14}, seen):
            try:
                train_tiny(run, 20, *SPIKE, "train.max_bad_steps=3")
            except TrainingStopped as exc:
                message = str(exc)
        stop.injected += 1
        saved = manager.latest(run / "checkpoints")
        expect = "loss spike" if kind == "spike" else "non-finite"
        ok = "3 consecutive steps were skipped" in message and expect in message
        stop.survived += int(ok and saved is not None and saved.name == "step-14")
        stop.details[kind] = message
    return [*rows, stop]


# ---- 6. hostile inputs -------------------------------------------------------------------------
def _token_dir(path: Path, num_tokens: int = 6000, seed: int = 0) -> Path:
    ids = np.random.default_rng(seed).integers(0, 256, num_tokens)
    return write_token_dir(path, [("train", ids), ("val", ids[:1000])], ByteTokenizer())


def _damage(kind: str, path: Path) -> Path:
    _token_dir(path, num_tokens=300 if kind == "tiny corpus" else 6000)
    train = path / "train.npy"
    if kind == "truncated":
        train.write_bytes(train.read_bytes()[:-100])
    elif kind == "wrong dtype":
        np.save(train, np.load(train).astype(np.int32))
    elif kind == "id beyond vocab":  # 400: fits the file's uint16, not the model's 320 ids
        tokens = np.load(train)
        tokens[7] = 400
        np.save(train, tokens)
    return path


def hostile_inputs(work: Path) -> Outcome:
    """Broken data, configs and checkpoints given to a run that has a checkpoint: each is a
    ValueError naming the problem, raised before anything is loaded or written, and the run's
    checkpoints are unchanged."""
    out = Outcome("broken inputs", "bad token files, configs, model shape")
    run = work / "inputs_run"
    train_tiny(run, 2)
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
    data_cases = {
        "truncated": r"train\.npy is truncated or corrupt",
        "wrong dtype": r"train\.npy holds int32 values but meta\.json says uint16",
        "id beyond vocab": r"token id 400 in .*train\.npy is >= model\.vocab_size \(320\)",
        "tiny corpus": r"fewer than one global batch",
    }
    cases: list[tuple[str, list[str], str]] = [
        (k, [f"data.path={_damage(k, work / k.replace(' ', '_'))}"], v)
        for k, v in data_cases.items()
    ]
    cases += [
        (
            "other model shape",
            ["model.d_model=128"],
            r"model\.d_model cannot change on --resume \(64 in .*, 128 now\)",
        ),
        ("unknown config key", ["train.lr_max=1"], r"unknown field 'train\.lr_max'"),
        ("wrong config type", ["train.steps=many"], r"train\.steps \('many'\) must be an integer"),
    ]
    for name, overrides, pattern in cases:
        out.injected += 1
        try:
            train_tiny(run, 4, *overrides)
            message = ""
        except ValueError as exc:
            message = str(exc)
        after = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
        ok = re.search(pattern, message) is not None and after == before
        out.survived += int(ok)
        out.details[name] = message
    empty = work / "empty.txt"
    empty.write_text("\n")
    out.injected += 1
    with contextlib.suppress(ValueError):
        prepare([empty], work / "empty_tokens", progress=False)
        out.details["empty corpus"] = "accepted"
    out.survived += int("empty corpus" not in out.details and not (work / "empty_tokens").exists())
    return out


# ---- 7. config fuzzing -------------------------------------------------------------------------
FIELDS = {
    f.name: [g.name for g in dataclasses.fields(f.default_factory)]
    for f in dataclasses.fields(RunConfig)
    if f.name in SECTIONS
}
_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(1, 64),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["auto", "softmax", "cosine", "bf16", "fsdp", "sharded", "1e-3", "x", ""]),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _section(name: str) -> st.SearchStrategy:
    keys = st.one_of(st.sampled_from(FIELDS[name]), st.text(max_size=6), st.integers())
    return st.one_of(st.dictionaries(keys, _values, max_size=6), _values)


config_dicts = st.builds(
    lambda known, extra: {**extra, **known},
    st.fixed_dictionaries({}, optional={"name": _values, **{s: _section(s) for s in SECTIONS}}),
    st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), _values, max_size=3),
)
_NAMED = re.compile(r"\b(name|config|" + "|".join(SECTIONS) + r")\b")


def check_config_dict(data: Any) -> bool:
    """The property: a RunConfig, or a ValueError whose message names a field or section.
    Anything else raises. Returns whether a config was built."""
    try:
        RunConfig.from_dict(data)
        return True
    except ValueError as exc:
        if not _NAMED.search(str(exc)):
            raise AssertionError(f"error names no field or section: {exc}") from None
        return False


def config_fuzz(num_examples: int) -> Outcome:
    built, tried = [0], [0]

    @settings(
        max_examples=num_examples,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(config_dicts)
    def fuzz(data):
        tried[0] += 1
        built[0] += check_config_dict(data)

    failure = ""
    try:
        fuzz()
    except Exception as exc:  # the falsifying example goes in the details
        failure = f"{type(exc).__name__}: {exc}"
    out = Outcome("random config dicts", "hypothesis: random sections, keys, value types")
    out.injected, out.survived = tried[0], tried[0] if not failure else 0
    out.details = {"built": built[0], "failure": failure}
    return out


# ---- the table ---------------------------------------------------------------------------------
# ---- 8. the run directory -----------------------------------------------------------------------
def _flip_a_byte(checkpoint: Path) -> None:
    shard = next(checkpoint.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _write_documents(path: Path, word: str, num_docs: int = 400) -> Path:
    lines = [json.dumps({"text": f"{word} " * 30 + str(i)}) for i in range(num_docs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def data_replaced(work: Path) -> Outcome:
    """A run trains on a token directory; `prepare` of other documents into it is refused, and
    after `--overwrite` a resume of the run is an error naming the change (the content hash its
    checkpoints record), with the checkpoints untouched."""
    out = Outcome("data re-prepared under a run", "prepare into its token dir; then --overwrite")
    data, run = work / "replaced_data", work / "replaced_run"
    prepare([_write_documents(work / "a.jsonl", "alpha")], data, progress=False)
    train_tiny(run, 2, f"data.path={data}")
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
    other = _write_documents(work / "b.jsonl", "beta gamma")
    for overwrite in (False, True):
        out.injected += 1
        try:
            prepare([other], data, progress=False, overwrite=overwrite)
            train_tiny(run, 4, f"data.path={data}")
            message = ""
        except ValueError as exc:
            message = str(exc)
        after = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
        expected = "the data changed since checkpoint" if overwrite else "--overwrite"
        out.survived += int(expected in message and after == before)
        out.details[f"overwrite={overwrite}"] = message
    return out


def concurrent_runs(work: Path, cache: Path) -> Outcome:
    """While `moetrain train` runs, a second one with --resume and another with --overwrite start
    in its run directory: both are refused by its lock and change nothing. Then the first is
    SIGKILLed; its stale lock does not stop the restart, which ends where a fault-free run ends."""
    from moetrain import cli

    reference, run = work / "lock_reference", work / "lock_run"
    steps = 12
    _python(_cli(reference, steps), _env(cache))
    out = Outcome("a second run in a used run dir", "--resume / --overwrite beside a live run")
    env = _env(cache, MOETRAIN_FAULT_SAVE_DELAY="1")  # keeps the first run alive for a while
    child = subprocess.Popen([sys.executable, *_cli(run, steps)], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not manager.list_complete(run / "checkpoints") and time.monotonic() < deadline:
            time.sleep(0.05)
        for flag in ("--resume", "--overwrite"):
            out.injected += 1
            args = [flag if a == "--resume" else a for a in _cli(run, steps)[2:]]  # same config
            with contextlib.redirect_stderr(io.StringIO()) as err:
                code = cli.main(args)
            refused = code == 2 and "is in use by another moetrain run" in err.getvalue()
            out.survived += int(refused and child.poll() is None)
            out.details[flag] = err.getvalue().strip()
    finally:
        child.kill()
        child.wait()
    logged, newest = _last_logged(run), _newest_step(run)
    _python(_cli(run, steps), _env(cache))  # the killed run's lock is stale: no error
    out.lost = lost_steps(run, reference)
    out.redone = max(logged - newest, 0)
    out.details["killed after step"] = logged
    return out


def corrupt_rotation(work: Path) -> Outcome:
    """A byte flipped in the newest checkpoint: the resume moves it aside as step-4.corrupt and
    the next rotation keeps step-2, the newest verified one. Every checkpoint corrupt: --resume
    is an error naming them, not a silent restart from step 0."""
    out = Outcome("corrupt checkpoint, then rotation", "flip a byte in the newest / in all")
    reference = work / "rotation_reference"
    train_tiny(reference, 6, "train.checkpoint_every=100")
    run = work / "rotation_run"
    train_tiny(run, 4)
    _flip_a_byte(run / "checkpoints" / "step-4")
    out.injected += 1
    with contextlib.redirect_stdout(io.StringIO()):
        resumed = train_tiny(run, 6, "train.checkpoint_every=100")  # saves step-6 only
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    out.details["kept"] = kept
    lost = lost_steps(run, reference)
    ok = resumed.resumed_from.name == "step-2" and kept == ["step-2", "step-4.corrupt", "step-6"]
    out.survived += int(ok and lost == 0)
    out.lost += lost
    out.redone += 2
    run = work / "rotation_all"
    train_tiny(run, 4)
    for step in (2, 4):
        _flip_a_byte(run / "checkpoints" / f"step-{step}")
    out.injected += 1
    logged = (run / "metrics.jsonl").stat().st_size
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            train_tiny(run, 6)
        message = ""
    except manager.CheckpointError as exc:
        message = str(exc)
    out.details["all corrupt"] = message
    named = "no checkpoint" in message and "step-2.corrupt, step-4.corrupt" in message
    out.survived += int(named and (run / "metrics.jsonl").stat().st_size == logged)
    return out


def table(rows: list[Outcome]) -> str:
    lines = [
        "| fault | how it is injected | injected | survived | data lost (steps) | work redone (steps) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.fault} | {r.injection} | {r.injected} | {r.survived} | {r.lost} | {r.redone} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="random SIGKILLs of one run")
    parser.add_argument("--fuzz", type=int, default=500, help="random configs to try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/reliability"))
    args = parser.parse_args(argv)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    cache = args.out / "cache"
    os.environ["MOETRAIN_CACHE"] = str(cache)
    started = time.time()
    steps = 4 * args.kills + 14  # room for every kill to make progress
    rows = [*kill_anywhere(args.out, cache, kills=args.kills, steps=steps, seed=args.seed)]
    rows.append(rank_death(args.out, cache))
    rows += [disk_full(args.out), unwritable_run_dir(args.out), bit_rot(args.out)]
    rows.append(hostile_checkpoints(args.out))
    rows += numerical_faults(args.out)
    rows += [hostile_inputs(args.out), config_fuzz(args.fuzz)]
    rows += [data_replaced(args.out), concurrent_runs(args.out, cache), corrupt_rotation(args.out)]
    print(table(rows))
    print(
        f"\n{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, {time.time() - started:.0f} s: "
        f"python benchmarks/reliability.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    failed = [r.fault for r in rows if r.survived != r.injected or r.lost]
    if failed:
        print(f"\nNOT SURVIVED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
