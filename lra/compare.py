"""Two result sets side by side: the same (model, task) cells from two leaderboards or two run files.

A file with ``seed`` and ``trainer`` columns is a ``runs.csv`` and is first reduced with the leaderboard's
rules (:func:`lra.leaderboard.build_leaderboard`); a file with ``model``, ``task``, ``test_acc`` (and no
``seed``) is a ``leaderboard.csv``. Cells present in only one file are kept, with a blank on the other side.

    python -m lra.compare A.csv B.csv [--trainer lra] [--out diff.csv]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from lra.leaderboard import build_leaderboard, sort_leaderboard

COMPARE_COLUMNS = ["model", "task", "a", "b", "diff", "n_seeds_a", "n_seeds_b"]


def kind_of(df: pd.DataFrame) -> str:
    cols = set(df.columns)
    if {"model", "task", "seed", "trainer", "test_acc"} <= cols:
        return "runs"
    if {"model", "task", "test_acc"} <= cols:
        return "leaderboard"
    raise ValueError(f"neither a runs.csv nor a leaderboard.csv (columns: {sorted(cols)})")


def as_leaderboard(df: pd.DataFrame, trainer: str | None = "lra") -> pd.DataFrame:
    return build_leaderboard(df, None, trainer) if kind_of(df) == "runs" else df


def compare(a: pd.DataFrame, b: pd.DataFrame, trainer: str | None = "lra") -> pd.DataFrame:
    """``diff`` = b - a, per (model, task) cell; columns ``COMPARE_COLUMNS``."""
    cols = ["model", "task", "test_acc", "n_seeds"]
    la, lb = (as_leaderboard(x, trainer).reindex(columns=cols) for x in (a, b))
    m = la.merge(lb, on=["model", "task"], how="outer", suffixes=("_a", "_b"))
    m = m.rename(columns={"test_acc_a": "a", "test_acc_b": "b"})
    m["a"], m["b"] = pd.to_numeric(m["a"]), pd.to_numeric(m["b"])
    m["diff"] = m["b"] - m["a"]
    for c in ("n_seeds_a", "n_seeds_b"):
        m[c] = pd.to_numeric(m[c]).round().astype("Int64")
    # order as a leaderboard of side a (then b's extra models), tasks in LRA order
    order = sort_leaderboard(m.assign(test_acc=m["a"].fillna(m["b"]))[["model", "task", "test_acc"]])
    m = order[["model", "task"]].merge(m, on=["model", "task"], how="left")
    return m[COMPARE_COLUMNS]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(prog="python -m lra.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="leaderboard.csv or runs.csv")
    ap.add_argument("b", help="leaderboard.csv or runs.csv")
    ap.add_argument("--trainer", default="lra", help="for run files: comma-separated trainer names, or 'all'")
    ap.add_argument("--out", default=None, help="also write the comparison to this CSV")
    args = ap.parse_args(argv)
    a, b = pd.read_csv(args.a), pd.read_csv(args.b)
    table = compare(a, b, args.trainer)
    print(f"a = {args.a} ({kind_of(a)})\nb = {args.b} ({kind_of(b)})\ndiff = b - a (test accuracy %)")
    print(table.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.2f}"))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out, index=False, float_format="%.4f")
    return table


if __name__ == "__main__":
    main()
