"""runs.csv appends: atomic under concurrency, schema-checked, schema changes handled; the committed unfinished runs
still resume."""
from __future__ import annotations

import multiprocessing as mp
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf

from lra.config import unnamed_keys, validate
from lra.provenance import config_hash, is_stopped
from lra.report.results import LAYER_BENCH_COLUMNS, RUN_COLUMNS, append_row, git_sha
from lra.train.checkpoint import RunFiles
from tests.conftest import ROOT, compose_cfg

UNFINISHED = ROOT / "results" / "unfinished"  # sweep folders, as under outputs/multirun


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
    from lra.report.results import merge_rows

    remote, local = tmp_path / "remote.csv", tmp_path / "runs.csv"
    for i in range(3):
        append_row(remote, {"task": "listops", "model": f"m{i}", "seed": 0, "status": "ok", "config_hash": f"h{i}",
                            "timestamp": f"2026-01-0{i + 1}T00:00:00Z", "run_dir": f"/r/{i}", "test_acc": 0.5},
                   RUN_COLUMNS)
    append_row(local, pd.read_csv(remote).iloc[0].dropna().to_dict(), RUN_COLUMNS)
    assert merge_rows(remote, local) == 2 and merge_rows(remote, local) == 0
    merged = pd.read_csv(local)
    assert list(merged.model) == ["m0", "m1", "m2"] and list(merged.columns) == RUN_COLUMNS


def test_merging_a_machines_rows_brings_their_curves_along(tmp_path, capsys):
    from lra.report.results import curve_path, main, write_curve

    remote, local = tmp_path / "remote", tmp_path / "results"
    row = {"task": "image", "model": "s4d", "seed": 0, "experiment": "s4d_lra", "status": "ok", "config_hash": "h0",
           "timestamp": "2026-01-01T00:00:00Z", "run_dir": "/r/0", "test_acc": 0.8}
    append_row(remote / "runs.csv", row, RUN_COLUMNS)
    history = [{"step": 900, "train_loss": 1.5, "val_acc": 0.4, "lr": 0.01}, {"step": 1800, "train_loss": 1.1,
                                                                              "val_acc": 0.55, "lr": 0.009}]
    assert write_curve(remote, row, history).name == "image_s4d_s4d_lra_seed0_h0_20260101T000000Z.csv"
    assert write_curve(remote, {**row, "timestamp": "x"}, []) is None  # a run that never evaluated: no curve
    main([str(remote / "runs.csv"), "--into", str(local / "runs.csv")])
    curve = pd.read_csv(curve_path(local, row))
    assert curve.to_dict("records") == history and "1 curves copied" in capsys.readouterr().out
    main([str(remote / "runs.csv"), "--into", str(local / "runs.csv")])  # again: nothing new
    assert "curves copied" not in capsys.readouterr().out and len(pd.read_csv(local / "runs.csv")) == 1


def test_merge_keeps_each_kind_of_rows_in_its_own_schema(tmp_path):
    """A layer bench's rows (ours and a package's at one timestamp) merge into a layer_bench.csv with its own
    header; merging them into a runs.csv is refused, never a file with both headers."""
    from lra.report.results import merge_rows

    remote, local, runs = tmp_path / "remote.csv", tmp_path / "layer_bench.csv", tmp_path / "runs.csv"
    for impl in ("lra performer", "performer-pytorch 1.1.4"):
        append_row(remote, {"model": "performer", "seq_len": 4096, "batch_size": 32, "status": "ok", "ms_fwd_bwd": 4.8,
                            "timestamp": "2026-01-01T00:00:00Z", "implementation": impl}, LAYER_BENCH_COLUMNS)
    assert merge_rows(remote, local) == 2 and merge_rows(remote, local) == 0
    assert list(pd.read_csv(local).columns) == LAYER_BENCH_COLUMNS
    append_row(runs, {"task": "listops", "model": "m", "seed": 0, "status": "ok"}, RUN_COLUMNS)
    with pytest.raises(ValueError, match="different kinds of rows"):
        merge_rows(remote, runs)
    assert list(pd.read_csv(runs).columns) == RUN_COLUMNS
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="fit none of"):
        merge_rows(tmp_path / "other.csv", local)


@pytest.mark.parametrize("run_dir", sorted(p.parent for p in UNFINISHED.glob("**/checkpoint.pt")),
                         ids=lambda p: str(p.relative_to(UNFINISHED)))
def test_an_unfinished_grid_run_still_resumes_by_its_sweeps_command(run_dir):
    """results/unfinished keeps the grid runs that a lease's end stopped, for the next machine to resume with the
    sweep's own command (docs/running.md). Each must still be what that command composes today: the folder the
    sweep gives the job (<sweep>/<task>/<model>/<overrides>) and the configuration hash of its checkpoint, which a
    resume checks (a changed default would make it refuse, and the steps done would be lost)."""
    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    cfg = compose_cfg([*overrides, "run_dir=x"])
    validate(cfg)
    chash = config_hash(OmegaConf.to_container(cfg, resolve=True))
    files = RunFiles(run_dir)  # read as a resume reads them
    checkpoint, result = files.load_checkpoint(), files.finished()
    assert checkpoint["config_hash"] == result["config_hash"] == chash
    assert is_stopped(result["status"]) and checkpoint["state"]["step"] == result["steps"]
    sweep, task, model, name = run_dir.relative_to(UNFINISHED).parts
    named = sorted(o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in unnamed_keys())
    assert (task, model, name) == (cfg.task.name, cfg.model.name, ",".join(named))
    assert f"sweep={sweep} " in (ROOT / "docs" / "running.md").read_text()  # a documented sweep's command resumes it
