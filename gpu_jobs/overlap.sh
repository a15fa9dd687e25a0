#!/usr/bin/env bash
# Issue #40 (moe.overlap=two_chunk) on one GPU. Expected wall time: about 5 minutes, at most
# 6.8 (each piece has its own timeout). Run from the worktree root with $OUT set.
#   1. tests/parallel/test_overlap.py -m gpu: overlapped == plain with 4 ranks sharing the GPU
#      over gloo (fp32 eager, bf16 compiled); the loopback transport under
#      TORCH_CUDA_SANITIZER=1 (no race; a race reported when the wait is left out); the
#      overlapped step with the loopback captured as a CUDA graph equals the eager step
#   2. benchmarks/overlap.py, eager: sigma/eta of every stand-in and pairing, and whole blocks
#      with overlap none/two_chunk -> $OUT/overlap.json (the lead commits it as
#      benchmarks/overlap.json)
#   3. the same blocks compiled (as training runs them) -> $OUT/overlap_compiled.json
set -u
OUT=${OUT:-/tmp/overlap_out}
mkdir -p "$OUT"
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
timeout 190 python3 -m pytest -q -m gpu tests/parallel/test_overlap.py -p no:cacheprovider \
    > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests exit $?" >> "$OUT/gpu_tests.txt"
timeout 90 python3 benchmarks/overlap.py --out "$OUT/overlap.json" --budget-s 70 \
    > "$OUT/overlap_bench.txt" 2>&1
echo "benchmark exit $?" >> "$OUT/overlap_bench.txt"
timeout 130 python3 benchmarks/overlap.py --out "$OUT/overlap_compiled.json" --parts layers \
    --compile --budget-s 100 > "$OUT/overlap_compiled.txt" 2>&1
echo "compiled benchmark exit $?" >> "$OUT/overlap_compiled.txt"
echo "== gpu tests"; tail -4 "$OUT/gpu_tests.txt"
echo "== benchmark (eager)"; tail -20 "$OUT/overlap_bench.txt"
echo "== blocks compiled"; tail -15 "$OUT/overlap_compiled.txt"
