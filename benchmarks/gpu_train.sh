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
# Data: text and image read .devdata/{imdb,cifar10} (zstd parquet copies of ../shared/data, 38 MB, carried);
# Pathfinder is generated into $LRA_CACHE_DIR by its loader on first use (200K images, about 5 minutes on 16
# cores), so a fresh machine regenerates it and the run's config (data.root=null) never changes.
set -u
STATE=${STATE:-/tmp/lra_runs}
export LRA_CACHE_DIR=${LRA_CACHE_DIR:-/tmp/lra_cache} PYTHONUNBUFFERED=1
if [ ! -d "$STATE" ] && [ -d .devstate/runs ]; then cp -r .devstate/runs "$STATE"; echo "seeded $STATE from .devstate/runs"; fi
mkdir -p "$STATE/results"

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
if [ "${BACKUP:-0}" = 1 ]; then
  tar -c -C "$(dirname "$STATE")" --transform "s,^$(basename "$STATE"),runs," "$(basename "$STATE")" | split -b 15m -d - "$OUT/state.tar."
fi
ls -la "$OUT"
