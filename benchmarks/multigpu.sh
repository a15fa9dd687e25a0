#!/usr/bin/env bash
# Multi-GPU runs of the multi-GPU issue, for a host with N GPUs (default: all visible).
# NOT YET RUN: no multi-GPU machine has been lent so far (see benchmarks/RESULTS.md).
# Usage: N=8 bash benchmarks/multigpu.sh   (results appended to $OUT/RESULTS.md)
set -uo pipefail
N=${N:-$(nvidia-smi -L | wc -l)}
OUT=${OUT:-.}; R=$OUT/RESULTS.md
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
run() { torchrun --standalone --nproc-per-node "$N" -m moetrain bench "$@" --results-md "$R"; }
# resident experts (NoSync and AllToAll dispatchers) vs the FSDP2 baseline, olmoe-1b-7b;
# NoSync is capacity mode (buffers of about 1.25 T K rows a rank, drops counted), AllToAll dropless
run --preset olmoe-1b-7b --optimizer mixed --set parallel.ep="$N" --set moe.dispatcher=no_sync \
  --set moe.capacity_factor=1.25
run --preset olmoe-1b-7b --optimizer mixed --set parallel.ep="$N" --set moe.dispatcher=all_to_all
run --preset olmoe-1b-7b --optimizer mixed --set parallel.data_parallel=fsdp
# the FSDP2 variants the projection compares (docs/plan.md): one gather a micro-batch, bf16 reduce
run --preset olmoe-1b-7b --optimizer mixed --set parallel.data_parallel=fsdp \
  --set parallel.fsdp_reshard=backward
run --preset olmoe-1b-7b --optimizer mixed --set parallel.data_parallel=fsdp \
  --set precision.grad_dtype=bf16
# distributed optimizer
run --preset olmoe-1b-7b --optimizer mixed --set parallel.ep="$N" --set train.optimizer=sharded
# expert scaling 8 -> 128 experts at top-4 with ep = number of GPUs
for e in 8 16 32 64 128; do
  run --preset "scale-E$e" --optimizer bf16-adamw --set parallel.ep="$N"
done
# FP8 expert GEMMs vs BF16
run --preset olmoe-1b-7b --optimizer mixed --set parallel.ep="$N" --set precision.experts=fp8_rowwise
