#!/usr/bin/env bash
# Device call (about 8-10 minutes on an H200 for the whole sweep; keep the CPU otherwise idle, the 1K rows are
# launch-bound): the LRA Table 2 sweep, every registered model at 1K-4K (batch 32) and the non-quadratic ones at
# 8K/16K (batch 8). Failing cases log their whole traceback to $OUT/bench.log.
#   LRA_GIT_SHA=<commit> bash benchmarks/gpu_bench_sweep.sh          (after the wheel install prefix)
#   MODELS=longformer,bigbird,performer VARIANTS='{model:bigbird,block:64}' PROBE=1 bash benchmarks/gpu_bench_sweep.sh
# MODELS re-measures only those models (and the transformer baseline) at 1K-16K, about 3 minutes, with
# VARIANTS='{model:bigbird,block:64},...' (bench.variants) as more rows;
# PROBE=1 first runs benchmarks/flex_pattern_probe.py (one attention layer of each block-sparse pattern split
# into tile construction, kernel, mask_mod and tile count) into $OUT/probe.log, about 3 minutes.
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
if [ "${PROBE:-0}" = 1 ]; then
  timeout 240 python3 benchmarks/flex_pattern_probe.py 2>&1 | grep -viE "warn|^\s*$" > "$OUT/probe.log"; cat "$OUT/probe.log"
fi
if [ -n "${MODELS:-}" ]; then
  bench 300 "bench.models=[transformer,$MODELS]" "bench.variants=[${VARIANTS:-}]" \
    "bench.lengths=[1024,2048,3072,4096,8192,16384]"
  exit 0
fi
bench 300                                  # every registered model at 1K-4K, batch 32
bench 240 "bench.models=[transformer,local,sparse,longformer,bigbird,linear,performer,linformer,reformer,sinkhorn]" \
  "bench.lengths=[8192,16384]"             # the non-quadratic models at 8K/16K, batch 8
