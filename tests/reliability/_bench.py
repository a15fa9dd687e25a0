"""benchmarks/reliability.py, imported as a module: its fault scenarios are what these tests run
(with small counts), so the table in docs/reliability.md and the tests check the same code."""

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "reliability.py"
_spec = importlib.util.spec_from_file_location("moetrain_reliability_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up there
_spec.loader.exec_module(bench)
