#!/usr/bin/env bash
# Device call (about 8-10 minutes on an H200; keep the CPU otherwise idle, the 1K rows are launch-bound):
# the whole LRA Table 2 sweep again, because the baseline changed (mask-free inputs: the transformer now runs
# SDPA's unmasked kernels) and because the b621894 sweep ran longformer and bigbird past Dynamo's recompile
# limit (eagerly) and cut performer and sinkhorn off at 1K-4K. Failing cases log their whole traceback to
# $OUT/bench.log (longformer and bigbird raised an InductorError at 16K).
#   LRA_GIT_SHA=<commit> bash benchmarks/gpu_bench_sweep.sh     (after the wheel install prefix)
set -u
cp results/bench.csv "$OUT/bench.csv"
: > "$OUT/bench.log"
B="bench.compile=false bench.warmup=3 bench.steps=10 bench.progress=false bench.out=$OUT/bench.csv"
bench() {
  local limit=$1; shift
  echo "== $*" | tee -a "$OUT/bench.log"
  HYDRA_FULL_ERROR=1 timeout "$limit" python3 -m lra.bench $B "$@" >> "$OUT/bench.log" 2>&1
  grep -E "^[a-z]+ +[0-9.]+ \(|^ERR" "$OUT/bench.log" | tail -24
}
timeout 90 python3 benchmarks/gpu_check_patterns.py 2>&1 | grep -vi warn | tail -2
bench 300                                  # every registered model at 1K-4K, batch 32
bench 240 "bench.models=[transformer,local,sparse,longformer,bigbird,linear,performer,linformer,reformer,sinkhorn]" \
  "bench.lengths=[8192,16384]"             # the non-quadratic models at 8K/16K, batch 8
