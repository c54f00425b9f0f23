"""runs.csv appends: atomic under concurrency, schema-checked, schema changes handled."""
from __future__ import annotations

import multiprocessing as mp
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from lra.results import RUN_COLUMNS, append_row, git_sha


def _writer(path: str, worker: int, n: int) -> None:
    for i in range(n):
        append_row(path, {"task": "listops", "model": f"m{worker}", "seed": i, "overrides": "x" * 2000}, RUN_COLUMNS)


def test_concurrent_appends_never_lose_or_corrupt_rows(tmp_path):
    path = tmp_path / "runs.csv"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), w, 50)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    df = pd.read_csv(path)
    assert list(df.columns) == RUN_COLUMNS and len(df) == 200
    assert sorted(df.groupby("model").seed.apply(sorted).tolist()) == [list(range(50))] * 4
    assert (df.overrides.str.len() == 2000).all()


def test_unknown_column_is_an_error(tmp_path):
    with pytest.raises(KeyError, match="not in the schema"):
        append_row(tmp_path / "r.csv", {"task": "x", "acuracy": 1}, RUN_COLUMNS)


def test_older_schema_is_widened(tmp_path):
    path = tmp_path / "r.csv"
    append_row(path, {"a": 1}, ["a"])
    append_row(path, {"a": 2, "b": 3}, ["a", "b"])
    df = pd.read_csv(path)
    assert list(df.columns) == ["a", "b"] and df.a.tolist() == [1, 2] and pd.isna(df.b[0]) and df.b[1] == 3


def test_git_sha_names_this_checkout_and_the_override_wins(monkeypatch):
    monkeypatch.delenv("LRA_GIT_SHA", raising=False)
    sha = git_sha()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    if head.returncode == 0:
        assert sha.removesuffix("+dirty") == head.stdout.strip()[:12]
    monkeypatch.setenv("LRA_GIT_SHA", "0123456789ab")
    assert git_sha() == "0123456789ab"


def test_merge_appends_only_new_rows(tmp_path):
    from lra.results import merge_rows

    remote, local = tmp_path / "remote.csv", tmp_path / "runs.csv"
    for i in range(3):
        append_row(remote, {"task": "listops", "model": f"m{i}", "seed": 0, "status": "ok", "config_hash": f"h{i}",
                            "timestamp": f"2026-01-0{i + 1}T00:00:00Z", "run_dir": f"/r/{i}", "test_acc": 0.5},
                   RUN_COLUMNS)
    append_row(local, pd.read_csv(remote).iloc[0].dropna().to_dict(), RUN_COLUMNS)
    assert merge_rows(remote, local) == 2 and merge_rows(remote, local) == 0
    merged = pd.read_csv(local)
    assert list(merged.model) == ["m0", "m1", "m2"] and list(merged.columns) == RUN_COLUMNS
