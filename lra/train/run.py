"""``run(cfg) -> dict``: one training run as a plain PyTorch loop, callable from tests and from ``python -m lra``.

validate -> data -> model -> AdamW + LRA schedule -> train with periodic validation (best-validation weights
kept) -> test with the best and the final weights -> one row appended to ``results.dir/runs.csv``.

With ``pretrain=mlm|causal`` a pretraining phase comes first (``Pretrainer``: the same loop and step, the encoder
with a token head, the training split only, in ``<run_dir>/pretrain``; ``lra.train.pretrain``), and the classifier
starts from its encoder's weights; the one row names the pretraining (``pretrain``, ``pretrain_hash``).

Nothing is lost when a run is stopped: a checkpoint (model, optimiser, scheduler, RNG, step, timers) is written
every ``trainer.ckpt_every`` steps and when a signal arrives (Ctrl-C, SIGTERM, or Slurm's SIGUSR2 before a
timeout or preemption: the current step finishes, the checkpoint is saved, the run exits with code 75);
rerunning the same command continues from it. A finished run rerun says so and writes no second row
(``resume=false`` starts it over); one that ended in ``oom`` or ``error`` runs again. No wrong number is recorded:
a non-finite loss stops the run as ``status=diverged``, an out-of-memory as ``status=oom``, a failure as
``status=error: ...``, all without accuracies. With ``trainer.devices=N`` (or under ``torchrun``) the run is
data-parallel (``lra.train.distributed``).
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import math
import os
import random
import signal
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from lra.config import eval_batch_size, mixer_settings, model_options, sweep_folder, validate
from lra.data import BatchOrder, Split, TaskData, load_task
from lra.errors import EXIT_INTERRUPTED, ConfigError, first_line
from lra.io import atomic_save
from lra.provenance import PARTIAL_PRESETS, config_hash, departures, error_status, is_stopped, stopped_status
from lra.report import baseline
from lra.report.results import (
    PRETRAIN_CURVE_COLUMNS,
    RUN_COLUMNS,
    RunRow,
    append_row,
    device_name,
    git_sha,
    now_iso,
    write_curve,
)
from lra.train import distributed, engine, pretrain
from lra.train.checkpoint import RunFiles, rng_state, set_rng_state
from lra.train.packing import model_inputs, packed_share, real_ends, trim
from models import list_models
from models.registry import get_model_class

log = logging.getLogger("lra")
STOP_CHECK_EVERY = 10  # steps between the data-parallel ranks' agreement on a stop request
clock = time.monotonic  # trainer.time_limit's clock (seconds); a test replaces it
CPU_WARN_AFTER_S = 15 * 60  # a CPU run estimated to take longer than this gets a warning with the estimate

class RunInterrupted(Exception):
    """The run was asked to stop; its checkpoint is saved and rerunning the command resumes it."""


class StopFlag:
    """Set by a signal handler; the loop checks it between steps so a checkpoint is never half an update."""

    requested = False
    signum: int | None = None


STOP = StopFlag()
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
CATCH_SIGNALS = "LRA_CATCH_SIGNALS"  # "1": the loop catches STOP_SIGNALS (``catch_signals``); spawned ranks inherit it


def catch_signals() -> None:
    """This process's runs, and the data-parallel ranks they spawn, catch SIGINT, SIGTERM and SIGUSR2 to stop with
    a checkpoint (``graceful_stop``). The commands ask for it (``python -m lra``, a launcher's jobs); ``run`` called
    from other code, a test say, leaves the signals to its caller: pytest's Ctrl-C stops the suite."""
    os.environ[CATCH_SIGNALS] = "1"


@contextmanager
def graceful_stop():
    """Turn SIGINT, SIGTERM and SIGUSR2 into a request to stop after the current step, where the process asked to
    (``catch_signals``). The previous handlers are kept: after the checkpoint, a previous SIGUSR2 handler
    (submitit's, which requeues the Slurm job) is called."""

    def handler(signum, frame):
        if STOP.requested and signum == signal.SIGINT:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        STOP.requested, STOP.signum = True, signum
        log.warning("%s: finishing this step and saving a checkpoint", signal.Signals(signum).name)

    try:
        old = {s: signal.signal(s, handler) for s in STOP_SIGNALS} if os.environ.get(CATCH_SIGNALS) == "1" else {}
    except ValueError:  # not the main thread (e.g. some test runners): no handlers, same loop
        old = {}
    STOP.requested, STOP.signum = False, None
    try:
        yield old
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def task_shape(data: TaskData) -> engine.TaskShape:
    """Without a single pad token in any split (pixel tasks) the model runs mask-free."""
    padded = any(bool((s.tokens == 0).any()) for s in (data.train, data.val, data.test))
    return engine.TaskShape(data.vocab_size, data.seq_len, data.n_classes, data.pair, padded, data.grid)


def to_device(ids: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A batch's ids or labels (int64; or ``dtype``: a pretraining batch's masked positions) on ``device``. On CUDA the
    copy goes through pinned memory: a copy from pageable memory makes the host wait until the GPU has run
    everything queued before it, so one such copy per step keeps the host from preparing the next step while the
    GPU runs this one."""
    if device.type == "cuda":
        return ids.pin_memory().to(device, non_blocking=True).to(dtype)
    return ids.to(dtype)


def device_batch(split: Split, rows: slice | torch.Tensor, device: torch.device, packed: bool = False,
                 cls_token: bool = True, trimmed: bool = False) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The examples ``rows`` of ``split`` on ``device``: the model's inputs (the ids, cut after the longest example
    when ``trimmed``, or the packed batch: ``lra.train.packing``) and the labels. Nothing here waits for the GPU."""
    tokens = trim(split.tokens[rows]) if trimmed else split.tokens[rows]
    inputs = tuple(to_device(t, device) for t in model_inputs(tokens, packed, cls_token))
    return inputs, to_device(split.labels[rows], device)


@torch.no_grad()
def accuracy(model, split: Split, batch_size: int, device: torch.device, autocast, packed: bool = False,
             cls_token: bool = True, trimmed: bool = False, cuda_graphs: bool = False,
             world: distributed.World = distributed.SINGLE) -> float:
    """Accuracy on ``split``. In a data-parallel world every rank takes its share of the batches (batch k on rank
    k mod size, the batches themselves as one process cuts them) and the counts are summed, so the ranks finish
    an evaluation together in 1/size of the time, with the single process's result."""
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    # Trimmed batches in length order: each is cut near its own examples' length (a count of correct answers does
    # not depend on the order; a random order leaves nearly every batch at full length).
    order = torch.argsort(real_ends(split.tokens), stable=True) if trimmed else None
    for i in range(world.rank * batch_size, len(split), world.size * batch_size):
        rows = slice(i, i + batch_size) if order is None else order[i : i + batch_size]
        inputs, labels = device_batch(split, rows, device, packed, cls_token, trimmed)
        if cuda_graphs:  # compiled graphs replay as CUDA graphs (compile_mode): the last batch's outputs are dead
            torch.compiler.cudagraph_mark_step_begin()
        with autocast():
            correct += (model(*inputs).argmax(-1) == labels).sum()
    model.train()
    return world.sum(correct).item() / len(split)


def check_writable(*folders: str | Path) -> None:
    """Fail at start, not after hours of training, when an output folder cannot be written."""
    for folder in folders:
        folder = Path(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".lra-write-test-{time.time_ns()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"{folder} is not writable ({type(e).__name__}: {e.strerror or e}); choose another "
                              f"folder (results.dir=... or hydra.run.dir=...)") from None


HELD_BY_PARENT = "LRA_RUN_FOLDER_HELD"  # the run folder the process that spawned this rank holds
PARENT_OVERRIDES = "LRA_RUN_OVERRIDES"  # the command-line overrides of that process (a spawned rank has no Hydra)


def wandb_settings(cfg: DictConfig, run_dir: str | Path, chash: str) -> dict:
    """``wandb.init``'s arguments for a run. Its id is the run's own (its configuration hash and folder), resumed
    where it exists: a run continued after a stop, a time limit or a requeue logs on into the wandb run it began. A
    multirun's jobs share a group, the sweep's name; the experiment is the job type and a tag, beside task and
    model."""
    folder = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    tags = dict.fromkeys([cfg.experiment, cfg.task.name, cfg.model.name, *(cfg.logger.get("tags") or [])])
    return dict(project=cfg.logger.project, entity=cfg.logger.get("entity"), mode=cfg.logger.mode, dir=str(run_dir),
                id=f"{chash}-{folder}", resume="allow", group=sweep_group(cfg), job_type=cfg.experiment,
                tags=[str(t) for t in tags], name=f"{cfg.task.name}-{cfg.model.name}-s{cfg.seed}",
                config=OmegaConf.to_container(cfg, resolve=True), reinit=True)


def sweep_group(cfg: DictConfig) -> str | None:
    """The sweep a run is a job of (its folder under outputs/multirun: ``sweep``, or the name the CLI derived from
    the command), or None for a single run."""
    try:
        multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:  # run(cfg) called outside Hydra: a test, a spawned data-parallel rank
        multirun = False
    return sweep_folder(cfg.get("sweep")) if multirun or cfg.get("sweep") else None


def start_logger(cfg: DictConfig, run_dir: Path, chash: str):
    if cfg.logger.name != "wandb":
        return None
    import wandb  # optional: only this logger needs it

    return wandb.init(**wandb_settings(cfg, run_dir, chash))


def log_result(logger, row: dict, step: int) -> None:
    """A row into the run's wandb run, then its end: every field in the summary, and the row as a table (each
    stopped slice's, then the finished run's)."""
    import wandb  # optional: only the wandb logger calls this

    kept = {k: v for k, v in row.items() if v is not None}
    logger.summary.update(kept)
    logger.log({"result": wandb.Table(columns=list(kept), data=[list(kept.values())])}, step=step)
    logger.finish()


def check_batch_split(batch_size: int, processes: int) -> None:
    """Every data-parallel process needs at least one example of each global batch."""
    if batch_size < processes:
        raise ConfigError(f"schedule.batch_size={batch_size} is smaller than the {processes} processes of "
                          f"trainer.devices: each needs at least one example of every batch")


def run(cfg: DictConfig) -> dict:
    """Train and evaluate ``cfg.model`` on ``cfg.task``; return the result row (also appended to runs.csv)."""
    validate(cfg)
    world = distributed.from_env()
    if int(cfg.trainer.devices) > 1 and not world.distributed:
        check_batch_split(cfg.schedule.batch_size, int(cfg.trainer.devices))  # before any process starts
        plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # picklable, Hydra's resolvers done
        check_writable(plain.run_dir, plain.results.dir)
        with RunFiles(plain.run_dir).hold():  # here, so that a folder in use fails before any rank starts
            os.environ[HELD_BY_PARENT] = str(Path(plain.run_dir).resolve())  # the ranks inherit both
            os.environ[PARENT_OVERRIDES] = _overrides()
            try:
                distributed.spawn(int(cfg.trainer.devices), run_rank, plain)
            finally:
                os.environ.pop(HELD_BY_PARENT)
                os.environ.pop(PARENT_OVERRIDES)
        return RunFiles(plain.run_dir).finished()
    return run_rank(cfg)


def run_rank(cfg: DictConfig) -> dict:
    """``run`` in one process of a (possibly single-process) world."""
    world = distributed.from_env()
    check_batch_split(cfg.schedule.batch_size, world.size)  # torchrun's processes too
    device = engine.resolve_device(cfg.device)
    if device.type == "cuda" and world.distributed:
        device = torch.device("cuda", world.local_rank)
    engine.configure(device, cfg.trainer.threads, cfg.trainer.deterministic)
    distributed.init(world, device)
    try:
        return Trainer(cfg, world, device).fit()
    except RunInterrupted:
        if world.distributed:  # the other ranks are stopped by their own copy of the signal
            raise SystemExit(EXIT_INTERRUPTED) from None
        raise
    finally:
        distributed.shutdown()


class Trainer:
    """The loop and its state. ``fit`` reads top to bottom: resume or start, (pretrain,) train with evaluations and
    checkpoints, test, record."""

    phase = ""  # what a stopped status says the run was stopped in ("pretraining"; "" the task's training)

    def __init__(self, cfg: DictConfig, world: distributed.World, device: torch.device):
        self.cfg, self.world, self.device = cfg, world, device
        self.wall_start = time.time()
        self.files = RunFiles(cfg.run_dir)
        self.chash = config_hash(OmegaConf.to_container(cfg, resolve=True))
        self.precision = engine.resolve_precision(cfg.trainer.precision, device)
        self.compiled = engine.resolve_compile(cfg.trainer.compile, device)
        self.autocast = engine.autocast(self.precision, device)
        # where and with what code this process trains: a row names them even when the run fails before its first step
        self.here = {"devices": device_name(device), "git_shas": git_sha()}
        self.state = {"step": 0, "best_val": -1.0, "best_step": 0, "timed_steps": 0, "timed_s": 0.0, "wall_s": 0.0,
                      "peak_mem_mb": 0.0, "history": [], **{key: [now] for key, now in self.here.items()},
                      "deterministic": bool(cfg.trainer.deterministic)}
        self.deadline = None  # trainer.time_limit's end on ``clock``, set as this process's first loop starts

    # -- the run ------------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        held = os.environ.get(HELD_BY_PARENT) == str(self.files.dir.resolve())  # ranks spawned by ``run``
        if held or not self.world.is_main:  # torchrun's other ranks follow rank 0, which holds the folder
            return self.fit_held()
        check_writable(self.files.dir, self.cfg.results.dir)
        with self.files.hold():
            return self.fit_held()

    def fit_held(self) -> dict:
        cfg, files = self.cfg, self.files
        if self.world.is_main:
            (files.dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        checkpoint = self.resume_or_start()
        if isinstance(checkpoint, dict) and "row" in checkpoint:
            return checkpoint["row"]
        seed_everything(cfg.seed)
        self.data = load_task(cfg)
        if self.world.is_main:
            log.info(self.data.summary())
            changed = departures(_overrides(), bool(self.data.info.get("val_is_test", False)))
            if changed and cfg.experiment not in PARTIAL_PRESETS:
                log.warning("%s changes what experiment=%s computes: the leaderboard shows this run as %s+modified, "
                            "apart from the preset's own runs", " ".join(changed), cfg.experiment, cfg.experiment)
        try:
            pretrained = None
            if pretrain.pretraining(cfg) and checkpoint is None:  # a classifier checkpoint comes after the phase
                status, pretrained, trained = self.pretrain()
                if status != "ok" and not trained:  # stopped at pretrain.stop_at already: nothing new to record
                    return files.finished() or self.record(status)
                if status != "ok":  # diverged, or stopped by pretrain.stop_at or trainer.time_limit
                    return self.record(status)
                seed_everything(cfg.seed)  # one initial head, whether the phase ran in this process or before
            self.build(checkpoint, pretrained)
            status = self.train()
        except torch.cuda.OutOfMemoryError as e:
            return self.record("oom", detail=first_line(e))
        except (RunInterrupted, ConfigError):
            raise
        except Exception as e:
            if (op := engine.nondeterministic_op(e)) is not None:  # a setting that cannot run: no row
                raise ConfigError(f"trainer.deterministic=true: model {cfg.model.name} calls {op}, which has no "
                                  f"deterministic implementation on {self.device.type} in torch {torch.__version__}; "
                                  f"run it with trainer.deterministic=false, or with another trainer.mixer setting "
                                  f"or model option that avoids the op") from e
            log.exception("%s/%s failed", cfg.task.name, cfg.model.name)  # the traceback, in the run's own log
            self.record(error_status(e))
            raise
        if status != "ok" and not is_stopped(status):  # diverged: no accuracies
            return self.record(status)
        return self.record(status, metrics=self.test())  # ok, or schedule.stop_at's result of the steps done

    def resume_or_start(self):
        """None (fresh), a checkpoint dict, or {"row": ...} for a finished run."""
        files, resume = self.files, self.cfg.resume
        if resume == "false":
            if self.world.is_main:
                files.clear()
            self.world.barrier()
            return None
        done = files.finished()
        end = self.cfg.schedule.stop_at
        if done is not None and is_stopped(done.get("status")) and end is not None \
                and done.get("steps", 0) >= end and done.get("config_hash") == self.chash:
            log.info("%s stopped at step %d already (schedule.stop_at=%d): no new row; raise or drop stop_at to "
                     "train on", files.dir, done["steps"], end)
            return {"row": done}
        if done is not None and is_stopped(done.get("status")):
            log.info("%s %s: it goes on from its checkpoint", files.dir, done.get("status"))
            done = None
        elif done is not None and files.settled() is None:
            log.warning("%s ended with status %r: running it again (from its checkpoint when there is one)",
                        files.dir, done.get("status"))
            done = None
        if done is not None:
            if done.get("config_hash") != self.chash:
                raise ConfigError(f"{files.dir} holds a finished run of another configuration (hash "
                                  f"{done.get('config_hash')} != {self.chash}); use another folder "
                                  f"(hydra.run.dir=...) or resume=false to start over")
            log.info("%s/%s seed %d already finished in %s (status %s, test %s): no new row; resume=false reruns it",
                     done.get("task"), done.get("model"), done.get("seed", 0), files.dir, done.get("status"),
                     done.get("test_acc"))
            return {"row": done}
        checkpoint = files.load_checkpoint()
        if checkpoint is None:
            pretraining_started = pretrain.pretraining(self.cfg) and RunFiles(
                files.dir / pretrain.FOLDER).has_checkpoint()
            if resume == "true" and not pretraining_started:
                raise ConfigError(f"resume=true but {files.dir} holds no readable checkpoint; run without "
                                  f"resume=true to start")
            if files.has_checkpoint():
                log.warning("no readable checkpoint in %s: starting over", files.dir)
            return None
        if checkpoint["config_hash"] != self.chash:
            raise ConfigError(f"{files.checkpoint} was written by a different configuration (hash "
                              f"{checkpoint['config_hash']} != {self.chash}); use another run_dir "
                              f"(hydra.run.dir=...) or resume=false to start over")
        return checkpoint

    def pretrain(self) -> tuple[str, dict | None, bool]:
        """The pretraining phase (``Pretrainer``), from its checkpoint where it has one: (its status, the pretrained
        encoder's weights where it ended ok, whether it trained now). This run's time limit spans both phases, and
        its row counts the phase's wall time, devices and commits as its own."""
        phase = Pretrainer(pretrain.pretraining_config(self.cfg), self.world, self.device, self.data,
                           task_shape(self.data))
        phase.deadline = self.deadline
        status, weights, trained = phase.fit_phase()
        self.deadline = phase.deadline
        self.state["wall_s"], self.wall_start = phase.wall_s(), time.time()
        for key in self.here:
            self.state[key] = list(dict.fromkeys([*phase.state[key], *self.state[key]]))
        return status, weights, trained

    def make_model(self) -> torch.nn.Module:
        cfg = self.cfg
        return engine.build_model(cfg.model.name, model_options(cfg), cfg.backbone, task_shape(self.data))

    def build(self, checkpoint: dict | None, pretrained: dict | None = None) -> None:
        """The model, its optimiser and schedule, from ``checkpoint`` where given; else with the encoder's weights
        ``pretrained`` where given (the classifier's head as initialised)."""
        cfg, device = self.cfg, self.device
        self.model = self.make_model()
        if checkpoint is None and pretrained is not None:
            self.model.encoder.load_state_dict(pretrained)  # strict: every weight of the encoder, nothing else
        for key, settings in mixer_settings(cfg).items():  # how the mixers run, not what: set on each one built
            try:
                engine.set_mixer_attributes(self.model, cfg.model.name, settings)
            except ValueError as e:  # a setting that cannot run: no row, as for any invalid setting
                shown = settings["backend"] if key == "trainer.mixer_backend" else settings
                raise ConfigError(f"{key}={shown}: {e}") from None  # e.g. a backend deterministic mode refuses
        self.model.to(device)
        self.packed = self.resolve_packing()
        self.trimmed = self.resolve_trimming()
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.optimizer = engine.build_optimizer(self.model, cfg.optim, device)
        self.scheduler = engine.build_scheduler(self.optimizer, cfg.optim, cfg.schedule.steps)
        if checkpoint is not None:
            self.model.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.scheduler.load_state_dict(checkpoint["scheduler"])
            set_rng_state(checkpoint["rng"], device)
            self.state = checkpoint["state"]
            log.info("resuming %s from step %d", self.files.dir, self.state["step"])
            # a run resumed on other hardware or code names every device and commit it trained on
            for key, now in self.here.items():
                if now not in self.state[key]:
                    self.state[key].append(now)
            # deterministic only if every step was: a checkpoint without the key predates the switch
            self.state["deterministic"] = self.state.get("deterministic", False) and bool(cfg.trainer.deterministic)
        train_model = self.model
        if self.world.distributed:
            # gradient_as_bucket_view: the gradients live in the all-reduce buckets (no copy in and out of them).
            # broadcast_buffers=False: no broadcast of rank 0's buffers before every forward. They are constants
            # (positions, hash rotations) or BatchNorm statistics, which only evaluation reads: the ranks take rank
            # 0's before each evaluation (``accuracy``), rank 0 alone saves them, and its own evolve the same
            # either way. torch 2.13 names that forward_sync_buffers (broadcast_buffers is deprecated there); both
            # leave the one sync at construction, of buffers the ranks built alike.
            no_forward_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(
                DistributedDataParallel).parameters else {"broadcast_buffers": False}
            train_model = DistributedDataParallel(self.model, device_ids=[device.index] if device.type == "cuda"
                                                  else None, gradient_as_bucket_view=True, **no_forward_sync)
        self.eager_train_fn = train_model
        mode = cfg.trainer.compile_mode
        self.train_fn = torch.compile(train_model, mode=mode) if self.compiled else train_model
        self.eval_fn = self.train_fn if not self.world.distributed else (
            torch.compile(self.model, mode=mode) if self.compiled else self.model)
        if self.world.is_main:
            log.info("%s: %s parameters", cfg.model.name, f"{self.n_params:,}")

    def resolve_trimming(self) -> bool:
        """``trainer.trim``, where it is exact: a 2-D task's grid is its whole length (and LRA's pixel_zero_is_pad
        makes background pixels pads), and some mixers' outputs depend on the padded length."""
        cfg = self.cfg
        trimmable = self.model.supports_trimming
        if cfg.trainer.trim and not trimmable:
            log.warning("trainer.trim: not applied: model %s's outputs depend on the padded length", cfg.model.name)
        return bool(cfg.trainer.trim) and self.data.grid is None and trimmable

    def resolve_packing(self) -> bool:
        """``trainer.pack``: false; auto (pack where the task has padding and every mixer keeps packed examples
        apart); true (the same, or fail saying why)."""
        mode, cfg = self.cfg.trainer.pack, self.cfg
        if mode == "false":
            return False
        why = None
        if not self.model.padded:
            why = f"task {cfg.task.name} has no padding to pack away"
        elif self.model.encoder.tied_dropout:
            why = "backbone.tie_dropout draws one dropout mask per row, which a packed row's examples would share"
        elif not self.model.supports_packing:
            able = ", ".join(n for n in list_models() if getattr(get_model_class(n), "supports_segments", False))
            why = f"model {cfg.model.name} cannot keep packed examples apart (models that can: {able})"
        if why is None:
            share = packed_share(self.data.train.tokens[: cfg.schedule.batch_size], self.model.encoder.cls_token)
            if self.world.is_main:
                log.info("packing: the first training batch fits in %.0f%% of its rows", 100 * share)
            return True
        if mode == "true":
            raise ConfigError(f"trainer.pack=true: {why}; use trainer.pack=auto (pack where possible) or false")
        if self.world.is_main:
            log.info("trainer.pack=auto: not packing (%s)", why)
        return False

    def device_inputs(self, rows: torch.Tensor, packed: bool) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The training examples ``rows`` on the device, ``packed`` or not: (the model's inputs, the labels)."""
        return device_batch(self.data.train, rows, self.device, packed, self.model.encoder.cls_token, self.trimmed)

    def batch(self, rows: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The training examples ``rows`` on the device: (the model's inputs, the labels)."""
        inputs, labels = self.device_inputs(rows, self.packed)
        if self.compiled and not self.packed:
            # training batches are full: their size stays an int in the compiled graphs, though evaluation's last
            # batch, a smaller one through the same code, makes torch.compile's automatic dynamic shapes treat the
            # batch as a symbol from then on. A FlexAttention table's gradient must have int sizes
            # (models/patterns.score_table); packed batches vary in rows
            for tensor in inputs:
                torch._dynamo.mark_static(tensor, 0)
        return inputs, labels

    @property
    def cuda_graphs(self) -> bool:
        """Whether the compiled graphs replay as CUDA graphs (``trainer.compile_mode``; off once running eagerly)."""
        return engine.replays_cuda_graphs(self.compiled, self.device, self.cfg.trainer.compile_mode)

    @property
    def eval_compiled(self) -> bool:
        """Whether evaluation runs through torch.compile (it can fall back alone: ``eager_if_compile_fails``)."""
        return self.eval_fn is not self.model

    def accuracy(self, split: Split) -> float:
        """Accuracy on ``split``, every rank its share; they evaluate with rank 0's buffers (BatchNorm statistics
        drift apart per rank in training, as each normalises its share of the batch), which its checkpoints hold."""
        self.world.broadcast_buffers(self.model)
        return self.eager_if_compile_fails(lambda: accuracy(
            self.eval_fn, split, eval_batch_size(self.cfg), self.device, self.autocast, self.packed,
            self.model.encoder.cls_token, self.trimmed, self.cuda_graphs and self.eval_compiled, self.world),
            evaluation=True)

    def batch_order(self) -> BatchOrder:
        cfg = self.cfg
        grouped = cfg.schedule.batching == "length_grouped"
        lengths = real_ends(self.data.train.tokens) if grouped else None
        return BatchOrder(len(self.data.train), cfg.schedule.batch_size, cfg.seed, lengths)

    def train(self) -> str:
        """The loop; returns ``ok``, ``diverged``, or ``stopped: at step N of M`` (``schedule.stop_at``, or
        ``trainer.time_limit``: the step it had reached when its minutes were up, evaluated and checkpointed)."""
        cfg, state, world, device = self.cfg, self.state, self.world, self.device
        steps, every = cfg.schedule.steps, cfg.schedule.eval_every
        end = cfg.schedule.stop_at or steps  # the learning rate follows `steps` whatever the end
        order = self.batch_order()
        # profiled steps run slower: they are left out of the timing, as the warm-up before them
        timer = engine.StepTimer(device, cfg.trainer.timing_warmup + cfg.trainer.profile_steps, state["timed_steps"],
                                 state["timed_s"])
        profiler = engine.StepProfiler(device, state["step"] + cfg.trainer.timing_warmup, cfg.trainer.profile_steps,
                                       self.files.dir) if world.is_main else None
        self.timer, self.logger = timer, start_logger(cfg, self.files.dir, self.chash) if world.is_main else None
        loss_sum, n_loss, warned = torch.zeros((), device=device), 0, False
        self.check_compiled_gradients()
        engine.reset_peak_memory(device)
        self.model.train()
        bar = tqdm(total=steps, initial=state["step"], desc=f"{cfg.task.name}/{cfg.model.name} {self.phase}".rstrip(),
                   disable=not (cfg.trainer.progress and world.is_main), dynamic_ncols=True)
        limit = cfg.trainer.time_limit
        if limit is not None and self.deadline is None:
            self.deadline = clock() + 60 * limit
        deadline = self.deadline
        with graceful_stop() as previous_handlers:
            while state["step"] < end:
                signalled, time_up = self.stop_agreed(deadline)
                if time_up:
                    log.info("trainer.time_limit=%g minutes reached at step %d of %d: the run ends here as stopped; "
                             "the same command goes on from its checkpoint", limit, state["step"], steps)
                    if n_loss and self.diverged(loss_sum):
                        return "diverged"
                    if n_loss:  # the steps since the last evaluation: evaluate where the run ends
                        timer.pause()
                        self.validate_and_log(loss_sum, n_loss, bar)
                    self.checkpoint(timer)
                    break
                if signalled:
                    self.checkpoint(timer)
                    bar.close()
                    self.after_stop(previous_handlers)
                    raise RunInterrupted(f"stopped at step {state['step']}; checkpoint in {self.files.dir}; rerun the "
                                         f"same command to resume")
                inputs, labels = self.batch(world.shard(order.indices(state["step"])))
                if profiler is not None:
                    profiler.before_step(state["step"])
                timer.before_step()
                loss_sum += self.step(inputs, labels)
                timer.after_step()
                n_loss += 1
                state["step"] += 1
                if profiler is not None:
                    profiler.after_step(state["step"])
                bar.update(1)
                step, last = state["step"], state["step"] == end
                if not warned and device.type == "cpu" and timer.running()[0] >= 3 and cfg.experiment != "smoke":
                    warned = self.warn_cpu(timer, steps)
                if (step % every == 0 or last or step % 100 == 0) and self.diverged(loss_sum):
                    return "diverged"
                if step % every == 0 or last:
                    timer.pause()
                    self.validate_and_log(loss_sum, n_loss, bar)
                    loss_sum.zero_()
                    n_loss = 0
                    engine.reset_peak_memory(device)
                if step % cfg.trainer.ckpt_every == 0 or last:
                    self.checkpoint(timer)
        bar.close()
        timer.pause()
        return "ok" if state["step"] == steps else stopped_status(state["step"], steps, self.phase)

    # -- pieces of the loop -------------------------------------------------------------------------------------
    def stop_agreed(self, deadline: float | None = None) -> tuple[bool, bool]:
        """Whether to stop before this step: (a signal arrived, the ``deadline`` on ``clock`` has passed). Alone: at
        once. Data-parallel: every rank must stop at the same step, which takes an all-reduce and a device-to-host
        read; done every ``STOP_CHECK_EVERY`` steps (the same steps on every rank), not every step, where that sync
        would stall the queue of GPU work each step and cost the scaling across GPUs."""
        time_up = deadline is not None and clock() >= deadline
        if not self.world.distributed:
            return STOP.requested, time_up
        if self.state["step"] % STOP_CHECK_EVERY:
            return False, False
        flags = self.world.any(torch.tensor([float(STOP.requested), float(time_up)], device=self.device))
        return bool(flags[0] > 0), bool(flags[1] > 0)

    def step(self, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        """One training step (eagerly from here on if torch.compile fails: ``eager_if_compile_fails``)."""
        if self.cuda_graphs:  # compiled graphs replay as CUDA graphs (compile_mode): the last step's outputs are dead
            torch.compiler.cudagraph_mark_step_begin()
        return self.eager_if_compile_fails(lambda: engine.train_step(
            self.train_fn, self.optimizer, inputs, labels, autocast=self.autocast,
            grad_clip=self.cfg.optim.grad_clip, scheduler=self.scheduler,
            loss_weight=self.world.loss_weight(self.cfg.schedule.batch_size), loss_fn=self.loss_fn))

    loss_fn = staticmethod(engine.classification_loss)  # the loss of a training step (the pretraining's counts tokens)

    def eager_if_compile_fails(self, work, evaluation: bool = False):
        """``work()``; with ``trainer.compile=auto``, what torch.compile cannot compile runs eagerly from then on,
        saying so, and ``work()`` runs again. A training step that fails to compile (before its update) makes the
        whole model eager, and the row says compiled=False. An evaluation that fails (no autograd: another graph,
        which Inductor lowers apart) makes evaluation alone eager: the compiled training steps, which the row's
        timing measures, go on (compiled=True; the log and ``compile_error.txt`` say which part fell back). Any
        other error is raised."""
        part = "evaluation" if evaluation else "training"
        try:
            return work()
        except Exception as error:
            cfg = self.cfg
            compiled = self.eval_compiled if evaluation else self.compiled
            if not (compiled and cfg.trainer.compile == "auto" and engine.is_compile_error(error)):
                raise
            # the whole story, for a bug report; the log gets a line
            trace = self.record_compile_error(f"torch.compile failed in {part}:\n"
                                              + "".join(traceback.format_exception(error)))
            log.warning("torch.compile failed for %s in %s (%s: %s); running %s eagerly (traceback: %s)",
                        cfg.model.name, part, type(error).__name__, first_line(error),
                        "evaluation" if evaluation else "it", trace)
        if evaluation:
            self.eval_fn = self.model
        else:
            self.run_eagerly()
        return work()  # the lambdas read self.train_fn / self.eval_fn, now the eager ones

    def record_compile_error(self, text: str) -> Path:
        """Appends ``text`` to the run folder's ``compile_error.txt`` (the main rank writes; every failure kept, an
        evaluation's, then a training step's or the compile check's) and returns its path, for the log line."""
        trace = self.files.dir / "compile_error.txt"
        if self.world.is_main:
            with trace.open("a") as f:
                f.write(text)
        return trace

    def run_eagerly(self) -> None:
        """Training and evaluation run the eager model from here on (the row says compiled=False)."""
        torch._dynamo.reset()
        self.optimizer.zero_grad(set_to_none=True)
        self.compiled, self.train_fn, self.eval_fn = False, self.eager_train_fn, self.model

    def check_compiled_gradients(self) -> None:
        """``trainer.compile_check`` (auto: wherever the model is compiled: ``engine.compile_check_due``):
        before this process's first step, the loss gradients of the first ``engine.COMPILE_CHECK_ROWS`` training rows
        (unpacked), through torch.compile and eagerly, each against a float64 copy of the model's, in eval mode
        (``engine.compiled_gradient_check``: compiled is accepted within ``COMPILE_ERROR_FACTOR`` times eager's error
        plus a floor). Where a gradient is further off, the compiled model computes something else: with
        ``trainer.compile=auto`` the run trains eagerly (the log and ``compile_error.txt`` name the parameter and both
        errors; the row says compiled=False), with ``true`` it stops, saying so (``engine.refuse_compiled``). Costs
        one more compilation (of the check's graphs, dropped after it). Where the fp32 graphs fail to compile
        (Inductor's code generation can fail in fp32 where it succeeds in bf16) and the run trains in bf16, the check
        runs under its autocast; where the model does not run in float64, compiled is compared with eager (the log
        says so); where no graph compiles, it says the gradients are unchecked and leaves the failure to the training
        step's own fallback."""
        cfg = self.cfg
        if not engine.compile_check_due(cfg.trainer.compile_check, self.compiled):
            return
        rows = torch.arange(min(engine.COMPILE_CHECK_ROWS, len(self.data.train)))
        inputs, labels = self.device_inputs(rows, False)
        bf16 = self.autocast if self.precision == "bf16" else None
        check = engine.compiled_gradient_check(self.model, inputs, labels, bf16)
        for note in check.notes():
            log.info("compile check: %s", note)
        if check.precision is None:
            log.warning("compile check: %s; the training step's compilation decides", check.describe())
        # every rank reaches this agreement (a data-parallel rank waits for the others here), whatever it found
        differs = self.world.any(torch.tensor([float(check.rejected)], device=self.device))[0] > 0
        if not differs:
            if check.precision is not None:
                log.info("compile check: the compiled gradients are the model's (%s)", check.describe())
            return
        where = f"{check.describe()}, on {len(rows)} training rows" if check.rejected else "on another rank"
        report = engine.refuse_compiled(cfg.model.name, where, cfg.trainer.compile, "trainer")
        trace = self.record_compile_error(f"compile check: {report}\n")
        log.warning("%s; training it eagerly (%s)", report, trace)
        self.run_eagerly()

    def diverged(self, loss_sum: torch.Tensor) -> bool:
        """Whether the training loss summed since the last evaluation is non-finite on any rank (logged)."""
        bad = torch.stack([torch.zeros((), device=self.device), (~torch.isfinite(loss_sum)).float()])
        if not bool(self.world.any(bad)[1] > 0):
            return False
        log.error("non-finite training loss by step %d: the run diverged (status=diverged)", self.state["step"])
        return True

    def warn_cpu(self, timer: engine.StepTimer, steps: int) -> bool:
        done, seconds = timer.running()
        per_step = seconds / done
        left = (steps - self.state["step"]) * per_step
        if left > CPU_WARN_AFTER_S:
            log.warning("training on the CPU: %d steps at %.2f s/step is about %.1f hours. For a short run use "
                        "experiment=smoke (or schedule.steps=...); for the LRA schedule use a GPU", steps, per_step,
                        left / 3600)
        return True

    def validate_and_log(self, loss_sum: torch.Tensor, n_loss: int, bar) -> None:
        """Evaluates on the validation split and logs it with the training loss of the ``n_loss`` steps since the
        last evaluation (their sum ``loss_sum``, averaged over every rank's share of the batch)."""
        state, world = self.state, self.world
        train_loss = world.mean(loss_sum / n_loss, self.cfg.schedule.batch_size).item()
        self.state["peak_mem_mb"] = max(state["peak_mem_mb"], engine.peak_memory_mb(self.device))
        val_acc = self.accuracy(self.data.val)  # every rank its share of the batches
        if world.is_main:
            lr = self.scheduler.get_last_lr()[0]
            if val_acc > state["best_val"]:
                state["best_val"], state["best_step"] = val_acc, state["step"]
                self.files.save_best(self.model.state_dict(), state["step"], val_acc)
            state["history"].append({"step": state["step"], "train_loss": train_loss, "val_acc": val_acc, "lr": lr})
            bar.set_postfix(loss=f"{train_loss:.3f}", val=f"{val_acc:.4f}", best=f"{state['best_val']:.4f}")
            if not self.cfg.trainer.progress:  # no bar: the log carries the progress instead, naming the run,
                cfg = self.cfg  # since a sweep's jobs side by side write to one stream
                log.info("%s/%s seed %d: step %d/%d: train loss %.4f, val %.4f (best %.4f at %d), lr %.3g",
                         cfg.task.name, cfg.model.name, cfg.seed, state["step"], cfg.schedule.steps, train_loss,
                         val_acc, state["best_val"], state["best_step"], lr)
            if self.logger is not None:
                self.logger.log({"train/loss": train_loss, "val/acc": val_acc, "lr": lr}, step=state["step"])
        world.barrier()

    def checkpoint(self, timer: engine.StepTimer) -> None:
        timer.pause()
        state = self.state
        state["timed_steps"], state["timed_s"] = timer.steps, timer.seconds
        if self.world.is_main:
            self.files.save_checkpoint({
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "rng": rng_state(self.device), "config_hash": self.chash,
                "state": {**state, "wall_s": state["wall_s"] + time.time() - self.wall_start}})
        self.world.barrier()

    def after_stop(self, previous_handlers: dict) -> None:
        """Slurm (through submitit) sends SIGUSR2 before a timeout or preemption: once the checkpoint is saved,
        hand the signal to submitit's handler, which requeues the job (the requeued job resumes from here)."""
        handler = previous_handlers.get(STOP.signum)
        if STOP.signum == signal.SIGUSR2 and callable(handler) and self.world.is_main:
            handler(STOP.signum, None)

    def test(self) -> dict:
        """Test accuracy of the final weights, then of the best-validation checkpoint (every rank its share of the
        batches; rank 0 reports)."""
        final_test = self.accuracy(self.data.test)
        # every rank loads the checkpoint rank 0 wrote (each evaluation since ended at a barrier)
        self.model.load_state_dict(self.files.load_best(self.device)["model"])
        best_test = self.accuracy(self.data.test)
        if not self.world.is_main:
            return {}
        return {"val_acc": self.state["best_val"], "test_acc": best_test, "best_step": self.state["best_step"],
                "final_val_acc": self.state["history"][-1]["val_acc"], "final_test_acc": final_test}

    def stall_baseline(self) -> float | None:
        """``lra.baseline``'s stall baseline of this run's data, for the leaderboard to judge the row by; None where
        it cannot be measured, which must not cost the run its row."""
        try:
            return baseline.measure(self.data).val_baseline
        except Exception as e:  # noqa: BLE001 - the row matters more than the baseline beside it
            log.warning("no stall baseline for this row (%s: %s)", type(e).__name__, e)
            return None

    def record(self, status: str, metrics: dict | None = None, detail: str = "") -> dict:
        """The result row, appended once (rank 0); accuracies and timings only for an ``ok`` run and one stopped by
        ``schedule.stop_at``."""
        cfg, state, data = self.cfg, self.state, self.data
        stopped = is_stopped(status)  # schedule.stop_at: trained normally, for fewer steps
        if status != "ok" and not stopped:
            log.error("%s/%s: %s%s", cfg.task.name, cfg.model.name, status, f" ({detail})" if detail else "")
        # accuracies, speed and memory are measured (none for a run stopped in its pretraining: no classifier yet)
        ok = (status == "ok" or stopped) and metrics is not None
        steps_per_s = self.timer.steps_per_s if ok and hasattr(self, "timer") else None
        row = RunRow(
            **run_identity(cfg), status=status, **(metrics or {}),
            val_majority=baseline.majority_share(data.val.labels, data.n_classes),
            val_baseline=self.stall_baseline() if ok and self.world.is_main else None,  # judges accuracies only
            steps=state["step"], seq_len=data.seq_len,
            train_steps_per_s=steps_per_s, examples_per_s=steps_per_s * cfg.schedule.batch_size if steps_per_s
            else None, peak_mem_mb=state["peak_mem_mb"] if ok else None, params=getattr(self, "n_params", None),
            wall_time_s=state["wall_s"] + time.time() - self.wall_start, precision=self.precision,
            compiled=self.compiled, devices=self.world.size, data=data.version(),
            split=data.info.get("split", ""), device=" + ".join(state["devices"]),
            torch=torch.__version__, git_sha=" + ".join(state["git_shas"]), config_hash=self.chash,
            timestamp=now_iso(), run_dir=str(self.files.dir), overrides=_overrides(),
            packed=getattr(self, "packed", None), val_is_test=bool(data.info.get("val_is_test", False)),
            deterministic=state["deterministic"])
        out = asdict(row)
        if self.world.is_main:
            save_row(cfg, self.files, out, state["history"])
            if ok:
                speed = (f"{steps_per_s:.1f} steps/s" if math.isfinite(steps_per_s) else
                         f"speed not timed (all {state['step']} steps within trainer.timing_warmup)")
                log.info("%s/%s: %sbest val %.4f at step %d, test %.4f (final %.4f), %s, %.0f MB",
                         cfg.task.name, cfg.model.name, f"{status}: " if stopped else "", out["val_acc"],
                         out["best_step"], out["test_acc"], out["final_test_acc"], speed, state["peak_mem_mb"])
            if getattr(self, "logger", None) is not None:
                log_result(self.logger, out, state["step"])
        self.world.barrier()
        return out


class Pretrainer(Trainer):
    """A run's pretraining phase (``pretrain=mlm|causal``): ``Trainer``'s loop, step, checkpoints, resume, stops and
    time limit, on the training split alone, with the encoder under a token head (``lra.train.pretrain.TokenModel``)
    and the loss over its predicted tokens. ``cfg`` is the phase's (``pretraining_config``: its folder
    ``<run_dir>/pretrain``, its schedule). It appends no row: its result and history go to its folder, its curve
    (``PRETRAIN_CURVE_COLUMNS``) beside runs.csv, and where it ends ok the encoder's weights to ``encoder.pt``."""

    phase = "pretraining"

    def __init__(self, cfg: DictConfig, world: distributed.World, device: torch.device, data: TaskData,
                 shape: engine.TaskShape):
        super().__init__(cfg, world, device)
        self.data = replace(data, val=None, test=None)  # the training split only: no other is ever read
        self.shape = shape  # the task's (vocabulary, length, padding), as the classifier after it has it
        self.loss_fn = self.token_loss = pretrain.TokenLoss(engine.classification_loss, device)

    def fit_phase(self) -> tuple[str, dict | None, bool]:
        """Resume or start, train, record: (the status, the encoder's weights where it ended ok, whether it trained
        now). A phase that ended already (ok, diverged, or stopped at the same ``pretrain.stop_at``) is read back."""
        files = self.files
        if self.world.is_main:
            files.dir.mkdir(parents=True, exist_ok=True)
            (files.dir / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))
        checkpoint = self.resume_or_start()
        if isinstance(checkpoint, dict) and "row" in checkpoint:
            row = checkpoint["row"]
            self.state.update({key: row.get(key, self.state[key]) for key in ("devices", "git_shas")})
            self.state["wall_s"], self.wall_start = row.get("wall_time_s") or 0.0, time.time()
            return row["status"], self.pretrained() if row["status"] == "ok" else None, False
        self.build(checkpoint)
        status = self.train()
        if status == "ok" and self.world.is_main:
            atomic_save({"encoder": pretrain.encoder_weights(self.model.state_dict()), "config_hash": self.chash,
                         "step": self.state["step"]}, files.dir / pretrain.ENCODER)
        self.record(status)  # ends at a barrier: every rank reads the weights rank 0 wrote
        return status, self.pretrained() if status == "ok" else None, True

    def pretrained(self) -> dict:
        """The encoder's weights at the phase's end (``encoder.pt``), on the CPU."""
        path = self.files.dir / pretrain.ENCODER
        saved = torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None
        if saved is None or saved.get("config_hash") != self.chash:
            why = "of another configuration" if saved else "missing"
            raise ConfigError(f"{self.files.dir} records a finished pretraining without its weights ({path.name} "
                              f"{why}); resume=false starts the run over")
        return saved["encoder"]

    def wall_s(self) -> float:
        """The phase's wall time so far, over every process that ran it."""
        return self.state["wall_s"] + time.time() - self.wall_start

    def make_model(self) -> torch.nn.Module:
        cfg, shape = self.cfg, self.shape
        encoder = engine.build_model(cfg.model.name, model_options(cfg), cfg.backbone, shape).encoder
        return pretrain.TokenModel(encoder, cfg.backbone.d_model, shape.vocab_size, cfg.pretrain.objective,
                                   shape.padded)

    def resolve_packing(self) -> bool:
        return False  # one example a row: the targets are laid out per example

    def resolve_trimming(self) -> bool:
        return False

    def device_inputs(self, rows: torch.Tensor, packed: bool) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The training examples ``rows`` as the objective's batch on the device: (the TokenModel's inputs, the
        targets). A pair task's documents are rows of their own. The mask draws are the global batch's at this step
        (``mask_noise``), of which this rank takes its rows as ``World.shard`` takes its examples."""
        cfg, world = self.cfg, self.world
        tokens = self.data.train.tokens[rows]  # (b, N) or (b, 2, N)
        noise = None
        if cfg.pretrain.objective == "mlm":
            # at least a global batch of draws, and rows enough for this rank's (the compile check's few rows too)
            n = max(cfg.schedule.batch_size, world.size * len(tokens))
            draws = pretrain.mask_noise(cfg.seed, self.state["step"], (n, *tokens.shape[1:]))
            noise = draws[world.rank :: world.size][: len(tokens)].reshape(-1, tokens.shape[-1])
        inputs, targets = pretrain.objective_batch(cfg.pretrain.objective, tokens.reshape(-1, tokens.shape[-1]),
                                                   self.model.encoder.cls_token, cfg.pretrain.mask_rate, noise)
        as_ = lambda t: torch.bool if t.dtype == torch.bool else torch.long  # ids int64, masked positions bool
        return tuple(to_device(t, self.device, as_(t)) for t in inputs), to_device(targets, self.device)

    def validate_and_log(self, loss_sum: torch.Tensor, n_loss: int, bar) -> None:
        """The curve's row: the loss and the token accuracy over the training steps since the last row (the phase
        evaluates no split: it reads the training split only)."""
        cfg, state, world = self.cfg, self.state, self.world
        train_loss = world.mean(loss_sum / n_loss, cfg.schedule.batch_size).item()
        correct, count = (world.sum(n).item() for n in self.token_loss.take())
        token_acc = correct / max(count, 1)
        state["peak_mem_mb"] = max(state["peak_mem_mb"], engine.peak_memory_mb(self.device))
        if world.is_main:
            lr = self.scheduler.get_last_lr()[0]
            state["history"].append({"step": state["step"], "train_loss": train_loss, "token_acc": token_acc, "lr": lr})
            bar.set_postfix(loss=f"{train_loss:.3f}", tokens=f"{token_acc:.4f}")
            if not cfg.trainer.progress:
                log.info("%s/%s seed %d: pretraining step %d/%d: loss %.4f, token accuracy %.4f, lr %.3g",
                         cfg.task.name, cfg.model.name, cfg.seed, state["step"], cfg.schedule.steps, train_loss,
                         token_acc, lr)
            if self.logger is not None:
                self.logger.log({"pretrain/loss": train_loss, "pretrain/token_acc": token_acc, "pretrain/lr": lr},
                                step=state["step"])
        world.barrier()

    def record(self, status: str, metrics: dict | None = None, detail: str = "") -> dict:
        """The phase's result (its folder's ``result.json``, and its curve beside runs.csv); no row."""
        cfg, state = self.cfg, self.state
        last = state["history"][-1] if state["history"] else {}
        row = dict(phase="pretrain", task=cfg.task.name, model=cfg.model.name, seed=cfg.seed,
                   experiment=cfg.experiment, objective=cfg.pretrain.objective, status=status, steps=state["step"],
                   train_loss=last.get("train_loss"), token_acc=last.get("token_acc"),
                   train_steps_per_s=self.timer.steps_per_s, wall_time_s=self.wall_s(), devices=state["devices"],
                   git_shas=state["git_shas"], config_hash=self.chash, timestamp=now_iso(), run_dir=str(self.files.dir))
        if self.world.is_main:
            write_curve(cfg.results.dir, row, state["history"], PRETRAIN_CURVE_COLUMNS)
            self.files.write_result(row, state["history"])
            log.info("%s/%s: pretraining (%s) %s at step %d: loss %s, token accuracy %s", cfg.task.name,
                     cfg.model.name, cfg.pretrain.objective, status, state["step"], last.get("train_loss"),
                     last.get("token_acc"))
            if self.logger is not None:
                self.logger.finish()
        self.world.barrier()
        return row


def record_crash(cfg: DictConfig, run_dir: str | Path, how: str) -> dict:
    """The row of a run whose process died before it could record one (a segfault, the OOM killer), written by
    the launcher that started it: ``status=error: crashed (<how>)``, no accuracies. ``result.json`` says the same,
    so relaunching the sweep runs the job again, from its checkpoint when it has one."""
    row = asdict(RunRow(
        **run_identity(cfg), status=f"error: crashed ({how})", seq_len=cfg.task.seq_len, torch=torch.__version__,
        git_sha=git_sha(), timestamp=now_iso(), run_dir=str(run_dir)))
    save_row(cfg, RunFiles(run_dir), row, [])
    return row


def run_identity(cfg: DictConfig) -> dict:
    """The row fields that the config alone fixes: what ran, under which schedule."""
    return dict(task=cfg.task.name, model=cfg.model.name, seed=cfg.seed, experiment=cfg.experiment,
                batch_size=cfg.schedule.batch_size, eval_every=cfg.schedule.eval_every, batching=cfg.schedule.batching,
                pretrain=cfg.pretrain.objective if pretrain.pretraining(cfg) else None,
                pretrain_hash=pretrain.pretrain_hash(cfg))


def save_row(cfg: DictConfig, files: RunFiles, row: dict, history: list) -> None:
    """Append the row to ``runs.csv`` and its validation curve to ``curves/`` beside it, then record it in the run's
    folder (which marks the run as ended)."""
    append_row(Path(cfg.results.dir) / "runs.csv", row, RUN_COLUMNS)
    write_curve(cfg.results.dir, row, history)
    files.write_result(row, history)


def _overrides() -> str:
    if PARENT_OVERRIDES in os.environ:  # a rank spawned by ``run``: Hydra lives in the parent
        return os.environ[PARENT_OVERRIDES]
    try:
        return " ".join(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 - run(cfg) called directly, outside a Hydra app
        return ""

