#!/usr/bin/env bash
# GPU checks of branch `safety` (issue #38 items 9 and 10). Run from the worktree root:
#   OUT=/some/dir bash gpu_jobs/safety.sh
# Expected wall time: about 2 minutes (three pytest runs side by side on the one GPU, each under
# its own timeout; the longest is capped at 170 s). Full logs: $OUT/safety/*.log.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/safety"
export PYTHONPATH=.
run() {  # name, timeout (s), pytest arguments...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m pytest -q -rA -p no:cacheprovider "$@" > "$OUT/safety/$name.log" 2>&1
  echo $? > "$OUT/safety/$name.rc"
}
# 9: the MXFP8 expert product compiled (inductor) against eager, output and both gradients
run mxfp8_compiled 150 -m gpu tests/moe/test_mxfp8_compiled.py &
# 10: fp32 _grouped_mm capture (bf16 captures, fp32 does not); the fp32 step with a bf16 expert
#     GEMM swapped in captures (strict); the fp32 run is refused up front and warns nothing
run fp32_graph 150 -m gpu tests/gpu/test_gpu_fp32_graph.py &
# 10: the multi-rank fp32 case and its one-process reference, a failed capture now an error
run multirank_fp32 170 -m gpu tests/gpu/test_gpu_multirank.py -k "tiny-dp2-ep2-nosync-fp32" &
wait
printf '%-16s %-4s %s\n' piece rc result
for name in mxfp8_compiled fp32_graph multirank_fp32; do
  printf '%-16s %-4s %s\n' "$name" "$(cat "$OUT/safety/$name.rc")" \
    "$(grep -E '(passed|failed|error|skipped)' "$OUT/safety/$name.log" | tail -n 1)"
done
