"""The runner end to end on CPU: a smoke run writes a valid row, is reproducible, and resumes."""
from __future__ import annotations

import math

import pandas as pd
import pytest

import lra.run as runner
from lra.results import RUN_COLUMNS


def test_smoke_run_writes_a_valid_row(smoke_cfg, tmp_path):
    row = runner.run(smoke_cfg())
    df = pd.read_csv(tmp_path / "results" / "runs.csv")
    assert list(df.columns) == RUN_COLUMNS and len(df) == 1
    got = df.iloc[0]
    assert (got.task, got.model, got.trainer, got.steps, got.seq_len) == ("listops", "transformer", "smoke", 30, 2000)
    for col in ("val_acc", "test_acc", "final_val_acc", "final_test_acc"):
        assert 0.0 <= got[col] <= 1.0
    assert got.train_steps_per_s > 0 and math.isclose(got.examples_per_s, got.train_steps_per_s * 8, rel_tol=1e-4)
    assert got.peak_mem_mb > 0 and got.params == row["params"] > 0
    assert got.best_step in (15, 30) and got.device.startswith("cpu") and got.precision == "fp32"
    assert len(str(got.config_hash)) == 12 and (tmp_path / "run" / "result.json").exists()


def test_same_seed_same_metrics_and_rerun_starts_over(smoke_cfg, tmp_path):
    first = runner.run(smoke_cfg("train.steps=12", "train.eval_every=6"))
    second = runner.run(smoke_cfg("train.steps=12", "train.eval_every=6"))  # same dir, finished: rerun from scratch
    keys = ("val_acc", "test_acc", "final_val_acc", "final_test_acc", "best_step")
    assert [first[k] for k in keys] == [second[k] for k in keys]
    assert len(pd.read_csv(tmp_path / "results" / "runs.csv")) == 2


def test_resume_after_interrupt_equals_uninterrupted(smoke_cfg, tmp_path, monkeypatch):
    overrides = ("train.steps=16", "train.eval_every=4", "trainer.ckpt_every=100")
    reference = runner.run(smoke_cfg(*overrides, f"run_dir={tmp_path / 'ref'}"))

    calls = {"n": 0}
    real_step = runner._train_step

    def step_then_stop(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 7:  # as if SIGTERM arrived during step 7: the loop stops after it
            runner.STOP.requested = True
        return real_step(*args, **kwargs)

    monkeypatch.setattr(runner, "_train_step", step_then_stop)
    with pytest.raises(runner.RunInterrupted, match="stopped at step 7"):
        runner.run(smoke_cfg(*overrides))
    assert (tmp_path / "run" / runner.CHECKPOINT).exists()
    assert len(pd.read_csv(tmp_path / "results" / "runs.csv")) == 1  # only the reference run's row
    monkeypatch.setattr(runner, "_train_step", real_step)
    resumed = runner.run(smoke_cfg(*overrides, "resume=true"))
    assert calls["n"] == 7  # the resumed run did the other 9 steps with the real step function
    for k in ("val_acc", "test_acc", "final_val_acc", "final_test_acc", "best_step", "steps"):
        assert resumed[k] == reference[k], k
    again = runner.run(smoke_cfg(*overrides, "resume=true"))  # finished: returns the result, no new row
    assert again["timestamp"] == resumed["timestamp"]
    assert len(pd.read_csv(tmp_path / "results" / "runs.csv")) == 2


def interrupt_after_one_step(cfg, monkeypatch) -> None:
    """Run ``cfg`` as if SIGTERM arrived during its first step: it checkpoints and raises RunInterrupted."""
    monkeypatch.setattr(runner.STOP, "requested", False)
    real_step = runner._train_step

    def stop_now(*args, **kwargs):
        runner.STOP.requested = True
        return real_step(*args, **kwargs)

    monkeypatch.setattr(runner, "_train_step", stop_now)
    with pytest.raises(runner.RunInterrupted):
        runner.run(cfg)
    monkeypatch.setattr(runner, "_train_step", real_step)


def test_resume_refuses_a_different_config(smoke_cfg, monkeypatch):
    interrupt_after_one_step(smoke_cfg("train.steps=8"), monkeypatch)
    with pytest.raises(RuntimeError, match="different configuration"):
        runner.run(smoke_cfg("train.steps=8", "optim.lr=0.01"))
    with pytest.raises(FileNotFoundError, match="resume=true"):
        runner.run(smoke_cfg("train.steps=8", "resume=true", "run_dir=/nonexistent-lra-test-dir/x"))


def test_lra_schedules():
    # rsqrt: linear warm-up to base/sqrt(warmup), then base/sqrt(t) (LRA's ListOps: peak 1.58e-3 at 1000)
    assert 0.05 * runner.lr_factor(1000, "rsqrt", 1000, 5000) == pytest.approx(1.581e-3, rel=1e-3)
    assert 0.05 * runner.lr_factor(5000, "rsqrt", 1000, 5000) == pytest.approx(7.07e-4, rel=1e-3)
    assert runner.lr_factor(500, "rsqrt", 1000, 5000) == pytest.approx(0.5 / math.sqrt(1000))
    assert runner.lr_factor(100, "cosine", 100, 1100) == pytest.approx(1.0)
    assert runner.lr_factor(600, "cosine", 100, 1000) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="rsqrt, cosine or constant"):
        runner.lr_factor(1, "linear", 1, 1)


def test_wandb_offline_logging(smoke_cfg, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional; install the [wandb] extra to test its logger")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    runner.run(smoke_cfg("logger=wandb", "logger.mode=offline", "train.steps=4", "train.eval_every=2"))
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_a_run_resumed_on_other_hardware_names_both_devices_and_commits(smoke_cfg, monkeypatch):
    interrupt_after_one_step(smoke_cfg("train.steps=6", "train.eval_every=3"), monkeypatch)
    monkeypatch.setattr(runner, "device_name", lambda device: "Other GPU")
    monkeypatch.setenv("LRA_GIT_SHA", "0123456789ab")
    row = runner.run(smoke_cfg("train.steps=6", "train.eval_every=3", "resume=true"))
    first, second = row["device"].split(" + ")
    assert first.startswith("cpu") and second == "Other GPU"
    assert row["git_sha"].endswith(" + 0123456789ab") and not row["git_sha"].startswith("0123456789ab")
