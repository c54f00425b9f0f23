"""Hydra launchers for lra's grids of runs (``lra -m ... hydra/launcher=<name>``).

* ``local`` (the default for ``-m``): Hydra's basic launcher, one job after another.
* ``gpus``: one host, many GPUs. Jobs run in parallel (joblib), each on GPUs that no other running job holds: a job
  takes a per-GPU file lock before CUDA starts (``trainer.devices`` of them for a data-parallel job) and keeps it to
  the end, surplus jobs wait, and each job gets its share of the host's CPU cores (every process otherwise takes all
  of them and the jobs slow each other down).
* ``slurm``: submitit's Slurm launcher with requeue on timeout or preemption: Slurm signals SIGUSR2 ahead of the
  end, the runner finishes its step and checkpoints, submitit requeues the job and the requeued job resumes.

Each prints, before launching, how many of the sweep's jobs are already finished (skipped: the runner returns the
recorded result and appends no second row), how many resume from a checkpoint and how many start afresh, so a grid
interrupted by a machine going away continues with the same command.
"""
# No `from __future__ import annotations` here: Hydra executes plugin modules outside sys.modules, where dataclasses
# cannot resolve string annotations.
import ctypes
import json
import logging
import multiprocessing
import os
import pickle
import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from hydra._internal.core_plugins.basic_launcher import BasicLauncher, BasicLauncherConf
from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, setup_globals
from omegaconf import OmegaConf

from lra.launchers import UNAVAILABLE

# The [sweep] extra (pip install "lra[sweep]") brings both plugins; each launcher needs only its own, so a host with
# one of them installed still has that launcher. UNAVAILABLE (lra.launchers) says why one is not registered, for the
# CLI's error (`lra.config.check_launcher`) where Hydra would only list the launchers it has.
try:
    from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf
    from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher
except ImportError as e:
    JoblibLauncher, UNAVAILABLE["gpus"] = None, str(e)
try:
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
except ImportError as e:
    SlurmLauncher, UNAVAILABLE["slurm"] = None, str(e)

log = logging.getLogger(__name__)


def job_state(run_dir: Path) -> str:
    """finished | running | retry | resume | new, as the runner will find the job's folder (running: another process
    is training it now, and this launch of the job stops at once; retry: it ended in ``oom`` or ``error`` and runs
    again; resume: it has a checkpoint to go on from, a run stopped by ``schedule.stop_at`` included)."""
    from lra.provenance import is_stopped  # plugin at the start of every app
    from lra.train.checkpoint import RunFiles  # lra's runner (torch) only when a sweep needs it: Hydra loads this

    files = RunFiles(run_dir)
    if files.settled() is not None:
        return "finished"
    if files.in_use():
        return "running"
    done = files.finished()
    if done is not None and not is_stopped(done.get("status")):
        return "retry"
    return "resume" if files.has_checkpoint() else "new"


def sweep_job(hydra_context, config, overrides: Sequence[str]):
    """A sweep's job as Hydra composes it (its ``hydra`` node included)."""
    return hydra_context.config_loader.load_sweep_config(config, list(overrides))


def job_dir(job) -> Path:
    """The folder a sweep's job runs in."""
    return Path(str(job.hydra.sweep.dir)) / str(job.hydra.sweep.subdir)


def is_run(job) -> bool:
    """Whether a job is a training run of ``lra`` (resumable, with a row of its own), not another app's job (the
    bench's, which starts afresh and appends its own rows)."""
    return "resume" in job


def report(launcher, job_overrides: Sequence[Sequence[str]]) -> Counter:
    """Log (and return) how many jobs are finished, retried after a failure, resumable and new."""
    counts: Counter = Counter()
    for overrides in job_overrides:
        job = sweep_job(launcher.hydra_context, launcher.config, overrides)
        if not is_run(job):
            return counts
        counts[job_state(job_dir(job))] += 1
    log.info("sweep %s: %d jobs: %d already finished (skipped, no new row), %d run again after an oom or error, "
             "%d resume from a checkpoint, %d new%s", launcher.config.hydra.sweep.dir, len(job_overrides),
             counts["finished"], counts["retry"], counts["resume"], counts["new"],
             f"; {counts['running']} running in another process now (these stop at once: relaunch once they end)"
             if counts["running"] else "")
    return counts


class LocalLauncher(BasicLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        report(self, job_overrides)
        return super().launch(job_overrides, initial_job_idx)


@dataclass
class LocalConf(BasicLauncherConf):
    _target_: str = "hydra_plugins.lra_launchers.lra_launchers.LocalLauncher"


def claim_gpus(lock_dir: Path, slots: int, n: int = 1, poll_s: float = 1.0) -> list[tuple[int, FileLock]]:
    """The locks of ``n`` free GPUs (held until released), waiting while fewer than ``n`` are free. Waiting jobs
    are served in the order they began to wait (a ticket each in ``lock_dir``), so a job that has just released
    its GPU cannot take it straight back from one that waited longer; a job whose request fits the free GPUs while
    an earlier one's does not goes ahead. A job never sits on part of its GPUs while it waits for the rest: what it
    took is given back before the next try, so two waiting multi-GPU jobs cannot block each other."""
    if n > slots:
        raise ValueError(f"a job asks for trainer.devices={n} GPUs but the launcher has {slots} GPU slots "
                         f"(hydra.launcher.gpus): ask for at most {slots}")
    lock_dir.mkdir(parents=True, exist_ok=True)
    ticket = take_ticket(lock_dir, n)
    said = False
    try:
        while True:
            free = []
            for slot in range(slots):
                lock = FileLock(str(lock_dir / f"gpu{slot}.lock"))
                try:
                    lock.acquire(timeout=0)
                except Timeout:
                    continue
                free.append((slot, lock))
            ahead = [need for seq, need in waiting(lock_dir) if seq < ticket[0] and need <= len(free)]
            if not ahead and len(free) >= n:
                for _, lock in free[n:]:
                    lock.release()
                return free[:n]
            for _, lock in free:
                lock.release()
            if not said:  # once: a sweep's surplus jobs all wait here
                log.info("waiting for %d free GPU%s of %d (locks in %s)", n, "s" if n > 1 else "", slots, lock_dir)
                said = True
            time.sleep(poll_s)
    finally:
        ticket[1].unlink(missing_ok=True)


def take_ticket(lock_dir: Path, n: int) -> tuple[int, Path]:
    """A waiting job's place in the queue: the next number of ``lock_dir``'s counter and a file naming it, this
    process and the GPUs it wants (``wait-<number>-<pid>-<n>``; removed when the job has its GPUs or gives up)."""
    with FileLock(str(lock_dir / "queue.lock")):
        counter = lock_dir / "queue.next"
        seq = int(counter.read_text() or 0) if counter.exists() else 0
        counter.write_text(str(seq + 1))
        path = lock_dir / f"wait-{seq:012d}-{os.getpid()}-{n}"
        path.touch()
    return seq, path


def waiting(lock_dir: Path) -> list[tuple[int, int]]:
    """(number, GPUs wanted) of every job waiting for GPUs on this host. A ticket whose process is gone (killed
    while waiting) is removed, so it never holds the queue up."""
    found = []
    for path in lock_dir.glob("wait-*"):
        _, seq, pid, need = path.name.split("-")
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            continue
        except PermissionError:  # another user's live process
            pass
        found.append((int(seq), int(need)))
    return found


def stop_with_parent(parent: int) -> None:
    """Linux: this process gets SIGTERM when its parent ends. A sweep stopped by a signal to its own process alone
    (``kill PID``, a container's stop) would otherwise leave its running jobs training on, orphaned, on GPUs that a
    relaunch then waits for; with it each job finishes its step, checkpoints and ends, as if signalled itself.
    Elsewhere nothing (the signal still reaches a job sent to the whole process group, as a terminal's Ctrl-C)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # no libc with prctl (macOS, Windows)
        return
    if os.getppid() != parent:  # the parent ended before the line above took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _send_result(conn, fn, args, env, parent: int) -> None:
    """In the job's own process: ``fn(*args)`` with ``env`` added to its environment, its result sent back pickled
    (an exception as a RuntimeError that names it, since not every exception pickles). Loky's pickler, as joblib's
    own workers use: Hydra runs this module outside ``sys.modules``, so its classes pickle by value."""
    from joblib.externals.loky.backend.reduction import dumps  # optional: the [sweep] extra brings joblib

    stop_with_parent(parent)
    os.environ.update(env)
    try:
        result = fn(*args)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it
        result = RuntimeError(f"{type(error).__name__}: {error}")
    if isinstance(getattr(result, "_return_value", None), BaseException):
        error = result._return_value
        result._return_value = RuntimeError(f"{type(error).__name__}: {error}")
    conn.send_bytes(bytes(dumps(result)))
    conn.close()


class JobCrashed(RuntimeError):
    """The process of one job died (a signal such as SIGSEGV, or the kernel's OOM killer) without a result."""

    def __init__(self, how: str):
        super().__init__(f"the job's process died ({how}) before it returned")
        self.how = how


def run_isolated(fn, *args, env: dict[str, str] | None = None):
    """``fn(*args)`` in a process of its own, so that a job that crashes (a segfault inside torch.compile's cache,
    the OOM killer) takes down neither the worker nor the other jobs of its sweep; ``env`` is added to that
    process's environment alone. Returns its result, or raises ``JobCrashed`` saying how it ended. Forked where the
    platform can (no CUDA has started in the worker yet)."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_send_result, args=(send, fn, args, env or {}, os.getpid()))
    child.start()
    send.close()
    try:
        payload = receive.recv_bytes()
    except EOFError:  # the child ended without sending
        payload = None
    child.join()
    if payload is None:
        code = child.exitcode
        killed = code is not None and code < 0
        raise JobCrashed(f"signal {signal.Signals(-code).name}" if killed else f"exit code {code}")
    result = pickle.loads(payload)
    if isinstance(result, BaseException):
        raise result
    return result


if JoblibLauncher is not None:

    def gpu_placement(held: Sequence[int], slots: int, real_gpus: int) -> tuple[list[str], dict[str, str]]:
        """Overrides and environment that put a job on the GPUs it holds. One GPU: ``device=cuda:<slot>``. Several
        (``trainer.devices=N``, one data-parallel run): the job's process sees only them (``CUDA_VISIBLE_DEVICES``),
        and its ranks take ``cuda:0..N-1`` of that view. ``LRA_LOCAL_JOBS`` gives each process of the job its share
        of the host's cores (the host's cores / slots; the runner splits it further over its ranks)."""
        share = {"LRA_LOCAL_JOBS": f"{slots / len(held):g}"}  # a job of N GPUs takes N shares, one per rank
        if held[-1] >= real_gpus:  # no such GPU (a CPU host: slots are only a limit on jobs at once)
            return [], share
        if len(held) == 1:
            return [f"device=cuda:{held[0]}"], share
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(real_gpus)]
        return [], {**share, "CUDA_VISIBLE_DEVICES": ",".join(ids[i] for i in held)}


    def execute_on_a_free_gpu(idx, overrides, hydra_context, config, task_function, singleton_state, slots: int,
                              real_gpus: int, lock_dir: str) -> JobReturn:
        """One job in a joblib worker: claim its GPUs (``trainer.devices``, one by default), run on them in a
        process of its own, release them. A job whose process dies returns as failed, naming its folder; the
        others run on, and the sweep fails at its end (relaunched, the job resumes from its last checkpoint)."""
        from hydra_plugins.hydra_joblib_launcher import _core  # optional: the [sweep] extra

        devices = int(OmegaConf.select(sweep_job(hydra_context, config, overrides), "trainer.devices", default=1))
        claimed = claim_gpus(Path(lock_dir), slots, devices)
        held = [slot for slot, _ in claimed]
        extra, env = gpu_placement(held, slots, real_gpus)
        start = time.time()
        try:
            ret = run_isolated(_core.execute_job, idx, list(overrides) + extra, hydra_context, config, task_function,
                               singleton_state, env=env)
            out = Path(str(ret.hydra_cfg.hydra.runtime.output_dir))
        except JobCrashed as crash:
            job = sweep_job(hydra_context, config, list(overrides) + extra)
            out = job_dir(job)
            if is_run(job):
                log.error("job %s: %s; its row says so, and relaunching the sweep runs it again from its last "
                          "checkpoint", out, crash)
                from lra.train.run import record_crash  # the runner (torch) only where a job crashed, as in job_state

                record_crash(job, out, crash.how)  # the job never got to write its own row
            else:
                log.error("job %s: %s", out, crash)
            ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED,
                            _return_value=RuntimeError(f"{out}: {crash}"))
        finally:
            for _, lock in claimed:
                lock.release()
        out.mkdir(parents=True, exist_ok=True)  # the job's folder: which GPUs it held, and when
        (out / "gpu_slot.json").write_text(json.dumps({"slot": held[0], "slots": held, "start": start,
                                                       "end": time.time()}))
        return ret


    def visible_gpus() -> int:
        try:
            import torch  # torch (seconds) only where the gpus launcher starts, not at Hydra's plugin scan

            return torch.cuda.device_count()
        except Exception:  # noqa: BLE001 - no torch or no driver: no GPUs
            return 0


    class GpusLauncher(JoblibLauncher):
        def __init__(self, gpus: int | None = None, lock_dir: str = "/tmp/lra-gpu-locks", **joblib: Any) -> None:
            super().__init__(**joblib)
            self.real_gpus = visible_gpus()
            self.slots = int(gpus) if gpus else max(self.real_gpus, 1)
            self.lock_dir = lock_dir
            self.joblib["n_jobs"] = self.slots

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            from joblib import Parallel, delayed  # optional: the [sweep] extra

            setup_globals()
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
            Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
            report(self, job_overrides)
            log.info("%d jobs on %d GPU slots (%d visible GPUs), locks in %s", len(job_overrides), self.slots,
                     self.real_gpus, self.lock_dir)
            state = Singleton.get_state()
            runs = Parallel(**{**self.joblib, "backend": "loky"})(
                delayed(execute_on_a_free_gpu)(initial_job_idx + i, overrides, self.hydra_context, self.config,
                                               self.task_function, state, self.slots, self.real_gpus, self.lock_dir)
                for i, overrides in enumerate(job_overrides))
            return list(runs)


    @dataclass
    class GpusConf(JobLibLauncherConf):
        _target_: str = "hydra_plugins.lra_launchers.lra_launchers.GpusLauncher"
        gpus: int | None = None  # null: one slot per visible GPU (at least one)
        lock_dir: str = "${oc.env:LRA_GPU_LOCKS,/tmp/lra-gpu-locks}"  # host-wide: sweeps started apart share the GPUs


if SlurmLauncher is not None:

    class SlurmRequeueLauncher(SlurmLauncher):
        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            report(self, job_overrides)
            return super().launch(job_overrides, initial_job_idx)


    @dataclass
    class SlurmConf(SlurmQueueConf):
        _target_: str = "hydra_plugins.lra_launchers.lra_launchers.SlurmRequeueLauncher"
        gpus_per_node: int | None = 1
        cpus_per_task: int | None = 8
        timeout_min: int = 240
        signal_delay_s: int = 120  # SIGUSR2 this long before the time limit: enough to finish a step and checkpoint
        max_num_timeout: int = 20  # requeues after a timeout or preemption (the run resumes from its checkpoint)


store = ConfigStore.instance()
store.store(group="hydra/launcher", name="local", node=LocalConf, provider="lra")
if JoblibLauncher is not None:
    store.store(group="hydra/launcher", name="gpus", node=GpusConf, provider="lra")
if SlurmLauncher is not None:
    store.store(group="hydra/launcher", name="slurm", node=SlurmConf, provider="lra")
