"""benchmarks/faultlab, the fault scenarios of benchmarks/reliability.py, for these tests: they
run the same scenarios (with small counts), so the table in docs/reliability.md and the tests
check the same code. benchmarks/ is not a package, so its directory goes on sys.path here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from faultlab import (  # noqa: E402
    harness,
    inputs,
    numerical,
    processes,
    run_dirs,
    storage,
    untrusted,
)

__all__ = ["harness", "inputs", "numerical", "processes", "run_dirs", "storage", "untrusted"]
