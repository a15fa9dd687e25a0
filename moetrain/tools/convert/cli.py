"""`moetrain export` and `moetrain import`: argument parsing for Hugging Face conversion.

`add_convert_parsers(subparsers)` adds both commands; each sets `func` (parsed arguments -> exit
code). User errors are `ValueError`s, left for the top-level CLI to print.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moetrain.config.fields import FORMATS

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def add_convert_parsers(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face OLMoE, Qwen3-MoE or Mixtral directory",
        description="Write config.json, safetensors weights and the tokenizer files of a moetrain "
        "checkpoint, loadable with transformers' from_pretrained (OlmoeForCausalLM, "
        "Qwen3MoeForCausalLM or MixtralForCausalLM: the family that expresses the model; a "
        "setting no family expresses is an error naming it).",
    )
    export.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a step-N/ checkpoint, or a run directory (its newest checkpoint)",
    )
    export.add_argument("--out", required=True, metavar="HF_DIR", help="new or empty directory")
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        type=parse_size,
        metavar="SIZE",
        help="split the weights into shards of at most SIZE (e.g. 5GB, 500MB; default 5GB)",
    )
    export.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="cast the weights (default: keep the checkpoint's dtype, bit-exact)",
    )
    export.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer.json to ship instead of the run's own; it must fit the model: the "
        "model's vocab_size is its size rounded up to a multiple of 64, or it is the run's "
        "tokenizer",
    )
    export.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="the Hugging Face family to write (default: the one that expresses the model; its "
        "q/k norm tells them apart: full olmoe, per_head qwen3_moe, none mixtral)",
    )
    export.set_defaults(func=run_export)

    imp = subparsers.add_parser(
        "import",
        help="turn a Hugging Face OLMoE, Qwen3-MoE or Mixtral directory into a moetrain checkpoint",
        description="Write a step-0, weights-only moetrain checkpoint of an OlmoeForCausalLM, "
        "Qwen3MoeForCausalLM or MixtralForCausalLM directory (config.json + safetensors) under "
        "OUT/checkpoints/, its config as OUT/config.yaml and its tokenizer under OUT/tokenizer/; "
        "train from it with moetrain train OUT/config.yaml --init-from OUT --run-dir NEW.",
    )
    imp.add_argument("hf_dir", metavar="HF_DIR", help="directory with config.json and safetensors")
    imp.add_argument("--out", required=True, metavar="DIR", help="output run directory")
    imp.add_argument("--name", default=None, help="run name in the config (default: HF_DIR's name)")
    imp.set_defaults(func=run_import)


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000; '512MiB' -> 536_870_912; a plain number is bytes."""
    stripped = text.strip().lower()
    number = stripped.rstrip("kmgib")
    unit = stripped[len(number) :]
    try:
        value = float(number) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"size {text!r} must be a number of bytes, optionally with a unit "
            f"({', '.join(u.upper() for u in _SIZE_UNITS if u)})"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be > 0")
    return int(value)


def run_export(args: argparse.Namespace) -> int:
    from moetrain.tools.convert.io import export_checkpoint

    out = export_checkpoint(
        args.checkpoint,
        args.out,
        args.max_shard_size,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        format=args.format,
    )
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"exported {args.checkpoint} to {out} (load with {architecture}.from_pretrained)")
    return 0


def run_import(args: argparse.Namespace) -> int:
    from moetrain.tools.convert.io import import_hf

    checkpoint = import_hf(args.hf_dir, args.out, name=args.name)
    print(
        f"imported {args.hf_dir} as {checkpoint}; train from it with: moetrain train "
        f"{Path(args.out) / 'config.yaml'} --init-from {args.out} --run-dir NEW_RUN"
    )
    return 0
