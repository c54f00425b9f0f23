"""Hydra launchers for lra's grids of runs (``lra -m ... hydra/launcher=<name>``).

* ``local`` (the default for ``-m``): Hydra's basic launcher, one job after another.
* ``gpus``: one host, many GPUs. Jobs run in parallel (joblib), each on a GPU that no other running job holds: a job
  takes a per-GPU file lock before CUDA starts and keeps it to the end, surplus jobs wait, and each job gets its
  share of the host's CPU cores (every process otherwise takes all of them and the jobs slow each other down).
* ``slurm``: submitit's Slurm launcher with requeue on timeout or preemption: Slurm signals SIGUSR2 ahead of the
  end, the runner finishes its step and checkpoints, submitit requeues the job and the requeued job resumes.

Each prints, before launching, how many of the sweep's jobs are already finished (skipped: the runner returns the
recorded result and appends no second row), how many resume from a checkpoint and how many start afresh, so a grid
interrupted by a machine going away continues with the same command.
"""
# No `from __future__ import annotations` here: Hydra executes plugin modules outside sys.modules, where dataclasses
# cannot resolve string annotations.
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from hydra._internal.core_plugins.basic_launcher import BasicLauncher, BasicLauncherConf
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn

try:  # the [sweep] extra: pip install "lra[sweep]"
    from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf
    from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
except ImportError:  # only the local launcher then; `hydra/launcher=gpus` says it is unknown, listing `local`
    JoblibLauncher = SlurmLauncher = None

log = logging.getLogger(__name__)


def job_state(run_dir: Path) -> str:
    """finished | retry | resume | new, as the runner will find the job's folder (retry: it ended in ``oom`` or
    ``error`` and runs again)."""
    from lra.checkpoint import RunFiles

    files = RunFiles(run_dir)
    if files.settled() is not None:
        return "finished"
    if files.finished() is not None:
        return "retry"
    return "resume" if files.has_checkpoint() else "new"


def report(launcher, job_overrides: Sequence[Sequence[str]]) -> Counter:
    """Log (and return) how many jobs are finished, retried after a failure, resumable and new."""
    counts: Counter = Counter()
    for overrides in job_overrides:
        cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        counts[job_state(Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir))] += 1
    log.info("sweep %s: %d jobs: %d already finished (skipped, no new row), %d run again after an oom or error, "
             "%d resume from a checkpoint, %d new", launcher.config.hydra.sweep.dir, len(job_overrides),
             counts["finished"], counts["retry"], counts["resume"], counts["new"])
    return counts


class LocalLauncher(BasicLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        report(self, job_overrides)
        return super().launch(job_overrides, initial_job_idx)


@dataclass
class LocalConf(BasicLauncherConf):
    _target_: str = "hydra_plugins.lra_launchers.lra_launchers.LocalLauncher"


def claim_gpu(lock_dir: Path, slots: int, poll_s: float = 1.0) -> tuple[int, FileLock]:
    """The first free GPU's lock (held until released), waiting while every GPU is held."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    while True:
        for slot in range(slots):
            lock = FileLock(str(lock_dir / f"gpu{slot}.lock"))
            try:
                lock.acquire(timeout=0)
                return slot, lock
            except Timeout:
                continue
        time.sleep(poll_s)


if JoblibLauncher is not None:

    def execute_on_a_free_gpu(idx, overrides, hydra_context, config, task_function, singleton_state, slots: int,
                              real_gpus: int, lock_dir: str) -> JobReturn:
        """One job in a joblib worker: claim a GPU, run on it (``device=cuda:<slot>``), release it."""
        from hydra_plugins.hydra_joblib_launcher import _core

        slot, lock = claim_gpu(Path(lock_dir), slots)
        os.environ["LRA_LOCAL_JOBS"] = str(slots)  # the runner gives this process its share of the cores
        extra = [f"device=cuda:{slot}"] if slot < real_gpus else []
        start = time.time()
        try:
            ret = _core.execute_job(idx, list(overrides) + extra, hydra_context, config, task_function, singleton_state)
        finally:
            lock.release()
        if isinstance(getattr(ret, "_return_value", None), BaseException):  # back to the launcher, picklable
            error = ret._return_value
            ret._return_value = RuntimeError(f"{type(error).__name__}: {error}")
        out = Path(str(ret.hydra_cfg.hydra.runtime.output_dir))  # the job's folder: which GPU it held, and when
        (out / "gpu_slot.json").write_text(json.dumps({"slot": slot, "start": start, "end": time.time()}))
        return ret


    def visible_gpus() -> int:
        try:
            import torch

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
            from hydra.core.singleton import Singleton
            from hydra.core.utils import configure_log, setup_globals
            from joblib import Parallel, delayed

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


    class SlurmRequeueLauncher(SlurmLauncher):
        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            report(self, job_overrides)
            return super().launch(job_overrides, initial_job_idx)


    @dataclass
    class GpusConf(JobLibLauncherConf):
        _target_: str = "hydra_plugins.lra_launchers.lra_launchers.GpusLauncher"
        gpus: int | None = None  # null: one slot per visible GPU (at least one)
        lock_dir: str = "${oc.env:LRA_GPU_LOCKS,/tmp/lra-gpu-locks}"  # host-wide: sweeps started apart share the GPUs


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
    store.store(group="hydra/launcher", name="slurm", node=SlurmConf, provider="lra")
