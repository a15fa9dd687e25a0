#!/usr/bin/env bash
# The benchmark runs behind benchmarks/RESULTS.md, on one GPU. PART=1 to 5 (each fits one
# 10-minute device call). Appends dated tables to $OUT/RESULTS.md (or ./RESULTS.new.md).
set -uo pipefail
OUT=${OUT:-.}; R=$OUT/RESULTS.md
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
if [[ ${PART:-1} == 1 ]]; then
  python3 -m moetrain bench --preset small --compare hf --profile --json "$OUT/small.json" --results-md "$R" 2>&1 | grep -v Warn | tail -14
  python3 -m moetrain bench --preset olmoe8 --compare hf --json "$OUT/olmoe8.json" --results-md "$R" 2>&1 | grep -v Warn | tail -8
fi
if [[ ${PART:-1} == 2 ]]; then
  python3 -m moetrain bench --sweep --optimizer bf16-adamw --json "$OUT/sweep.json" --results-md "$R" 2>&1 | grep -v Warn | tail -14
  python3 -m moetrain bench --preset olmoe8 --optimizer mixed --set precision.experts=fp8_rowwise --json "$OUT/olmoe8_fp8.json" --results-md "$R" 2>&1 | grep -v Warn | tail -5
  timeout 300 python3 benchmarks/fp8_training.py 2>&1 | tee "$OUT/fp8_kernels.txt"
fi
if [[ ${PART:-1} == 3 ]]; then  # low precision: step time by recipe, then loss curves
  for p in "" "--set precision.experts=fp8_rowwise" "--set precision.experts=fp8_rowwise --set precision.dispatch=fp8"; do
    python3 -m moetrain bench --preset olmoe8 --optimizer mixed --profile $p --json "$OUT/olmoe8_prec$(echo $p | tr -dc a-z0-9 | tail -c 12).json" --results-md "$R" 2>&1 | grep -v Warn | tail -6
  done
  python3 benchmarks/precision_curves.py --preset demo --steps 300 --set parallel.compile=false 2>&1 | grep -v "^note" | tee "$OUT/curves.txt"
fi
if [[ ${PART:-1} == 4 ]]; then  # each Triton kernel against its twin, as a share of each preset's step
  python3 benchmarks/kernel_gains.py --json "$OUT/kernel_gains.jsonl" 2>&1 | tee "$OUT/kernel_gains.txt"
fi
if [[ ${PART:-1} == 5 ]]; then  # single-GPU options on small, one at a time against the default
  for s in train.cuda_graph=false model.attention_backend=flash \
           parallel.activation_checkpointing=moe parallel.activation_checkpointing=full \
           "train.micro_batch_size=4 --set train.seq_len=4096" \
           "train.micro_batch_size=16 --set train.seq_len=1024"; do
    python3 -m moetrain bench --preset small --optimizer bf16-adamw --set $s \
      --json "$OUT/small_$(echo $s | tr -dc a-z0-9 | tail -c 24).json" --results-md "$R" 2>&1 \
      | grep -v Warn | tail -3
  done
fi
