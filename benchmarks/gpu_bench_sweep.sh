#!/usr/bin/env bash
# Device call (about 8-10 minutes on an H200 for the whole sweep; keep the CPU otherwise idle, the 1K rows are
# launch-bound): the LRA Table 2 sweep, every registered model at 1K-4K (batch 32) and the non-quadratic ones at
# 8K/16K (batch 8). Failing cases log their whole traceback to $OUT/bench.log.
#   LRA_GIT_SHA=<commit> bash benchmarks/gpu_bench_sweep.sh          (after the wheel install prefix)
#   MODELS=longformer,bigbird,performer VARIANTS='{model:bigbird,block:64}' PROBE=1 bash benchmarks/gpu_bench_sweep.sh
# MODELS re-measures only those models (and the transformer baseline) at 1K-16K, about 3 minutes, with
# VARIANTS='{model:bigbird,block:64},...' (bench.variants) as more rows;
# LENGTHS='[1024,2048,3072,4096]' narrows MODELS' lengths (for a quadratic model);
# PROBE=1 first runs benchmarks/flex_pattern_probe.py (one attention layer of each block-sparse pattern split
# into tile construction, kernel, mask_mod and tile count) into probe.log, about 3 minutes.
# On a machine of several GPUs, sweeps run side by side, one a GPU, each into its own folder:
#   CUDA_VISIBLE_DEVICES=2 DEST=$OUT/b CHECK=0 MODELS=linear,performer bash benchmarks/gpu_bench_sweep.sh &
# (DEST defaults to $OUT; CHECK=0 skips gpu_check_patterns.py). Each sweep re-measures its own transformer
# baseline on its own GPU, so its relative columns never mix GPUs.
set -u
DEST=${DEST:-$OUT}
mkdir -p "$DEST"
cp results/bench.csv "$DEST/bench.csv"
: > "$DEST/bench.log"
B="bench.compile=false bench.warmup=3 bench.steps=10 bench.progress=false bench.out=$DEST/bench.csv"
bench() {
  local limit=$1; shift
  echo "== $*" | tee -a "$DEST/bench.log"
  HYDRA_FULL_ERROR=1 timeout "$limit" python3 -m lra.bench $B "$@" >> "$DEST/bench.log" 2>&1
  grep -E "^[a-z]+ +[0-9.]+ \(|^ERR" "$DEST/bench.log" | tail -24
}
if [ "${CHECK:-1}" = 1 ]; then
  timeout 90 python3 benchmarks/gpu_check_patterns.py 2>&1 | grep -vi warn | tail -2
fi
if [ "${PROBE:-0}" = 1 ]; then
  timeout 240 python3 benchmarks/flex_pattern_probe.py 2>&1 | grep -viE "warn|^\s*$" > "$DEST/probe.log"; cat "$DEST/probe.log"
fi
if [ -n "${MODELS:-}" ]; then
  bench 300 "bench.models=[transformer,$MODELS]" "bench.variants=[${VARIANTS:-}]" \
    "bench.lengths=${LENGTHS:-[1024,2048,3072,4096,8192,16384]}"
  exit 0
fi
bench 300                                  # every registered model at 1K-4K, batch 32
bench 240 "bench.models=[transformer,local,sparse,longformer,bigbird,linear,performer,linformer,reformer,sinkhorn]" \
  "bench.lengths=[8192,16384]"             # the non-quadratic models at 8K/16K, batch 8
