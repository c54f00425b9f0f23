"""Result rows: the schemas of ``runs.csv`` and ``bench.csv`` (one dataclass each) and of ``layer_bench.csv`` (a
column list), documented in ``results/README.md``; atomic appends, and provenance (device, torch, git commit,
config hash). Leaderboards and charts are derived from these CSVs, never edited.

Every row has a ``status``: ``ok``, ``diverged`` (a non-finite loss stopped the run), ``oom``,
``error: <Type>: <message>``, or ``stopped: at step N of M`` (``schedule.stop_at`` or ``trainer.time_limit``: a
recipe run as far as device time allowed). Only ``ok`` and ``stopped`` rows carry accuracies or timings; only ``ok``
rows are ever averaged.
Each row's validation curve goes beside ``runs.csv``: ``curves/<task>_<model>_<experiment>_seed<seed>_<config
hash>_<timestamp>.csv`` (``CURVE_COLUMNS``; ``curve_path``), the evaluations of the run up to that row; a
self-pretrained run's pretraining curve beside it as ``curves/pretrain_..._<pretrain_hash>_<timestamp>.csv``
(``PRETRAIN_CURVE_COLUMNS``).
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import platform
import subprocess
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from filelock import FileLock

from lra import __version__
from lra.io import atomic_write_text, temporary_name


@dataclass
class RunRow:
    """One training run (``runs.csv``)."""

    task: str
    model: str
    seed: int
    experiment: str  # the preset that ran: lra (LRA's protocol), smoke, a recipe (conf/experiment/)
    status: str  # ok | diverged | oom | error: <Type>: <message>
    val_acc: float | None = None  # best validation accuracy (fraction)
    test_acc: float | None = None  # test accuracy of the best-validation checkpoint
    best_step: int | None = None
    final_val_acc: float | None = None
    final_test_acc: float | None = None  # test accuracy of the final weights (LRA's own protocol)
    val_majority: float | None = None  # the validation split's majority-class share
    val_baseline: float | None = None  # the stall baseline (lra.baseline): a run no better than it has stalled
    steps: int | None = None
    seq_len: int | None = None
    batch_size: int | None = None  # the global batch
    eval_every: int | None = None
    train_steps_per_s: float | None = None
    examples_per_s: float | None = None
    peak_mem_mb: float | None = None
    params: int | None = None
    wall_time_s: float | None = None
    precision: str | None = None
    compiled: bool | None = None
    devices: int | None = None  # processes of a data-parallel run
    data: str | None = None  # data source and version
    split: str | None = None
    device: str | None = None
    torch: str | None = None
    git_sha: str | None = None
    config_hash: str | None = None
    timestamp: str | None = None
    run_dir: str | None = None
    overrides: str | None = None
    packed: bool | None = None  # several examples per row (trainer.pack); exact, so not in the config hash
    batching: str | None = None  # random (LRA's) | length_grouped (schedule.batching)
    val_is_test: bool | None = None  # validation is the test set (Text, as LRA): the final weights are the result
    deterministic: bool | None = None  # trained in torch's deterministic mode (trainer.deterministic); not hashed
    pretrain: str | None = None  # self-pretrained first on the training split: mlm | causal (blank: from scratch)
    pretrain_hash: str | None = None  # the config hash of that pretraining phase (its folder: run_dir/pretrain)


@dataclass
class BenchRow:
    """One (model, sequence length) of a ``python -m lra.bench`` sweep (``bench.csv``). ``rel_*`` are against
    ``transformer`` at the same length, batch, precision, backbone and device; ``peak_mem_mb`` is the peak of the
    timed steps, of the kind ``mem_kind`` says."""

    model: str
    task: str
    seq_len: int
    batch_size: int
    status: str = ""
    steps_per_s: float | None = None
    examples_per_s: float | None = None
    ms_per_step: float | None = None
    ms_p10: float | None = None  # spread of the timed steps
    ms_p90: float | None = None
    peak_mem_mb: float | None = None
    mem_kind: str | None = None
    rel_speed: float | None = None
    rel_mem: float | None = None
    params: int | None = None
    precision: str | None = None
    compiled: bool | None = None
    sdpa_backend: str | None = None
    backbone: str | None = None
    warmup: int | None = None
    timed_steps: int | None = None
    device: str | None = None
    torch: str | None = None
    git_sha: str | None = None
    timestamp: str | None = None
    compile_mode: str | None = None  # torch.compile's mode where it is not the default (reduce-overhead, ...)
    compile_note: str | None = None  # why a case asked to compile ran eagerly: the compile check's finding


RUN_COLUMNS = [f.name for f in fields(RunRow)]
BENCH_COLUMNS = [f.name for f in fields(BenchRow)]
# ``python -m lra.layer_bench``'s rows (layer_bench.csv). implementation: "lra <model>" for ours (blank in rows
# written before it existed), the package's name for theirs; package / pin: the distribution installed and the one
# the protocol pins (blank for ours and for SDPA); ms_p10, ms_p90: the spread of the timed calls; triton: the Triton
# that compiled the kernels (blank where none was installed, and in rows older than the column); compile_note: why a
# layer asked to compile ran eagerly (the compile check's finding; blank otherwise and in older rows)
LAYER_BENCH_COLUMNS = ["model", "seq_len", "batch_size", "status", "ms_fwd_bwd", "peak_mb", "precision", "device",
                       "torch", "git_sha", "timestamp", "implementation", "package", "pin", "compiled", "ms_p10",
                       "ms_p90", "compile_mode", "triton", "compile_note", "width"]
SCHEMAS = {"runs.csv": RUN_COLUMNS, "bench.csv": BENCH_COLUMNS, "layer_bench.csv": LAYER_BENCH_COLUMNS}
# What a bench row's speed depends on besides the model, the length, the batch and the device: rows that differ in any
# of these were timed under different protocols (say, the whole model eager with attention dropout, or compiled
# without it, or replaying CUDA graphs). compile_mode is blank for the default mode, as in rows older than the column
BENCH_PROTOCOL = ("task", "precision", "compiled", "backbone", "compile_mode")


def as_text(rows, columns):
    """A DataFrame of ``rows``' ``columns`` as text, '' where a value is blank or the column absent (rows written
    before it): read back from a CSV such a blank is NaN, which pandas' comparisons and groupby would otherwise drop
    or never match."""
    import pandas as pd  # pandas only where rows are read back: the runner appends its row without it

    return rows.reindex(columns=list(columns)).map(lambda v: "" if pd.isna(v) else str(v))


def schema_of(header: list[str], source: str | Path) -> list[str]:
    """The columns of the schema a CSV's header belongs to: the one holding all of its columns (older files lack
    the newest ones), the narrowest if several do."""
    fits = [cols for cols in SCHEMAS.values() if set(header) <= set(cols)]
    if not fits:
        raise ValueError(f"{source}: its columns fit none of {', '.join(SCHEMAS)} (header {header[:6]}...)")
    return min(fits, key=len)


def append_row(path: str | Path, row: dict, columns: list[str]) -> None:
    """Append ``row`` to the CSV at ``path`` under an exclusive lock, so concurrent runs (multirun, several
    processes) never interleave or lose rows. Keys outside ``columns`` are an error; missing ones are blank.
    If the file's header differs (an older schema), the file is rewritten with the union of columns,
    atomically (write a temporary file, then rename)."""
    path = Path(path)
    extra = sorted(set(row) - set(columns))
    if extra:
        raise KeyError(f"row has columns not in the schema: {extra}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
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
        tmp = temporary_name(path)
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=merged, lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, path)


CURVE_COLUMNS = ["step", "train_loss", "val_acc", "lr"]  # one row per evaluation; train loss averaged since the last
# a pretraining phase's curve: its loss and the share of predicted tokens its argmax got right, both over the training
# steps since the last row
PRETRAIN_CURVE_COLUMNS = ["step", "train_loss", "token_acc", "lr"]


def curve_path(results_dir: str | Path, row: dict) -> Path:
    """Where the validation curve of ``row`` (a runs.csv row) lives: named by what ran and when it was recorded,
    so a run stopped early and later finished keeps both curves. A pretraining phase's record (its ``phase`` is
    ``pretrain``, its ``config_hash`` the phase's: a row's ``pretrain_hash``) names its curve ``pretrain_...``."""
    when = str(row["timestamp"]).replace("-", "").replace(":", "")
    phase = f"{row['phase']}_" if row.get("phase") else ""
    name = f"{phase}{row['task']}_{row['model']}_{row['experiment']}_seed{row['seed']}_{row['config_hash']}_{when}.csv"
    return Path(results_dir) / "curves" / name


def write_curve(results_dir: str | Path, row: dict, history: list[dict],
                columns: list[str] = CURVE_COLUMNS) -> Path | None:
    """The run's evaluations (``history``: dicts of ``columns``) as a CSV beside runs.csv, written atomically;
    nothing for a run that never evaluated."""
    if not history:
        return None
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    w.writerows({k: _fmt(h.get(k)) for k in columns} for h in history)
    path = curve_path(results_dir, row)
    atomic_write_text(path, buf.getvalue())
    return path


def merge_curves(source_dir: Path, dest_dir: Path) -> int:
    """Copy the curves of ``source_dir`` that ``dest_dir`` lacks; returns how many were copied."""
    copied = 0
    for src in sorted((source_dir / "curves").glob("*.csv")):
        dest = dest_dir / "curves" / src.name
        if not dest.exists():
            atomic_write_text(dest, src.read_text())
            copied += 1
    return copied


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def git_sha(short: bool = True) -> str:
    """The commit the code ran at, with ``+dirty`` when the tree had uncommitted changes. ``LRA_GIT_SHA``,
    when set, wins: a copy of the tree whose ``.git`` is stale or absent (a remote GPU machine, a container)
    would otherwise report the wrong commit. An installed copy with no checkout says so, with its version."""
    if os.environ.get("LRA_GIT_SHA"):
        return os.environ["LRA_GIT_SHA"]
    root = Path(__file__).resolve().parents[2]
    no_checkout = f"unknown (lra {__version__}, no git checkout)"  # the running code's version, not a dist's
    if not (root / ".git").exists():
        return no_checkout
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return no_checkout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        out = sha.stdout.strip()[: 12 if short else 40]
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def triton_version() -> str:
    """The Triton that compiles the process's kernels (Inductor's and the packages'), as installed first on the path;
    '' where there is none. A layer's time moves with it (mamba's compiled layer is faster under Triton 3.7.1 than
    under 3.6)."""
    for dist in ("triton", "pytorch-triton"):  # the release's name, and the nightlies'
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return ""


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_rows(source: str | Path, dest: str | Path) -> int:
    """Append the rows of ``source`` (a runs.csv, bench.csv or layer_bench.csv, e.g. brought back from another
    machine) that ``dest`` does not hold yet (same timestamp, model, and config hash or length, and implementation);
    returns how many were added. Both files must be of one schema."""
    import pandas as pd  # as in as_text

    src, dest = Path(source), Path(dest)
    rows = pd.read_csv(src, dtype=str, keep_default_na=False)
    columns = schema_of(list(rows.columns), src)
    key = [c for c in ("timestamp", "model", "config_hash", "seq_len", "run_dir", "implementation") if c in rows]
    seen = set()
    if dest.exists() and dest.stat().st_size:
        old = pd.read_csv(dest, dtype=str, keep_default_na=False)
        if schema_of(list(old.columns), dest) is not columns:
            raise ValueError(f"{src} and {dest} hold different kinds of rows: merge a runs.csv into a runs.csv, "
                             f"a bench.csv into a bench.csv, a layer_bench.csv into a layer_bench.csv")
        seen = {tuple(r) for r in old.reindex(columns=key).itertuples(index=False)}
    added = 0
    for r in rows.to_dict("records"):
        if tuple(r.get(k, "") for k in key) in seen:
            continue
        append_row(dest, {k: v for k, v in r.items() if k in columns and v != ""}, columns)
        added += 1
    return added


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lra.results",
                                 description="Merge result rows from another results folder (e.g. a GPU "
                                             "machine's), and the validation curves beside them.")
    ap.add_argument("sources", nargs="+", help="runs.csv, bench.csv or layer_bench.csv files to merge")
    ap.add_argument("--into", required=True, help="the CSV to append the new rows to (e.g. results/runs.csv)")
    args = ap.parse_args(argv)
    for source in args.sources:
        print(f"{source}: {merge_rows(source, args.into)} new rows appended to {args.into}")
        curves = merge_curves(Path(source).parent, Path(args.into).parent)
        if curves:
            print(f"{Path(source).parent / 'curves'}: {curves} curves copied to {Path(args.into).parent / 'curves'}")


if __name__ == "__main__":
    main()
