"""A run's files on disk: resumable checkpoints (the latest two, written atomically, loaded with
``weights_only=True`` so a file in a run folder can never run code), the best-validation weights and the result.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts: the RNG states are converted to
tensors and lists (numpy's state array would need pickle).
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import random
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock, Timeout

from lra.errors import ConfigError, first_line
from lra.io import atomic_save, atomic_write_text

log = logging.getLogger("lra")
SETTLED_STATUSES = ("ok", "diverged")  # a run that ended so is not run again by a relaunch

CHECKPOINT, PREVIOUS, BEST, RESULT, HISTORY = "checkpoint.pt", "checkpoint.prev.pt", "best.pt", "result.json", \
    "history.json"
LOCK = "run.lock"  # held by the process training the run (``RunFiles.hold``)


def rng_state(device: torch.device) -> dict:
    """Every generator a run draws from. On CUDA only the training device's: a run resumes on whichever GPU is free,
    of a host that may have fewer GPUs than the one that saved it."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                     gauss],
             "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and device.type == "cuda":
        if isinstance(cuda, (list, tuple)):  # written before one device's state was kept: every GPU of its host
            cuda = cuda[0]  # the slot it trained on is not recorded; any state is a valid continuation
        torch.cuda.set_rng_state(cuda, device)


def why_unreadable(error: Exception) -> str:
    """Why ``torch.load`` could not read a file, in one line. The weights-only loader's refusal opens with how to
    load the file anyway (``weights_only=False``, which runs code from it: no advice for a file in a run folder);
    the line says what it refused instead."""
    text = str(error)
    if isinstance(error, pickle.UnpicklingError) and "WeightsUnpickler error:" in text:
        after = [line.strip() for line in text.split("WeightsUnpickler error:", 1)[1].splitlines() if line.strip()]
        what = after[0].split(". ")[0] if after else "an object it does not read"
        return (f"torch's weights-only loader refused it: {what}; it reads tensors and plain containers only, never "
                f"code from a file")
    first = first_line(error)
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class FolderInUse(ConfigError):
    """A user error (exit code 2, one line): the run's folder is another process's now."""

    def __init__(self, run_dir: Path):
        super().__init__(f"{run_dir} is in use: another process is running this run now; wait for it to end (then "
                         f"the same command resumes or reports it), or give this one another folder "
                         f"(hydra.run.dir=...)")


class RunFiles:
    """The files of one run folder."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.checkpoint, self.previous = self.dir / CHECKPOINT, self.dir / PREVIOUS
        self.best, self.result, self.history = self.dir / BEST, self.dir / RESULT, self.dir / HISTORY
        self.lock = self.dir / LOCK

    @contextmanager
    def hold(self):
        """This process's hold on the folder for the length of a run: two processes training one run (the same
        command started twice, or with other execution settings, which name no folder) would overwrite each other's
        checkpoints and append two rows. Raises ``FolderInUse`` when another process holds it; the hold ends with
        the process, however it ends."""
        lock = FileLock(str(self.lock))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise FolderInUse(self.dir) from None
        try:
            yield
        finally:
            lock.release()

    def in_use(self) -> bool:
        """Whether another process holds the folder now (is training this run)."""
        if not self.lock.exists():
            return False
        try:
            with self.hold():
                return False
        except FolderInUse:
            return True

    def save_checkpoint(self, state: dict) -> None:
        """Keep the previous checkpoint as the fallback, then publish the new one (atomically)."""
        if self.checkpoint.exists():
            os.replace(self.checkpoint, self.previous)
        atomic_save(state, self.checkpoint)

    def load_checkpoint(self) -> dict | None:
        """The latest readable checkpoint (the previous one when the latest is unreadable, saying so); None when
        there is none. A truncated or corrupt file is named, never silently trusted.

        Loaded on the CPU: ``load_state_dict`` moves weights and optimizer state to the parameters' device, and the
        RNG states must stay CPU tensors (``torch.set_rng_state`` and numpy take no CUDA tensor)."""
        for path in (self.checkpoint, self.previous):
            if not path.exists():
                continue
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unreadable file: say which, try the next
                log.warning("checkpoint %s is unreadable (%s)%s", path, why_unreadable(e),
                            "; trying the previous one" if path == self.checkpoint else "")
                continue
            if path == self.previous:
                log.warning("resuming from the previous checkpoint %s (step %d)", path, state["state"]["step"])
            return state
        return None

    def has_checkpoint(self) -> bool:
        return self.checkpoint.exists() or self.previous.exists()

    def clear(self) -> None:
        for path in (self.checkpoint, self.previous, self.best, self.result):
            path.unlink(missing_ok=True)

    def save_best(self, model_state: dict, step: int, val_acc: float) -> None:
        atomic_save({"model": model_state, "step": step, "val_acc": val_acc}, self.best)

    def load_best(self, device: torch.device) -> dict:
        return torch.load(self.best, map_location=device, weights_only=True)

    def finished(self) -> dict | None:
        """The recorded row of an ended run (any status), or None."""
        if not self.result.exists():
            return None
        try:
            return json.loads(self.result.read_text())
        except (OSError, ValueError):
            return None

    def settled(self) -> dict | None:
        """The recorded row when it is a result (``ok`` or ``diverged``: a rerun computes the same), else None. An
        ``oom`` or ``error`` row records a failure of the code or the machine, which a relaunch retries."""
        done = self.finished()
        return done if done is not None and done.get("status") in SETTLED_STATUSES else None

    def write_result(self, row: dict, history: list) -> None:
        atomic_write_text(self.history, json.dumps(history))
        atomic_write_text(self.result, json.dumps(row, indent=1, default=str))
