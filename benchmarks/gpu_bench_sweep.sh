#!/usr/bin/env bash
# Device call (about 6 minutes on an H200): check the block-sparse models' FlexAttention path against their
# dense path on CUDA, then the LRA Table 2 sweep at 1K-4K for the models whose GPU path changed, and 8K/16K
# (batch 8) for every non-quadratic model. Appends to $OUT/bench.csv, seeded with the committed rows so the
# relative figures can use earlier transformer rows.
#   LRA_GIT_SHA=<commit> bash benchmarks/gpu_bench_sweep.sh     (after the wheel install prefix)
set -u
cp results/bench.csv "$OUT/bench.csv"
timeout 90 python3 benchmarks/gpu_check_patterns.py 2>&1 | grep -vi warn | tee "$OUT/patterns_check.log"
B="bench.compile=false bench.warmup=3 bench.steps=10 bench.progress=false bench.out=$OUT/bench.csv"
timeout 200 python3 -m lra.bench $B bench.models=[transformer,local,sparse,longformer,bigbird,linear,performer,sinkhorn] \
  2>&1 | grep -vi warn | tail -30
timeout 200 python3 -m lra.bench $B bench.lengths=[8192,16384] \
  bench.models=[transformer,local,sparse,longformer,bigbird,linear,performer,linformer,reformer,sinkhorn] 2>&1 | grep -vi warn | tail -30
