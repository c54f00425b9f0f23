"""The model x task leaderboard, derived from ``runs.csv`` and set beside the published LRA Table 1.

Tay et al. 2021, "Long Range Arena: A Benchmark for Efficient Transformers" (https://arxiv.org/abs/2011.04006),
Table 1. Rules:

* runs of the chosen experiments only (default ``lra``: LRA's protocol; smoke runs never count); other
  experiments (recipes, variants) are separate rows, labelled by their ``experiment``; so are runs on Pathfinder
  images of an older generator version (``<experiment>+superseded_data``);
* only ``status == ok`` rows carry a result; ``diverged``, ``oom`` and ``error`` runs are counted (``n_failed``)
  while their seed has no ok run, and never averaged; a run ended early by ``schedule.stop_at`` or
  ``trainer.time_limit`` (``stopped: at step N of M``, a recipe longer than the device time it got) is named in the
  note with its accuracy so far, while its seed has no ok run, and never averaged either;
* per (experiment, model, task, seed) the ok run with the best validation accuracy (a re-run of the same seed
  replaces, never averages with, the earlier one); it is *stalled* when its best validation accuracy is within
  1 point of the validation split's majority-class share: it still counts, and ``n_stalled`` says so; it
  *collapsed* when it learned (not stalled) but its final weights' validation accuracy is back within that point:
  its best-validation checkpoint still counts, and the note says so (the final weights' test is beside it);
* per (experiment, model, task) the mean and sample std over seeds of the best-validation checkpoint's test
  accuracy (``test_acc``) and of the final weights' (``final_test_acc``, LRA's own protocol), and ``n_seeds``;
* where the validation split is the test set (a row's ``val_is_test``: Text, whose IMDb has no validation set, as
  in LRA), choosing by validation would choose on test: the latest ok run of each seed counts, and the headline
  ``test_acc`` is the final weights' (``headline = final``; elsewhere ``best_val``);
* averages, when every task they need is present: ``avg4`` = ListOps, Text, Image, Pathfinder (LRA's five without
  Retrieval, whose AAN files a user may not have); ``avg5`` = the paper's LRA score (Path-X excluded); ``avg6`` =
  six tasks with Path-X counted as 50 when it failed (50 +- 1 %) or is missing (S4's Table 10 convention);
* ``published`` = the LRA Table 1 cell and ``diff`` = ours - published; a recipe's rows (an experiment in
  ``RECIPE_PAPERS``) are set beside the paper the recipe comes from instead (S4D's recipe: S4D-LegS's numbers).

Accuracies are percentages; a runs file holding fractions (every accuracy <= 1) is scaled by 100.

    python -m lra.leaderboard [--results DIR] [--runs DIR/runs.csv] [--out DIR/leaderboard.csv]
                              [--published results/published.csv] [--experiment lra]
"""
from __future__ import annotations

import argparse
import os
from collections import Counter
from pathlib import Path

import pandas as pd

from lra.provenance import PARTIAL_PRESETS, departures, is_stopped

TASKS4 = ["listops", "text", "image", "pathfinder"]
TASKS5 = ["listops", "text", "retrieval", "image", "pathfinder"]
TASKS6 = TASKS5 + ["pathx"]
AVERAGES = {"avg4": TASKS4, "avg5": TASKS5, "avg6": TASKS5}
PATHX_CHANCE, PATHX_FAIL_BAND = 50.0, 1.0
SUPERSEDED = "+superseded_data"  # the experiment suffix of rows on older Pathfinder images (``superseded_data``)
STALL_BAND = 1.0  # points above the majority-class share within which a run counts as stalled
PUBLISHED_SOURCE = "lra_table1"
# a recipe's rows are compared with the paper it reproduces: experiment -> (published.csv source, our model name ->
# the model name in that source's rows)
RECIPE_PAPERS = {"s4d_lra": ("s4d_2022", {"s4d": "s4d_legs"})}
DEFAULT_RESULTS = os.environ.get("LRA_RESULTS_DIR", "outputs/results")
LEADERBOARD_COLUMNS = ["experiment", "model", "task", "test_acc", "test_std", "n_seeds", "n_failed", "n_stalled",
                       "val_acc", "final_test_acc", "final_test_std", "headline", "published", "diff", "note"]
ACC_COLUMNS = ["val_acc", "test_acc", "final_val_acc", "final_test_acc", "val_majority"]
AVG_NOTES = {"avg4": "4-task mean (ListOps, Text, Image, Pathfinder): LRA's five without Retrieval",
             "avg5": "5-task mean, Path-X excluded (LRA's score)",
             "avg6": "6-task mean, failed/missing Path-X = 50 (S4 convention)"}


def as_percent(runs: pd.DataFrame) -> pd.DataFrame:
    runs = runs.copy()
    cols = [c for c in ACC_COLUMNS if c in runs]
    for c in cols:
        runs[c] = pd.to_numeric(runs[c], errors="coerce")
    values = runs[[c for c in cols if c != "val_majority"]].stack()
    if len(values) and values.max() <= 1.0:  # fractions: no real run scores <= 1 % everywhere
        runs[cols] = runs[cols] * 100
    elif "val_majority" in runs and runs["val_majority"].max() <= 1.0:
        runs["val_majority"] = runs["val_majority"] * 100
    return runs


def normalise(runs: pd.DataFrame) -> pd.DataFrame:
    """Percentages; ``status`` and ``experiment`` present (a row without a status is read as ok). A run with
    length-grouped batches did not follow its preset's protocol: its experiment reads ``<preset>+length_grouped``,
    so it is never averaged with the preset's own runs; nor is one whose command line changed what the preset
    computes (``lra.provenance.departures``, e.g. ``backbone.n_layers=2``): ``<preset>+modified``; nor one trained
    on Pathfinder images of an older generator version (``superseded_data``): ``<preset>+superseded_data``."""
    runs = as_percent(runs)
    if "status" not in runs:
        runs["status"] = "ok"
    runs["status"] = runs["status"].fillna("ok").astype(str)
    runs["experiment"] = runs["experiment"].astype(str) if "experiment" in runs else "lra"
    runs["val_is_test"] = val_is_test(runs)
    if "batching" in runs:
        grouped = runs["batching"].astype(str) == "length_grouped"
        runs.loc[grouped, "experiment"] = runs.loc[grouped, "experiment"] + "+length_grouped"
    if "data" in runs:  # images of an older generator are another dataset
        stale = superseded_data(runs)
        runs.loc[stale, "experiment"] = runs.loc[stale, "experiment"] + SUPERSEDED
    if "overrides" in runs:  # a preset changed on the command line is not the preset
        changed = [bool(departures(o, t)) and e not in PARTIAL_PRESETS
                   for o, t, e in zip(runs["overrides"].fillna(""), runs["val_is_test"], runs["experiment"])]
        runs.loc[changed, "experiment"] = runs.loc[changed, "experiment"] + "+modified"
    return runs


def superseded_counts(runs: pd.DataFrame) -> dict[tuple[str, str, str], int]:
    """(experiment, model, task) -> how many of its rows ``superseded_data`` set apart; ``runs`` normalised."""
    apart = runs[runs["experiment"].str.endswith(SUPERSEDED)]
    return dict(Counter(zip(apart["experiment"].str.removesuffix(SUPERSEDED), apart["model"], apart["task"],
                            strict=True)))


def superseded_data(runs: pd.DataFrame) -> pd.Series:
    """Rows trained on generated Pathfinder images older than today's generator draws: ``pathfinder_gen vN`` with N
    below ``GENERATOR_VERSION``, or, in a file where rows name their generator version, a Pathfinder / Path-X row that
    names no data (written before rows named it, which came with version 2). Another generator version draws other
    images (other grey levels, other tokens): such a row is kept apart from today's, as
    ``<experiment>+superseded_data``."""
    data = runs["data"].astype("string")
    version = pd.to_numeric(data.str.extract(r"^pathfinder_gen v(\d+)\b", expand=False), errors="coerce")
    if not version.notna().any():  # no row names a generator version: nothing to compare them with
        return pd.Series(False, index=runs.index)
    unrecorded = data.isna() & runs["task"].isin(["pathfinder", "pathx"])
    from lra.data.pathfinder_gen import GENERATOR_VERSION  # lra.data brings torch: only where Pathfinder rows are

    return ((version < GENERATOR_VERSION) | unrecorded).fillna(False).astype(bool)


def as_bool(values: pd.Series) -> pd.Series:
    """A CSV column of booleans (``True``/``False``, blanks) as True / False / NA."""
    words = values.astype("string").str.strip().str.lower()
    return words.map({"true": True, "1": True, "1.0": True, "false": False, "0": False, "0.0": False}).astype("boolean")


def val_is_test(runs: pd.DataFrame) -> pd.Series:
    """Whether each row's validation split was its test set. Rows older than the ``val_is_test`` column say so in
    their split recipe (``val=test``)."""
    recipe = runs["split"].astype("string").str.contains("val=test", regex=False) if "split" in runs else None
    recipe = pd.Series(False, index=runs.index) if recipe is None else recipe.fillna(False).astype(bool)
    if "val_is_test" not in runs:
        return recipe
    return as_bool(runs["val_is_test"]).fillna(recipe).astype(bool)


def select_runs(runs: pd.DataFrame, experiment: str | None = "lra") -> pd.DataFrame:
    """All rows of the chosen experiments, with ``best`` marking one ok row per (experiment, model, task, seed):
    the best by validation accuracy (the latest on a tie; the latest where validation is the test set) and
    ``stalled`` on those that stalled."""
    return select_normalised(normalise(runs), experiment)


def select_normalised(runs: pd.DataFrame, experiment: str | None = "lra") -> pd.DataFrame:
    """``select_runs`` on rows ``normalise`` has read already."""
    if experiment not in (None, "", "all"):
        runs = runs[runs["experiment"].isin(experiment.split(","))]
    ok = runs[(runs["status"] == "ok") & runs["test_acc"].notna()]
    ok = ok.assign(_by=ok["val_acc"].where(~ok["val_is_test"]))  # no choice by validation where it is the test set
    order = ["_by"] + (["timestamp"] if "timestamp" in ok else [])
    best = ok.sort_values(order, na_position="first", kind="stable")
    best = best.drop_duplicates(["experiment", "model", "task", "seed"], keep="last")
    runs = runs.assign(best=runs.index.isin(best.index))
    unknown = pd.Series(float("nan"), index=runs.index)  # older rows without the column: never flagged
    at_majority = runs.get("val_majority", unknown) + STALL_BAND  # within the band: no better than the prior
    stalled = runs["best"] & (runs["val_acc"] <= at_majority)
    return runs.assign(stalled=stalled,
                       collapsed=runs["best"] & ~stalled & (runs.get("final_val_acc", unknown) <= at_majority))


def headline(best: pd.DataFrame) -> pd.Series:
    """The test accuracy the leaderboard reports for each selected run: the final weights' where validation is the
    test set, else the best-validation checkpoint's."""
    return best["final_test_acc"].where(best["val_is_test"], best["test_acc"])


def seed_accuracies(runs: pd.DataFrame, experiment: str | None = "lra") -> pd.DataFrame:
    """One row per (experiment, model, task, seed) of the selected runs, ``test_acc`` = its headline accuracy (%):
    the values behind each cell's mean and std."""
    best = select_runs(runs, experiment)
    best = best[best["best"]]
    return best[["experiment", "model", "task", "seed"]].assign(test_acc=headline(best)).reset_index(drop=True)


def _cell(experiment, model, task, g: pd.DataFrame) -> dict:
    best = g[g["best"]]
    n = len(best)
    # a failed run counts while its seed has no ok run (a seed rerun to ok after an oom or a fixed error is a result)
    open_seed, ended_early = ~g["seed"].isin(best["seed"]), g["status"].map(is_stopped)  # no ok run yet
    stopped = ended_early & open_seed  # schedule.stop_at, trainer.time_limit
    unresolved = (g["status"] != "ok") & ~ended_early & open_seed
    failed = int(unresolved.sum())
    row = dict(experiment=experiment, model=model, task=task, n_seeds=n, n_failed=failed,
               n_stalled=int(best["stalled"].sum()), note="")
    notes = []
    if n:
        final, values = bool(best["val_is_test"].all()), headline(best)
        row.update(test_acc=values.mean(), test_std=values.std(ddof=1) if n > 1 else None,
                   val_acc=best["val_acc"].mean(), final_test_acc=best["final_test_acc"].mean(),
                   final_test_std=best["final_test_acc"].std(ddof=1) if n > 1 else None,
                   headline="final" if final else "best_val")
        if final:
            notes.append("final weights: the validation split is the test set")
    latest = g[stopped].drop_duplicates("seed", keep="last")  # the furthest-trained is the latest
    for (_, run), so_far in zip(latest.iterrows(), headline(latest), strict=True):  # Text: its weights at the stop
        where = run["status"].replace(": ", " ", 1)  # stopped at step N of M
        notes.append(f"seed {run['seed']} {where}, test {so_far:.2f} so far (not averaged)")
    if failed:
        kinds = g.loc[unresolved, "status"].str.split(":").str[0].value_counts()
        notes.append("failed: " + ", ".join(f"{c} {k}" for k, c in kinds.items()))
    if row["n_stalled"]:
        notes.append(f"{row['n_stalled']} of {n} seeds stalled (best val within {STALL_BAND:g} point of the "
                     f"majority class)")
    if best["collapsed"].any():
        notes.append(f"{int(best['collapsed'].sum())} of {n} seeds collapsed (final val back within {STALL_BAND:g} "
                     f"point of the majority class; the best-val checkpoint counts)")
    if task == "pathx" and n and abs(row["test_acc"] - PATHX_CHANCE) <= PATHX_FAIL_BAND:
        notes.append("FAIL (50 +- 1 %)")
    row["note"] = "; ".join(notes)
    return row


def _averages(cells: pd.DataFrame) -> list[dict]:
    rows = []
    for (experiment, model), g in cells.dropna(subset=["test_acc"]).groupby(["experiment", "model"], sort=False):
        acc = dict(zip(g["task"], g["test_acc"], strict=True))
        seeds = dict(zip(g["task"], g["n_seeds"], strict=True))
        for name, tasks in AVERAGES.items():
            if not all(t in acc for t in tasks):
                continue
            value, note = sum(acc[t] for t in tasks) / len(tasks), AVG_NOTES[name]
            if name == "avg6":
                pathx = acc.get("pathx")
                failed = pathx is None or abs(pathx - PATHX_CHANCE) <= PATHX_FAIL_BAND
                how = "Path-X missing = 50" if pathx is None else "Path-X failed = 50" if failed else "Path-X as run"
                value = (sum(acc[t] for t in tasks) + (PATHX_CHANCE if failed else pathx)) / 6
                note = f"{note}; {how}"
            rows.append(dict(experiment=experiment, model=model, task=name, test_acc=value, note=note,
                             n_seeds=int(min(seeds[t] for t in tasks))))
    return rows


def build_leaderboard(runs: pd.DataFrame, published: pd.DataFrame | None = None,
                      experiment: str | None = "lra") -> pd.DataFrame:
    """Long format: one row per (experiment, model, task) and per average; columns ``LEADERBOARD_COLUMNS``."""
    runs = normalise(runs)
    set_apart = superseded_counts(runs)
    runs = select_normalised(runs, experiment)
    rows = [_cell(e, m, t, g) for (e, m, t), g in runs.groupby(["experiment", "model", "task"], sort=False)]
    for row in rows:  # say where a cell's rows on older Pathfinder images went
        if n := set_apart.get((row["experiment"], row["model"], row["task"])):
            left_out = f"{n} run(s) on an older Pathfinder generator version left out ({row['experiment']}{SUPERSEDED})"
            row["note"] = "; ".join(x for x in (row["note"], left_out) if x)
    cells = pd.DataFrame(rows, columns=LEADERBOARD_COLUMNS)
    lb = pd.DataFrame(rows + _averages(cells), columns=LEADERBOARD_COLUMNS)
    pub = {experiment: published_cells(published, experiment) for experiment in lb["experiment"].unique()}
    for i, r in lb.iterrows():
        value, note = pub[r["experiment"]].get((r["model"], r["task"]), (None, ""))
        lb.at[i, "published"] = value
        lb.at[i, "diff"] = None if value is None or pd.isna(r["test_acc"]) else r["test_acc"] - value
        if value is None and note.startswith("FAIL"):
            lb.at[i, "note"] = "; ".join(x for x in (r["note"], "LRA Table 1: FAIL") if x)
    for c in ["test_acc", "test_std", "val_acc", "final_test_acc", "final_test_std", "published", "diff"]:
        lb[c] = pd.to_numeric(lb[c], errors="coerce")
    for c in ["n_seeds", "n_failed", "n_stalled"]:
        lb[c] = pd.to_numeric(lb[c], errors="coerce").astype("Int64")
    return sort_leaderboard(lb)


def published_cells(published: pd.DataFrame | None, experiment: str = "lra") -> dict:
    """(model, task) -> (value or None, note) from LRA Table 1 (test accuracy, avg4, avg5, avg6), or for a recipe
    (``RECIPE_PAPERS``) from its paper's rows, under our model names."""
    if published is None or published.empty:
        return {}
    source, names = RECIPE_PAPERS.get(experiment, (PUBLISHED_SOURCE, {}))
    p = published[published["source"] == source]
    p = p.assign(model=p["model"].replace({theirs: ours for ours, theirs in names.items()}))
    out = {}
    for r in p[p["metric"].isin(["test_acc", "avg5", "avg6"])].itertuples(index=False):
        value = pd.to_numeric(r.value, errors="coerce")
        out[(r.model, r.task)] = (None if pd.isna(value) else float(value), "" if pd.isna(r.note) else str(r.note))
    acc = p[p["metric"] == "test_acc"].assign(value=lambda d: pd.to_numeric(d["value"], errors="coerce"))
    for model, g in acc.groupby("model"):  # the paper's cells give its 4-task mean too
        cells = g.set_index("task")["value"].reindex(TASKS4)
        if cells.notna().all():
            out[(model, "avg4")] = (float(cells.mean()), "")
    return out


def sort_leaderboard(lb: pd.DataFrame) -> pd.DataFrame:
    """Experiments (lra first), models by their best average (avg5, else avg4; models without one last), tasks in
    LRA order."""
    def score(e, m):
        for name in ("avg5", "avg4"):
            v = lb[(lb["experiment"] == e) & (lb["model"] == m) & (lb["task"] == name)]["test_acc"]
            if len(v) and pd.notna(v.iloc[0]):
                return (0 if name == "avg5" else 1, -float(v.iloc[0]))
        return (2, 0.0)

    keys = sorted({(e, m) for e, m in zip(lb["experiment"], lb["model"], strict=True)},
                  key=lambda em: (em[0] != "lra", em[0], *score(*em), em[1]))
    rank = {k: i for i, k in enumerate(keys)}
    task_order = {t: i for i, t in enumerate(TASKS6 + list(AVERAGES))}
    key = [rank[(e, m)] * 100 + task_order.get(t, 50) for e, m, t in zip(lb["experiment"], lb["model"], lb["task"],
                                                                          strict=True)]
    return lb.assign(_k=key).sort_values("_k", kind="stable").drop(columns="_k").reset_index(drop=True)


def wide(lb: pd.DataFrame, value: str = "test_acc") -> pd.DataFrame:
    """(experiment, model) down, tasks (then the averages) across, in leaderboard order."""
    tasks = [t for t in TASKS6 + list(AVERAGES) if t in set(lb["task"])]
    tasks += sorted(set(lb["task"]) - set(tasks))
    table = lb.pivot(index=["experiment", "model"], columns="task", values=value)
    order = list(dict.fromkeys(zip(lb["experiment"], lb["model"], strict=True)))
    return table.reindex(index=pd.MultiIndex.from_tuples(order, names=["experiment", "model"]), columns=tasks)


def format_cell(r) -> str:
    if pd.isna(r["test_acc"]):
        return f"failed x{int(r['n_failed'])}" if r["n_failed"] else "-"
    s = f"{r['test_acc']:.2f}"
    if pd.notna(r["test_std"]):
        s += f"+-{r['test_std']:.2f}"
    if r["task"] not in AVERAGES and r["n_seeds"] > 1:
        s += f"[{int(r['n_seeds'])}]"
    if pd.notna(r["diff"]):
        s += f" ({r['diff']:+.2f})"
    elif str(r["note"]).startswith("FAIL"):
        s += " FAIL"
    if pd.notna(r["n_failed"]) and r["n_failed"]:
        s += f" !{int(r['n_failed'])}"
    if pd.notna(r["n_stalled"]) and r["n_stalled"]:
        s += f" ~{int(r['n_stalled'])}"
    return s


def format_leaderboard(lb: pd.DataFrame) -> str:
    if lb.empty:
        return "(no runs)"
    tasks = list(wide(lb).columns)
    labels = {(e, m): m if e == "lra" else f"{m} [{e}]" for e, m in zip(lb["experiment"], lb["model"], strict=True)}
    width = max(12, max(map(len, labels.values())) + 2)
    lines = ["test accuracy %: mean +- std over seeds [n seeds] (diff vs LRA Table 1, or for a recipe vs its paper); "
             "!n failed runs, ~n stalled",
             "model".ljust(width) + "".join(t.rjust(24) for t in tasks)]
    cells = lb.set_index(["experiment", "model", "task"])
    for key, label in labels.items():
        out = [format_cell(cells.loc[(*key, t)].to_dict() | {"task": t}) if (*key, t) in cells.index else "-"
               for t in tasks]
        lines.append(label.ljust(width) + "".join(c.rjust(24) for c in out))
    lines += [f"{name}: {note}" for name, note in AVG_NOTES.items() if name in tasks]
    final = sorted(set(lb.loc[lb["headline"] == "final", "task"])) if "headline" in lb else []
    lines += [f"{t}: final weights' accuracy (its validation split is the test set, as in LRA)" for t in final]
    if "retrieval" not in tasks:
        lines.append("retrieval: no runs (it needs the LRA release's AAN files: data.root=<lra_release>)")
    return "\n".join(lines)


def whole_lra_minutes(runs: pd.DataFrame, experiment: str | None = "lra") -> pd.DataFrame:
    """Per (experiment, model) with a run of each of ListOps, Text, Image and Pathfinder: the wall time of the
    lowest seed's selected run of each task (training with its evaluations, across resumes) and their sum, in
    minutes, with the devices they ran on."""
    picked = select_runs(runs, experiment)
    picked = picked[picked["best"] & picked["task"].isin(TASKS4)]
    if "wall_time_s" not in picked or picked.empty:
        return pd.DataFrame(columns=["experiment", "model", *TASKS4, "total", "devices"])
    picked = picked.sort_values("seed", kind="stable").drop_duplicates(["experiment", "model", "task"])
    rows = []
    for (experiment_name, model), g in picked.groupby(["experiment", "model"], sort=False):
        minutes = g.set_index("task")["wall_time_s"].astype(float).reindex(TASKS4) / 60
        if minutes.notna().all():
            devices = sorted({d for ds in g.get("device", pd.Series(dtype=str)).dropna().astype(str)
                              for d in ds.split(" + ")})
            rows.append(dict(experiment=experiment_name, model=model, **minutes.round(1).to_dict(),
                             total=round(float(minutes.sum()), 1), devices=", ".join(devices)))
    return pd.DataFrame(rows, columns=["experiment", "model", *TASKS4, "total", "devices"])


def pick_device(bench: pd.DataFrame, device: str | None = None) -> str:
    """``device`` if given, else the card whose ok rows cover the most models (on a tie, the one with the latest
    row): a chart draws one card's rows, and a few rows from another card (a rerun on whichever machine came)
    must not take the chart over from the card that timed every model."""
    if device is not None:
        return device
    rows = bench.sort_values("timestamp", kind="stable") if "timestamp" in bench else bench
    ok = rows[rows["status"].astype(str) == "ok"] if "status" in rows else rows
    ok = rows if ok.empty else ok
    cards = ok["device"].astype(str)
    models = ok.groupby(cards)["model"].nunique()
    latest = {card: i for i, card in enumerate(cards)}  # each card's latest row: its position, oldest first
    return max(models.index, key=lambda card: (models[card], latest[card]))


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(prog="python -m lra.leaderboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=DEFAULT_RESULTS,
                    help="results folder: reads runs.csv, writes leaderboard.csv (the project's: results)")
    ap.add_argument("--runs", default=None, help="runs file (default: RESULTS/runs.csv)")
    ap.add_argument("--out", default=None, help="leaderboard file (default: RESULTS/leaderboard.csv)")
    ap.add_argument("--published", default=str(Path(__file__).resolve().parents[2] / "results" / "published.csv"))
    ap.add_argument("--experiment", default="lra", help="comma-separated experiment names, or 'all'")
    args = ap.parse_args(argv)
    runs_path = Path(args.runs or Path(args.results) / "runs.csv")
    out = Path(args.out or Path(args.results) / "leaderboard.csv")
    if not runs_path.exists():
        raise SystemExit(f"no runs at {runs_path}: train with `python -m lra` first (or --results results for the "
                         f"project's published runs)")
    published = pd.read_csv(args.published) if Path(args.published).exists() else None
    lb = build_leaderboard(pd.read_csv(runs_path), published, args.experiment)
    out.parent.mkdir(parents=True, exist_ok=True)
    lb.to_csv(out, index=False, float_format="%.4f")
    print(format_leaderboard(lb))
    minutes = whole_lra_minutes(pd.read_csv(runs_path), args.experiment)
    if not minutes.empty:
        print("\nWall time of a whole LRA (the four tasks run here), minutes:")
        print(minutes.to_string(index=False))
    print(f"written to {out}")
    return lb


if __name__ == "__main__":
    main()
