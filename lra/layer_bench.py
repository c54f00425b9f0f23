"""One attention layer of each mixer, forward + backward, beside the public PyTorch package of the same method.

    python -m lra.layer_bench                                 # every registered mixer, the three shapes below
    python -m lra.layer_bench --models linear,performer --shapes 4096x32 --out results/layer_bench.csv

Protocol (the one the public packages were measured with): d 256, 4 heads of 64, projections included, no
dropout, inputs without padding (mask=None where the mixer takes it, else an all-true mask), bf16 autocast on
CUDA (fp32 on CPU); N 1024 and 4096 at batch 32, N 16384 at batch 8; ms per forward + backward (median of
``--steps`` synchronised calls after ``--warmup``) and peak MB (``cuda_max_allocated``, CUDA only). The public
packages' numbers are the ``peers_h200_layer`` rows of ``results/published.csv`` (measured on an H200: compare on
that card, and rerun the transformer row as the baseline in the same call). ``--out`` appends rows (device,
torch, commit) to a CSV. 2-D mixers run at square lengths only (their grid is the square).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from lra import engine
from lra.bench import model_config_options
from lra.results import device_name, git_sha, now_iso
from models import create_model, list_models
from models.registry import Grid

ROOT = Path(__file__).resolve().parent.parent
D_MODEL, HEADS = 256, 4
SHAPES = [(1024, 32), (4096, 32), (16384, 8)]  # (N, batch)
COLUMNS = ["model", "seq_len", "batch_size", "status", "ms_fwd_bwd", "peak_mb", "precision", "device", "torch",
           "git_sha", "timestamp"]


def time_layer(name: str, n: int, batch: int, device: torch.device, warmup: int = 3, steps: int = 10,
               options: dict | None = None) -> tuple[float, float | None]:
    """(median ms of one forward + backward, peak MB or None off CUDA) for mixer ``name`` at (batch, n)."""
    torch.manual_seed(0)
    mixer = create_model(name, d_model=D_MODEL, n_heads=HEADS, d_qkv=D_MODEL, dropout=0.0, max_len=n,
                         **{**model_config_options(name), **(options or {})}).to(device).train()
    x = torch.randn(batch, n, D_MODEL, device=device, requires_grad=True)  # (B, N, D)
    mask = None if getattr(mixer, "accepts_no_mask", False) else torch.ones(batch, n, dtype=torch.bool, device=device)
    extra = {}
    if getattr(mixer, "needs_grid", False):
        side = round(n ** 0.5)
        if side * side != n:
            raise ValueError(f"{name} attends over a 2-D grid: time it at square lengths")
        extra["grid"] = Grid(side, side)
    cuda = device.type == "cuda"
    autocast = engine.autocast(engine.resolve_precision("auto", device), device)

    def step():
        with autocast():
            y = mixer(x, mask, **extra)  # (B, N, D)
        y.float().square().mean().backward()

    for _ in range(warmup):
        step()
    engine.synchronize(device)
    engine.reset_peak_memory(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        engine.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), (engine.peak_memory_mb(device) if cuda else None)


def peers(published: Path = ROOT / "results" / "published.csv") -> pd.DataFrame:
    """The public packages' per-layer rows: model, implementation, seq_len, ms_fwd_bwd, peak_mb."""
    p = pd.read_csv(published)
    p = p[p["source"] == "peers_h200_layer"]
    wide = p.pivot_table(index=["model", "note", "seq_len"], columns="metric", values="value").reset_index()
    return wide.rename(columns={"note": "implementation", "ms": "ms_fwd_bwd", "mb": "peak_mb"})


def compare(ours: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """Our rows beside every public implementation of the same method and length, with the speed-up."""
    merged = ours.merge(reference, on=["model", "seq_len"], how="left", suffixes=("", "_public"))
    merged["speedup"] = merged["ms_fwd_bwd_public"] / merged["ms_fwd_bwd"]
    return merged[["model", "seq_len", "batch_size", "ms_fwd_bwd", "peak_mb", "implementation", "ms_fwd_bwd_public",
                   "peak_mb_public", "speedup"]]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(prog="python -m lra.layer_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(list_models()), help="comma-separated registry names")
    parser.add_argument("--shapes", default=",".join(f"{n}x{b}" for n, b in SHAPES), help="NxB,...")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="append the rows to this CSV")
    args = parser.parse_args(argv)
    device = engine.resolve_device(args.device)
    engine.configure(device, engine.cpu_threads(None))
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    common = dict(precision="bf16" if device.type == "cuda" else "fp32", device=device_name(device),
                  torch=torch.__version__, git_sha=git_sha())
    rows = []
    for name in args.models.split(","):
        for n, batch in shapes:
            row = dict(common, model=name, seq_len=n, batch_size=batch, timestamp=now_iso())
            try:
                row["ms_fwd_bwd"], row["peak_mb"] = time_layer(name, n, batch, device, args.warmup, args.steps)
                row["status"] = "ok"
            except torch.cuda.OutOfMemoryError:
                row["status"] = "oom"
            except Exception as error:  # noqa: BLE001 - a failing case is a row; the sweep goes on
                row["status"] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(f"{name:12s} N {n:6d} B {batch:3d}: {row['status']:5s} {row.get('ms_fwd_bwd', float('nan')):8.2f} ms",
                  flush=True)
    ours = pd.DataFrame(rows).reindex(columns=COLUMNS)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        ours.to_csv(args.out, mode="a", header=not args.out.exists(), index=False)
    table = compare(ours[ours["status"] == "ok"], peers())
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return table


if __name__ == "__main__":
    main()
