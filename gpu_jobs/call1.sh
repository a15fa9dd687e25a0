#!/usr/bin/env bash
# Device call 1 of session 17: every GPU test, in four groups side by side (correctness, not
# timing), then the measurements that must run alone: the overlap stand-ins (#40), the
# dispatcher's costs (#39 c) and the projection of ref-47b with one rank measured here (#39 d).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt"
t0=$(date +%s)
g() { local name=$1; shift; timeout 240 python3 -m pytest -q -m gpu -rfE -p no:cacheprovider "$@" > "$OUT/t_$name.log" 2>&1; echo "rc=$?" >> "$OUT/t_$name.log"; }
g core tests/gpu/test_gpu_core.py tests/gpu/test_gpu_document_mask.py tests/gpu/test_gpu_projection.py &
g multi tests/gpu/test_gpu_multirank.py tests/gpu/test_gpu_fp32_graph.py tests/parallel/test_gpu_ep.py tests/parallel/test_compiled_no_sync.py &
g over tests/parallel/test_overlap.py tests/moe/test_mxfp8_compiled.py tests/optim &
g kern tests/kernels tests/moe/test_fp8_experts.py tests/moe/test_grouped_gemm.py tests/nn &
wait
echo "tests done at $(( $(date +%s) - t0 )) s" | tee "$OUT/times.txt"
timeout 90 python3 benchmarks/overlap.py --out "$OUT/overlap.json" --budget-s 70 > "$OUT/overlap_bench.txt" 2>&1
echo "overlap rc=$? at $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt"
timeout 40 python3 - > "$OUT/dispatch_cost.txt" 2>&1 <<'PY'
import torch
from moetrain.bench.dispatch_cost import host_sync_s, index_work_s
from moetrain.presets import get_preset
config = get_preset("ref-47b").with_overrides(["parallel.ep=8"])
dev = torch.device("cuda")
local, no_sync = index_work_s(config, 8, 1.25, dev)
print(f"| ref-47b, ep 8, 16k tokens | balanced {1e3 * local:.3f} ms | no_sync {1e3 * no_sync:.3f} ms | index work {1e3 * (no_sync - local):.3f} ms a layer | host sync {1e3 * host_sync_s(config, dev):.3f} ms a layer |")
PY
echo "dispatch rc=$? at $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt"
GIB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
PRESET=$([ "$GIB" -ge 120 ] && echo ref-47b || echo olmoe-1b-7b)
timeout 200 python3 -m moetrain bench --project --project-presets $PRESET --steps 2 --warmup 2 \
  --overlap "$OUT/overlap.json" --out "$OUT/bench_project" > "$OUT/bench_project.log" 2>&1
echo "project rc=$? at $(( $(date +%s) - t0 )) s" >> "$OUT/times.txt"
cat "$OUT/gpu.txt" "$OUT/times.txt"
for f in "$OUT"/t_*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$f" | tail -8; done
echo "== overlap"; tail -12 "$OUT/overlap_bench.txt"
echo "== dispatch"; tail -2 "$OUT/dispatch_cost.txt"
echo "== project"; grep -E "best resident|^reference|^\| (resident|fsdp2)" "$OUT/bench_project.log" | tail -24
