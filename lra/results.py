"""Result rows: the schema of ``runs.csv`` and ``bench.csv``, atomic appends, and provenance (device,
torch, git commit, config hash). Leaderboards and charts are derived from these CSVs, never edited.
"""
from __future__ import annotations

import csv
import fcntl
import hashlib
import io
import json
import os
import platform
import subprocess
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

# One row per finished training run. Documented in results/README.md; keep the two in step.
RUN_COLUMNS = [
    "task", "model", "seed", "trainer",
    "val_acc", "test_acc", "best_step", "final_val_acc", "final_test_acc",
    "steps", "seq_len", "batch_size", "train_steps_per_s", "examples_per_s", "peak_mem_mb",
    "params", "wall_time_s", "precision", "compiled", "split", "device", "torch", "git_sha",
    "config_hash", "timestamp", "run_dir", "overrides",
]

# One row per (model, sequence length) of a `python -m lra.bench` sweep (LRA Table 2 protocol). `status` is
# ok | oom | error: <message>; figures are blank unless ok. `rel_*` are against `transformer` at the same
# length, batch, precision, backbone and device. `peak_mem_mb` is the peak of the timed steps, of the kind
# `mem_kind` says: cuda_max_allocated on a GPU, peak_rss (the whole process) on CPU.
BENCH_COLUMNS = [
    "model", "task", "seq_len", "batch_size", "status",
    "steps_per_s", "examples_per_s", "ms_per_step", "peak_mem_mb", "mem_kind", "rel_speed", "rel_mem",
    "params", "precision", "compiled", "sdpa_backend", "backbone", "warmup", "timed_steps",
    "device", "torch", "git_sha", "timestamp",
]


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def append_row(path: str | Path, row: dict, columns: list[str]) -> None:
    """Append ``row`` to the CSV at ``path`` under an exclusive lock, so concurrent runs (multirun, several
    processes) never interleave or lose rows. Keys outside ``columns`` are an error; missing ones are blank.
    If the file's header differs (an older schema), the file is rewritten with the union of columns,
    atomically (write a temporary file, then rename)."""
    path = Path(path)
    extra = sorted(set(row) - set(columns))
    if extra:
        raise KeyError(f"row has columns not in the schema: {extra}")
    with _locked(path):
        header = None
        if path.exists() and path.stat().st_size:
            with open(path, newline="") as f:
                header = next(csv.reader(f), None)
        if header is None or header == columns:
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
            if header is None:
                w.writeheader()
            w.writerow({k: _fmt(row.get(k)) for k in columns})
            with open(path, "a", newline="") as f:
                f.write(buf.getvalue())  # one write call: a reader never sees half a row
                f.flush()
                os.fsync(f.fileno())
            return
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        merged = header + [c for c in columns if c not in header]
        rows.append({k: _fmt(row.get(k)) for k in columns})
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=merged, lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, path)


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def git_sha(short: bool = True) -> str:
    """The commit the code ran at, with ``+dirty`` when the tree had uncommitted changes. ``LRA_GIT_SHA``,
    when set, wins: a copy of the tree whose ``.git`` is stale or absent (a remote GPU machine, a container)
    would otherwise report the wrong commit."""
    if os.environ.get("LRA_GIT_SHA"):
        return os.environ["LRA_GIT_SHA"]
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        out = sha.stdout.strip()[: 12 if short else 40]
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def config_hash(cfg_dict: dict) -> str:
    """A short hash of everything that defines a run (run_dir and result paths excluded)."""
    keep = {k: v for k, v in cfg_dict.items() if k not in ("run_dir", "results", "resume", "device", "hydra")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:12]


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
