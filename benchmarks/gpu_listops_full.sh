#!/usr/bin/env bash
# Device call: the full-schedule ListOps transformer run of issue 2, with the PEERS minimal SDPA model re-measured on the same card.
set -u
python3 benchmarks/minimal_sdpa.py --json $OUT/minimal_eager.json
export LRA_CACHE_DIR=/tmp/lra_cache
python3 -m lra task=listops model=transformer trainer.progress=false \
  results.dir=$OUT/results hydra.run.dir=/tmp/outputs/listops_full 2>&1 | grep -vE "^\s*$" | tail -5
cp /tmp/outputs/listops_full/history.json /tmp/outputs/listops_full/result.json $OUT/ 2>/dev/null
cp /tmp/outputs/listops_full/*.log $OUT/ 2>/dev/null
