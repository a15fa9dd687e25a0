#!/usr/bin/env bash
# Issue #39 (resident experts vs FSDP2) on one GPU. Expected wall time: about 5 minutes on an
# H200 (each piece has its own timeout, 380 s in all). Run from the worktree root:
#   OUT=/some/dir bash gpu_jobs/project.sh
# Writes everything under $OUT/project/ (each piece as soon as it finishes) and prints a short
# table last. Pieces, in order of priority:
#   (c) the dispatchers' index work (NoSync stand-in vs the BalancedDispatcher) and the
#       exact-split host sync at ref-47b's per-rank shapes (ep 8, 16k tokens)
#   (a) measured peak memory of one reduced-depth case per layout (resident experts with
#       ShardedAdamW and with the replicated AdamW at dp = ep = 2 on one GPU over gloo; FSDP2 at
#       one rank, where it shards nothing) against the planner's memory model
#   (b) a briefly trained router's rank load (max / mean rows per rank at ep 8)
#   (d) bench --project for ref-47b: the table, the reference's row, the compute-scale sweep
# On a GPU under 120 GiB (H100) the cases shrink: 1-layer memory cases, olmoe-1b-7b for (d)
# (ref-47b's whole-model rank does not fit 80 GB even at 2 layers).
set -uo pipefail
OUT=${OUT:-out}; D=$OUT/project; mkdir -p "$D"
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
GIB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
if [ "$GIB" -ge 120 ]; then LAYERS=2; MB=2; PRESET=ref-47b; else LAYERS=1; MB=1; PRESET=olmoe-1b-7b; fi
echo "GPU memory ${GIB} GiB: memory cases at $LAYERS layers, micro-batch $MB; projecting $PRESET" | tee "$D/plan.txt"

timeout 40 python3 - > "$D/dispatch_cost.txt" 2>&1 <<'EOF'
import torch
from moetrain.bench.dispatch_cost import host_sync_s, index_work_s
from moetrain.presets import get_preset
config = get_preset("ref-47b").with_overrides(["parallel.ep=8"])
dev = torch.device("cuda")
local, no_sync = index_work_s(config, 8, 1.25, dev)
print(f"| ref-47b, ep 8, 16k tokens | balanced {1e3 * local:.3f} ms | no_sync {1e3 * no_sync:.3f} ms | index work {1e3 * (no_sync - local):.3f} ms a layer | host sync {1e3 * host_sync_s(config, dev):.3f} ms a layer |")
EOF
echo "(c) rc=$?" >> "$D/plan.txt"

timeout 110 python3 benchmarks/multirank_memory.py --preset ref-47b --layers $LAYERS \
  --micro-batch-size $MB --ranks 2 > "$D/memory.md" 2>&1
echo "(a) rc=$?" >> "$D/plan.txt"

timeout 40 python3 benchmarks/routing_load.py --steps 200 --every 100 --ep 8 --device cuda \
  > "$D/routing_load.md" 2>&1
echo "(b) rc=$?" >> "$D/plan.txt"

timeout 190 python3 -m moetrain bench --project --project-presets $PRESET --steps 2 --warmup 2 \
  --out "$D/bench_project" > "$D/bench_project.log" 2>&1
echo "(d) rc=$?" >> "$D/plan.txt"

echo "== summary"
cat "$D/plan.txt"
cat "$D/dispatch_cost.txt" | tail -1
grep -E "^\| (resident|fsdp2)" "$D/memory.md"
tail -3 "$D/routing_load.md"
grep -E "best resident|^reference" "$D/bench_project.log"
