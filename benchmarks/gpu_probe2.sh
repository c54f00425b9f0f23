#!/usr/bin/env bash
set -u
python3 benchmarks/sdpa_backends.py 2>&1 | grep -v Warning
python3 -m lra.generate listops --out /tmp/lra_data --workers 16 >/dev/null 2>&1
for v in "backbone.pooling=mean" "backbone.pooling=mean backbone.attn_dropout=0"; do
  python3 -m lra task=listops data.root=/tmp/lra_data train.steps=300 train.eval_every=300 trainer.timing_warmup=60 \
    trainer.progress=false results.dir=$OUT/probe run_dir=/tmp/probe_$RANDOM $v 2>&1 | grep -E "steps/s|Error" | tail -2
  echo "variant [$v] done"
done
