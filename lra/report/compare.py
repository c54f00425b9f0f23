"""Two result sets side by side: two leaderboards or run files (accuracy per model and task), or two bench files
(speed and memory per model and length).

A file with ``seed`` and ``test_acc`` columns is a ``runs.csv`` and is first reduced with the leaderboard's rules
(:func:`lra.report.leaderboard.build_leaderboard`); one with ``model``, ``task``, ``test_acc`` is a ``leaderboard.csv``;
one with ``seq_len`` and ``steps_per_s`` is a ``bench.csv`` (its latest ok row per model, length and batch).
Cells present in only one file are kept, with a blank on the other side.

    python -m lra.compare A.csv B.csv [--experiment lra] [--out diff.csv]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from lra.errors import DataError
from lra.report.leaderboard import build_leaderboard, sort_leaderboard

COMPARE_COLUMNS = ["experiment", "model", "task", "a", "b", "diff", "n_seeds_a", "n_seeds_b"]
BENCH_COMPARE_COLUMNS = ["model", "seq_len", "batch_size", "steps_per_s_a", "steps_per_s_b", "speed_ratio",
                         "peak_mem_mb_a", "peak_mem_mb_b", "mem_ratio"]


def kind_of(df: pd.DataFrame) -> str:
    cols = set(df.columns)
    if {"model", "seq_len", "steps_per_s", "status"} <= cols:
        return "bench"
    if {"model", "task", "seed", "test_acc"} <= cols:
        return "runs"
    if {"model", "task", "test_acc"} <= cols:
        return "leaderboard"
    raise ValueError(f"neither a runs.csv, a leaderboard.csv nor a bench.csv (columns: {sorted(cols)})")


def as_leaderboard(df: pd.DataFrame, experiment: str | None = "lra") -> pd.DataFrame:
    lb = build_leaderboard(df, None, experiment) if kind_of(df) == "runs" else df
    return lb if "experiment" in lb else lb.assign(experiment="lra")


def compare(a: pd.DataFrame, b: pd.DataFrame, experiment: str | None = "lra") -> pd.DataFrame:
    """Accuracy: ``diff`` = b - a, per (experiment, model, task) cell; columns ``COMPARE_COLUMNS``."""
    keys, cols = ["experiment", "model", "task"], ["experiment", "model", "task", "test_acc", "n_seeds"]
    la, lb = (as_leaderboard(x, experiment).reindex(columns=cols) for x in (a, b))
    m = la.merge(lb, on=keys, how="outer", suffixes=("_a", "_b"))
    m = m.rename(columns={"test_acc_a": "a", "test_acc_b": "b"})
    m["a"], m["b"] = pd.to_numeric(m["a"]), pd.to_numeric(m["b"])
    m["diff"] = m["b"] - m["a"]
    for c in ("n_seeds_a", "n_seeds_b"):
        m[c] = pd.to_numeric(m[c]).round().astype("Int64")
    # order as a leaderboard of side a (then b's extra models), tasks in LRA order
    order = sort_leaderboard(m.assign(test_acc=m["a"].fillna(m["b"]))[[*keys, "test_acc"]])
    return order[keys].merge(m, on=keys, how="left")[COMPARE_COLUMNS]


def latest_bench(df: pd.DataFrame) -> pd.DataFrame:
    ok = df[df["status"].astype(str) == "ok"]
    if "timestamp" in ok:
        ok = ok.sort_values("timestamp", kind="stable")
    return ok.drop_duplicates(["model", "seq_len", "batch_size"], keep="last")


def compare_bench(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Speed and memory: ``speed_ratio`` = b / a in steps/s, ``mem_ratio`` = b / a in peak MB."""
    keys, cols = ["model", "seq_len", "batch_size"], ["model", "seq_len", "batch_size", "steps_per_s", "peak_mem_mb"]
    m = latest_bench(a)[cols].merge(latest_bench(b)[cols], on=keys, how="outer", suffixes=("_a", "_b"))
    for c in ("steps_per_s_a", "steps_per_s_b", "peak_mem_mb_a", "peak_mem_mb_b"):
        m[c] = pd.to_numeric(m[c], errors="coerce")
    m["speed_ratio"] = m["steps_per_s_b"] / m["steps_per_s_a"]
    m["mem_ratio"] = m["peak_mem_mb_b"] / m["peak_mem_mb_a"]
    return m.sort_values(keys, kind="stable").reset_index(drop=True)[BENCH_COMPARE_COLUMNS]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(prog="python -m lra.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="leaderboard.csv, runs.csv or bench.csv")
    ap.add_argument("b", help="a file of the same family (accuracy or bench)")
    ap.add_argument("--experiment", default="lra", help="for run files: comma-separated experiments, or 'all'")
    ap.add_argument("--out", default=None, help="also write the comparison to this CSV")
    args = ap.parse_args(argv)
    for path in (args.a, args.b):
        if not Path(path).is_file():
            raise DataError(f"no file at {path}: compare two leaderboard.csv, runs.csv or bench.csv files")
    a, b = pd.read_csv(args.a), pd.read_csv(args.b)
    ka, kb = kind_of(a), kind_of(b)
    print(f"a = {args.a} ({ka})\nb = {args.b} ({kb})")
    if "bench" in (ka, kb):
        if ka != kb:
            raise SystemExit("a bench file compares only with another bench file")
        table = compare_bench(a, b)
        print("speed_ratio = steps/s of b / a; mem_ratio = peak MB of b / a")
    else:
        table = compare(a, b, args.experiment)
        print("diff = b - a (test accuracy %)")
    print(table.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.2f}"))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out, index=False, float_format="%.4f")
    return table


if __name__ == "__main__":
    main()
