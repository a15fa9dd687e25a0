"""Routing statistics: load statistics on hand-computed routings, the gaming detector on
synthetic series."""

import json
import math

import numpy as np
import pytest
import torch

from moetrain.train.routing_stats import (
    StepLoadPeak,
    TokenGamingDetector,
    routing_summary,
    summarize_moe_stats,
)


def _summary(tokens, **kwargs):
    args = {"lb_loss": 1.0, "z_loss": 0.0, "lb_weight": 0.01, "z_weight": 0.001, **kwargs}
    return routing_summary(tokens, **args)


def test_perfectly_balanced_routing():
    s = _summary(torch.tensor([4, 4, 4, 4]))
    assert s["max_mean"] == 1.0
    assert s["cv"] == 0.0
    assert s["zero_frac"] == 0.0
    assert s["tokens_per_expert"] == [4, 4, 4, 4]


def test_skewed_routing_by_hand():
    # loads 8, 4, 4, 0: mean 4, max/mean 2, population variance (16+0+0+16)/4 = 8
    s = _summary(np.array([8, 4, 4, 0]), lb_loss=1.25, z_loss=3.0, entropy=0.5)
    assert s["max_mean"] == pytest.approx(2.0)
    assert s["cv"] == pytest.approx(math.sqrt(8) / 4)
    assert s["zero_frac"] == 0.25
    assert s["entropy"] == 0.5
    assert s["lb_loss"] == 1.25 and s["z_loss"] == 3.0
    assert s["lb_loss_weighted"] == pytest.approx(0.0125)
    assert s["z_loss_weighted"] == pytest.approx(0.003)
    assert s["tokens_per_expert"] == [8, 4, 4, 0]
    assert all(type(v) is int for v in s["tokens_per_expert"])
    json.dumps(s)  # plain Python values only


def test_all_routes_to_one_expert():
    s = _summary([0, 0, 12, 0])
    assert s["max_mean"] == pytest.approx(4.0)  # = E, the worst possible
    # population std of (0, 0, 12, 0) around mean 3 is sqrt((3 * 9 + 81) / 4) = sqrt(27)
    assert s["cv"] == pytest.approx(math.sqrt(27) / 3)
    assert s["zero_frac"] == 0.75


def test_drop_fraction():
    s = _summary([6, 2, 2, 2], dropped=3)
    assert s["drop_frac"] == pytest.approx(3 / 12)  # routed defaults to the total of the counts
    s = _summary([6, 2, 2, 2], dropped=torch.tensor(3), routed=torch.tensor(24))
    assert s["drop_frac"] == pytest.approx(3 / 24)
    assert _summary([6, 2, 2, 2])["drop_frac"] is None
    assert _summary([6, 2, 2, 2])["entropy"] is None


def test_no_routes_is_undefined_not_balanced():
    s = _summary([0, 0, 0])
    assert math.isnan(s["max_mean"]) and math.isnan(s["cv"])
    assert s["zero_frac"] == 1.0


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="1-D"):
        _summary(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="non-empty"):
        _summary([])


def test_step_load_peak_is_the_worst_steps_max_over_mean():
    """Fresh random loads of 3 layers over 5 steps: each layer's peak is the largest max/mean
    of one step (numpy), not that of the summed load; a read starts the next interval at 0."""
    gen = torch.Generator().manual_seed(0)
    peak = StepLoadPeak(3, torch.device("cpu"))
    steps = [torch.randint(0, 50, (3, 8), generator=gen) for _ in range(5)]
    for load_LE in steps:
        peak.update(list(load_LE))
    loads = np.stack([s.numpy() for s in steps]).astype(np.float64)  # (step, layer, expert)
    expected = (loads.max(axis=2) / loads.mean(axis=2)).max(axis=0)
    assert peak.read().tolist() == pytest.approx(expected.tolist(), rel=1e-6)
    summed = loads.sum(axis=0)
    assert (summed.max(axis=1) / summed.mean(axis=1) < expected).all()  # averaged away
    assert peak.read().tolist() == [0.0, 0.0, 0.0]
    peak.update([])  # a model without MoE layers
    assert _summary([4, 4], max_mean_peak=2.5)["max_mean_peak"] == 2.5


def test_summarize_moe_stats_matches_per_layer_summaries():
    stats = {
        0: {
            "tokens_per_expert": torch.tensor([8, 4, 4, 0]),
            "lb_loss": torch.tensor(1.25),
            "z_loss": torch.tensor(3.0),
        },
        2: {
            "tokens_per_expert": torch.tensor([3, 5, 4, 4]),
            "lb_loss": torch.tensor(1.0),
            "z_loss": torch.tensor(0.5),
            "entropy": torch.tensor(1.2),
            "dropped": torch.tensor(2),
        },
    }
    out = summarize_moe_stats(stats, lb_weight=0.01, z_weight=0.001)
    assert [o["layer"] for o in out] == [0, 2]
    for o, (layer, st) in zip(out, stats.items(), strict=True):
        extra = {k: st[k] for k in ("entropy", "dropped") if k in st}
        expected = routing_summary(
            st["tokens_per_expert"],
            lb_loss=st["lb_loss"],
            z_loss=st["z_loss"],
            lb_weight=0.01,
            z_weight=0.001,
            **extra,
        )
        assert o["tokens_per_expert"] == expected.pop("tokens_per_expert")
        scalars = {k: v for k, v in o.items() if k != "tokens_per_expert"}
        assert scalars == pytest.approx({"layer": layer, **expected}, nan_ok=True)
    assert out[0]["entropy"] is None and out[1]["entropy"] == pytest.approx(1.2)
    assert out[1]["drop_frac"] == pytest.approx(2 / 16)
    assert summarize_moe_stats({}, lb_weight=0.01, z_weight=0.0) == []


# --- gaming detector --------------------------------------------------------------------------


def _feed(detector, layer, lb_series, mm_series, every=10):
    return [
        msg
        for i, (lb, mm) in enumerate(zip(lb_series, mm_series, strict=True))
        if (msg := detector.update(i * every, layer, lb, mm)) is not None
    ]


def test_detector_fires_on_gaming():
    # lb loss slides from 1.10 to 1.00 while max/mean load climbs from 1.5 to 3.0
    lb = np.linspace(1.10, 1.00, 10)
    mm = np.linspace(1.5, 3.0, 10)
    messages = _feed(TokenGamingDetector(window=5), 3, lb, mm)
    assert messages
    assert "layer 3" in messages[0]
    assert "steps 0-40" in messages[0]
    assert "1.1000" in messages[0] and "1.50" in messages[0]  # the numbers, not just a verdict
    # once per window of evidence, not on every log line
    assert len(messages) == 2


def test_detector_silent_when_healthy():
    # both improving: the loss and the measured load agree
    lb = np.linspace(1.30, 1.02, 30)
    mm = np.linspace(3.0, 1.3, 30)
    assert _feed(TokenGamingDetector(), 0, lb, mm) == []


def test_detector_silent_when_loss_honestly_reports_imbalance():
    # imbalance worsens and the lb loss says so (it rises): a problem, but not gaming
    lb = np.linspace(1.0, 1.2, 30)
    mm = np.linspace(1.5, 3.0, 30)
    assert _feed(TokenGamingDetector(), 0, lb, mm) == []


def test_detector_silent_on_noise():
    rng = np.random.default_rng(0)
    n = 500
    lb = 1.05 * (1 + 0.01 * rng.standard_normal(n))
    mm = 1.6 * (1 + 0.03 * rng.standard_normal(n))
    assert _feed(TokenGamingDetector(), 0, lb, mm) == []


def test_detector_silent_on_the_scatter_of_short_log_intervals():
    # stationary readings that scatter as a short run's do (few tokens per log interval): the
    # thresholds alone (2% and 10%) fired at ~40% of the log steps of 8 layers
    rng = np.random.default_rng(0)
    detector, steps, fired = TokenGamingDetector(), 300, set()
    for step in range(steps):
        for layer in range(8):
            lb = 1.03 + 0.02 * rng.standard_normal()
            mm = 1.5 * (1 + 0.15 * rng.standard_normal())
            if detector.update(step, layer, lb, mm) is not None:
                fired.add(step)
    assert len(fired) <= 0.02 * steps
    # a real trend under a little scatter is still reported
    lb = np.linspace(1.10, 1.00, 10) + 0.005 * rng.standard_normal(10)
    mm = np.linspace(1.5, 3.0, 10) * (1 + 0.03 * rng.standard_normal(10))
    assert _feed(TokenGamingDetector(), 0, lb, mm)


def test_detector_tracks_layers_separately():
    detector = TokenGamingDetector(window=4)
    healthy_lb, healthy_mm = np.linspace(1.2, 1.0, 8), np.linspace(2.0, 1.2, 8)
    gaming_lb, gaming_mm = np.linspace(1.1, 1.0, 8), np.linspace(1.5, 3.0, 8)
    messages = []
    for i in range(8):  # interleaved, as the trainer logs every layer at each log step
        for layer, lb, mm in ((0, healthy_lb, healthy_mm), (1, gaming_lb, gaming_mm)):
            if (msg := detector.update(i, layer, lb[i], mm[i])) is not None:
                messages.append(msg)
    assert messages and all(m.startswith("layer 1:") for m in messages)


def test_detector_skips_nan_and_validates():
    detector = TokenGamingDetector(window=3)
    assert detector.update(0, 0, float("nan"), 2.0) is None
    assert _feed(detector, 0, [1.1, float("nan"), 1.0, 0.9], [1.5, 2.0, 2.5, 3.0]) == []
    with pytest.raises(ValueError, match="window"):
        TokenGamingDetector(window=1)
