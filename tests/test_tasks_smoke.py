"""The documented smoke run of every task, exactly as a user types it (``python -m lra task=<task>
model=transformer experiment=smoke``, plus the data source for the tasks that need one), through the CLI on CPU:
each finishes and writes one ok row. With ../shared/data the real IMDb and CIFAR-10 copies are used, else small
files in their original format. ``-m slow`` also checks the promise of the preset: under a minute each."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import SHARED_DATA, in_background
from tests.test_data_tasks import write_aan_release, write_cifar_parquet, write_imdb_parquet

SMOKE_BUDGET_S = 60


def data_option(task: str, root: Path) -> list[str]:
    """The data option ``task`` needs (none for the generated ones), its small files written under ``root`` where
    ../shared/data has no real copy."""
    if task == "retrieval":
        return [f"data.root={write_aan_release(root)}"]
    if task in ("text", "image"):
        real, write = (SHARED_DATA / "imdb", write_imdb_parquet) if task == "text" else \
            (SHARED_DATA / "cifar10", write_cifar_parquet)
        return [f"data.path={real if real.exists() else write(root)}"]
    return []


def smoke_command(task: str, options: list[str], folder: Path, environ: dict[str, str] | None = None
                  ) -> subprocess.CompletedProcess:
    """The documented command, run in a fresh folder with a cold cache, in ``environ`` (default: this process's)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**(os.environ if environ is None else environ), "LRA_CACHE_DIR": str(folder / "cache"),
           "LRA_RESULTS_DIR": str(folder / "results")}
    return subprocess.run([sys.executable, "-m", "lra", f"task={task}", "model=transformer", "experiment=smoke",
                           *options, f"hydra.run.dir={folder / 'run'}"], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=900)


def check_row(task: str, proc: subprocess.CompletedProcess, folder: Path) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = pd.read_csv(folder / "results" / "runs.csv")
    assert len(rows) == 1 and rows.status[0] == "ok" and rows.task[0] == task and rows.experiment[0] == "smoke"
    assert 0.0 <= rows.test_acc[0] <= 1.0
    assert rows.val_is_test[0] == (task == "text")  # IMDb has no validation split: Text validates on test


def smoke_cli(task: str, options: list[str], tmp_path) -> float:
    """Run the documented command in a fresh folder with a cold cache, check its row; return its wall time."""
    start = time.perf_counter()
    proc = smoke_command(task, options, tmp_path)
    seconds = time.perf_counter() - start
    check_row(task, proc, tmp_path)
    return seconds


TASKS = ["listops", "text", "retrieval", "image", "pathfinder", "pathx"]


# the documented command with a shorter schedule (4 steps, not 20) and 8 examples per evaluation split, not 32
# (the two validations and two tests of 32 long sequences were most of its time): every stage of the run, at a
# fraction of the time; the slow test below runs it unchanged
SHORTER = {task: ["schedule.steps=4", "schedule.eval_every=2", "data.limit.val=8", "data.limit.test=8"]
           for task in TASKS}
# Path-X's preset is 4 steps already, each about 4 s at 16,384 tokens on 2 cores, after generating 20 images (6 s):
# 2 steps and one image per evaluation split (10 images to generate) still take every stage, in 18 s, not 30
SHORTER["pathx"] = ["schedule.steps=2", "schedule.eval_every=2", "data.limit.val=1", "data.limit.test=1"]


def shortened_run(folder: Path, environ: dict[str, str], task: str) -> subprocess.CompletedProcess:
    """The shortened command of ``task`` in ``folder``, its data source (if it needs one) under folder/sources. Run
    in the background (``in_background``): a run spends its first seconds starting Python and importing torch on one
    core, and the tests beside it most of theirs on one core."""
    return smoke_command(task, data_option(task, folder / "sources") + SHORTER[task], folder, environ)


@pytest.mark.parametrize("task", TASKS)
@in_background(shortened_run)
def test_documented_smoke_run(task, ran_in_background):
    run, folder = ran_in_background()
    check_row(task, run, folder)


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_documented_smoke_run_takes_under_a_minute(task, tmp_path):
    """Wall time on a quiet 2-core machine; a busy one breaks it, hence ``slow`` (not in the default run)."""
    seconds = smoke_cli(task, data_option(task, tmp_path), tmp_path)
    assert seconds < SMOKE_BUDGET_S, f"{task}: the smoke run took {seconds:.0f} s"
