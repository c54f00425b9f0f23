"""Running many jobs: the GPU launcher (jobs in parallel, never two on one GPU, each with its share of the cores),
stable and resumable sweep folders, data-parallel runs (DDP over gloo on CPU equals one process), and a real Slurm
cluster when one runs (CI starts one)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import lra.train.run as runner
from hydra_plugins.lra_launchers.lra_launchers import JobCrashed, claim_gpus, gpu_placement, job_state, run_isolated
from lra.config import sweep_slug
from lra.errors import ConfigError
from lra.train import distributed
from lra.train.checkpoint import RunFiles
from lra.train.engine import cpu_threads
from tests.conftest import ROOT, in_background

pytestmark = pytest.mark.heavy  # CI's second tier (.ci/run): several processes a test (DDP, the gpus launcher)

FAST = ["experiment=smoke", "task.seq_len=200", "backbone.n_layers=1", "schedule.steps=4", "schedule.eval_every=2",
        "data.limit.train=32", "data.limit.val=8", "data.limit.test=8"]


def cli_env(tmp_path: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an `lra` command run by a test: ``environ`` (default: this process's) with data, rows and
    GPU locks under ``tmp_path``, and none of the sweep variables a parent sweep (the tests' own runner inside one)
    would pass down."""
    env = {**(os.environ if environ is None else environ), "LRA_CACHE_DIR": str(tmp_path / "cache"),
           "LRA_RESULTS_DIR": str(tmp_path / "results"), "LRA_GPU_LOCKS": str(tmp_path / "locks")}
    env.pop("LRA_SWEEP_NAME", None)
    env.pop("LRA_SWEPT_KEYS", None)
    return env


def lra_cli(args: list[str], tmp_path: Path, timeout: int = 900, environ: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "lra", *args], cwd=tmp_path, env=cli_env(tmp_path, environ),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_the_gpu_launcher_runs_in_parallel_never_two_jobs_on_one_gpu_and_resumes(tmp_path):
    """Three jobs on two GPUs: two at once, and the third on a GPU one of them gave back."""
    args = ["-m", "hydra/launcher=gpus", "hydra.launcher.gpus=2", *FAST, "model=transformer,linear,local"]
    first = lra_cli(args, tmp_path)
    assert ("3 jobs: 0 already finished (skipped, no new row), 0 run again after an oom or error, 0 resume from a "
            "checkpoint, 3 new") in first.stdout
    slots = [json.loads(p.read_text()) for p in (tmp_path / "outputs" / "multirun").rglob("gpu_slot.json")]
    assert len(slots) == 3 and {s["slot"] for s in slots} == {0, 1}
    for a in slots:
        for b in slots:
            if a is not b and a["slot"] == b["slot"]:
                assert a["end"] <= b["start"] or b["end"] <= a["start"], "two jobs held one GPU at once"
    assert any(a["start"] < b["end"] and b["start"] < a["end"] for a in slots for b in slots if a is not b)
    assert len(pd.read_csv(tmp_path / "results" / "runs.csv")) == 3
    again = lra_cli(args, tmp_path)  # the same command: a stable folder, nothing rerun, no new row
    assert "3 jobs: 3 already finished" in again.stdout
    assert len(pd.read_csv(tmp_path / "results" / "runs.csv")) == 3
    sweeps = list((tmp_path / "outputs" / "multirun").iterdir())
    assert [p.name for p in sweeps] == [sweep_slug([*FAST, "model=transformer,linear,local"])]


@in_background(lambda folder, environ: lra_cli(["-m", "hydra/launcher=gpus", "hydra.launcher.gpus=2",
                                                "trainer.devices=2", *FAST, "model=transformer,linear"], folder,
                                               environ=environ))
def test_data_parallel_jobs_under_the_gpu_launcher_hold_their_gpus_for_the_whole_run(ran_in_background):
    """trainer.devices=2 with hydra/launcher=gpus on 2 slots: each job holds both (so they run one after the other,
    never sharing a GPU), trains over two processes, and writes one row that names the command's overrides (the
    ranks run in processes of their own, without Hydra)."""
    _, tmp_path = ran_in_background()
    slots = [json.loads(p.read_text()) for p in (tmp_path / "outputs" / "multirun").rglob("gpu_slot.json")]
    assert sorted(tuple(s["slots"]) for s in slots) == [(0, 1), (0, 1)]
    a, b = slots
    assert a["end"] <= b["start"] or b["end"] <= a["start"], "two jobs held one GPU at once"
    rows = pd.read_csv(tmp_path / "results" / "runs.csv")
    assert sorted(rows["model"]) == ["linear", "transformer"] and (rows["devices"] == 2).all()
    assert (rows["status"] == "ok").all()
    assert all("trainer.devices=2" in o.split() and f"model={m}" in o.split()
               for o, m in zip(rows["overrides"], rows["model"])), list(rows["overrides"])


@in_background(lambda folder, environ: lra_cli(["-m", *FAST, "model=transformer,linear", "sweep=my_grid"], folder,
                                               environ=environ))
def test_the_local_launcher_reports_and_the_sweep_folder_can_be_named(ran_in_background):
    """`-m model=a,b` runs both jobs, one after the other, each in <sweep>/<task>/<model>/, and both rows land in
    one runs.csv."""
    proc, tmp_path = ran_in_background()
    assert "2 jobs: 0 already finished" in proc.stdout
    done = list((tmp_path / "outputs" / "multirun" / "my_grid").glob("listops/*/*/result.json"))
    assert sorted(p.parent.parent.name for p in done) == ["linear", "transformer"]
    rows = pd.read_csv(tmp_path / "results" / "runs.csv")
    assert sorted(rows.model) == ["linear", "transformer"] and (rows.status == "ok").all()


def run_then_continue_with_other_execution_settings(folder: Path, environ: dict[str, str]) -> None:
    run = [*FAST, "model=linear", "seed=3"]
    lra_cli(run, folder, environ=environ)
    lra_cli([*run, "trainer.progress=false", "trainer.threads=1", "trainer.devices=2"], folder, environ=environ)


@in_background(run_then_continue_with_other_execution_settings)
def test_a_run_continued_with_other_execution_settings_finds_its_folder(ran_in_background):
    """Devices, threads and the progress bar change how a run executes, not what it computes (the config hash leaves
    them out), so they name neither the run's folder nor a sweep's: the same run with other such settings finds its
    folder (here finished: no second row), and a sweep relaunched with them finds its jobs."""
    _, tmp_path = ran_in_background()
    assert len(list((tmp_path / "outputs" / "smoke" / "listops" / "linear").iterdir())) == 1
    assert len(pd.read_csv(tmp_path / "results" / "runs.csv")) == 1
    sweep = ["model=transformer,linear", "seed=0,1"]
    assert sweep_slug([*sweep, "trainer.devices=2", "trainer.progress=false", "hydra/launcher=gpus",
                       "hydra.launcher.gpus=4", "logger=wandb"]) == sweep_slug(sweep)
    assert sweep_slug([*sweep, "trainer.precision=fp32"]) != sweep_slug(sweep)  # what a run computes names it


@in_background(lambda folder, environ: lra_cli(["-m", *FAST, "model=linear", "sweep=threads", "trainer.threads=1,2"],
                                               folder, environ=environ))
def test_a_sweep_over_an_execution_setting_runs_each_value(ran_in_background):
    """A setting the command sweeps names its jobs' folders (a scaling measurement over trainer.devices=1,2 is two
    runs), though a setting given once does not."""
    _, tmp_path = ran_in_background()
    done = sorted(p.parent.name for p in (tmp_path / "outputs" / "multirun" / "threads").rglob("result.json"))
    assert len(done) == 2 and all("trainer.threads=" in name for name in done)
    assert sorted(pd.read_csv(tmp_path / "results" / "runs.csv")["overrides"].str.extract(r"threads=(\d)")[0]) == \
        ["1", "2"]


def test_job_states_from_the_run_folder(tmp_path):
    files = RunFiles(tmp_path / "job")
    assert job_state(files.dir) == "new"
    files.save_checkpoint({"state": {"step": 1}})
    assert job_state(files.dir) == "resume"
    files.write_result({"status": "ok"}, [])
    assert job_state(files.dir) == "finished"
    files.write_result({"status": "diverged"}, [])  # a result too: a rerun would diverge again
    assert job_state(files.dir) == "finished"
    for failure in ("oom", "error: InductorError: LoweringException"):
        files.write_result({"status": failure}, [])
        assert job_state(files.dir) == "retry"
    files.write_result({"status": "stopped: at step 1 of 9"}, [])  # schedule.stop_at: it goes on from its checkpoint
    assert job_state(files.dir) == "resume"
    files.write_result({"status": "oom"}, [])
    with files.hold():  # as the process training it holds it, seen from another (a process of its own)
        other = subprocess.run([sys.executable, "-c", "import sys; from hydra_plugins.lra_launchers.lra_launchers "
                                "import job_state; print(job_state(sys.argv[1]))", str(files.dir)],
                               capture_output=True, text=True, cwd=ROOT)
    assert other.stdout.strip() == "running", other.stderr[-2000:]
    assert job_state(files.dir) == "retry"  # the hold ended with the run


def _segfault() -> None:
    import faulthandler

    faulthandler.disable()  # pytest's handler would print every thread's stack for this deliberate crash
    os.kill(os.getpid(), signal.SIGSEGV)


def _fail() -> None:
    raise ValueError("a bad option")


def test_a_job_runs_in_a_process_of_its_own_and_a_crash_is_reported_not_spread():
    """A job whose process dies (a segfault in torch.compile's cache killed a worker, and with it its whole sweep)
    is reported as crashed, by signal; the launcher's process lives on; results and errors come back."""
    assert run_isolated(divmod, 7, 2) == (3, 1)
    with pytest.raises(RuntimeError, match="SIGSEGV") as crash:
        run_isolated(_segfault)
    assert type(crash.value).__name__ == JobCrashed.__name__  # by name: Hydra's plugin scan re-executes the module
    with pytest.raises(RuntimeError, match="ValueError: a bad option"):
        run_isolated(_fail)


def sweep_stopped_by_a_signal(folder: Path, environ: dict[str, str]) -> tuple[Path | None, str, list[Path]]:
    """A sweep of two jobs on one GPU slot, SIGTERM to its own process once its first job trains: that job's folder
    (None: it never started training), its log once it has checkpointed, and the folders of the jobs after it."""
    args = ["-m", "hydra/launcher=gpus", "hydra.launcher.gpus=1", *FAST, "schedule.steps=100000",
            "schedule.eval_every=2", "trainer.ckpt_every=100000", "trainer.progress=false", "seed=0,1",
            "sweep=stopped"]
    # its own process group: the signal below reaches nothing else, and the cleanup can end the whole group
    sweep = subprocess.Popen([sys.executable, "-m", "lra", *args], cwd=folder, env=cli_env(folder, environ),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    jobs = folder / "outputs" / "multirun" / "stopped" / "listops" / "transformer"
    try:
        for _ in range(600):  # until the first job's loop runs (its first evaluation): its signal handlers are in
            logs = list(jobs.glob("*seed=0*/__main__.log")) if jobs.exists() else []
            if logs and "step 2/100000" in logs[0].read_text():
                first, log = logs[0].parent, logs[0]
                break
            time.sleep(0.5)
        else:
            return None, "", []
        os.kill(sweep.pid, signal.SIGTERM)  # the sweep's own process only
        sweep.wait(timeout=60)
        for _ in range(240):
            if (first / "checkpoint.pt").exists() and "SIGTERM" in log.read_text():
                break
            time.sleep(0.5)
        return first, log.read_text(), list(jobs.glob("*seed=1*"))
    finally:
        if _group_alive(sweep.pid):  # whatever is left of the sweep, on failure
            os.killpg(sweep.pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a job ends with its sweep through Linux's prctl")
@in_background(sweep_stopped_by_a_signal)
def test_a_sweep_stopped_by_a_signal_to_its_own_process_stops_its_jobs_with_a_checkpoint(ran_in_background):
    """`kill PID` of a sweep (or a container's stop: the signal reaches its first process alone) must not leave its
    running job training on, orphaned, on a GPU the relaunch then waits for: the job finishes its step, checkpoints
    and ends, and no other job starts. Its checkpoint can only come from the stop (ckpt_every past the schedule)."""
    (first, log, later_jobs), _ = ran_in_background()
    assert first is not None, "the sweep's first job did not start"
    assert "SIGTERM: finishing this step and saving a checkpoint" in log
    assert (first / "checkpoint.pt").exists()
    assert not later_jobs, "a job started after the sweep was stopped"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _crashing_task(cfg) -> None:
    _segfault()


def test_a_job_that_crashes_under_the_gpus_launcher_gets_an_error_row_and_runs_again(tmp_path, monkeypatch):
    """The gpus launcher's job function, given a task that segfaults: the job returns as failed, naming its folder;
    the row says how it ended (no accuracy); a relaunch runs it again."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus
    from hydra.types import HydraContext, RunMode

    from hydra_plugins.lra_launchers.lra_launchers import execute_on_a_free_gpu

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LRA_RESULTS_DIR", str(tmp_path / "results"))
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://lra.conf"))
    config = loader.load_configuration("config", overrides=["sweep=crash"], run_mode=RunMode.MULTIRUN)
    context = HydraContext(config_loader=loader, callbacks=Callbacks(config))
    ret = execute_on_a_free_gpu(0, ["experiment=smoke", "model=linear", "seed=4"], context, config, _crashing_task,
                                Singleton.get_state(), 1, 0, str(tmp_path / "locks"))
    assert ret.status == JobStatus.FAILED and "SIGSEGV" in str(ret._return_value)
    rows = pd.read_csv(tmp_path / "results" / "runs.csv")
    assert rows["status"].tolist() == ["error: crashed (signal SIGSEGV)"] and rows["test_acc"].isna().all()
    assert (rows["model"].tolist(), rows["seed"].tolist(), rows["experiment"].tolist()) == (["linear"], [4], ["smoke"])
    assert job_state(tmp_path / rows["run_dir"][0]) == "retry"


def claim_elsewhere(lock_dir: Path, slots: int, n: int) -> subprocess.Popen:
    """Another process claiming ``n`` of ``slots`` GPUs: it prints the slots it got, then exits (releasing them)."""
    code = ("from pathlib import Path; from hydra_plugins.lra_launchers.lra_launchers import claim_gpus; "
            f"print([s for s, _ in claim_gpus(Path(r'{lock_dir}'), {slots}, {n}, poll_s=0.05)], flush=True)")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)


def test_a_held_gpu_is_never_claimed_twice(tmp_path):
    [(slot, lock)] = claim_gpus(tmp_path, 2)
    other = claim_elsewhere(tmp_path, 2, 1)
    assert other.communicate(timeout=120)[0].strip() == str([1 - slot])
    lock.release()


def test_a_data_parallel_job_claims_several_gpus_waiting_without_holding_any(tmp_path):
    """trainer.devices=2 under the gpus launcher: the job takes two free GPUs at once. While fewer are free it
    waits holding none of them, so a GPU that is free stays free for other jobs."""
    import threading

    with pytest.raises(ValueError, match=r"trainer.devices=3 GPUs but the launcher has 2 GPU slots"):
        claim_gpus(tmp_path, 2, 3)
    [(_, first)] = claim_gpus(tmp_path, 3)  # slot 0 of 3
    pair = claim_elsewhere(tmp_path, 3, 2)
    assert pair.communicate(timeout=120)[0].strip() == "[1, 2]"  # the two free ones, together
    ours = [first, *(lock for _, lock in claim_gpus(tmp_path, 3, 1))]  # slots 0 and 1: one left
    waiting = claim_elsewhere(tmp_path, 3, 2)  # wants two, one is free: it waits
    got = []
    taker = threading.Thread(target=lambda: got.extend(claim_gpus(tmp_path, 3, 1, poll_s=0.05)), daemon=True)
    taker.start()
    taker.join(timeout=60)
    assert [slot for slot, _ in got] == [2], "the waiting job sat on the free GPU"
    for lock in ours + [lock for _, lock in got]:
        lock.release()
    assert len(eval(waiting.communicate(timeout=120)[0])) == 2  # once two are free, it has them


def test_waiting_jobs_get_a_freed_gpu_in_the_order_they_began_to_wait(tmp_path):
    """A sweep's worker that finishes a job and claims again for its next must not take its GPU straight back from a
    job that has waited longer (it did: a 100-second job waited the whole lease behind two long ones). A killed
    waiter's ticket holds nobody up."""
    code = ("import os, time; from pathlib import Path; from hydra_plugins.lra_launchers.lra_launchers import "
            f"claim_gpus; claim_gpus(Path(r'{tmp_path}'), 1, 1, poll_s=0.05); print(time.time(), flush=True)")
    [(_, lock)] = claim_gpus(tmp_path, 1)
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (tmp_path / f"wait-{0:012d}-{dead.pid}-1").touch()  # a waiter killed before it got its GPU
    dead.kill()
    dead.wait()
    (tmp_path / "queue.next").write_text("1")
    first = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.time() + 60
    while not list(tmp_path.glob(f"wait-*-{first.pid}-1")):  # it waits, with a ticket
        assert time.time() < deadline and first.poll() is None
        time.sleep(0.05)
    lock.release()
    [(_, again)] = claim_gpus(tmp_path, 1, poll_s=0.05)  # straight back in line: served after the waiter
    taken_back = time.time()
    again.release()
    assert float(first.communicate(timeout=60)[0]) < taken_back
    assert not list(tmp_path.glob("wait-*"))  # every ticket gone, the dead one's too


def test_a_job_is_placed_on_the_gpus_it_holds_with_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_placement([2], 4, 4) == (["device=cuda:2"], {"LRA_LOCAL_JOBS": "4"})
    assert gpu_placement([1, 3], 4, 4) == ([], {"LRA_LOCAL_JOBS": "2", "CUDA_VISIBLE_DEVICES": "1,3"})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # a host the user narrowed: slots index what is visible
    assert gpu_placement([1, 3], 4, 4)[1]["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert gpu_placement([0, 1], 2, 0) == ([], {"LRA_LOCAL_JOBS": "1"})  # a CPU host: slots only limit jobs at once
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    for jobs, threads in (("4", 16), ("1.33333", 48), ("8", 8)):  # one slot; a 3-GPU job of 4 slots; a rank of 2
        monkeypatch.setenv("LRA_LOCAL_JOBS", jobs)
        assert cpu_threads(None) == threads


def test_a_run_on_a_gpu_takes_one_gpus_share_of_the_cores_when_no_launcher_says_more(monkeypatch):
    """Runs started by hand, one per GPU, do not know of each other: each takes its GPU's share of the host."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr("lra.train.engine.host_gpus", lambda: 4)
    monkeypatch.delenv("LRA_LOCAL_JOBS", raising=False)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert (cpu_threads(None, cuda), cpu_threads(None, cpu), cpu_threads(None)) == (16, 64, 64)
    assert cpu_threads(3, cuda) == 3  # trainer.threads wins
    monkeypatch.setenv("LRA_LOCAL_JOBS", "8")  # two jobs a GPU (the launcher's slots): their share, not the GPU's
    assert cpu_threads(None, cuda) == 8
    monkeypatch.setenv("LRA_LOCAL_JOBS", "2")  # a rank of a 2-GPU run started by hand
    assert cpu_threads(None, cuda) == 16


# a run small enough for two gloo processes, without dropout, so that one process and two compare exactly; evaluation
# in batches of 3, spread over the ranks
DDP_SMALL = ("task.seq_len=200", "backbone.n_layers=1", "backbone.dropout=0", "backbone.attn_dropout=0",
             "data.limit.train=64", "data.limit.val=16", "data.limit.test=13", "trainer.eval_batch_size=3")


def test_ddp_over_two_gloo_processes_equals_one_process_and_writes_one_row(smoke_cfg, tmp_path):
    """... evaluating too: batches of 3 spread the validation and test splits over both ranks, whose counts add up
    to one process's accuracies."""
    same = (*DDP_SMALL, "schedule.steps=6", "schedule.eval_every=3")
    one = runner.run(smoke_cfg(*same, f"run_dir={tmp_path / 'one'}"))
    two = runner.run(smoke_cfg(*same, "trainer.devices=2", f"run_dir={tmp_path / 'two'}"))
    assert two["devices"] == 2 and one["devices"] == 1 and two["config_hash"] == one["config_hash"]
    for key in ("val_acc", "test_acc", "final_val_acc", "final_test_acc", "best_step"):
        assert two[key] == pytest.approx(one[key], abs=1e-6), key
    history = [json.loads((tmp_path / d / "history.json").read_text()) for d in ("one", "two")]
    for a, b in zip(*history, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)  # the same updates, up to sum order
    rows = pd.read_csv(tmp_path / "results" / "runs.csv")
    assert len(rows) == 2 and sorted(rows.devices) == [1, 2]


def test_ddp_over_ranks_that_do_not_divide_the_batch_equals_one_process(smoke_cfg, tmp_path):
    """A batch of 7 over two ranks (shares of 4 and 3): each rank's loss is weighted by its share, so the updates,
    the logged training loss and the results equal one process's (DDP's plain average of the ranks' gradients
    would weight the share of 3 as much as the share of 4). A batch smaller than the ranks is refused first."""
    same = (*DDP_SMALL, "schedule.steps=4", "schedule.eval_every=2", "schedule.batch_size=7")
    one = runner.run(smoke_cfg(*same, f"run_dir={tmp_path / 'one'}"))
    two = runner.run(smoke_cfg(*same, "trainer.devices=2", f"run_dir={tmp_path / 'two'}"))
    for key in ("val_acc", "test_acc", "final_test_acc", "best_step"):
        assert two[key] == pytest.approx(one[key], abs=1e-6), key
    history = [json.loads((tmp_path / d / "history.json").read_text()) for d in ("one", "two")]
    for a, b in zip(*history, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    world = distributed.World(rank=1, size=2)
    assert (world.share(7), world.loss_weight(7), distributed.World(0, 2).loss_weight(7)) == (3, 6 / 7, 8 / 7)
    with pytest.raises(ConfigError, match="smaller than the 2 processes"):
        runner.run(smoke_cfg(*DDP_SMALL, "schedule.batch_size=1", "trainer.devices=2", f"run_dir={tmp_path / 'x'}"))


def _batchnorm_statistics_after_broadcast(out: str) -> None:
    """One rank: running statistics of its own, then rank 0's broadcast over them; saved for the test to read."""
    world = distributed.from_env()
    distributed.init(world, torch.device("cpu"))
    try:
        norm = torch.nn.BatchNorm1d(3)
        norm.running_mean.fill_(world.rank + 1.0)  # each rank normalised its own share of the batches
        world.broadcast_buffers(norm)
        torch.save(norm.running_mean, Path(out) / f"rank{world.rank}.pt")
    finally:
        distributed.shutdown()


def test_the_ranks_evaluate_with_rank_0s_batchnorm_statistics(tmp_path):
    distributed.spawn(2, _batchnorm_statistics_after_broadcast, str(tmp_path))
    for rank in (0, 1):
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt"), torch.ones(3)), rank


def test_ranks_that_pack_their_shares_make_the_same_updates_as_one_unpacked_process(smoke_cfg, tmp_path):
    same = ("task.seq_len=1000", "backbone.n_layers=1", "backbone.dropout=0", "backbone.attn_dropout=0",
            "schedule.steps=4", "schedule.eval_every=2", "data.limit.train=64", "data.limit.val=32",
            "data.limit.test=32")
    one = runner.run(smoke_cfg(*same, f"run_dir={tmp_path / 'one'}"))
    packed = runner.run(smoke_cfg(*same, "trainer.devices=2", "trainer.pack=true", f"run_dir={tmp_path / 'two'}"))
    assert packed["packed"] is True and packed["devices"] == 2
    for key in ("val_acc", "test_acc", "final_test_acc", "best_step"):
        assert packed[key] == pytest.approx(one[key], abs=1e-6), key
    history = [json.loads((tmp_path / d / "history.json").read_text()) for d in ("one", "two")]
    for a, b in zip(*history, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)


def test_data_parallel_ranks_agree_on_a_stop_every_few_steps_not_every_step(monkeypatch):
    """A per-step agreement (all-reduce + read back) would stall every step's GPU queue; alone, a stop is at once."""
    reduced = []

    class FakeWorld:
        distributed = True

        def any(self, flags):
            reduced.append(float(flags[0]))
            return flags

    trainer = runner.Trainer.__new__(runner.Trainer)
    trainer.world, trainer.device, trainer.state = FakeWorld(), torch.device("cpu"), {"step": 0}
    monkeypatch.setattr(runner.STOP, "requested", True)
    stops = []
    for step in range(1, 2 * runner.STOP_CHECK_EVERY + 1):
        trainer.state["step"] = step
        stops.append(trainer.stop_agreed()[0])
    assert stops.index(True) == runner.STOP_CHECK_EVERY - 1 and len(reduced) == 2  # one agreement per cadence
    monkeypatch.setattr(runner.STOP, "requested", False)
    trainer.state["step"] = runner.STOP_CHECK_EVERY + 1
    assert trainer.stop_agreed(deadline=runner.clock() - 1) == (False, False)  # trainer.time_limit: at the cadence
    trainer.state["step"] = 2 * runner.STOP_CHECK_EVERY
    assert trainer.stop_agreed(deadline=runner.clock() - 1) == (False, True)
    monkeypatch.setattr(runner.STOP, "requested", True)
    trainer.world = runner.distributed.World()  # one process
    trainer.state["step"] = 1
    assert trainer.stop_agreed() == (True, False)


def slurm_available() -> str | None:
    """None when a Slurm cluster answers, else why not. ``scontrol ping`` first: with no controller up it says so
    at once, where ``sinfo`` retries for 9 s before it does."""
    if not shutil.which("sinfo"):
        return "no Slurm client here (CI installs slurm-wlm and starts a one-node cluster: .ci/slurm.sh)"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if ping.returncode != 0:  # 1 where the controller is down
        said = ping.stdout.strip() or ping.stderr.strip() or f"exit status {ping.returncode}"
        return f"no Slurm controller answers (scontrol ping): {said.splitlines()[0]}"
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0 or ("idle" not in proc.stdout and "mix" not in proc.stdout):
        return f"Slurm does not answer with an idle node: {proc.stderr.strip() or proc.stdout.strip()}"
    return None


def sweep_through_slurm(folder: Path, environ: dict[str, str]
                        ) -> tuple[str | None, subprocess.CompletedProcess | None]:
    """(why no Slurm cluster answers, None), or (None, two jobs run through the Slurm launcher)."""
    reason = slurm_available()
    if reason is not None:
        return reason, None
    return None, lra_cli(["-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=null",
                          "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10", *FAST,
                          "model=transformer,linear"], folder, timeout=1200, environ=environ)


@pytest.mark.slurm
@in_background(sweep_through_slurm)
def test_a_sweep_through_slurm_writes_two_intact_rows(ran_in_background):
    (reason, proc), tmp_path = ran_in_background()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Slurm test: {reason}")
        pytest.skip(reason)
    assert "2 jobs: 0 already finished" in proc.stdout
    rows = pd.read_csv(tmp_path / "results" / "runs.csv")
    assert len(rows) == 2 and set(rows.model) == {"transformer", "linear"} and (rows.status == "ok").all()


@pytest.mark.slurm
@pytest.mark.slow  # Slurm takes minutes to start a requeued job again
def test_a_slurm_job_signalled_before_its_end_checkpoints_is_requeued_and_resumes(tmp_path):
    """What Slurm does before a timeout or a preemption (SIGUSR2, through submitit's --signal): the runner finishes
    its step and checkpoints, submitit requeues the job, and the requeued job resumes from the checkpoint: one row."""
    reason = slurm_available()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Slurm test: {reason}")
        pytest.skip(reason)
    args = ["-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1",
            "hydra.launcher.timeout_min=10", "hydra.launcher.name=lra-requeue-test", *FAST, "schedule.steps=3000",
            "schedule.eval_every=3000", "trainer.ckpt_every=100000", "sweep=requeue", "model=transformer"]
    sweep = subprocess.Popen([sys.executable, "-m", "lra", *args], cwd=tmp_path, env=cli_env(tmp_path),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job_log = None
    for _ in range(300):  # wait for training to start in the Slurm job
        logs = list((tmp_path / "outputs" / "multirun" / "requeue").rglob("__main__.log"))
        if logs and "parameters" in logs[0].read_text():
            job_log = logs[0]
            break
        subprocess.run(["sleep", "1"])
    assert job_log is not None, "the Slurm job never started training"
    jobs = subprocess.run(["squeue", "-h", "-n", "lra-requeue-test", "-o", "%i"], capture_output=True, text=True)
    job_id = jobs.stdout.split()[0]
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    out, _ = sweep.communicate(timeout=900)
    assert sweep.returncode == 0, out[-3000:]
    text = job_log.read_text()
    assert "SIGUSR2: finishing this step and saving a checkpoint" in text and "resuming" in text
    rows = pd.read_csv(tmp_path / "results" / "runs.csv")
    assert len(rows) == 1 and rows.status[0] == "ok" and rows.steps[0] == 3000


def test_a_run_stopped_on_one_process_resumes_on_two_and_ends_as_one_process_would(smoke_cfg, tmp_path):
    """A device lease may offer more GPUs than the one a run started on: its checkpoint resumes under
    trainer.devices=2 (the same global batch split over two gloo ranks), and the run ends as the uninterrupted
    one-process run does, up to the order of the gradient sums."""
    same = (*DDP_SMALL, "schedule.steps=8", "schedule.eval_every=4", "trainer.ckpt_every=100")
    one = runner.run(smoke_cfg(*same, f"run_dir={tmp_path / 'one'}"))
    stopped = runner.run(smoke_cfg(*same, "schedule.stop_at=4", f"run_dir={tmp_path / 'moved'}"))
    assert stopped["status"] == "stopped: at step 4 of 8" and stopped["devices"] == 1
    # resume=true: from the checkpoint or not at all (a fresh start would raise)
    moved = runner.run(smoke_cfg(*same, "trainer.devices=2", "resume=true", f"run_dir={tmp_path / 'moved'}"))
    assert moved["status"] == "ok" and moved["steps"] == 8 and moved["devices"] == 2
    assert moved["config_hash"] == one["config_hash"]
    for key in ("val_acc", "test_acc", "final_val_acc", "final_test_acc", "best_step"):
        assert moved[key] == pytest.approx(one[key], abs=1e-6), key
    history = [json.loads((tmp_path / d / "history.json").read_text()) for d in ("one", "moved")]
    assert [h["step"] for h in history[1]] == [h["step"] for h in history[0]]
    for a, b in zip(*history, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
