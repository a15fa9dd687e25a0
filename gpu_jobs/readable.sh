#!/usr/bin/env bash
# GPU job of branch `readable` (issue #42). Run from the worktree root on one H200 (or H100):
#     OUT=/path/to/out bash gpu_jobs/readable.sh
# Expected wall: about 4 minutes. (1) the GPU tests of what this branch changed: the FP8 experts
# (moe/fp8_gemm.py split, FP8ExpertsInputs), the grouped GEMM backends, the Triton quantizers
# (MXFP8 kernel removed), the gather kernels (weighted combine removed), ShardedAdamW's fused
# update (bucket protocol), timeout 120 s;
# (2) benchmarks/kernel_gains.py over small, olmoe8, scale-E8 and scale-E128, timeout 130 s,
# its rows appended to $OUT/kernel_gains.jsonl as they come (a timed-out run keeps them; the
# table is printed from that file either way). Every output file lands directly in $OUT.
set -u
OUT=${OUT:?set OUT to the output folder}
mkdir -p "$OUT"
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1

timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/moe/test_fp8_experts.py tests/moe/test_grouped_gemm.py tests/kernels/test_quant.py \
    tests/kernels/test_gather_kernels.py tests/optim/test_sharded.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest.txt"

rm -f "$OUT/kernel_gains.jsonl"
timeout 130 python3 benchmarks/kernel_gains.py --json "$OUT/kernel_gains.jsonl" \
    > "$OUT/kernel_gains.txt" 2>&1
echo "kernel_gains rc=$?" >> "$OUT/kernel_gains.txt"

cat "$OUT/gpu.txt"
tail -n 3 "$OUT/pytest.txt"
tail -n 1 "$OUT/kernel_gains.txt"
[ -s "$OUT/kernel_gains.jsonl" ] && python3 benchmarks/kernel_gains.py --table "$OUT/kernel_gains.jsonl"
