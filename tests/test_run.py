"""The runner end to end on CPU: a smoke run writes a valid row, is reproducible, resumes, never records a wrong
number (divergence, empty splits), survives bad checkpoints, and refuses unwritable folders at start."""
from __future__ import annotations

import logging
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from itertools import count
from pathlib import Path

import pandas as pd
import pytest
import torch

import lra.train.run as runner
from lra.data import Split
from lra.errors import ConfigError, DataError
from lra.provenance import departures
from lra.report.results import RUN_COLUMNS, curve_path
from lra.train import engine
from lra.train.checkpoint import RunFiles
from tests.conftest import ROOT, in_background

TINY = ("task.seq_len=256", "backbone.n_layers=1")  # the runner's behaviour, not the model's: short and shallow
SHORT = (*TINY, "schedule.steps=12", "schedule.eval_every=6")


def rows(tmp_path) -> pd.DataFrame:
    return pd.read_csv(tmp_path / "results" / "runs.csv")


def rows_a_minute_apart(monkeypatch) -> None:
    """Each row the runner records from here on is timed a minute after the last (from 2000-01-01), where a test
    slept a second between rows: curves are named by what ran and the row's time, to the second, so two rows of one
    run within a second would share a curve file."""
    minutes = count()
    start = datetime(2000, 1, 1, tzinfo=timezone.utc)
    monkeypatch.setattr(runner, "now_iso", lambda: (start + timedelta(minutes=next(minutes))).strftime(
        "%Y-%m-%dT%H:%M:%SZ"))


def test_smoke_run_writes_a_valid_row(smoke_cfg, tmp_path):
    # the preset at a fifth of its steps, and 8 examples per evaluation split, not 32 (their four passes at 2,000
    # tokens were most of its time)
    row = runner.run(smoke_cfg("schedule.steps=4", "schedule.eval_every=2", "data.limit.val=8", "data.limit.test=8"))
    df = rows(tmp_path)
    assert list(df.columns) == RUN_COLUMNS and len(df) == 1
    got = df.iloc[0]
    assert (got.task, got.model, got.experiment, got.status, got.steps, got.seq_len) == \
        ("listops", "transformer", "smoke", "ok", 4, 2000)
    for col in ("val_acc", "test_acc", "final_val_acc", "final_test_acc", "val_majority", "val_baseline"):
        assert 0.0 <= got[col] <= 1.0
    assert got.val_baseline >= got.val_majority  # the stall baseline is never below the prior
    assert got.train_steps_per_s > 0 and math.isclose(got.examples_per_s, got.train_steps_per_s * 8, rel_tol=1e-4)
    assert got.peak_mem_mb > 0 and got.params == row["params"] > 0 and got.eval_every == 2 and got.devices == 1
    assert got.best_step in (2, 4) and got.device.startswith("cpu") and got.precision == "fp32"
    assert len(str(got.config_hash)) == 12 and (tmp_path / "run" / "result.json").exists()


def test_a_preset_changed_on_the_command_line_is_said_at_the_start(smoke_cfg, monkeypatch, caplog):
    cfg = smoke_cfg(*SHORT)
    cfg.experiment = "lra"  # a full preset's name: smoke runs are short by design, their overrides say nothing
    monkeypatch.setattr(runner, "_overrides", lambda: "task=listops backbone.n_layers=1 trainer.progress=false")
    with caplog.at_level(logging.WARNING, logger="lra"):
        runner.run(cfg)
    assert "backbone.n_layers=1 changes what experiment=lra computes" in caplog.text and "lra+modified" in caplog.text


def test_same_seed_same_metrics_a_finished_run_is_not_rerun(smoke_cfg, tmp_path):
    first = runner.run(smoke_cfg(*SHORT))
    again = runner.run(smoke_cfg(*SHORT))  # finished: says so, returns its row, appends nothing
    assert again["timestamp"] == first["timestamp"] and len(rows(tmp_path)) == 1
    second = runner.run(smoke_cfg(*SHORT, "resume=false"))  # the flag that forces a rerun
    keys = ("val_acc", "test_acc", "final_val_acc", "final_test_acc", "best_step")
    assert [first[k] for k in keys] == [second[k] for k in keys]
    assert len(rows(tmp_path)) == 2


def test_stop_at_ends_a_run_early_as_stopped_and_it_resumes_to_the_full_run(smoke_cfg, tmp_path, monkeypatch):
    """schedule.stop_at: a row that says where the run stopped (never ok), its validation curve beside runs.csv;
    the same command again adds nothing; without stop_at the run goes on from its checkpoint, and ends as the
    uninterrupted run does (the learning rate spanned all the steps throughout)."""
    overrides = (*TINY, "schedule.steps=12", "schedule.eval_every=3", "trainer.ckpt_every=100")
    rows_a_minute_apart(monkeypatch)
    reference = runner.run(smoke_cfg(*overrides, f"run_dir={tmp_path / 'ref'}"))
    stopped = runner.run(smoke_cfg(*overrides, "schedule.stop_at=6"))
    assert stopped["status"] == "stopped: at step 6 of 12" and stopped["steps"] == 6
    assert 0 <= stopped["test_acc"] <= 1 and stopped["train_steps_per_s"] > 0 and stopped["peak_mem_mb"] > 0
    assert stopped["config_hash"] == reference["config_hash"]  # where it stops is not what it computes
    curve = pd.read_csv(curve_path(tmp_path / "results", stopped))
    assert list(curve.columns) == ["step", "train_loss", "val_acc", "lr"] and curve["step"].tolist() == [3, 6]
    assert runner.run(smoke_cfg(*overrides, "schedule.stop_at=6"))["timestamp"] == stopped["timestamp"]
    assert len(rows(tmp_path)) == 2
    finished = runner.run(smoke_cfg(*overrides))
    assert finished["status"] == "ok" and finished["steps"] == 12
    for k in ("val_acc", "test_acc", "final_val_acc", "final_test_acc", "best_step"):
        assert finished[k] == reference[k], k
    reference_curve, finished_curve = (pd.read_csv(curve_path(tmp_path / "results", r)) for r in (reference, finished))
    assert finished_curve["step"].tolist() == [3, 6, 9, 12]  # the resumed run's curve goes on from the stop's
    pd.testing.assert_frame_equal(finished_curve, reference_curve)
    assert len(list((tmp_path / "results" / "curves").iterdir())) == 3  # the stopped row keeps its own
    with pytest.raises(ConfigError, match="schedule.stop_at=13 is not valid"):
        runner.run(smoke_cfg(*overrides, "schedule.stop_at=13"))


def test_time_limit_ends_a_run_where_its_minutes_run_out_as_stopped_and_the_same_command_goes_on(
        smoke_cfg, tmp_path, monkeypatch):
    """trainer.time_limit: the run ends at the step its minutes ran out, evaluated there (off the cadence too, as
    stop_at), checkpointed and tested, in a `stopped` row; the same command trains another slice from there, and a
    run without the limit ends with the weights of an uninterrupted run. The clock is a counter, a minute a reading
    (one as the loop starts, one before each step): no wall-clock assert."""
    overrides = (*TINY, "schedule.steps=12", "schedule.eval_every=4", "trainer.ckpt_every=100")
    rows_a_minute_apart(monkeypatch)
    reference = runner.run(smoke_cfg(*overrides, f"run_dir={tmp_path / 'ref'}"))
    readings = iter(range(10_000))
    monkeypatch.setattr(runner, "clock", lambda: 60.0 * next(readings))
    first = runner.run(smoke_cfg(*overrides, "trainer.time_limit=6"))  # the 6th reading in the loop: before step 6
    assert first["status"] == "stopped: at step 5 of 12" and first["steps"] == 5
    assert 0 <= first["test_acc"] <= 1 and first["config_hash"] == reference["config_hash"]
    assert pd.read_csv(curve_path(tmp_path / "results", first))["step"].tolist() == [4, 5]
    second = runner.run(smoke_cfg(*overrides, "trainer.time_limit=6"))  # from step 5, five more steps
    assert second["status"] == "stopped: at step 10 of 12"
    assert pd.read_csv(curve_path(tmp_path / "results", second))["step"].tolist() == [4, 5, 8, 10]
    finished = runner.run(smoke_cfg(*overrides))
    assert finished["status"] == "ok" and finished["steps"] == 12 and len(rows(tmp_path)) == 4
    for k in ("final_val_acc", "final_test_acc"):  # the same weights at the end: slices change no step
        assert finished[k] == reference[k], k
    curve = pd.read_csv(curve_path(tmp_path / "results", finished)).set_index("step")
    want = pd.read_csv(curve_path(tmp_path / "results", reference)).set_index("step")
    pd.testing.assert_frame_equal(curve.loc[[4, 8, 12], ["val_acc", "lr"]], want.loc[[4, 8, 12], ["val_acc", "lr"]])
    with pytest.raises(ConfigError, match=r"trainer.time_limit=0.0 is not valid"):
        runner.run(smoke_cfg(*overrides, "trainer.time_limit=0"))


def stop_during_step(monkeypatch, n: int, signum: int | None = None) -> dict:
    """Make step ``n`` behave as if a signal arrived during it: the loop stops after it."""
    calls = {"n": 0}
    real_step = engine.train_step

    def step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            runner.STOP.requested, runner.STOP.signum = True, signum
        return real_step(*args, **kwargs)

    monkeypatch.setattr(engine, "train_step", step)
    return calls


def test_resume_after_interrupt_equals_uninterrupted(smoke_cfg, tmp_path, monkeypatch):
    overrides = (*TINY, "schedule.steps=16", "schedule.eval_every=4", "trainer.ckpt_every=100")
    reference = runner.run(smoke_cfg(*overrides, f"run_dir={tmp_path / 'ref'}"))
    real_step = engine.train_step
    calls = stop_during_step(monkeypatch, 7)
    with pytest.raises(runner.RunInterrupted, match="stopped at step 7"):
        runner.run(smoke_cfg(*overrides))
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    assert len(rows(tmp_path)) == 1  # only the reference run's row
    monkeypatch.setattr(engine, "train_step", real_step)
    resumed = runner.run(smoke_cfg(*overrides, "resume=true"))
    assert calls["n"] == 7  # the resumed run did the other 9 steps with the real step function
    for k in ("val_acc", "test_acc", "final_val_acc", "final_test_acc", "best_step", "steps"):
        assert resumed[k] == reference[k], k
    assert len(rows(tmp_path)) == 2


@pytest.mark.gpu
def test_a_run_interrupted_on_cuda_resumes_there(smoke_cfg, tmp_path, monkeypatch):
    """The checkpoint's RNG states must reach torch and numpy as CPU tensors however the run's device is named."""
    overrides = (*TINY, "schedule.steps=8", "schedule.eval_every=4", "device=cuda")
    interrupt_after_one_step(smoke_cfg(*overrides), monkeypatch)
    resumed = runner.run(smoke_cfg(*overrides, "resume=true"))
    assert resumed["status"] == "ok" and resumed["steps"] == 8 and not resumed["device"].startswith("cpu")


@pytest.mark.gpu
def test_a_checkpoint_from_a_host_with_more_gpus_resumes_on_cuda(smoke_cfg, tmp_path, monkeypatch):
    """Checkpoints once held every GPU's generator: one from a 4-GPU host failed to resume on a 2-GPU host."""
    overrides = (*TINY, "schedule.steps=8", "schedule.eval_every=4", "device=cuda")
    interrupt_after_one_step(smoke_cfg(*overrides), monkeypatch)
    path = tmp_path / "run" / "checkpoint.pt"
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["rng"]["cuda"] = [checkpoint["rng"]["cuda"]] * (torch.cuda.device_count() + 2)
    torch.save(checkpoint, path)
    resumed = runner.run(smoke_cfg(*overrides, "resume=true"))
    assert resumed["status"] == "ok" and resumed["steps"] == 8


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["ids", "packed"])
def test_a_batch_reaches_the_gpu_without_waiting_for_its_queued_work(packed):
    """The host prepares step k+1's batch while the GPU still runs step k. A copy from pageable memory (as the
    labels' once were) makes the host wait for the GPU's whole queue at every step."""
    torch.manual_seed(0)
    tokens = torch.randint(1, 50, (64, 512))
    tokens[::2, 300:] = 0  # padding, so that packing has something to pack
    split, rows, cuda = Split(tokens, torch.randint(0, 10, (64,))), torch.randperm(64)[:32], torch.device("cuda")
    runner.device_batch(split, rows, cuda, packed)  # the CUDA context and the pinned buffers exist from here on
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(2_000_000_000)  # about a second of queued GPU work
    inputs, labels = runner.device_batch(split, rows, cuda, packed)
    returned = time.perf_counter()
    torch.cuda.synchronize()
    queued = time.perf_counter() - start
    assert returned - start < 0.25 * queued, f"the batch took {returned - start:.3f} s of {queued:.3f} s queued"
    assert labels.is_cuda and all(t.is_cuda for t in inputs)
    assert torch.equal(labels.cpu(), split.labels[rows])


def interrupt_after_one_step(cfg, monkeypatch) -> None:
    real_step = engine.train_step
    stop_during_step(monkeypatch, 1)
    with pytest.raises(runner.RunInterrupted):
        runner.run(cfg)
    monkeypatch.setattr(engine, "train_step", real_step)


@pytest.mark.parametrize("devices", [1, 2])
def test_a_run_folder_another_process_is_running_is_refused(smoke_cfg, tmp_path, devices):
    """Two processes training one run would overwrite each other's checkpoints and append two rows. A data-parallel
    run is refused before its ranks start, and its ranks train in the folder their parent holds."""
    (tmp_path / "run").mkdir()
    hold = ("import sys, time; from filelock import FileLock; lock = FileLock(sys.argv[1]); lock.acquire(); "
            "print('held', flush=True); time.sleep(120)")
    other = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "run" / "run.lock")], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match="in use: another process is running this run"):
            runner.run(smoke_cfg(*SHORT, f"trainer.devices={devices}"))
    finally:
        other.kill()
        other.wait()
    assert runner.run(smoke_cfg(*SHORT, f"trainer.devices={devices}"))["status"] == "ok"  # the other has ended
    assert len(rows(tmp_path)) == 1


def test_resume_refuses_a_different_config(smoke_cfg, monkeypatch):
    interrupt_after_one_step(smoke_cfg(*TINY, "schedule.steps=8"), monkeypatch)
    with pytest.raises(ConfigError, match="different configuration"):
        runner.run(smoke_cfg(*TINY, "schedule.steps=8", "optim.lr=0.01"))
    with pytest.raises(ConfigError, match="resume=true"):
        runner.run(smoke_cfg(*TINY, "schedule.steps=8", "resume=true", "run_dir=/tmp/lra-test-no-such-run/x"))


def test_a_truncated_checkpoint_falls_back_to_the_previous_one(smoke_cfg, tmp_path, monkeypatch, caplog):
    overrides = (*TINY, "schedule.steps=12", "schedule.eval_every=4", "trainer.ckpt_every=4")
    reference = runner.run(smoke_cfg(*overrides, f"run_dir={tmp_path / 'ref'}"))
    real_step = engine.train_step
    stop_during_step(monkeypatch, 10)  # checkpoints at 4 and 8; the stop at 10 writes the latest
    with pytest.raises(runner.RunInterrupted):
        runner.run(smoke_cfg(*overrides))
    monkeypatch.setattr(engine, "train_step", real_step)
    files = RunFiles(tmp_path / "run")
    files.checkpoint.write_bytes(files.checkpoint.read_bytes()[:1000])  # truncated, as by a full disk
    resumed = runner.run(smoke_cfg(*overrides))
    assert "checkpoint.pt is unreadable" in caplog.text and "previous checkpoint" in caplog.text
    for k in ("val_acc", "test_acc", "final_test_acc", "steps"):
        assert resumed[k] == reference[k], k


def test_checkpoints_never_unpickle_code(smoke_cfg, tmp_path, monkeypatch, caplog):
    """A crafted checkpoint.pt that runs code when unpickled is refused, not executed; the warning says it was
    refused and why, never torch's advice to load it with weights_only=False."""
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torch.save({"state": Exploit()}, run_dir / "checkpoint.pt", pickle_protocol=pickle.DEFAULT_PROTOCOL)
    with caplog.at_level(logging.WARNING, logger="lra"):
        row = runner.run(smoke_cfg(*TINY, "schedule.steps=2", "schedule.eval_every=2"))  # starts over, saying so
    assert not marker.exists() and row["steps"] == 2
    warning = next(r.getMessage() for r in caplog.records if "checkpoint.pt is unreadable" in r.getMessage())
    assert "torch's weights-only loader refused it: " in warning, warning
    assert "weights_only" not in warning and "Re-running" not in warning and "\n" not in warning


def test_a_nan_loss_is_recorded_as_diverged_without_accuracies(smoke_cfg, tmp_path):
    row = runner.run(smoke_cfg(*TINY, "optim.lr=1e30", "schedule.steps=40", "schedule.eval_every=20"))
    assert row["status"] == "diverged" and row["steps"] < 40
    got = rows(tmp_path).iloc[0]
    assert got.status == "diverged"
    assert all(pd.isna(got[c]) for c in ("val_acc", "test_acc", "final_test_acc", "train_steps_per_s"))


def test_a_run_that_fails_while_building_records_where_and_why(smoke_cfg, tmp_path, monkeypatch, caplog):
    """An error before the first step (here, resuming) still gives a row naming the device and commit, and the run's
    log holds the traceback (the launcher only sees the exception's message)."""
    interrupt_after_one_step(smoke_cfg(*SHORT), monkeypatch)

    def broken(state, device):
        raise IndexError("tuple index out of range")

    monkeypatch.setattr(runner, "set_rng_state", broken)
    monkeypatch.setenv("LRA_GIT_SHA", "0123456789ab")
    with caplog.at_level(logging.ERROR, logger="lra"), pytest.raises(IndexError):
        runner.run(smoke_cfg(*SHORT, "resume=true"))
    got = rows(tmp_path).iloc[-1]
    assert got.status == "error: IndexError: tuple index out of range"
    assert got.device.startswith("cpu") and got.git_sha == "0123456789ab"
    assert "Traceback" in caplog.text and "in broken" in caplog.text


def test_a_checkpoint_keeps_the_generator_of_its_own_gpu_only(monkeypatch):
    """A run resumes on whichever GPU is free, of a host that may have fewer GPUs than the one that saved it: the
    checkpoint holds its own device's CUDA generator, and one written with every GPU's (as they once were) resumes
    on a host with fewer."""
    import lra.train.checkpoint as ckpt

    got, put = [], []
    monkeypatch.setattr(ckpt.torch.cuda, "get_rng_state", lambda device: got.append(device) or torch.ones(3))
    monkeypatch.setattr(ckpt.torch.cuda, "set_rng_state", lambda state, device: put.append((state, device)))
    cuda1 = torch.device("cuda", 1)
    state = ckpt.rng_state(cuda1)
    assert got == [cuda1] and torch.equal(state["cuda"], torch.ones(3))
    ckpt.set_rng_state(state, torch.device("cuda", 0))
    assert put[-1][1] == torch.device("cuda", 0) and torch.equal(put[-1][0], torch.ones(3))
    legacy = {**state, "cuda": [torch.full((3,), float(i)) for i in range(4)]}  # a 4-GPU host's, resumed on cuda:0
    ckpt.set_rng_state(legacy, torch.device("cuda", 0))
    assert len(put) == 2 and torch.equal(put[-1][0], torch.zeros(3))
    assert "cuda" not in ckpt.rng_state(torch.device("cpu"))
    ckpt.set_rng_state(legacy, torch.device("cpu"))  # a CUDA run resumed on the CPU leaves CUDA alone
    assert len(put) == 2


def test_an_empty_split_fails_at_start(smoke_cfg, tmp_path, monkeypatch):
    from lra.data import listops

    real = listops.read_tsv

    def empty_val(path, seq_len):
        split = real(path, seq_len)
        return split.head(0) if "val" in path.name else split

    monkeypatch.setattr(listops, "read_tsv", empty_val)
    with pytest.raises(DataError, match="the val split is empty"):  # a cold cache: the files are read, not a hit
        runner.run(smoke_cfg(*TINY, f"data.cache_dir={tmp_path / 'cache'}"))
    assert not (tmp_path / "results" / "runs.csv").exists()


def test_an_unwritable_results_folder_fails_at_start(smoke_cfg, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a folder should be")
    with pytest.raises(ConfigError, match="not writable"):
        runner.run(smoke_cfg(f"results.dir={blocked / 'results'}", f"data.cache_dir={tmp_path / 'cache'}"))
    assert not (tmp_path / "cache").exists()  # nothing was generated before the check


def test_lra_schedules():
    # rsqrt: linear warm-up to base/sqrt(warmup), then base/sqrt(t) (LRA's ListOps: peak 1.58e-3 at 1000)
    assert 0.05 * engine.lr_factor(1000, "rsqrt", 1000, 5000) == pytest.approx(1.581e-3, rel=1e-3)
    assert 0.05 * engine.lr_factor(5000, "rsqrt", 1000, 5000) == pytest.approx(7.07e-4, rel=1e-3)
    assert engine.lr_factor(500, "rsqrt", 1000, 5000) == pytest.approx(0.5 / math.sqrt(1000))
    assert engine.lr_factor(100, "cosine", 100, 1100) == pytest.approx(1.0)
    assert engine.lr_factor(600, "cosine", 100, 1000) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="rsqrt, cosine or constant"):
        engine.lr_factor(1, "linear", 1, 1)


def test_parameter_groups_honour_optim_attributes():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight._optim = {"lr": 1e-3, "weight_decay": 0.0}
    groups = engine.parameter_groups(model, weight_decay=0.1)
    assert [len(g["params"]) for g in groups] == [3, 1]
    assert groups[0]["weight_decay"] == 0.1 and groups[1] == {"params": [model[1].weight], "lr": 1e-3,
                                                              "weight_decay": 0.0}


def test_wandb_offline_logging(smoke_cfg, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional; install the [wandb] extra to test its logger")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "600")  # a busy machine starts the wandb service slowly
    runner.run(smoke_cfg(*TINY, "logger=wandb", "logger.mode=offline", "schedule.steps=4", "schedule.eval_every=2"))
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


class WandbStub:
    """wandb as the runner uses it, recording: ``init``'s arguments, what is logged (step, data), the summary and
    the tables. ``init`` returns the stub itself as the run."""

    def __init__(self):
        self.inits, self.logged, self.summary, self.finished = [], [], {}, 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, data: dict, step: int | None = None):
        self.logged.append((step, data))

    def finish(self):
        self.finished += 1

    class Table:
        def __init__(self, columns: list, data: list):
            self.columns, self.data = columns, data


def test_wandb_resumes_its_run_and_logs_the_curve_and_the_row(smoke_cfg, tmp_path, monkeypatch):
    """A run stopped and resumed is one wandb run (an id of its own, resume=allow), tagged and typed by its
    experiment; the validation curve is logged as it goes, and each row (the stopped slice's, the finished run's)
    as the summary and a table. A sweep's name groups its jobs; another folder is another wandb run."""
    stub = WandbStub()
    monkeypatch.setitem(sys.modules, "wandb", stub)
    overrides = (*TINY, "logger=wandb", "logger.mode=offline", "logger.tags=[mine]", "schedule.steps=8",
                 "schedule.eval_every=2")
    runner.run(smoke_cfg(*overrides, "schedule.stop_at=4"))
    finished = runner.run(smoke_cfg(*overrides))
    first, second = stub.inits
    assert first["id"] == second["id"] and first["resume"] == second["resume"] == "allow"
    assert first["job_type"] == "smoke" and first["tags"] == ["smoke", "listops", "transformer", "mine"]
    assert first["group"] is None and first["mode"] == "offline" and first["dir"] == str(tmp_path / "run")
    assert [step for step, data in stub.logged if "val/acc" in data] == [2, 4, 6, 8]
    tables = [data["result"] for _, data in stub.logged if "result" in data]
    assert [t.data[0][t.columns.index("status")] for t in tables] == ["stopped: at step 4 of 8", "ok"]
    assert stub.summary["status"] == "ok" and stub.summary["test_acc"] == finished["test_acc"] and stub.finished == 2
    other = smoke_cfg(*overrides, f"run_dir={tmp_path / 'other'}", "sweep=mine")
    settings = runner.wandb_settings(other, other.run_dir, finished["config_hash"])
    assert settings["group"] == "mine" and settings["id"] != first["id"]


def test_a_run_resumed_on_other_hardware_names_both_devices_and_commits(smoke_cfg, monkeypatch):
    interrupt_after_one_step(smoke_cfg(*TINY, "schedule.steps=6", "schedule.eval_every=3"), monkeypatch)
    monkeypatch.setattr(runner, "device_name", lambda device: "Other GPU")
    monkeypatch.setenv("LRA_GIT_SHA", "0123456789ab")
    row = runner.run(smoke_cfg(*TINY, "schedule.steps=6", "schedule.eval_every=3", "resume=true"))
    first, second = row["device"].split(" + ")
    assert first.startswith("cpu") and second == "Other GPU"
    assert row["git_sha"].endswith(" + 0123456789ab") and not row["git_sha"].startswith("0123456789ab")


def sigterm_once_the_loop_runs(folder: Path, environ: dict[str, str]) -> tuple[int, str]:
    """The CLI's smoke run, sent SIGTERM once its training loop runs: (its exit code, its stderr)."""
    args = [sys.executable, "-m", "lra", "experiment=smoke", "schedule.steps=400", "schedule.eval_every=2",
            "trainer.progress=false", "trainer.ckpt_every=1000", "data.limit.train=64",
            f"results.dir={folder / 'results'}", f"data.cache_dir={folder / 'cache'}",
            f"hydra.run.dir={folder / 'run'}", "backbone.n_layers=1", "task.seq_len=200"]
    proc = subprocess.Popen(args, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = folder / "run" / "__main__.log"
    # wait until the loop runs (its first evaluation's line): the signal handlers are in place from the loop's
    # start, not from the parameter count logged before (a SIGTERM in between ended the process with -15 in CI)
    for _ in range(600):
        if log.exists() and "step 2/400" in log.read_text():
            break
        if proc.poll() is not None:
            break
        subprocess.run(["sleep", "0.5"])
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


@in_background(sigterm_once_the_loop_runs)
def test_sigterm_saves_and_exits_with_one_line_and_code_75(ran_in_background):
    """The CLI, stopped by SIGTERM mid-run: a checkpoint, one line on stderr, exit code 75; the rerun resumes."""
    (returncode, err), tmp_path = ran_in_background()
    assert returncode == 75, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("interrupted: stopped at step") and "Traceback" not in err
    assert (tmp_path / "run" / "checkpoint.pt").exists()


def sigint_during_step(monkeypatch, n: int) -> None:
    """Step ``n`` sends this process a SIGINT, as Ctrl-C in a terminal does."""
    calls, real_step = count(1), engine.train_step

    def step(*args, **kwargs):
        if next(calls) == n:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(engine, "train_step", step)


def test_a_run_called_from_other_code_leaves_sigint_to_it(smoke_cfg, tmp_path, monkeypatch):
    """Under pytest a Ctrl-C is pytest's: ``run`` called from a test installs no handler, so the SIGINT raises
    KeyboardInterrupt there (the suite stops) rather than ending the run as stopped and the test as failed."""
    monkeypatch.delenv(runner.CATCH_SIGNALS, raising=False)
    sigint_during_step(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        runner.run(smoke_cfg(*TINY, "schedule.steps=6", "schedule.eval_every=3"))
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_a_command_catches_sigint_and_stops_with_a_checkpoint(smoke_cfg, tmp_path, monkeypatch):
    """A command asks for the signals (``catch_signals``, as ``python -m lra`` does): the SIGINT during step 2 ends
    the run after it, checkpointed, and the same command resumes it."""
    monkeypatch.setenv(runner.CATCH_SIGNALS, "1")
    previous = signal.getsignal(signal.SIGINT)
    real_step = engine.train_step
    sigint_during_step(monkeypatch, 2)
    with pytest.raises(runner.RunInterrupted, match="stopped at step 2"):
        runner.run(smoke_cfg(*TINY, "schedule.steps=6", "schedule.eval_every=3"))
    assert signal.getsignal(signal.SIGINT) is previous and (tmp_path / "run" / "checkpoint.pt").exists()
    monkeypatch.setattr(engine, "train_step", real_step)
    assert runner.run(smoke_cfg(*TINY, "schedule.steps=6", "schedule.eval_every=3"))["steps"] == 6


def test_sigusr2_checkpoints_then_hands_over_to_the_previous_handler(smoke_cfg, tmp_path, monkeypatch):
    """Slurm (through submitit) signals SIGUSR2 before a timeout: the step finishes, the checkpoint is written, and
    only then submitit's own handler (which requeues the job) is called."""
    monkeypatch.setenv(runner.CATCH_SIGNALS, "1")  # as the command's jobs do
    seen = []

    def submitit_handler(signum, frame):
        seen.append((signum, (tmp_path / "run" / "checkpoint.pt").exists()))

    old = signal.signal(signal.SIGUSR2, submitit_handler)
    try:
        real_step = engine.train_step
        stop_during_step(monkeypatch, 3, signum=signal.SIGUSR2)
        with pytest.raises(runner.RunInterrupted):
            runner.run(smoke_cfg(*TINY, "schedule.steps=8", "schedule.eval_every=4"))
        monkeypatch.setattr(engine, "train_step", real_step)
    finally:
        signal.signal(signal.SIGUSR2, old)
    assert seen == [(signal.SIGUSR2, True)]
    assert runner.run(smoke_cfg(*TINY, "schedule.steps=8", "schedule.eval_every=4"))["steps"] == 8  # resumes


class InductorError(RuntimeError):
    """What torch raises when lowering fails (``lra.train.engine.is_compile_error`` tells it by its module)."""


InductorError.__module__ = "torch._inductor.exc"


def test_a_model_torch_compile_cannot_compile_runs_eagerly_with_auto(smoke_cfg, monkeypatch, caplog):
    def broken_compile(model, **kwargs):
        def fn(*args, **kw):
            raise InductorError("LoweringException: cannot lower this")
        return fn

    monkeypatch.setattr(engine, "resolve_compile", lambda flag, device: True)
    monkeypatch.setattr(torch, "compile", broken_compile)
    caplog.set_level(logging.INFO)
    row = runner.run(smoke_cfg(*TINY, "schedule.steps=4", "schedule.eval_every=2", "trainer.compile=auto",
                               "trainer.compile_check=true"))
    assert row["status"] == "ok" and row["compiled"] is False and "running it eagerly" in caplog.text
    assert "compile check: torch.compile failed on it" in caplog.text  # the check leaves it to the training step
    trace = Path(row["run_dir"]) / "compile_error.txt"  # the traceback is kept beside the run, named in the log
    assert str(trace) in caplog.text and "LoweringException: cannot lower this" in trace.read_text()
    with pytest.raises(InductorError):  # asked for explicitly: the failure is the user's to see
        runner.run(smoke_cfg(*TINY, "schedule.steps=4", "schedule.eval_every=2", "trainer.compile=true",
                             "resume=false"))


class Scaled(torch.nn.Module):
    """What a miscompiled model looks like: the right shapes, other numbers (logits x2, so other gradients)."""

    def __init__(self, model, **kwargs):
        super().__init__()
        self.model = model

    def forward(self, *args, **kw):
        return 2.0 * self.model(*args, **kw)


def test_a_model_compiled_to_other_gradients_trains_eagerly_with_auto_and_stops_with_true(smoke_cfg, monkeypatch,
                                                                                            caplog):
    """trainer.compile_check: before the first step, the compiled model's gradients and the eager model's, each
    against float64's. Wrong ones (as Inductor's CUDA code gave Mamba) make a compile=auto run train eagerly, naming
    the parameter and both errors, and stop a compile=true run with the way out; right ones leave the run compiled."""
    monkeypatch.setattr(engine, "resolve_compile", lambda flag, device: True)
    monkeypatch.setattr(torch, "compile", Scaled)
    args = (*TINY, "schedule.steps=2", "schedule.eval_every=2", "trainer.compile_check=true")
    row = runner.run(smoke_cfg(*args, "trainer.compile=auto"))
    assert row["status"] == "ok" and row["compiled"] is False
    assert "other gradients than the eager model" in caplog.text and "training it eagerly" in caplog.text
    trace = (Path(row["run_dir"]) / "compile_error.txt").read_text()
    assert "compile check: torch.compile gives" in trace and "of its size off float64's compiled, " in trace
    assert re.search(r"compiled, \S+ eager \(bound 4 x eager \+ 2\.0e-03 = \S+\) in fp32, on 4 training rows", trace)
    with pytest.raises(RuntimeError, match="other gradients .* trainer.compile=auto runs it eagerly instead"):
        runner.run(smoke_cfg(*args, "trainer.compile=true", "resume=false"))
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)  # compiled to the same numbers
    caplog.clear()
    caplog.set_level(logging.INFO)
    row = runner.run(smoke_cfg(*args, "trainer.compile=true", "resume=false"))
    assert row["compiled"] is True and "the compiled gradients are the model's" in caplog.text


def test_the_check_runs_under_the_runs_bf16_where_its_fp32_graphs_do_not_compile(smoke_cfg, monkeypatch, caplog):
    """DeBERTa's fp32 graphs fail to compile for CUDA where its bf16 training graphs compile: the check then runs
    under the run's autocast, compiled bf16 and eager bf16 each against float64 (bf16's floor), and decides as in
    fp32; where nothing compiles it says the gradients are unchecked."""
    sign = {"logits": -1.0}  # negated logits: other gradients by far more than bf16's rounding

    class CompilesUnderAutocastOnly(torch.nn.Module):
        def __init__(self, model, **kwargs):
            super().__init__()
            self.model = model

        def forward(self, *args, **kw):
            if not torch.is_autocast_enabled("cpu"):
                raise InductorError("LoweringException: cannot lower this")
            return sign["logits"] * self.model(*args, **kw)

    monkeypatch.setattr(engine, "resolve_compile", lambda flag, device: True)
    monkeypatch.setattr(torch, "compile", CompilesUnderAutocastOnly)
    caplog.set_level(logging.INFO)
    args = (*TINY, "schedule.steps=2", "schedule.eval_every=2", "trainer.compile_check=true", "trainer.compile=auto")
    row = runner.run(smoke_cfg(*args, "trainer.precision=bf16"))
    assert row["compiled"] is False and "compile check: torch.compile failed on it in fp32" in caplog.text
    assert ") in bf16, on 4 training rows" in (Path(row["run_dir"]) / "compile_error.txt").read_text()
    sign["logits"] = 1.01  # off by more than fp32's floor, within bf16's
    caplog.clear()
    row = runner.run(smoke_cfg(*args, "trainer.precision=bf16", "resume=false"))
    assert row["compiled"] is True and "the compiled gradients are the model's" in caplog.text
    assert "in bf16)" in caplog.text
    caplog.clear()
    runner.run(smoke_cfg(*args, "trainer.precision=fp32", "resume=false"))  # compiles nowhere: training falls back
    assert "the compiled gradients are unchecked" in caplog.text


def test_an_evaluation_torch_compile_cannot_compile_runs_eagerly_alone_with_auto(smoke_cfg, monkeypatch, caplog):
    """Training compiles but evaluation (no autograd, another graph) does not, as ETC's on CUDA with torch 2.11:
    evaluation goes on eagerly, the training steps stay compiled, and the row says compiled (its timing is theirs)."""
    compiled_steps = []

    class FailsWithoutGrad(torch.nn.Module):  # a module, as torch.compile returns
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *args, **kw):
            if not torch.is_grad_enabled():
                raise InductorError("LoweringException: cannot lower this")
            compiled_steps.append(1)
            return self.model(*args, **kw)

    def compile_that_fails_without_grad(model, **kwargs):
        return FailsWithoutGrad(model)

    monkeypatch.setattr(engine, "resolve_compile", lambda flag, device: True)
    monkeypatch.setattr(torch, "compile", compile_that_fails_without_grad)
    row = runner.run(smoke_cfg(*TINY, "schedule.steps=4", "schedule.eval_every=2", "trainer.compile=auto",
                               "trainer.compile_check=false"))  # its own tests: here, one call per training step
    assert row["status"] == "ok" and row["compiled"] is True and "running evaluation eagerly" in caplog.text
    assert len(compiled_steps) == 4  # every training step, after the evaluation at step 2 fell back too
    assert row["steps"] == 4 and row["val_acc"] == row["val_acc"]  # evaluated, not NaN
    assert "torch.compile failed in evaluation" in (Path(row["run_dir"]) / "compile_error.txt").read_text()


def test_a_long_schedule_on_the_cpu_warns_with_its_estimate(smoke_cfg, monkeypatch, caplog):
    monkeypatch.setattr(runner, "CPU_WARN_AFTER_S", 0.0)  # any run counts as long here
    runner.run(smoke_cfg(*TINY, "experiment=lra", "device=cpu", "trainer.timing_warmup=1", "schedule.steps=6",
                         "schedule.eval_every=6", "data.limit.train=64", "data.limit.val=8", "data.limit.test=8",
                         "schedule.batch_size=4", "backbone.d_model=64", "backbone.d_qkv=64", "backbone.d_ff=64"))
    assert "training on the CPU: 6 steps" in caplog.text and "experiment=smoke" in caplog.text
    caplog.clear()
    runner.run(smoke_cfg(*TINY, "schedule.steps=6", "schedule.eval_every=6", "resume=false"))  # the smoke preset
    assert "training on the CPU" not in caplog.text


def test_a_stall_baseline_that_fails_costs_the_row_only_its_baseline(smoke_cfg, tmp_path, monkeypatch, caplog):
    def broken(data):
        raise ValueError("no baseline here")

    monkeypatch.setattr(runner.baseline, "measure", broken)
    with caplog.at_level(logging.WARNING, logger="lra"):
        row = runner.run(smoke_cfg(*SHORT))
    got = rows(tmp_path).iloc[0]
    assert row["status"] == got.status == "ok" and pd.isna(got.val_baseline) and got.val_majority > 0
    assert "no stall baseline for this row (ValueError: no baseline here)" in caplog.text


def test_out_of_memory_is_a_row_without_accuracies(smoke_cfg, tmp_path, monkeypatch):
    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    real_step = engine.train_step
    monkeypatch.setattr(engine, "train_step", oom)
    row = runner.run(smoke_cfg(*TINY))
    got = rows(tmp_path).iloc[0]
    assert row["status"] == got.status == "oom" and pd.isna(got.test_acc) and pd.isna(got.train_steps_per_s)
    assert pd.isna(got.val_baseline)  # nothing to judge by it
    # not a result: the same command runs it again (say, on a larger card) and records the outcome beside it
    monkeypatch.setattr(engine, "train_step", real_step)
    again = runner.run(smoke_cfg(*TINY))
    assert again["status"] == "ok" and list(rows(tmp_path).status) == ["oom", "ok"]
    assert runner.run(smoke_cfg(*TINY))["timestamp"] == again["timestamp"]  # now finished: not run a third time


def test_profiled_steps_write_a_kernel_table_and_stay_out_of_the_timing(smoke_cfg, tmp_path):
    row = runner.run(smoke_cfg(*SHORT, "trainer.timing_warmup=2", "trainer.profile_steps=3"))
    table = (tmp_path / "run" / "profile.txt").read_text()
    assert table.startswith("steps 3-5") and "aten::" in table and (tmp_path / "run" / "profile_trace.json").exists()
    assert "== host time by operator" in table
    assert "lra/train/engine.py" in table.split("== host time by function")[1]  # the training step's function, ours
    assert row["status"] == "ok" and row["train_steps_per_s"] > 0
    with pytest.raises(ConfigError, match="trainer.profile_steps=-1"):
        runner.run(smoke_cfg(*SHORT, "trainer.profile_steps=-1"))


def test_our_functions_are_found_under_a_path_the_profiler_left_unstripped():
    def call(name, us, cat="python_function"):  # an event of the exported trace
        return {"cat": cat, "name": name, "dur": us}

    events = [call("/srv/x/lra/train/run.py(421): step", 3000.0), call("lra/train/run.py(421): step", 1000.0),
                call("models/base.py(88): forward", 1000.0), call("torch/nn/modules/module.py(1750): _call_impl", 9e3),
                call("aten::mm", 500.0, cat="cpu_op")]
    table = engine.own_functions(events).splitlines()
    assert [line.split()[:4] for line in table[1:]] == [["lra/train/run.py(421):", "step", "4.00", "2"],
                                                        ["models/base.py(88):", "forward", "1.00", "1"]]
    assert "no Python calls" in engine.own_functions(events[3:])


def test_without_a_bar_the_progress_lines_name_their_run(smoke_cfg, caplog):
    """A sweep's jobs side by side write to one stream: each progress line says which run it is."""
    with caplog.at_level("INFO", logger="lra"):
        runner.run(smoke_cfg(*TINY, "schedule.steps=4", "schedule.eval_every=2", "trainer.progress=false", "seed=3"))
    assert "listops/transformer seed 3: step 2/4: train loss" in caplog.text


def test_compile_mode_reaches_torch_compile_and_leaves_the_config_hash(smoke_cfg, monkeypatch):
    """``trainer.compile_mode=reduce-overhead`` (CUDA graphs for launch-bound models) is how a run executes: it goes
    to every torch.compile call, and the row's config hash is the default mode's."""
    modes = []

    def recording_compile(model, **kwargs):
        modes.append(kwargs.get("mode"))
        return model

    monkeypatch.setattr(engine, "resolve_compile", lambda flag, device: True)
    monkeypatch.setattr(torch, "compile", recording_compile)
    base = (*TINY, "schedule.steps=2", "schedule.eval_every=2", "trainer.compile_check=false")  # the check's graphs:
    row = runner.run(smoke_cfg(*base, "trainer.compile_mode=reduce-overhead"))  # its own, in the default mode
    assert modes and set(modes) == {"reduce-overhead"} and row["status"] == "ok"
    assert row["config_hash"] == runner.run(smoke_cfg(*base, "resume=false"))["config_hash"]
    with pytest.raises(ConfigError, match="compile_mode"):
        runner.run(smoke_cfg(*base, "trainer.compile_mode=fast", "resume=false"))


def test_mixer_backend_sets_how_every_mixer_runs_and_leaves_the_config_hash(smoke_cfg, monkeypatch, tmp_path):
    """``trainer.mixer_backend=<name>`` sets each built mixer's ``backend`` (how it runs, never what it computes):
    the row's config hash is the default's, so a run resumes under another backend; a name the mixer does not have,
    or a model with one execution, stops the run before it starts, with no row."""
    built = []
    build = engine.build_model
    monkeypatch.setattr(engine, "build_model", lambda *args: built.append(build(*args)) or built[-1])
    base = (*TINY, "model=etc", "schedule.steps=2", "schedule.eval_every=2")
    row = runner.run(smoke_cfg(*base, "trainer.mixer_backend=recompute"))
    mixers = [m for m in built[0].modules() if type(m).__name__ == "ETC"]
    assert mixers and {m.backend for m in mixers} == {"recompute"} and row["status"] == "ok"
    assert row["config_hash"] == runner.run(smoke_cfg(*base, "resume=false"))["config_hash"]
    rows = len(pd.read_csv(tmp_path / "results" / "runs.csv"))
    with pytest.raises(ConfigError, match="trainer.mixer_backend=fused: etc: backend must be one of auto, explicit"):
        runner.run(smoke_cfg(*base, "trainer.mixer_backend=fused", "resume=false"))
    with pytest.raises(ConfigError, match="trainer.mixer_backend=flex: linear: backend is not a setting of how it "
                                          "runs \\(its settings: chunk_size, compile_core\\)"):
        runner.run(smoke_cfg(*TINY, "model=linear", "schedule.steps=2", "trainer.mixer_backend=flex"))
    assert len(pd.read_csv(tmp_path / "results" / "runs.csv")) == rows  # no row for either


def test_trainer_mixer_sets_any_setting_of_how_the_mixers_run_and_leaves_the_config_hash(smoke_cfg, monkeypatch):
    """``+trainer.mixer.<setting>=<value>`` sets that attribute (``models.base.execution_settings``) on every mixer
    built, as trainer.mixer_backend sets the backend: the row's hash is the default's (a run resumes under another
    setting) and its overrides change nothing the preset computes. A value the mixer does not allow, a setting it
    lacks, or the backend given twice, stops the run before it starts."""
    built = []
    build = engine.build_model
    monkeypatch.setattr(engine, "build_model", lambda *args: built.append(build(*args)) or built[-1])
    base = (*TINY, "model=gla", "schedule.steps=2", "schedule.eval_every=2")
    row = runner.run(smoke_cfg(*base, "+trainer.mixer.scan=recurrent", "+trainer.mixer.chunk_size=8"))
    mixers = [m for m in built[0].modules() if type(m).__name__ == "GLA"]
    assert mixers and {(m.scan, m.chunk_size) for m in mixers} == {("recurrent", 8)} and row["status"] == "ok"
    assert row["config_hash"] == runner.run(smoke_cfg(*base, "resume=false"))["config_hash"]
    assert departures("model=gla +trainer.mixer.scan=fla +trainer.mixer={scan:fla}") == []
    for bad, message in (("+trainer.mixer.scan=fast", "trainer.mixer.scan=fast: gla: scan must be 'auto'"),
                         ("+trainer.mixer.recompute=false", "trainer.mixer.recompute=False: gla: recompute is not a "
                                                            "setting of how it runs"),
                         ("+trainer.mixer.backend=dense", "gla: backend is not a setting")):
        with pytest.raises(ConfigError, match=message):
            runner.run(smoke_cfg(*base, bad, "resume=false"))
    with pytest.raises(ConfigError, match="the backend is given twice"):
        runner.run(smoke_cfg(*TINY, "model=etc", "trainer.mixer_backend=sdpa", "+trainer.mixer.backend=flex"))


def test_a_run_shorter_than_its_timing_warm_up_says_its_speed_was_not_timed(smoke_cfg, caplog):
    """Every step inside trainer.timing_warmup: no speed in the row (not a number, not a wrong one), and the final
    line says why instead of printing nan."""
    with caplog.at_level(logging.INFO, logger="lra"):
        row = runner.run(smoke_cfg(*TINY, "schedule.steps=2", "schedule.eval_every=2", "trainer.timing_warmup=3"))
    assert row["status"] == "ok" and math.isnan(row["train_steps_per_s"])  # not timed
    assert "speed not timed (all 2 steps within trainer.timing_warmup)" in caplog.text
    assert "nan steps/s" not in caplog.text
