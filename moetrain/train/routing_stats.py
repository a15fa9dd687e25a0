"""Routing statistics, a producer of the train record's "moe" entries: the measured expert load
of each MoE layer over a log interval (`routing_summary`, `summarize_moe_stats`), the worst
step's load within it (`StepLoadPeak`: the interval's summed load averages early peaks away),
and a warning
when the balance loss improves while that load gets worse (`TokenGamingDetector`: the balance
loss can be gamed, the measured load cannot).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

Number = float | int | torch.Tensor


def routing_summary(
    tokens_per_expert: torch.Tensor | np.ndarray | Sequence[int],
    *,
    lb_loss: Number,
    z_loss: Number,
    lb_weight: float,
    z_weight: float,
    entropy: Number | None = None,
    dropped: Number | None = None,
    routed: Number | None = None,
    max_mean_peak: Number | None = None,
) -> dict[str, Any]:
    """Load statistics of one MoE layer over a log interval, as plain Python numbers, from
    `tokens_per_expert` (routes per expert). Keys:
    - max_mean: max / mean load (1.0 is perfect balance; top-k routing's ceiling is E/K, where
      K experts take every route: docs/metrics.md);
    - max_mean_peak: the largest max / mean load of one step on one rank in the interval
      (`StepLoadPeak`; None when not measured);
    - cv: population standard deviation / mean of the load (0.0 is perfect balance);
    - zero_frac: fraction of experts that received no route;
    - entropy: mean per-token router entropy in nats (None when not measured);
    - drop_frac: dropped / routed (None when `dropped` is not given; `routed` defaults to the
      total of `tokens_per_expert`);
    - lb_loss, z_loss (unweighted), lb_loss_weighted, z_loss_weighted;
    - tokens_per_expert: the counts as a list of ints.
    With no routes at all, max_mean and cv are NaN: balance is undefined, not perfect.
    """
    load_E = _to_numpy(tokens_per_expert).astype(np.float64)
    if load_E.ndim != 1 or load_E.size == 0:
        raise ValueError(
            f"tokens_per_expert must be a non-empty 1-D vector, got shape {tuple(load_E.shape)}"
        )
    total = float(load_E.sum())
    mean = total / load_E.size
    if mean > 0:
        max_mean = float(load_E.max()) / mean
        cv = float(load_E.std()) / mean  # numpy's default std is the population std (ddof=0)
    else:
        max_mean = cv = math.nan

    drop_frac = None
    if dropped is not None:
        num_routed = float(routed) if routed is not None else total
        drop_frac = float(dropped) / num_routed if num_routed > 0 else 0.0

    lb, z = float(lb_loss), float(z_loss)
    return {
        "max_mean": max_mean,
        "max_mean_peak": None if max_mean_peak is None else float(max_mean_peak),
        "cv": cv,
        "zero_frac": float((load_E == 0).sum()) / load_E.size,
        "entropy": None if entropy is None else float(entropy),
        "drop_frac": drop_frac,
        "lb_loss": lb,
        "z_loss": z,
        "lb_loss_weighted": lb_weight * lb,
        "z_loss_weighted": z_weight * z,
        "tokens_per_expert": [int(v) for v in np.rint(load_E)],
    }


def summarize_moe_stats(
    stats_by_layer: Mapping[int, Mapping[str, torch.Tensor]],
    *,
    lb_weight: float,
    z_weight: float,
) -> list[dict[str, Any]]:
    """`{layer: MoELayer.read_stats()}` -> the "moe" list of a train record, one dict per layer,
    from one device-to-host copy. Optional stats keys: "entropy", "dropped", "routed",
    "max_mean_peak" (scalars)."""
    optional = ("entropy", "dropped", "routed", "max_mean_peak")
    flat: list[torch.Tensor] = []
    for stats in stats_by_layer.values():
        flat.append(stats["tokens_per_expert"].reshape(-1).double())
        for key in ("lb_loss", "z_loss", *optional):
            if key in stats:
                flat.append(torch.as_tensor(stats[key]).reshape(1).double())
    if not flat:
        return []
    device = flat[0].device
    host = torch.cat([t.to(device) for t in flat]).cpu().numpy()

    summaries, pos = [], 0
    for layer, stats in stats_by_layer.items():
        num_experts = stats["tokens_per_expert"].numel()
        values: dict[str, Any] = {"tokens_per_expert": host[pos : pos + num_experts]}
        pos += num_experts
        for key in ("lb_loss", "z_loss", *optional):
            if key in stats:
                values[key] = float(host[pos])
                pos += 1
        summary = routing_summary(
            values.pop("tokens_per_expert"), lb_weight=lb_weight, z_weight=z_weight, **values
        )
        summaries.append({"layer": int(layer), **summary})
    return summaries


class StepLoadPeak:
    """The largest max / mean expert load of one optimizer step since the last `read`, per MoE
    layer, from the routes this rank's micro-batches sent in the step (`update`, before any
    reduction over the ranks). Kept on the device (no host sync; a step graph updates it in
    place); the train record reduces it over the ranks with a max."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.peak_L = torch.zeros(num_layers, device=device)

    def update(self, step_tokens_per_expert: Sequence[torch.Tensor]) -> None:
        """One step's routes per expert, one tensor per MoE layer."""
        if not step_tokens_per_expert:
            return
        load_LE = torch.stack(list(step_tokens_per_expert)).float()
        ratio_L = load_LE.amax(dim=1) / load_LE.mean(dim=1).clamp_min(1e-9)
        self.peak_L.copy_(torch.maximum(self.peak_L, ratio_L))

    def read(self) -> torch.Tensor:
        """The peaks since the last read (a copy); zeroed in place for the next interval."""
        peak_L = self.peak_L.clone()
        self.peak_L.zero_()
        return peak_L


class TokenGamingDetector:
    """Warns when a layer's load-balancing loss improves while its measured load gets worse.

    Over each layer's last `window` log points it fits least-squares lines to the lb loss and to
    max/mean load against the step, and fires when along them the lb loss fell by more than
    `lb_improve` while max/mean rose by more than `imbalance_worsen` (both relative), each change
    beyond `significance` standard errors (without that test, noise fired at most log steps).
    After a warning the layer's window starts afresh: once per `window` log steps at most.
    """

    def __init__(
        self,
        window: int = 5,
        lb_improve: float = 0.02,
        imbalance_worsen: float = 0.10,
        significance: float = 3.0,
    ) -> None:
        if window < 2:
            raise ValueError(f"window ({window}) must be >= 2 log steps")
        if lb_improve < 0 or imbalance_worsen < 0:
            raise ValueError(
                f"lb_improve ({lb_improve}) and imbalance_worsen ({imbalance_worsen}) must be >= 0"
            )
        self.window, self.lb_improve, self.imbalance_worsen = window, lb_improve, imbalance_worsen
        self.significance = significance
        self._history: dict[int, deque[tuple[int, float, float]]] = {}

    def update(self, step: int, layer: int, lb_loss: float, max_mean: float) -> str | None:
        """Record one log point; return a warning message, or None."""
        history = self._history.setdefault(layer, deque(maxlen=self.window))
        lb, imbalance = float(lb_loss), float(max_mean)
        if not (math.isfinite(lb) and math.isfinite(imbalance)):
            history.clear()  # a NaN step says nothing about trends; start over
            return None
        history.append((step, lb, imbalance))
        if len(history) < self.window:
            return None

        steps = [s for s, _, _ in history]
        lb_start, lb_end, lb_error = _fitted_trend(steps, [v for _, v, _ in history])
        mm_start, mm_end, mm_error = _fitted_trend(steps, [v for _, _, v in history])
        if lb_start <= 0 or mm_start <= 0:
            return None
        lb_drop = (lb_start - lb_end) / lb_start
        mm_rise = (mm_end - mm_start) / mm_start
        if lb_drop <= self.lb_improve or mm_rise <= self.imbalance_worsen:
            return None
        k = self.significance
        if lb_start - lb_end <= k * lb_error or mm_end - mm_start <= k * mm_error:
            return None  # within the scatter of the readings: no trend
        history.clear()
        return (
            f"layer {layer}: load-balancing loss improved {100 * lb_drop:.1f}% "
            f"({lb_start:.4f} -> {lb_end:.4f}) while max/mean expert load worsened "
            f"{100 * mm_rise:.1f}% ({mm_start:.2f} -> {mm_end:.2f}) over steps "
            f"{steps[0]}-{steps[-1]} (fitted trend): the balance loss is being gamed; "
            f"judge balance by the measured load"
        )


def _fitted_trend(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float]:
    """The least-squares line through (x, y) at the first and last x, and the standard error of
    their difference (from the residuals; 0 for two points, which leave none)."""
    x_arr, y_arr = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    dx = x_arr - x_arr.mean()
    denom = float((dx * dx).sum())
    slope = float((dx * (y_arr - y_arr.mean())).sum()) / denom if denom > 0 else 0.0
    mean = float(y_arr.mean())
    residuals = y_arr - mean - slope * dx
    dof = len(x_arr) - 2
    error = math.sqrt(float((residuals**2).sum()) / dof / denom) if dof > 0 and denom > 0 else 0.0
    span = float(dx[-1] - dx[0])
    return mean + slope * float(dx[0]), mean + slope * float(dx[-1]), error * span


def _to_numpy(values: torch.Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return np.asarray(values)
