"""The documented smoke run of every task, exactly as a user types it (``python -m lra task=<task>
model=transformer experiment=smoke``, plus the data source for the tasks that need one), through the CLI on CPU:
each finishes and writes one ok row. With ../shared/data the real IMDb and CIFAR-10 copies are used, else small
files in their original format. ``-m slow`` also checks the promise of the preset: under a minute each."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pandas as pd
import pytest

from tests.conftest import ROOT, SHARED_DATA
from tests.test_data_tasks import aan_root, cifar_parquet, imdb_parquet  # noqa: F401 (fixtures)

SMOKE_BUDGET_S = 60


@pytest.fixture
def sources(tmp_path, imdb_parquet, cifar_parquet, aan_root):  # noqa: F811
    """The data option each task needs (none for the generated ones)."""
    real = {"text": SHARED_DATA / "imdb", "image": SHARED_DATA / "cifar10"}
    return {"listops": [], "pathfinder": [], "pathx": [], "retrieval": [f"data.root={aan_root}"],
            "text": [f"data.path={real['text'] if real['text'].exists() else imdb_parquet}"],
            "image": [f"data.path={real['image'] if real['image'].exists() else cifar_parquet}"]}


def smoke_cli(task: str, options: list[str], tmp_path) -> float:
    """Run the documented command in a fresh folder with a cold cache; return its wall time."""
    env = {**os.environ, "LRA_CACHE_DIR": str(tmp_path / "cache"), "LRA_RESULTS_DIR": str(tmp_path / "results")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lra", f"task={task}", "model=transformer", "experiment=smoke",
                           *options, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = pd.read_csv(tmp_path / "results" / "runs.csv")
    assert len(rows) == 1 and rows.status[0] == "ok" and rows.task[0] == task and rows.experiment[0] == "smoke"
    assert 0.0 <= rows.test_acc[0] <= 1.0
    assert rows.val_is_test[0] == (task == "text")  # IMDb has no validation split: Text validates on test
    return seconds


TASKS = ["listops", "text", "retrieval", "image", "pathfinder", "pathx"]


# the documented command with a shorter schedule (4 steps, not 20): every stage of the run, at a fifth of the
# time; the slow test below runs it unchanged
SHORTER = ["schedule.steps=4", "schedule.eval_every=2"]


@pytest.mark.parametrize("task", TASKS)
def test_documented_smoke_run(task, sources, tmp_path):
    smoke_cli(task, sources[task] + SHORTER, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_documented_smoke_run_takes_under_a_minute(task, sources, tmp_path):
    """Wall time on a quiet 2-core machine; a busy one breaks it, hence ``slow`` (not in the default run)."""
    seconds = smoke_cli(task, sources[task], tmp_path)
    assert seconds < SMOKE_BUDGET_S, f"{task}: the smoke run took {seconds:.0f} s"


def test_runs_from_another_folder_write_under_it(sources, tmp_path):
    """Outputs of an unconfigured run go to ./outputs of the folder it runs in, never into the project's results/."""
    before = (ROOT / "results" / "runs.csv").read_bytes()
    env = {**os.environ, "LRA_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("LRA_RESULTS_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "lra", "experiment=smoke", "schedule.steps=2",
                           "schedule.eval_every=2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(pd.read_csv(tmp_path / "outputs" / "results" / "runs.csv")) == 1
    assert (ROOT / "results" / "runs.csv").read_bytes() == before
