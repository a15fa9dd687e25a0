"""Communication beside compute: how much of a transfer a compute span hides, from pairs
measured on one GPU with stand-in communication kernels (`benchmarks/overlap.json`) or from a
stated assumption (`ASSUMED`). Pairs: `a2a` (moe.overlap two_chunk's exchanges under the other
chunk's compute), `fsdp_gather` and `fsdp_reduce_scatter` (FSDP2's prefetched gathers and
gradient reductions under the blocks' compute; GradientSync's and ShardedAdamW's reductions use
the latter). A pair measured with eta <= 0 (slower side by side than in turn) is projected
as run in turn. Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PAIRS = ("a2a", "fsdp_gather", "fsdp_reduce_scatter")
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "overlap.json"


@dataclass(frozen=True)
class Pair:
    sigma: float  # compute slowdown while the transfer runs: t_comp_with_comm / t_comp - 1
    eta: float  # share of the shorter of the two hidden: (t_comp + t_comm - t_pair) / shorter


@dataclass(frozen=True)
class Overlap:
    pairs: dict[str, Pair]
    source: str  # where the values come from, printed with the tables

    def describe(self) -> str:
        values = ", ".join(
            f"{k} sigma {p.sigma:.2f} eta {p.eta:.2f}" for k, p in self.pairs.items()
        )
        return f"overlap: {values} ({self.source})"


ASSUMED = Overlap(
    {"a2a": Pair(0.0, 0.0), "fsdp_gather": Pair(0.0, 1.0), "fsdp_reduce_scatter": Pair(0.0, 1.0)},
    "assumed, no overlap file: FSDP2's prefetches and gradient reductions hidden, "
    "all-to-alls exposed",
)


def load_overlap(path: str | Path) -> Overlap:
    """The measured pairs of an overlap file; a ValueError names the file and the bad field."""
    try:
        data = json.loads(Path(path).read_text())
        pairs = {name: data["pairs"][name] for name in PAIRS}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"overlap file {path}: {exc!r} (needs pairs {', '.join(PAIRS)})") from None
    out, serial = {}, []
    for name, values in pairs.items():
        sigma, eta = float(values["sigma"]), float(values["eta"])
        if sigma < 0 or eta > 1:
            raise ValueError(
                f"overlap file {path}: pairs.{name} (sigma {sigma}, eta {eta}) needs sigma >= 0 "
                "and eta <= 1"
            )
        if eta <= 0:  # the pair ran slower side by side than one after the other: not overlapped
            serial.append(f"{name} (measured eta {eta:.2f})")
            sigma, eta = 0.0, 0.0
        out[name] = Pair(sigma, eta)
    where = ", ".join(str(data.get(k, "?")) for k in ("gpu", "date", "torch"))
    note = f"; run one after the other: {', '.join(serial)}" if serial else ""
    return Overlap(out, f"measured: {path} ({where}){note}")


def overlap_from(path: str | Path | None) -> Overlap:
    """`path`'s pairs; None: the committed file when it exists, else the stated assumption."""
    if path is not None:
        return load_overlap(path)
    return load_overlap(DEFAULT_PATH) if DEFAULT_PATH.exists() else ASSUMED


def paired_s(compute: float, comm: float, pair: Pair) -> float:
    """Seconds of `compute` with a transfer of `comm` seconds beside it: a share phi =
    min(1, eta (1 + sigma)) of the transfer runs beside the compute, slowing it by sigma; the rest
    is exposed (this reproduces the pair when the transfer is the shorter)."""
    phi = min(1.0, pair.eta * (1 + pair.sigma))
    beside = phi * comm
    slow = 1 + pair.sigma
    together = beside if beside >= compute * slow else compute + beside * pair.sigma / slow
    return (1 - phi) * comm + together
