#!/usr/bin/env bash
# Device call: baseline (PEERS minimal SDPA model) and our runner's speed on ListOps, several variants.
# Usage (device tool, after the wheel install prefix): bash benchmarks/gpu_probe.sh
set -u
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
python3 benchmarks/minimal_sdpa.py --json $OUT/minimal_eager.json
python3 benchmarks/minimal_sdpa.py --compile --json $OUT/minimal_compiled.json
t0=$(date +%s); python3 -m lra.generate listops --out /tmp/lra_data --workers 16 >/dev/null 2>&1; echo "listops generated in $(( $(date +%s) - t0 )) s"
i=0
for v in "" "backbone.attn_dropout=0" "trainer.compile=false" "backbone.attn_dropout=0 backbone.dropout=0"; do
  i=$((i+1))
  python3 -m lra task=listops data.root=/tmp/lra_data train.steps=400 train.eval_every=200 trainer.timing_warmup=60 \
    trainer.progress=false results.dir=$OUT/probe run_dir=/tmp/probe$i $v 2>&1 | grep -E "steps/s|Error|error" | tail -3
  echo "variant [$v] done"
done
python3 -c "import pandas as pd; print(pd.read_csv('$OUT/probe/runs.csv')[['overrides','train_steps_per_s','peak_mem_mb','val_acc']].to_string())"
