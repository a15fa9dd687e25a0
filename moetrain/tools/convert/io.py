"""Files: a moetrain checkpoint <-> a Hugging Face OLMoE, Qwen3-MoE or Mixtral directory.

`export_checkpoint` reads a checkpoint's "model" part with DCP into world-size-1 tensors (any
saved layout), maps it with `hf.to_hf_state_dict` (to the one format that expresses the model,
or the one asked for) and writes config.json,
generation_config.json, safetensors (sharded with an index above `max_shard_bytes`) and the
checkpoint's tokenizer files, built in a sibling `.tmp` directory and renamed into place.
`import_hf` writes a step-0 checkpoint of the "model" part only, which `load_model_weights`
loads into a fresh model (`--init-from`), and the run's config.yaml beside it, as a run
directory has. Nothing is unpickled: weights come from safetensors,
DCP metadata through checkpoint/manager.py's restricted unpickler. `safetensors` and
`tokenizers` are optional (`moetrain[hf]`); their absence is a ValueError saying so.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moetrain.checkpoint import manager
from moetrain.config import RunConfig
from moetrain.data.loader import padded_vocab_size
from moetrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from moetrain.data.tokenizer_files import describe, tokenizer_files
from moetrain.model.transformer import Transformer
from moetrain.optional_packages import require
from moetrain.tools.convert.hf import (
    export_format,
    from_hf_state_dict,
    hf_config_dict,
    name_mismatch,
    run_config_from_hf,
    to_hf_state_dict,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- moetrain checkpoints ----------------------------------------------------------------------
def stored_model_tensors(checkpoint: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every tensor of the checkpoint's "model" part, by name."""
    metadata = manager.read_metadata(checkpoint)
    return {
        fqn.removeprefix("model."): (tuple(meta.size), meta.properties.dtype)
        for fqn, meta in metadata.state_dict_metadata.items()
        if fqn.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }


def load_model_weights(
    checkpoint: str | Path, model_state: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """Load only the "model" part of a checkpoint (an imported one, or any training checkpoint)
    in place into `model_state` (the same `model.state_dict()` the trainer saves); optimizer and
    RNG state are not touched. Returns the checkpoint's trainer state. Names that differ between
    the checkpoint and the model are a ValueError listing them."""
    path = manager.resolve(checkpoint, check_hashes=False)
    manager.verify(path)
    problem = _key_mismatch(
        model_state, stored_model_tensors(path), "missing in the checkpoint", "not in the model"
    )
    if problem:
        raise ValueError(
            f"checkpoint {path} does not fit this model (is the config the one it was saved "
            f"with?): {problem}"
        )
    return manager.load(path, {"model": dict(model_state)}, check_hashes=False)


# ---- export ------------------------------------------------------------------------------------
def export_checkpoint(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    max_shard_bytes: float = 5e9,
    *,
    dtype: str | None = None,
    tokenizer: str | None = None,
    format: str | None = None,
) -> Path:
    """Write a Hugging Face directory for a moetrain checkpoint (a step-N/ directory, a run
    directory or a checkpoints root) in `format` (olmoe, qwen3_moe, mixtral; None: the one that
    expresses the model, `hf.export_format`); returns `out_dir`. `dtype` casts the weights (None:
    the stored dtype, bit-exact). `tokenizer`: a tokenizer.json (or its directory) to ship
    instead of the checkpoint's."""
    path = manager.resolve(checkpoint_dir, check_hashes=False)
    carried = json.loads((path / manager.TRAINER_STATE).read_text()).get("tokenizer", {})
    # the tokenizer shipped: --tokenizer's, else the run's (a tokenizer.json needs `tokenizers`)
    hf_tokenizer = tokenizer != "byte" if tokenizer is not None else carried.get("type") == "hf"
    require("moetrain export", ["safetensors", *(["tokenizers"] * hf_tokenizer)], "hf")
    save_file = _safetensors().save_file
    out = _fresh_output_dir(out_dir)
    manager.verify(path)
    config = RunConfig.load_yaml(path / "config.yaml")
    fmt = export_format(config, format)
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype ({dtype!r}) must be one of {', '.join(_DTYPES)} or None")
    tokenizer_files, eos_token_id = _export_tokenizer(path, tokenizer, config)

    model_sd = _read_model_state(path, config)
    hf_sd = to_hf_state_dict(model_sd, config, format=fmt.name)
    cast = _DTYPES[dtype] if dtype is not None else None
    stored_dtype = model_sd["embed.weight"].dtype

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    _write_safetensors(hf_sd, tmp, max_shard_bytes, cast, save_file)
    dtype_name = str(cast or stored_dtype).removeprefix("torch.")
    hf_config = hf_config_dict(config, format=fmt.name, dtype=dtype_name, eos_token_id=eos_token_id)
    _write_json(tmp / "config.json", hf_config)
    eos = hf_config["eos_token_id"]
    generation = {"eos_token_id": eos} if eos is not None else {}
    _write_json(tmp / "generation_config.json", generation)
    for name, data in tokenizer_files.items():
        (tmp / name).write_bytes(data)
    _readable_by_all(tmp)
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(tmp, out)
    return out


def _read_model_state(path: Path, config: RunConfig) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like a world-size-1 model (built on meta: no init cost) in the
    checkpoint's stored dtypes, filled by DCP from whatever layout the checkpoint was saved in."""
    with torch.device("meta"):
        expected = Transformer(config).state_dict()
    stored = stored_model_tensors(path)
    problem = _key_mismatch(expected, stored, "missing", "unexpected")
    if problem:
        raise ValueError(f"checkpoint {path} does not match its config.yaml: {problem}")
    model_sd = {}
    for name, meta in expected.items():
        shape, stored_dtype = stored[name]
        if shape != tuple(meta.shape):
            raise ValueError(
                f"checkpoint {path}: {name} has shape {shape}, its config.yaml implies "
                f"{tuple(meta.shape)}"
            )
        model_sd[name] = torch.empty(shape, dtype=stored_dtype)
    manager.load(path, {"model": model_sd}, check_hashes=False)  # verified by the caller
    return model_sd


def _write_safetensors(
    hf_sd: Mapping[str, torch.Tensor],
    out: Path,
    max_shard_bytes: float,
    cast: torch.dtype | None,
    save_file: Any,
) -> None:
    """Greedy shards in name order (layer by layer); a tensor larger than the limit gets its own
    shard. Tensors are made contiguous one shard at a time, so peak memory is one shard over the
    model."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes ({max_shard_bytes}) must be > 0")
    shards: list[list[str]] = [[]]
    shard_bytes = [0]
    for name, t in hf_sd.items():
        nbytes = t.numel() * (cast or t.dtype).itemsize
        if shards[-1] and shard_bytes[-1] + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes.append(0)
        shards[-1].append(name)
        shard_bytes[-1] += nbytes

    def materialize(names: list[str]) -> dict[str, torch.Tensor]:
        return {n: hf_sd[n].to(dtype=cast or hf_sd[n].dtype).contiguous() for n in names}

    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(materialize(shards[0]), str(out / SINGLE_FILE), metadata=metadata)
        return
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(materialize(names), str(out / file), metadata=metadata)
        weight_map.update(dict.fromkeys(names, file))
    _write_json(
        out / INDEX_FILE, {"metadata": {"total_size": sum(shard_bytes)}, "weight_map": weight_map}
    )


def _export_tokenizer(
    checkpoint: Path, override: str | None, config: RunConfig
) -> tuple[dict[str, bytes], int]:
    """The tokenizer files to ship and the EOS id: those the checkpoint carries, or `override`
    (a tokenizer.json or its directory) when it fits the model (`check_tokenizer_fits`), so the
    export encodes exactly as the run did."""
    from moetrain.checkpoint.trained_model import checkpoint_tokenizer

    try:
        run_tokenizer = checkpoint_tokenizer(checkpoint, config)
    except ValueError as exc:
        if override is None:
            raise ValueError(
                f"cannot export the run's tokenizer ({exc}); pass the tokenizer.json to use "
                "(--tokenizer PATH)"
            ) from None
        run_tokenizer = None  # an older checkpoint whose data is gone: judged by size alone
    tok = load_tokenizer(override) if override else run_tokenizer
    if override is None and tok.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"tokenizer {tok.name} has {tok.vocab_size} ids, more than model.vocab_size "
            f"({config.model.vocab_size})"
        )
    if override is not None:
        check_tokenizer_fits(tok, run_tokenizer, config.model.vocab_size)
    return tokenizer_files(tok, config.train.seq_len), tok.eos_id


def check_tokenizer_fits(
    tokenizer: ByteTokenizer | HFTokenizer,
    run_tokenizer: ByteTokenizer | HFTokenizer | None,
    vocab_size: int,
) -> None:
    """A ValueError unless `tokenizer` fits a model of `vocab_size` ids: the vocabulary it
    gives a run (`padded_vocab_size`, as model.vocab_size left unset resolves) is exactly
    `vocab_size`, or it is the run's own tokenizer (a tokenizer.json of the same content) within
    them."""
    size = tokenizer.vocab_size
    if padded_vocab_size(size) == vocab_size:
        return
    if run_tokenizer is None:
        run = "which the checkpoint does not record"
    elif _tokenizer_json(tokenizer) == _tokenizer_json(run_tokenizer) and size <= vocab_size:
        return
    else:
        run = f"{run_tokenizer.name}, {run_tokenizer.vocab_size} ids"
    raise ValueError(
        f"--tokenizer {tokenizer.name} has {size} ids, a model.vocab_size of "
        f"{padded_vocab_size(size)} (its size rounded up to a multiple of 64), but the model has "
        f"{vocab_size}: a tokenizer fits when the model's vocab_size is its size so rounded, or "
        f"when it is the tokenizer the run trained with ({run}) and has at most {vocab_size} "
        "ids; leave --tokenizer out to ship the run's own"
    )


def _tokenizer_json(tokenizer: ByteTokenizer | HFTokenizer) -> Any:
    """What a tokenizer's tokenizer.json says, however the file is formatted."""
    return json.loads(tokenizer_files(tokenizer)["tokenizer.json"])


# ---- import ------------------------------------------------------------------------------------
def import_hf(hf_dir: str | Path, out_dir: str | Path, *, name: str | None = None) -> Path:
    """Write a step-0 moetrain checkpoint (weights only) of an OlmoeForCausalLM,
    Qwen3MoeForCausalLM or MixtralForCausalLM directory (by config.json's model_type) under
    `out_dir/checkpoints/`, and its config as `out_dir/config.yaml`; returns the checkpoint path.
    Tokenizer files, if any, are copied to `out_dir/tokenizer/` and the config points
    `data.tokenizer` at them."""
    load_file = _safetensors().load_file
    hf_dir, out = Path(hf_dir), Path(out_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    root = out / "checkpoints"
    if manager.list_complete(root):
        raise ValueError(f"{root} already holds checkpoints; import into a new directory")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
    config = run_config_from_hf(hf_config, name=name or hf_dir.resolve().name)

    hf_sd: dict[str, torch.Tensor] = {}
    for file in _weight_files(hf_dir):
        hf_sd.update(load_file(str(file)))
    model_sd = from_hf_state_dict(hf_sd, config)
    del hf_sd

    trainer_state: dict[str, Any] = {"step": 0, "imported_from": str(hf_dir.resolve())}
    carried = None
    if (hf_dir / "tokenizer.json").is_file():
        tokenizer_dir = out / "tokenizer"
        tokenizer_dir.mkdir(parents=True, exist_ok=True)
        for file_name in TOKENIZER_FILES:
            if (hf_dir / file_name).is_file():
                shutil.copyfile(hf_dir / file_name, tokenizer_dir / file_name)
        tokenizer_path = str((tokenizer_dir / "tokenizer.json").resolve())
        config = replace(config, data=replace(config.data, tokenizer=tokenizer_path))
        try:  # the checkpoint carries it too, as training checkpoints do
            tok = HFTokenizer(tokenizer_path, name=tokenizer_path)
            carried = tokenizer_files(tok, config.train.seq_len)
            trainer_state["tokenizer"] = describe(tok)
        except ValueError:  # no `tokenizers` package, or no EOS token: the copy above remains
            pass

    config_yaml = yaml.safe_dump(config.to_dict(), sort_keys=False)
    checkpoint = manager.save(
        root,
        step=0,
        tensor_state={"model": model_sd},
        trainer_state=trainer_state,
        config_yaml=config_yaml,
        extra_files=carried,
    )
    (out / "config.yaml").write_text(config_yaml)  # to train from: moetrain train OUT/config.yaml
    return checkpoint


def _weight_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a safetensors index: {exc}") from None
        files = [hf_dir / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names files that are missing: {', '.join(absent)}")
        return files
    if (hf_dir / SINGLE_FILE).is_file():
        return [hf_dir / SINGLE_FILE]
    raise ValueError(
        f"{hf_dir} has no {SINGLE_FILE} or {INDEX_FILE}; only safetensors weights are read "
        "(pickled pytorch_model.bin files are not: save the model with safe_serialization)"
    )


# ---- helpers -----------------------------------------------------------------------------------
def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError(
            "Hugging Face export/import needs the optional `safetensors` package: "
            "pip install 'moetrain[hf]' (or pip install safetensors)"
        ) from None
    return safetensors.torch


def _fresh_output_dir(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output directory {out} exists and is not empty; choose a new one")
    return out


def _readable_by_all(directory: Path) -> None:
    """safetensors writes its files with mode 0600; an export is meant to be shared, so its
    files get the mode a new file gets under the umask (0644 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _key_mismatch(expected, stored, missing_label: str, unexpected_label: str) -> str:
    """'' when the two key sets agree, else the keys each side lacks, labelled."""
    missing, unexpected = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    return name_mismatch(missing, unexpected, (f"{missing_label}:", f"{unexpected_label}:"))
