"""benchmarks/gpu_lanes.sh: device jobs side by side, one GPU each, queued (never shared) when GPUs are fewer.
A fake ``nvidia-smi`` on PATH stands in for the GPUs."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_lanes.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run_lanes(tmp_path: Path, gpus: int, lanes: list[str]) -> str:
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f'echo "GPU {i}: Fake GPU (UUID: GPU-{i})"\n' for i in range(gpus)))
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", LANES_DIR=str(tmp_path / "lanes"), LANES_STAGGER="0")
    done = subprocess.run(["bash", str(SCRIPT), *lanes], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_one_gpu_per_lane_and_queueing(tmp_path):
    # each lane records its GPU and when it started and ended (in a shared file, in order of events)
    lane = 'echo "start $CUDA_VISIBLE_DEVICES {i}" >> {log}; sleep 0.3; echo "end $CUDA_VISIBLE_DEVICES {i}" >> {log}'
    log = tmp_path / "events.txt"
    out = run_lanes(tmp_path, 2, [lane.format(i=i, log=log) for i in range(4)])
    assert "2 GPU(s), 4 lane(s)" in out
    events = [tuple(line.split()) for line in log.read_text().splitlines()]
    gpu_of = {lane: gpu for kind, gpu, lane in events if kind == "start"}
    assert gpu_of == {"0": "0", "1": "1", "2": "1", "3": "1"}  # lane 0 keeps GPU 0; the rest queue on GPU 1
    busy = {}
    for kind, gpu, lane_id in events:  # never two lanes at once on one GPU
        if kind == "start":
            assert gpu not in busy, f"lane {lane_id} started on GPU {gpu} while lane {busy[gpu]} ran"
            busy[gpu] = lane_id
        else:
            assert busy.pop(gpu) == lane_id
    assert "== lane 3 exit 0" in out


def test_enough_gpus_run_together_and_exit_codes_are_reported(tmp_path):
    out = run_lanes(tmp_path, 4, ["echo gpu=$CUDA_VISIBLE_DEVICES", "exit 3", "echo gpu=$CUDA_VISIBLE_DEVICES"])
    assert "gpu=0" in out and "gpu=2" in out
    assert "== lane 1 exit 3" in out
    assert (tmp_path / "lanes" / "lane2.txt").read_text().startswith("== lane 2 on GPU 2")
