#!/usr/bin/env bash
# One device call: GPU tests, then benchmarks. Usage on the GPU machine: bash benchmarks/gpu_check.sh
# Writes logs and JSON under $OUT (or ./.out). Keep NVLink multicast off on multi-GPU hosts.
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
STAGE=${STAGE:-all}
if [[ $STAGE == all || $STAGE == tests ]]; then
  timeout 420 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ $STAGE == all || $STAGE == bench ]]; then
  timeout 900 python3 -m moetrain bench --preset small --compare hf --profile --json "$OUT/small.json" 2>&1 | tee "$OUT/bench_small.log" | tail -30
fi
