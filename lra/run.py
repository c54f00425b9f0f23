"""``run(cfg) -> dict``: the whole training run as a plain PyTorch loop, callable from tests.

data -> model -> AdamW + LRA schedule -> train with periodic validation (best-validation weights kept)
-> test with the best and the final weights -> one row appended to ``results.dir/runs.csv``.
A run is resumable: a checkpoint (model, optimiser, scheduler, RNG, step, timers) is written every
``trainer.ckpt_every`` steps and when the run is stopped (Ctrl-C / SIGTERM finish the current step, save,
and exit); rerunning the same command continues from it.
"""
from __future__ import annotations

import json
import logging
import math
import random
import resource
import signal
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from lra.data import BatchOrder, Split, TaskData, load_task
from lra.data.common import atomic_save
from lra.encoder import Classifier, build_classifier
from lra.results import RUN_COLUMNS, append_row, config_hash, device_name, git_sha, now_iso

log = logging.getLogger("lra")
CHECKPOINT, BEST, RESULT = "checkpoint.pt", "best.pt", "result.json"


class RunInterrupted(RuntimeError):
    """The run was asked to stop; its checkpoint is saved and rerunning the command resumes it."""


class StopFlag:
    """Set by SIGINT/SIGTERM; the loop checks it between steps so a checkpoint is never half an update."""

    requested = False


STOP = StopFlag()


@contextmanager
def graceful_stop():
    def handler(signum, frame):
        if STOP.requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        STOP.requested = True
        log.warning("stop requested: finishing this step and saving a checkpoint (again to abort)")

    try:
        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread (e.g. some test runners): no handlers, same loop
        old = {}
    STOP.requested = False
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={name} but CUDA is not available; use device=cpu or device=auto")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def lr_factor(step: int, schedule: str, warmup: int, total: int) -> float:
    """LRA's schedules as products of factors (``utils/train_utils.py``), ``step`` counting from 1."""
    warm = min(1.0, step / warmup) if warmup else 1.0
    if schedule == "rsqrt":
        return warm / math.sqrt(max(step, warmup, 1))
    if schedule == "cosine":
        progress = (max(0, step - warmup) / max(total, 1)) % 1.0
        return warm * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    if schedule == "constant":
        return warm
    raise ValueError(f"optim.schedule must be rsqrt, cosine or constant, got {schedule!r}")


def build_model(cfg: DictConfig, data: TaskData) -> Classifier:
    """The task's classifier; without a single pad token in any split (pixel tasks) it runs mask-free."""
    options = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k != "name"}
    padded = any(bool((s.tokens == 0).any()) for s in (data.train, data.val, data.test))
    return build_classifier(cfg.model.name, options, cfg.backbone, data.vocab_size, data.seq_len, data.n_classes,
                            pair=data.pair, padded=padded, grid=data.grid)


def to_device(tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return tokens.pin_memory().to(device, non_blocking=True).long()
    return tokens.long()


@torch.no_grad()
def evaluate(model, split: Split, batch_size: int, device: torch.device, autocast) -> float:
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    for i in range(0, len(split), batch_size):
        tokens = to_device(split.tokens[i : i + batch_size], device)
        labels = split.labels[i : i + batch_size].to(device)
        with autocast():
            correct += (model(tokens).argmax(-1) == labels).sum()
    model.train()
    return correct.item() / max(len(split), 1)


def _train_step(model, optimizer, scheduler, tokens, labels, autocast, grad_clip) -> torch.Tensor:
    with autocast():
        loss = F.cross_entropy(model(tokens).float(), labels)
    loss.backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss.detach()


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _start_logger(cfg: DictConfig, run_dir: Path):
    if cfg.logger.name != "wandb":
        return None
    import wandb  # optional: only this logger needs it

    return wandb.init(
        project=cfg.logger.project, entity=cfg.logger.get("entity"), mode=cfg.logger.mode, dir=str(run_dir),
        config=OmegaConf.to_container(cfg, resolve=True), tags=list(cfg.logger.get("tags") or []),
        name=f"{cfg.task.name}-{cfg.model.name}-s{cfg.seed}", reinit=True,
    )


def run(cfg: DictConfig) -> dict:
    """Train and evaluate ``cfg.model`` on ``cfg.task``; return the metrics row (also appended to runs.csv)."""
    wall_start = time.time()
    device = resolve_device(cfg.device)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    chash = config_hash(cfg_dict)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))

    resume_state = _resume_state(cfg.resume, run_dir, chash)
    if resume_state == "done":
        return json.loads((run_dir / RESULT).read_text())

    seed_everything(cfg.seed)
    data = load_task(cfg)
    log.info(data.summary())
    model = build_model(cfg, data).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("%s: %s parameters", cfg.model.name, f"{n_params:,}")

    o, t, tr = cfg.optim, cfg.train, cfg.trainer
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
        fused=device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s + 1, o.schedule, o.warmup_steps, t.steps)
    )
    precision = tr.precision if tr.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16" else nullcontext
    compiled = tr.compile is True or (tr.compile == "auto" and device.type == "cuda")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    step_model = torch.compile(model) if compiled else model

    state = {"step": 0, "best_val": -1.0, "best_step": 0, "timed_steps": 0, "timed_s": 0.0, "wall_s": 0.0,
             "peak_mem_mb": 0.0, "history": [], "devices": [], "git_shas": []}
    if isinstance(resume_state, dict):
        model.load_state_dict(resume_state["model"])
        optimizer.load_state_dict(resume_state["optimizer"])
        scheduler.load_state_dict(resume_state["scheduler"])
        _set_rng_state(resume_state["rng"])
        state = resume_state["state"]
        log.info("resuming %s from step %d", run_dir, state["step"])
    # a run resumed on other hardware or code names every device and commit it trained on (its steps/s mixes them)
    for key, now in (("devices", device_name(device)), ("git_shas", git_sha())):
        seen = state.setdefault(key, [])
        if now not in seen:
            seen.append(now)

    def save_checkpoint():
        atomic_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "rng": _rng_state(), "config_hash": chash,
                     "state": {**state, "wall_s": state["wall_s"] + time.time() - wall_start}},
                    run_dir / CHECKPOINT)

    order = BatchOrder(len(data.train), t.batch_size, cfg.seed)
    wandb_run = _start_logger(cfg, run_dir)
    running_loss = torch.zeros((), device=device)
    n_loss, warm_left = 0, tr.timing_warmup
    segment_start, segment_steps = None, 0

    def close_segment():
        nonlocal segment_start, segment_steps
        if segment_start is not None and segment_steps:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            state["timed_s"] += time.perf_counter() - segment_start
            state["timed_steps"] += segment_steps
            state["peak_mem_mb"] = max(state["peak_mem_mb"], _peak_mem_mb(device))
        segment_start, segment_steps = None, 0

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    bar = tqdm(total=t.steps, initial=state["step"], desc=f"{cfg.task.name}/{cfg.model.name}",
               disable=not tr.progress, dynamic_ncols=True)
    with graceful_stop():
        while state["step"] < t.steps:
            if STOP.requested:
                close_segment()
                save_checkpoint()
                bar.close()
                raise RunInterrupted(f"stopped at step {state['step']}; rerun the same command to resume")
            if warm_left == 0 and segment_start is None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                segment_start = time.perf_counter()
            idx = order.indices(state["step"])
            tokens = to_device(data.train.tokens[idx], device)
            labels = data.train.labels[idx].to(device, non_blocking=True)
            running_loss += _train_step(step_model, optimizer, scheduler, tokens, labels, autocast, o.grad_clip)
            n_loss += 1
            state["step"] += 1
            bar.update(1)
            if warm_left > 0:
                warm_left -= 1
            else:
                segment_steps += 1
            last = state["step"] == t.steps
            if state["step"] % t.eval_every == 0 or last:
                close_segment()
                val_acc = evaluate(step_model, data.val, tr.eval_batch_size, device, autocast)
                train_loss = running_loss.item() / max(n_loss, 1)
                running_loss.zero_()
                n_loss = 0
                if val_acc > state["best_val"]:
                    state["best_val"], state["best_step"] = val_acc, state["step"]
                    atomic_save({"model": model.state_dict(), "step": state["step"], "val_acc": val_acc}, run_dir / BEST)
                state["history"].append({"step": state["step"], "train_loss": train_loss, "val_acc": val_acc,
                                         "lr": scheduler.get_last_lr()[0]})
                bar.set_postfix(loss=f"{train_loss:.3f}", val=f"{val_acc:.4f}", best=f"{state['best_val']:.4f}")
                if not tr.progress:  # no bar: the log (console and run_dir) carries the progress instead
                    log.info("step %d/%d: train loss %.4f, val %.4f (best %.4f at %d), lr %.3g", state["step"],
                             t.steps, train_loss, val_acc, state["best_val"], state["best_step"],
                             scheduler.get_last_lr()[0])
                if wandb_run is not None:
                    wandb_run.log({"train/loss": train_loss, "val/acc": val_acc, "lr": scheduler.get_last_lr()[0]},
                                  step=state["step"])
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
            if state["step"] % tr.ckpt_every == 0 or last:
                close_segment()
                save_checkpoint()
    bar.close()
    close_segment()

    final_val = state["history"][-1]["val_acc"] if state["history"] else evaluate(
        step_model, data.val, tr.eval_batch_size, device, autocast)
    final_test = evaluate(step_model, data.test, tr.eval_batch_size, device, autocast)
    model.load_state_dict(torch.load(run_dir / BEST, weights_only=True)["model"])
    best_test = evaluate(step_model, data.test, tr.eval_batch_size, device, autocast)

    steps_per_s = state["timed_steps"] / state["timed_s"] if state["timed_s"] else float("nan")
    row = {
        "task": cfg.task.name, "model": cfg.model.name, "seed": cfg.seed, "trainer": tr.name,
        "val_acc": state["best_val"], "test_acc": best_test, "best_step": state["best_step"],
        "final_val_acc": final_val, "final_test_acc": final_test, "steps": state["step"],
        "seq_len": data.seq_len, "batch_size": t.batch_size, "train_steps_per_s": steps_per_s,
        "examples_per_s": steps_per_s * t.batch_size, "peak_mem_mb": state["peak_mem_mb"], "params": n_params,
        "wall_time_s": state["wall_s"] + time.time() - wall_start, "precision": precision, "compiled": compiled,
        "split": data.info.get("split", ""), "device": " + ".join(state["devices"]), "torch": torch.__version__,
        "git_sha": " + ".join(state["git_shas"]), "config_hash": chash, "timestamp": now_iso(), "run_dir": str(run_dir),
        "overrides": _overrides(),
    }
    append_row(Path(cfg.results.dir) / "runs.csv", row, RUN_COLUMNS)
    (run_dir / RESULT).write_text(json.dumps(row, indent=1))
    (run_dir / "history.json").write_text(json.dumps(state["history"]))
    log.info("%s/%s: best val %.4f at step %d, test %.4f (final %.4f), %.1f steps/s, %.0f MB",
             cfg.task.name, cfg.model.name, state["best_val"], state["best_step"], best_test, final_test,
             steps_per_s, state["peak_mem_mb"])
    if wandb_run is not None:
        wandb_run.summary.update({k: v for k, v in row.items() if isinstance(v, (int, float))})
        wandb_run.finish()
    return row


def _resume_state(resume, run_dir: Path, chash: str):
    """None (fresh start), 'done' (finished already; resume=true returns its result), or a checkpoint."""
    ckpt, result = run_dir / CHECKPOINT, run_dir / RESULT
    if resume is False or resume == "false":
        for f in (ckpt, result, run_dir / BEST):
            f.unlink(missing_ok=True)
        return None
    if resume is True and result.exists():
        log.info("%s already finished; returning its result (resume=false reruns it)", run_dir)
        return "done"
    if result.exists():  # auto: a finished run in this directory is rerun from scratch
        result.unlink()
        ckpt.unlink(missing_ok=True)
        return None
    if not ckpt.exists():
        if resume is True:
            raise FileNotFoundError(f"resume=true but {ckpt} does not exist; run without resume=true to start")
        return None
    state = torch.load(ckpt, weights_only=False)
    if state["config_hash"] != chash:
        raise RuntimeError(
            f"{ckpt} was written by a different configuration (hash {state['config_hash']} != {chash}); "
            f"use another run_dir (hydra.run.dir=...) or resume=false to start over"
        )
    return state


def _overrides() -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        return " ".join(HydraConfig.get().overrides.task)
    except Exception:  # run(cfg) called directly, outside a Hydra app
        return ""
