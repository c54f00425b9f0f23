#!/usr/bin/env bash
# Device call on a machine of several GPUs: run independent jobs side by side, one GPU each.
#
#   bash benchmarks/gpu_lanes.sh 'CMD0' 'CMD1' 'CMD2' ...        (after the wheel install prefix)
#
# Lane i gets GPU i (CUDA_VISIBLE_DEVICES=i). With fewer GPUs than lanes, lane 0 keeps GPU 0 and the other
# lanes queue on GPUs 1..G-1 in turn, one after another on each GPU, so no two jobs ever share a GPU and
# timings stay those of a machine to themselves (with one GPU, every lane queues on it). Each lane's output
# goes to $LANES_DIR/lane<i>.txt (default /tmp/lanes); the tail of each is printed when all have finished.
# LANES_STAGGER (seconds, default 3) spaces the GPUs' starts.
# Typical: Pathfinder training in lane 0 while the bench sweeps (gpu_bench_sweep.sh with DEST and CHECK=0)
# fill the others.
set -u
gpus=$(nvidia-smi -L | grep -c '^GPU')
[ "$gpus" -ge 1 ] || { echo "no GPU found by nvidia-smi"; exit 1; }
echo "$gpus GPU(s), $# lane(s)"
LANES_DIR=${LANES_DIR:-/tmp/lanes}
mkdir -p "$LANES_DIR"
declare -a queue
for ((i = 0; i < $#; i++)); do
  if [ "$i" -lt "$gpus" ]; then g=$i
  elif [ "$gpus" -eq 1 ]; then g=0
  else g=$(( 1 + (i - 1) % (gpus - 1) )); fi
  queue[$g]+="$i "
done
lanes=("$@")
for g in "${!queue[@]}"; do
  (
    for i in ${queue[$g]}; do
      echo "== lane $i on GPU $g: ${lanes[$i]}" > "$LANES_DIR/lane$i.txt"
      CUDA_VISIBLE_DEVICES=$g bash -c "${lanes[$i]}" >> "$LANES_DIR/lane$i.txt" 2>&1
      echo "== lane $i exit $?" >> "$LANES_DIR/lane$i.txt"
    done
  ) &
  sleep "${LANES_STAGGER:-3}"  # Hydra names run folders by the second
done
wait
for ((i = 0; i < $#; i++)); do echo; tail -n 25 "$LANES_DIR/lane$i.txt"; done
