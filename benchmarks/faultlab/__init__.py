"""The fault scenarios that benchmarks/reliability.py runs and tests/reliability/ asserts on.

Each scenario function plants one fault in a CPU run of the `tiny` preset, compares the outcome
with a fault-free run and returns `harness.Outcome` rows (one row of the table in
docs/reliability.md each). harness.py runs and compares; the other modules hold one kind of fault
each: processes.py, storage.py, untrusted.py, numerical.py, inputs.py, run_dirs.py.
tests/reliability/ runs the same scenarios with small counts and asserts that nothing is lost.
The faults are planted through moetrain/faults.py (environment variables) or by patching a
function for the duration of one call; nothing here changes how moetrain runs otherwise.
"""
