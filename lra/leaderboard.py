"""The model x task leaderboard, derived from ``runs.csv`` and set beside the published LRA Table 1.

Tay et al. 2021, "Long Range Arena: A Benchmark for Efficient Transformers" (https://arxiv.org/abs/2011.04006),
Table 1. Rules:

* runs of one trainer only (default ``lra``: full schedules; smoke runs never count);
* per (model, task, seed) the run with the best validation accuracy, and its test accuracy (a re-run of the
  same seed replaces, never averages with, the earlier one);
* per (model, task) the mean over seeds, with the sample std and ``n_seeds`` when there are several;
* two LRA averages, only when all five tasks are present: ``avg5`` = the paper's mean over ListOps, Text,
  Retrieval, Image, Pathfinder (Path-X excluded); ``avg6`` = mean over the six with Path-X counted as 50 when
  it failed (50 +- 1 %) or is missing (the convention of S4's Table 10, which SSM papers follow);
* ``published`` = the LRA Table 1 cell (paper averages; the derived avg6) and ``diff`` = ours - published.

Accuracies are percentages; a runs file holding fractions (every accuracy <= 1) is scaled by 100.

    python -m lra.leaderboard [--runs results/runs.csv] [--out results/leaderboard.csv]
                              [--published results/published.csv] [--trainer lra]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

TASKS5 = ["listops", "text", "retrieval", "image", "pathfinder"]
TASKS6 = TASKS5 + ["pathx"]
AVERAGES = ["avg5", "avg6"]
PATHX_CHANCE, PATHX_FAIL_BAND = 50.0, 1.0
PUBLISHED_SOURCE = "lra_table1"
LEADERBOARD_COLUMNS = ["model", "task", "test_acc", "test_std", "n_seeds", "val_acc", "final_test_acc",
                       "published", "diff", "note"]
ACC_COLUMNS = ["val_acc", "test_acc", "final_val_acc", "final_test_acc"]
AVG_NOTES = {"avg5": "5-task mean, Path-X excluded (LRA convention)",
             "avg6": "6-task mean, failed/missing Path-X = 50 (S4 convention)"}


def as_percent(runs: pd.DataFrame) -> pd.DataFrame:
    runs = runs.copy()
    cols = [c for c in ACC_COLUMNS if c in runs]
    for c in cols:
        runs[c] = pd.to_numeric(runs[c], errors="coerce")
    values = runs[cols].stack()
    if len(values) and values.max() <= 1.0:  # fractions: no real run scores <= 1 % everywhere
        runs[cols] = runs[cols] * 100
    return runs


def select_runs(runs: pd.DataFrame, trainer: str | None = "lra") -> pd.DataFrame:
    """One row per (model, task, seed): the best by validation accuracy (the latest on a tie)."""
    runs = as_percent(runs)
    if trainer not in (None, "", "all"):
        runs = runs[runs["trainer"].astype(str).isin(trainer.split(","))]
    runs = runs.dropna(subset=["test_acc"])
    order = ["val_acc"] + (["timestamp"] if "timestamp" in runs else [])
    runs = runs.sort_values(order, na_position="first", kind="stable")
    return runs.drop_duplicates(["model", "task", "seed"], keep="last").reset_index(drop=True)


def published_cells(published: pd.DataFrame | None) -> dict:
    """(model, task) -> (value or None, note) from LRA Table 1 (test accuracy, avg5, avg6)."""
    if published is None or published.empty:
        return {}
    p = published[published["source"] == PUBLISHED_SOURCE]
    p = p[p["metric"].isin(["test_acc", *AVERAGES])]
    out = {}
    for r in p.itertuples(index=False):
        value = pd.to_numeric(r.value, errors="coerce")
        note = "" if pd.isna(r.note) else str(r.note)
        out[(r.model, r.task)] = (None if pd.isna(value) else float(value), note)
    return out


def build_leaderboard(runs: pd.DataFrame, published: pd.DataFrame | None = None,
                      trainer: str | None = "lra") -> pd.DataFrame:
    """Long format: one row per (model, task) and per (model, avg5 / avg6); columns ``LEADERBOARD_COLUMNS``."""
    best = select_runs(runs, trainer)
    rows = []
    for (model, task), g in best.groupby(["model", "task"], sort=False):
        n = len(g)
        note = ""
        if task == "pathx" and abs(g["test_acc"].mean() - PATHX_CHANCE) <= PATHX_FAIL_BAND:
            note = "FAIL (50 +- 1 %)"
        rows.append(dict(model=model, task=task, test_acc=g["test_acc"].mean(),
                         test_std=g["test_acc"].std(ddof=1) if n > 1 else None, n_seeds=n,
                         val_acc=g["val_acc"].mean(),
                         final_test_acc=g["final_test_acc"].mean() if "final_test_acc" in g else None, note=note))
    cells = pd.DataFrame(rows, columns=LEADERBOARD_COLUMNS)
    for model, g in cells.groupby("model", sort=False):
        acc = dict(zip(g["task"], g["test_acc"], strict=True))
        if not all(t in acc for t in TASKS5):
            continue
        seeds = int(g[g["task"].isin(TASKS5)]["n_seeds"].min())
        rows.append(dict(model=model, task="avg5", test_acc=sum(acc[t] for t in TASKS5) / 5, n_seeds=seeds,
                         note=AVG_NOTES["avg5"]))
        pathx = acc.get("pathx")
        failed = pathx is None or abs(pathx - PATHX_CHANCE) <= PATHX_FAIL_BAND
        how = "Path-X missing = 50" if pathx is None else "Path-X failed = 50" if failed else "Path-X as run"
        rows.append(dict(model=model, task="avg6", n_seeds=seeds, note=f"{AVG_NOTES['avg6']}; {how}",
                         test_acc=(sum(acc[t] for t in TASKS5) + (PATHX_CHANCE if failed else pathx)) / 6))
    lb = pd.DataFrame(rows, columns=LEADERBOARD_COLUMNS)
    pub = published_cells(published)
    for i, r in lb.iterrows():
        value, note = pub.get((r["model"], r["task"]), (None, ""))
        lb.at[i, "published"] = value
        lb.at[i, "diff"] = None if value is None else r["test_acc"] - value
        if value is None and note.startswith("FAIL"):
            lb.at[i, "note"] = "; ".join(x for x in (r["note"], "LRA Table 1: FAIL") if x)
    for c in ["test_acc", "test_std", "val_acc", "final_test_acc", "published", "diff"]:
        lb[c] = pd.to_numeric(lb[c], errors="coerce")
    return sort_leaderboard(lb)


def sort_leaderboard(lb: pd.DataFrame) -> pd.DataFrame:
    """Models by 5-task average (best first, models without one last), tasks in LRA order."""
    avg = lb[lb["task"] == "avg5"].set_index("model")["test_acc"]
    models = sorted(lb["model"].unique(), key=lambda m: (-avg.get(m, float("-inf")), m))
    task_order = {t: i for i, t in enumerate(TASKS6 + AVERAGES)}
    key = lb["model"].map({m: i for i, m in enumerate(models)}) * 100 + lb["task"].map(task_order).fillna(50)
    return lb.assign(_k=key).sort_values("_k", kind="stable").drop(columns="_k").reset_index(drop=True)


def wide(lb: pd.DataFrame, value: str = "test_acc") -> pd.DataFrame:
    """Models down, tasks (then avg5, avg6) across, in leaderboard order."""
    tasks = [t for t in TASKS6 + AVERAGES if t in set(lb["task"])]
    tasks += sorted(set(lb["task"]) - set(tasks))
    table = lb.pivot(index="model", columns="task", values=value)
    return table.reindex(index=list(dict.fromkeys(lb["model"])), columns=tasks)


def format_leaderboard(lb: pd.DataFrame) -> str:
    if lb.empty:
        return "(no runs)"
    tasks = list(wide(lb).columns)
    width = max(12, lb["model"].str.len().max() + 2)
    lines = ["test accuracy %: mean +- std over seeds [n seeds], (diff vs LRA Table 1)",
             "model".ljust(width) + "".join(t.rjust(22) for t in tasks)]
    cells = lb.set_index(["model", "task"])
    for model in dict.fromkeys(lb["model"]):
        out = []
        for t in tasks:
            if (model, t) not in cells.index:
                out.append("-")
                continue
            r = cells.loc[(model, t)]
            s = f"{r['test_acc']:.2f}"
            if pd.notna(r["test_std"]):
                s += f"+-{r['test_std']:.2f}"
            if t not in AVERAGES and r["n_seeds"] > 1:
                s += f"[{int(r['n_seeds'])}]"
            if pd.notna(r["diff"]):
                s += f" ({r['diff']:+.2f})"
            elif str(r["note"]).startswith("FAIL"):
                s += " FAIL"
            out.append(s)
        lines.append(model.ljust(width) + "".join(c.rjust(22) for c in out))
    lines += [f"avg5: {AVG_NOTES['avg5']}", f"avg6: {AVG_NOTES['avg6']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(prog="python -m lra.leaderboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="results/runs.csv")
    ap.add_argument("--out", default="results/leaderboard.csv")
    ap.add_argument("--published", default="results/published.csv")
    ap.add_argument("--trainer", default="lra", help="comma-separated trainer names, or 'all'")
    args = ap.parse_args(argv)
    runs_path = Path(args.runs)
    if not runs_path.exists():
        raise SystemExit(f"no runs at {runs_path}: train with `python -m lra` first")
    published = pd.read_csv(args.published) if Path(args.published).exists() else None
    lb = build_leaderboard(pd.read_csv(runs_path), published, args.trainer)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    lb.to_csv(args.out, index=False, float_format="%.4f")
    print(format_leaderboard(lb))
    print(f"written to {args.out}")
    return lb


if __name__ == "__main__":
    main()
