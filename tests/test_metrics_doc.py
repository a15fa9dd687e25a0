"""docs/metrics.md against the code it documents: every key of a layer's routing statistics in
its table and no key the code does not write, the ceilings it states, the token-gaming
detector's thresholds and warning as train/routing_stats.py has them, and a README link."""

import inspect
import math
import re
from pathlib import Path

import pytest

from moetrain.train.routing_stats import TokenGamingDetector, routing_summary

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "metrics.md").read_text()


def test_the_table_names_exactly_the_keys_the_code_writes():
    written = set(
        routing_summary([3, 1, 0, 4], lb_loss=1.1, z_loss=2.0, lb_weight=0.01, z_weight=0.001)
    )
    written |= {"buffer_utilization"}  # added by the train record for the no_sync dispatcher
    table = set(re.findall(r"^\| `(\w+)` \|", DOC, re.M))
    weighted = {"lb_loss_weighted", "z_loss_weighted"}  # named in the lb_loss and z_loss rows
    assert table | weighted == written
    assert all(f"`{key}`" in DOC for key in weighted)


@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 2), (64, 8)])
def test_the_stated_ceilings_are_the_codes(num_experts, top_k):
    """K experts take every route: max_mean E/K, cv sqrt(E/K - 1), zero_frac 1 - K/E."""
    assert "| E/K (K experts take everything) |" in DOC and "| sqrt(E/K - 1) |" in DOC
    assert "| 1 - K/E |" in DOC
    tokens = 1000
    load = [tokens] * top_k + [0] * (num_experts - top_k)
    s = routing_summary(load, lb_loss=0.0, z_loss=0.0, lb_weight=0.0, z_weight=0.0)
    assert s["max_mean"] == pytest.approx(num_experts / top_k)
    assert s["cv"] == pytest.approx(math.sqrt(num_experts / top_k - 1))
    assert s["zero_frac"] == pytest.approx(1 - top_k / num_experts)


def test_the_detector_is_described_as_it_runs():
    defaults = {k: p.default for k, p in inspect.signature(TokenGamingDetector).parameters.items()}
    assert f"the last {defaults['window']} log points" in DOC
    assert f"fell by more than {100 * defaults['lb_improve']:g}%" in DOC
    assert f"rose by more than {100 * defaults['imbalance_worsen']:g}%" in DOC
    assert f"{defaults['significance']:g} standard errors" in DOC
    detector, warning = TokenGamingDetector(), None
    for i in range(defaults["window"]):  # steady trends, as the example says
        f = i / (defaults["window"] - 1)
        warning = detector.update(100 * (i + 1), 3, 1.0312 - 0.0423 * f, 1.52 + 0.35 * f)
    assert warning is not None and f"warning: {warning}\n" in DOC


def test_the_readme_links_the_metrics_doc():
    assert "docs/metrics.md" in (ROOT / "README.md").read_text()
