#!/usr/bin/env bash
# Device calls: full-schedule `model=transformer` runs that outlast one 10-minute call.
#
#   DEADLINE=<unix time> bash benchmarks/gpu_train.sh TASK[:override,override...] ...   (after the wheel prefix)
#
# Tasks run one after another until DEADLINE; then SIGTERM makes the runner finish its step, checkpoint and
# exit, and the next call (same command) resumes it. Run state lives in $STATE (default /tmp/lra_runs: a warm
# machine keeps /tmp between calls but not ignored folders of the tree, which arrive afresh with each call).
# A carried .devstate/runs (unpacked backup) seeds $STATE when $STATE is absent (a fresh machine).
# Finished runs' rows go to $STATE/results/runs.csv.
# Everything small (rows, histories, logs, configs) goes to $OUT/report.tar; `BACKUP=1` also packs the
# checkpoints into $OUT/state.tar.NN pieces (15 MiB each), so a lost machine can resume from a carried copy:
#   mkdir -p .devstate && cat state.tar.* | tar -x -C .devstate     (then carry .devstate)
# Data: text and image read .devdata/{imdb,cifar10} (zstd parquet copies of ../shared/data, 38 MB, carried;
# made with pyarrow: pq.write_table(pq.read_table(src), dst, compression="zstd", compression_level=19));
# Pathfinder is generated into $LRA_CACHE_DIR by its loader on first use (200K images, about 5 minutes on 16
# cores), so the run's config (data.root=null) never changes. `PACK=1` packs the generated images into
# $OUT/pf32.tar.xz.NN (about 34 MB); carried back as .devdata/pf32.tar.xz.NN, they are unpacked into the cache
# on a fresh machine in seconds instead of generated again.
PF_GEN=pathfinder_gen/32px-hard-n200000-seed0
set -u
STATE=${STATE:-/tmp/lra_runs}
export LRA_CACHE_DIR=${LRA_CACHE_DIR:-/tmp/lra_cache} PYTHONUNBUFFERED=1
if [ ! -d "$STATE" ] && [ -d .devstate/runs ]; then cp -r .devstate/runs "$STATE"; echo "seeded $STATE from .devstate/runs"; fi
mkdir -p "$STATE/results"
pf_dir="$LRA_CACHE_DIR/$PF_GEN"
if [ ! -f "$pf_dir/complete.json" ] && ls .devdata/pf32.tar.xz.* >/dev/null 2>&1; then
  cat .devdata/pf32.tar.xz.* > /tmp/pf32.tar.xz
  python3 benchmarks/pathfinder_pack.py unpack /tmp/pf32.tar.xz "$pf_dir/pathfinder32/curv_contour_length_14" \
    && echo '{"n": 200000, "seed": 0, "resolution": 32, "difficulty": "hard"}' > "$pf_dir/complete.json"
fi
if [ "${PACK:-0}" = 1 ] && [ -f "$pf_dir/complete.json" ]; then  # beside the training, on one core
  (python3 benchmarks/pathfinder_pack.py pack "$pf_dir/pathfinder32/curv_contour_length_14" /tmp/pf32.tar.xz \
    && split -b 15m -d /tmp/pf32.tar.xz "$OUT/pf32.tar.xz.") &
fi

data_args() {
  case $1 in
    text) echo "data.path=.devdata/imdb" ;;
    image) echo "data.path=.devdata/cifar10" ;;
  esac
}

for spec in "$@"; do
  task=${spec%%:*}
  extra=""
  [[ $spec == *:* ]] && extra=${spec#*:}
  dir="$STATE/$task"
  if [ -f "$dir/result.json" ]; then echo "== $task: finished already"; continue; fi
  left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt 90 ]; then echo "== $task: ${left}s left, not started"; continue; fi
  echo "== $task: running for at most ${left}s"
  # shellcheck disable=SC2046
  timeout -s TERM -k 120 "$left" python3 -m lra task="$task" model=transformer trainer.progress=false \
    $(data_args "$task") ${extra//,/ } hydra.run.dir="$dir" results.dir="$STATE/results" 2>&1 \
    | grep -vE "^\s*$|[Ww]arning" | tail -40
done

# rows, histories and logs in one file ($OUT takes 8 files at most)
tar -c -C "$STATE" --exclude='*.pt' . > "$OUT/report.tar"
wait  # for the pack started above
if [ "${BACKUP:-0}" = 1 ]; then
  tar -c -C "$(dirname "$STATE")" --transform "s,^$(basename "$STATE"),runs," "$(basename "$STATE")" | split -b 15m -d - "$OUT/state.tar."
fi
ls -la "$OUT"
