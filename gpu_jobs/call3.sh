#!/usr/bin/env bash
# Device call 3 (H100 or H200, ~9 min): the GPU tests call 1 left failing or unfinished, alone;
# the kernels' gains (#42); the planner's memory against measured peaks (#39); the projection
# with one rank measured here and the committed overlap pairs (#39, #40).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt"
timeout 230 python3 -m pytest -v -m gpu -rfE --tb=short -p no:cacheprovider --durations=0 \
  tests/gpu/test_gpu_multirank.py tests/gpu/test_gpu_fp32_graph.py tests/parallel/test_gpu_ep.py \
  tests/parallel/test_compiled_no_sync.py 2>&1 | grep -vE "^DEBUG|torch.__trace" | tail -120 > "$OUT/t_multi.log" &
timeout 170 python3 -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider \
  tests/kernels/test_gather_kernels.py tests/moe/test_mxfp8_compiled.py tests/parallel/test_overlap.py \
  2>&1 | grep -vE "^DEBUG|torch.__trace" | tail -80 > "$OUT/t_fix.log" &
wait; echo "tests at $(el) s" >> "$OUT/times.txt"
rm -f "$OUT/kernel_gains.jsonl"
timeout 130 python3 benchmarks/kernel_gains.py --json "$OUT/kernel_gains.jsonl" > "$OUT/kernel_gains.txt" 2>&1
echo "kernel_gains rc=$? at $(el) s" >> "$OUT/times.txt"
GIB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
if [ "$GIB" -ge 120 ]; then LAYERS=2; MB=2; PRESET=ref-47b; else LAYERS=1; MB=1; PRESET=olmoe-1b-7b; fi
timeout 100 python3 benchmarks/multirank_memory.py --preset ref-47b --layers $LAYERS \
  --micro-batch-size $MB --ranks 2 > "$OUT/memory.md" 2>&1
echo "memory rc=$? at $(el) s" >> "$OUT/times.txt"
left=$(( 570 - $(el) ))
[ $left -gt 30 ] && timeout $left python3 -m moetrain bench --project --project-presets $PRESET --steps 2 \
  --warmup 2 --out "$OUT/bench_project" > "$OUT/bench_project.log" 2>&1
echo "project rc=$? at $(el) s" >> "$OUT/times.txt"
cat "$OUT/gpu.txt" "$OUT/times.txt"
echo "== multi"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/t_multi.log" | tail -14
echo "== fix"; grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/t_fix.log" | tail -8
echo "== kernels"; python3 benchmarks/kernel_gains.py --table "$OUT/kernel_gains.jsonl" 2>&1 | tail -30
echo "== memory"; grep -E "^\|" "$OUT/memory.md" | tail -6
echo "== project"; grep -E "best resident|^reference|^\| (resident|fsdp2)" "$OUT/bench_project.log" | tail -16
