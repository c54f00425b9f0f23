#!/usr/bin/env bash
# Device call (about 9 minutes on an H200; keep the CPU otherwise idle, the 1K rows are launch-bound):
# re-measure what the b621894 sweep could not, each model in its own process so that no model's compiled
# kernels count against another's recompile budget.
#   - transformer at 1K-4K (its 1K row ran beside Pathfinder generation), longformer and bigbird at 1K-4K
#     (they ran past Dynamo's recompile limit, i.e. eagerly), performer and sinkhorn at 1K-4K (cut off by a
#     timeout);
#   - transformer, longformer and bigbird at 8K/16K (bigbird 0.4x at 8K; both raised an InductorError at 16K:
#     the bench now logs the whole traceback to $OUT/bench.log).
#   LRA_GIT_SHA=<commit> bash benchmarks/gpu_bench_sweep.sh     (after the wheel install prefix)
set -u
cp results/bench.csv "$OUT/bench.csv"
: > "$OUT/bench.log"
B="bench.compile=false bench.warmup=3 bench.steps=10 bench.progress=false bench.out=$OUT/bench.csv"
bench() {
  local limit=$1; shift
  echo "== $*" | tee -a "$OUT/bench.log"
  HYDRA_FULL_ERROR=1 timeout "$limit" python3 -m lra.bench $B "$@" >> "$OUT/bench.log" 2>&1
  grep -E "^(transformer|local|sparse|longformer|bigbird|performer|sinkhorn) |^ERR" "$OUT/bench.log" | tail -4
}
timeout 90 python3 benchmarks/gpu_check_patterns.py 2>&1 | grep -vi warn | tail -2
for m in transformer longformer bigbird performer sinkhorn; do bench 110 "bench.models=[$m]"; done
for m in transformer longformer bigbird; do bench 90 "bench.models=[$m]" "bench.lengths=[8192,16384]"; done
