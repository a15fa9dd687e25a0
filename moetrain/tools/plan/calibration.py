"""A calibration file: rates measured on one GPU by `moetrain bench --calibrate` that replace
the planner's datasheet-derived efficiencies in `moetrain plan` (docs/plan.md, "Calibration from
measured kernels"). Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from moetrain.tools.plan.layout import GPUS, Cluster


@dataclass(frozen=True)
class ShapeRates:
    """TFLOP/s at one config's shapes (short timings, full clock): dense products, the experts'
    grouped GEMMs (uniform groups), causal attention; and the activation factor."""

    dense_tflops: float
    grouped_tflops: float
    attention_tflops: float  # model FLOPs: 6 D S per token and layer
    activation_factor: float = 1.0  # compiled block's saved bytes / plan.memory's


@dataclass(frozen=True)
class Calibration:
    gpu: str  # a key of plan.layout.GPUS
    device_name: str
    date: str
    matmul_tflops: float  # 8192^3 BF16, short
    sustained_tflops: float | None  # the same for >= 2 s, at the power limit
    hbm_tbps: float  # device-to-device copy: bytes read + written per second
    shapes: dict[str, ShapeRates] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise ValueError(f"calibration gpu ({self.gpu!r}) must be one of {', '.join(GPUS)}")

    @property
    def power_factor(self) -> float:
        """Sustained over short matmul rate (at most 1): how much the power limit slows products."""
        if not self.sustained_tflops:
            return 1.0
        return min(1.0, self.sustained_tflops / self.matmul_tflops)

    def rates(self, config_name: str) -> ShapeRates | None:
        """The config's entry, else the median of the entries, else None."""
        if config_name in self.shapes:
            return self.shapes[config_name]
        if not self.shapes:
            return None
        return ShapeRates(
            *(
                statistics.median(getattr(s, f.name) for s in self.shapes.values())
                for f in dataclasses.fields(ShapeRates)
            )
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


def default_path(gpu: str) -> Path:
    """$XDG_CACHE_HOME/moetrain/calibration-<gpu>.json (~/.cache when unset)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "moetrain" / f"calibration-{gpu}.json"


def load(path: str | Path) -> Calibration:
    try:
        data = json.loads(Path(path).read_text())
        data["shapes"] = {k: ShapeRates(**v) for k, v in data.get("shapes", {}).items()}
        return Calibration(**data)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"calibration file {path}: {exc}") from None


def save(calibration: Calibration, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(calibration.to_json() + "\n")
    return path


def calibrated_cluster(cluster: Cluster, calibration: Calibration, config_name: str) -> Cluster:
    """`cluster` with the measured rates of `config_name` (else the entries' median): products
    at the rate x sustained / short (steps run at the power limit, short timings do not),
    memory-bound work at the copy bandwidth, kept activations scaled by the measured factor."""
    if calibration.gpu != cluster.gpu.name:
        raise ValueError(
            f"the calibration was measured on {calibration.gpu}, the plan is for {cluster.gpu.name}"
        )
    peak = cluster.gpu.bf16_tflops
    changes: dict = {"hbm_tbps": calibration.hbm_tbps}
    rates = calibration.rates(config_name)
    power = calibration.power_factor
    if rates is None:
        changes["matmul_efficiency"] = calibration.matmul_tflops * power / peak
    else:
        changes |= {
            "matmul_efficiency": rates.dense_tflops * power / peak,
            "grouped_efficiency": rates.grouped_tflops * power / peak,
            "attention_efficiency": rates.attention_tflops * power / peak,
            "activation_factor": rates.activation_factor,
        }
    return dataclasses.replace(cluster, **changes)
