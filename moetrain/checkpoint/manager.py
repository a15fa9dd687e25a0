"""Atomic, verified, rotating checkpoints under `RUN_DIR/checkpoints/step-N/`
(docs/reliability.md "A checkpoint is complete or invisible").

A save writes `step-N.tmp/` (DCP shards, `trainer.json`, `config.yaml`, extra files, last
`manifest.json` with every file's size and SHA-256) and renames it; `latest()` picks only
directories that verify. A checkpoint failing verification on resume (or by its sizes at
rotation) is moved aside to `step-N.corrupt/`. Rotation keeps the newest `keep` that verify.

Reading executes nothing a checkpoint contains: DCP's `.metadata` pickle goes through an
unpickler that admits only DCP's metadata classes (`SafeFileSystemReader`), and the non-tensor
values DCP's planner would read with `weights_only=False` are read with `weights_only=True`
(`_SafeLoadPlanner`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from moetrain import faults

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.json"
CORRUPT = ".corrupt"
_STEP_DIR = re.compile(r"^step-(\d+)$")
EXTRA_STATE = "_extra_state"  # the state dict key of a module's `get_extra_state()`


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupted."""


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns that it assumes one process when no process group exists; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    checkpoint_root: Path | str,
    step: int,
    tensor_state: dict[str, Any],
    trainer_state: dict[str, Any],
    config_yaml: str,
    keep: int = 2,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Collective: every rank calls it; returns the final directory. A write failing on any rank
    removes `step-N.tmp/` and raises a CheckpointError on every rank (earlier checkpoints are
    untouched). Three phases, each closed by all ranks agreeing whether anything failed (a bare
    barrier would hang on a rank that raised): rank 0 makes the directory; every rank writes its
    shards; rank 0 writes trainer state, config and manifest and renames."""
    root = Path(checkpoint_root)
    final, tmp = root / f"step-{step}", root / f"step-{step}.tmp"

    def prepare() -> None:
        if _rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()

    def write_shards() -> None:
        with _quiet_dcp():
            dcp.save(tensor_state, checkpoint_id=str(tmp))

    def finalize() -> None:
        faults.in_save(step, _rank())
        if _rank() != 0:
            return
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
        (tmp / "config.yaml").write_text(config_yaml)
        for name, data in (extra_files or {}).items():  # e.g. the run's tokenizer files
            (tmp / name).write_bytes(data)
        files = {
            p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(tmp.iterdir())
            if p.is_file()
        }
        with (tmp / MANIFEST).open("w") as f:
            json.dump({"step": step, "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _prune(root, keep)

    for phase in (prepare, write_shards, finalize):
        error = None
        try:
            phase()
        except (OSError, CheckpointException) as exc:  # DCP's own exception is a BaseException
            error = _save_error(root, step, exc)
        message = first_error(None if error is None else str(error))
        if message is not None:
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            first_error(None)  # no rank returns before the partial directory is gone
            raise CheckpointError(message) from None
    return final


def first_error(message: str | None) -> str | None:
    """Every rank's phase outcome, agreed on by all: the first failure's message (with its rank
    when there are several ranks), or None. Also a barrier."""
    if not dist.is_initialized():
        return message
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    for rank, m in enumerate(messages):
        if m is not None:
            return f"rank {rank}: {m}"
    return None


def _save_error(root: Path, step: int, exc: BaseException) -> CheckpointError:
    cause = _os_error(exc)
    if cause is not None and cause.errno == errno.ENOSPC:
        reason = "no space left on device (ENOSPC)"
    elif cause is not None:
        reason = str(cause)
    else:
        reason = str(exc).strip().splitlines()[-1]
    if cause is not None and cause.filename:
        reason += f" writing {cause.filename}"
    newest = list_complete(root)
    kept = f"the newest complete checkpoint is still {newest[-1]}" if newest else "none existed"
    return CheckpointError(
        f"saving checkpoint step-{step} under {root} failed: {reason}; the partial "
        f"step-{step}.tmp was removed and {kept}"
    )


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, one of DCP's per-rank failures, or a cause."""
    seen: list[BaseException] = [exc]
    while seen:
        e = seen.pop()
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException):
            seen.extend(failure for failure, _ in e.failures.values())
        if e.__cause__ is not None:
            seen.append(e.__cause__)
    return None


def check_writable(directory: Path | str) -> None:
    """Create `directory` and write, fsync and delete a small file in it, so an unwritable run
    directory is a clear error before any training rather than at the first save."""
    directory = Path(directory)
    probe = directory / f".write-test-{uuid.uuid4().hex}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with probe.open("wb") as f:
            f.write(b"moetrain")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and exc.filename != str(directory) else ""
        raise CheckpointError(
            f"cannot write checkpoints to {directory}: {exc.strerror or exc}{where}; choose "
            "another --run-dir, or fix its permissions or free space"
        ) from None


def _prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints that verify (by sizes: hashing every kept checkpoint
    at every save would cost a full read of each), move aside those that do not, and delete the
    older ones. The checkpoint just written verifies by construction, so it is always kept."""
    kept = 0
    for path in reversed(list_complete(root)):
        if keep > 0 and kept >= keep:
            shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            verify(path, check_hashes=False)
            kept += 1
        except CheckpointError as exc:
            _report_moved(path, move_aside(path), exc)
    for path in root.glob("step-*.tmp"):  # leftovers of crashed saves
        shutil.rmtree(path, ignore_errors=True)


def list_complete(root: Path | str) -> list[Path]:
    """Complete checkpoint directories (a manifest present), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / MANIFEST).is_file():
            found.append((int(match.group(1)), path))
    return [p for _, p in sorted(found)]


def verify(path: Path | str, check_hashes: bool = True) -> dict[str, Any]:
    """Check every file of the manifest; return the manifest. Raises CheckpointError."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path} is corrupted: {exc}") from None
    for name, info in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        if file.stat().st_size != info["size"]:
            raise CheckpointError(
                f"checkpoint file {file} is truncated or altered "
                f"({file.stat().st_size} bytes, expected {info['size']})"
            )
        if check_hashes and _sha256(file) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {file} is corrupted (SHA-256 mismatch)")
    return manifest


def _flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


# The globals a DCP `.metadata` pickle of tensors and plain values references (listed from real
# checkpoints of the model, AdamW and sharded-AdamW states), plus every torch dtype.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # torch.strided and the other layouts, by name
    "pathlib": {"PosixPath", "WindowsPath"},  # StorageMeta.checkpoint_id
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        dtype = vars(torch).get(name) if module == "torch" else None  # no lazy imports
        if isinstance(dtype, torch.dtype):
            return dtype
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeFileSystemReader(dcp.FileSystemReader):
    """A DCP reader whose metadata unpickling can construct DCP metadata and nothing else."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except Exception as exc:  # anything a damaged or hostile pickle raises
            raise CheckpointError(f"{path} is not a checkpoint metadata file: {exc}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(
                f"{path} is not a checkpoint metadata file: it holds a {type(metadata).__name__}"
            )
        for info in (metadata.storage_data or {}).values():  # shards live next to .metadata
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
                raise CheckpointError(f"{path} points at a file outside its directory: {name!r}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: Path | str) -> Metadata:
    """The DCP metadata of a checkpoint directory (names, shapes, dtypes), read safely."""
    with _quiet_dcp():
        return SafeFileSystemReader(str(path)).read_metadata()


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP saves non-tensor values with torch.save, and the default planner reads them back with
    torch.load(weights_only=False), which runs whatever the bytes name. Here they are read with
    weights_only=True (tensors, numbers, strings, containers); the default planner only ever sees
    bytes re-serialized from that safe value."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            safe = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn} is not a plain value: {exc}"
            ) from None
        buffer = io.BytesIO()
        torch.save(safe, buffer)
        buffer.seek(0)
        super().load_bytes(read_item, buffer)


def _drop_extra_state_not_saved(state: dict[str, Any], saved: set[str], prefix: str = "") -> None:
    for key, value in list(state.items()):
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _drop_extra_state_not_saved(value, saved, name + ".")
        elif name.endswith(EXTRA_STATE) and name not in saved:
            del state[key]


def check_shapes(path: Path | str, tensor_state: dict[str, Any]) -> None:
    """Compare every tensor's global shape with the checkpoint's before loading anything, so a
    checkpoint of another model shape is one readable error rather than a DCP stack trace."""
    saved = read_metadata(path).state_dict_metadata
    problems = []
    for name, value in _flatten(tensor_state).items():
        if not hasattr(value, "shape"):
            continue
        if name not in saved:
            problems.append(f"{name} is missing from the checkpoint")
        elif hasattr(saved[name], "size") and tuple(saved[name].size) != tuple(value.shape):
            problems.append(
                f"{name}: checkpoint {tuple(saved[name].size)}, this model {tuple(value.shape)}"
            )
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(
            f"checkpoint {path} does not match this model: {'; '.join(problems[:5])}{more}"
        )


def latest(root: Path | str, check_hashes: bool = True, move_corrupt: bool = False) -> Path | None:
    """The newest checkpoint that verifies; corrupted newer ones are reported and skipped, and
    with `move_corrupt` (a resuming run's main rank) moved aside to step-N.corrupt/, so that
    rotation neither keeps them nor deletes an older good checkpoint in their favour."""
    for path in reversed(list_complete(root)):
        try:
            verify(path, check_hashes)
            return path
        except CheckpointError as exc:
            if move_corrupt:
                _report_moved(path, move_aside(path), exc)
            else:
                print(f"warning: skipping checkpoint: {exc}")
    return None


def agree_on_latest(root: Path | str) -> Path | None:
    """Collective: what a resume loads. Rank 0 alone picks (`latest`, moving corrupt newer ones
    aside) and every rank gets its path (load with check_hashes=False). A file rank 0 cannot read
    (an OSError) is not corruption: the same CheckpointError on every rank, not a hang."""
    found = error = None
    if _rank() == 0:
        try:
            path = latest(root, move_corrupt=True)
            found = None if path is None else path.name
        except OSError as exc:
            error = (
                f"cannot read the checkpoints under {root} to verify them: {exc}; fix the "
                "storage or its permissions and resume again"
            )
    if dist.is_initialized():
        agreed = [(found, error)]
        dist.broadcast_object_list(agreed, src=0)
        found, error = agreed[0]
    if error is not None:
        raise CheckpointError(error)
    return None if found is None else Path(root) / found


def move_aside(path: Path) -> Path:
    """Rename a checkpoint that fails verification to step-N.corrupt (-2, -3 ... if taken)."""
    target = path.with_name(path.name + CORRUPT)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{CORRUPT}-{n}")
    os.replace(path, target)
    return target


def _report_moved(path: Path, moved: Path, exc: CheckpointError) -> None:
    print(
        f"warning: checkpoint {path.name} fails verification ({exc}); moved aside to "
        f"{moved.name} (never resumed from, never deleted: inspect or delete it yourself)"
    )


def unusable(root: Path | str) -> list[Path]:
    """Checkpoints under `root` that exist but were moved aside or are complete and not picked:
    what a resume that found no verified checkpoint must name instead of starting over."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted([*list_complete(root), *root.glob(f"step-*{CORRUPT}*")], key=lambda p: p.name)


def resolve(path: Path | str, check_hashes: bool = True) -> Path:
    """A checkpoint directory (step-N/), or the newest complete one under `path/checkpoints/`
    (a run or import directory) or under `path` (a checkpoints root)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    for root in (path / "checkpoints", path):
        found = latest(root, check_hashes)
        if found is not None:
            return found
    raise ValueError(
        f"{path} is not a moetrain checkpoint: no {MANIFEST} in it, and no complete "
        "step-N/ checkpoint under it or under its checkpoints/ directory"
    )


def load(
    path: Path | str, tensor_state: dict[str, Any], check_hashes: bool = True
) -> dict[str, Any]:
    """Verify, then load tensors in place into `tensor_state`; returns the trainer state. A
    module's extra state (`nn.Module.get_extra_state`) that a checkpoint written before the
    module had any lacks is left as it is (and removed from `tensor_state`)."""
    path = Path(path)
    verify(path, check_hashes)
    _drop_extra_state_not_saved(tensor_state, set(read_metadata(path).state_dict_metadata))
    check_shapes(path, tensor_state)
    try:
        with _quiet_dcp():
            dcp.load(
                tensor_state,
                storage_reader=SafeFileSystemReader(str(path)),
                planner=_SafeLoadPlanner(),
            )
    except (Exception, CheckpointException) as exc:  # DCP's own exception is a BaseException
        raise CheckpointError(f"cannot load checkpoint {path} into this model: {exc}") from exc
    return json.loads((path / TRAINER_STATE).read_text())
