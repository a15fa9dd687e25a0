#!/usr/bin/env bash
# Device call 2 of session 17: the bf16 step before (.base: 902529f) and after this session's
# changes, in one job (#42); the planner's memory against measured peaks per layout (#39 a); the
# projection with one rank measured here and the measured overlap pairs (#39 d, #40).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total --format=csv,noheader > "$OUT/gpu.txt"
t0=$(date +%s)
for preset in small olmoe8; do
  for tree in .base .; do
    tag=$([ "$tree" = . ] && echo after || echo before)
    PYTHONPATH=$tree timeout 100 python3 -m moetrain bench --preset $preset --steps 8 --warmup 3 --optimizer mixed \
      --json "$OUT/step_${preset}_${tag}.json" > "$OUT/step_${preset}_${tag}.txt" 2>&1
    echo "$preset $tag rc=$? at $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt"
  done
done
export PYTHONPATH=.
GIB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
if [ "$GIB" -ge 120 ]; then LAYERS=2; MB=2; PRESET=ref-47b; else LAYERS=1; MB=1; PRESET=olmoe-1b-7b; fi
timeout 110 python3 benchmarks/multirank_memory.py --preset ref-47b --layers $LAYERS \
  --micro-batch-size $MB --ranks 2 > "$OUT/memory.md" 2>&1
echo "memory rc=$? at $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt"
timeout 190 python3 -m moetrain bench --project --project-presets $PRESET --steps 2 --warmup 2 \
  --out "$OUT/bench_project" > "$OUT/bench_project.log" 2>&1
echo "project rc=$? at $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt"
cat "$OUT/gpu.txt" "$OUT/times.txt"
for f in "$OUT"/step_*.txt; do echo "== $f"; grep -E "step ms|tok/s|^\|" "$f" | tail -3; done
echo "== memory"; grep -E "^\|" "$OUT/memory.md" | tail -6
echo "== project"; tail -30 "$OUT/bench_project.log"
