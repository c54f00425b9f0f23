"""The model x task leaderboard, derived from ``runs.csv`` and set beside the published LRA Table 1.

Tay et al. 2021, "Long Range Arena: A Benchmark for Efficient Transformers" (https://arxiv.org/abs/2011.04006),
Table 1. Rules:

* runs of the chosen experiments only (default ``lra``: LRA's protocol; smoke runs never count); other
  experiments (recipes, variants) are separate rows, labelled by their ``experiment``; so are self-pretrained runs
  (``<experiment>+pretrain_mlm``, ``+pretrain_causal``) and runs on Pathfinder images of an older generator version
  (``<experiment>+superseded_data``);
* only ``status == ok`` rows carry a result; ``diverged``, ``oom`` and ``error`` runs are counted (``n_failed``)
  while their seed has no ok run, and never averaged; a run ended early by ``schedule.stop_at`` or
  ``trainer.time_limit`` (``stopped: at step N of M``, a recipe longer than the device time it got) is named in the
  note with its accuracy so far, while its seed has no ok run, and never averaged either;
* per (experiment, model, task, seed) the ok run with the best validation accuracy (a re-run of the same seed
  replaces, never averages with, the earlier one); it is *stalled* when its best validation accuracy is within
  1 point of its *stall baseline*, the higher of the validation split's majority-class share (``val_majority``)
  and ``val_baseline``, what classifiers that cannot use the task's long-range structure score (``lra.baseline``;
  rows older than the column take their task's from ``baselines.csv``): it still counts, and
  ``n_stalled`` says so; it *collapsed* when it learned (not stalled) but its final weights' validation accuracy is
  back within that point: its best-validation checkpoint still counts, and the note says so (the final weights'
  test is beside it);
* per (experiment, model, task) the mean and sample std over seeds of the best-validation checkpoint's test
  accuracy (``test_acc``) and of the final weights' (``final_test_acc``, LRA's own protocol), and ``n_seeds``;
  beside the seeds' spread, the same command's: ``rerun_std`` pools the spread of runs repeating one seed and config
  on one kind of card outside deterministic mode, over ``n_reruns`` such repeats (``rerun_spread``);
* where the validation split is the test set (a row's ``val_is_test``: Text, whose IMDb has no validation set, as
  in LRA), choosing by validation would choose on test: the latest ok run of each seed counts, and the headline
  ``test_acc`` is the final weights' (``headline = final``; elsewhere ``best_val``);
* averages, when every task they need is present: ``avg4`` = ListOps, Text, Image, Pathfinder (LRA's five without
  Retrieval, whose AAN files a user may not have); ``avg5`` = the paper's LRA score (Path-X excluded); ``avg6`` =
  six tasks with Path-X counted as 50 when it failed (50 +- 1 %) or is missing (S4's Table 10 convention);
* ranks with confidence per task and on ``avg4`` / ``avg5`` within each experiment (``lra.rank``: a bootstrap over
  seeds and test examples; ``rank``, ``rank_lo``-``rank_hi``, ``best_group``; ``test_lo``-``test_hi`` the value's
  interval);
* ``published`` = the LRA Table 1 cell and ``diff`` = ours - published; a recipe's rows (an experiment in
  ``RECIPE_PAPERS``) are set beside the paper the recipe comes from instead (S4D's recipe: S4D-LegS's numbers).

Accuracies are percentages; a runs file holding fractions (every accuracy <= 1) is scaled by 100.

    python -m lra.leaderboard [--results DIR] [--runs DIR/runs.csv] [--out DIR/leaderboard.csv]
                              [--published FILE] [--baselines FILE]   (default: the package's copies)
                              [--experiment lra] [--readme README.md results/README.md]
"""
from __future__ import annotations

import argparse
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from lra.errors import DataError
from lra.provenance import PARTIAL_PRESETS, departures, is_stopped
from lra.report import rank

TASKS4 = ["listops", "text", "image", "pathfinder"]
TASKS5 = ["listops", "text", "retrieval", "image", "pathfinder"]
TASKS6 = TASKS5 + ["pathx"]
AVERAGES = {"avg4": TASKS4, "avg5": TASKS5, "avg6": TASKS5}
PATHX_CHANCE, PATHX_FAIL_BAND = 50.0, 1.0
SUPERSEDED = "+superseded_data"  # the experiment suffix of rows on older Pathfinder images (``superseded_data``)
STALL_BAND = 1.0  # points above the stall baseline within which a run counts as stalled
# LRA Table 1 (and the other papers' numbers) and the tasks' stall baselines ship inside the package, so that an
# installed copy sets its rows beside them: in the tree, links to results/published.csv and results/baselines.csv
# (one file each), which a wheel copies
PUBLISHED = Path(__file__).resolve().parent / "published.csv"
BASELINES = Path(__file__).resolve().parent / "baselines.csv"
# test split sizes of LRA's tasks, whose whole test splits the runs evaluate (baselines.csv counts them in our data):
# the rank bootstrap's test-set noise
TEST_SIZES = {"listops": 2000, "text": 25000, "retrieval": 17437, "image": 10000, "pathfinder": 20000,
              "pathx": 20000}
RANKED_AVERAGES = ("avg4", "avg5")  # plain means of their tasks; avg6's Path-X = 50 convention is not a measurement
PUBLISHED_SOURCE = "lra_table1"
# a recipe's rows are compared with the paper it reproduces: experiment -> (published.csv source, our model name ->
# the model name in that source's rows)
RECIPE_PAPERS = {"s4d_lra": ("s4d_2022", {"s4d": "s4d_legs"})}
DEFAULT_RESULTS = os.environ.get("LRA_RESULTS_DIR", "outputs/results")
LEADERBOARD_COLUMNS = ["experiment", "model", "task", "test_acc", "test_std", "n_seeds", "rerun_std", "n_reruns",
                       "n_failed", "n_stalled",
                       "stall_baseline", "val_acc", "final_test_acc", "final_test_std", "headline", "published", "diff",
                       "pretrain_gain", *rank.RANK_COLUMNS, "note"]
PRIOR_COLUMNS = ["val_majority", "val_baseline"]  # what a run that learned nothing scores
ACC_COLUMNS = ["val_acc", "test_acc", "final_val_acc", "final_test_acc", *PRIOR_COLUMNS]
AVG_NOTES = {"avg4": "4-task mean (ListOps, Text, Image, Pathfinder): LRA's five without Retrieval",
             "avg5": "5-task mean, Path-X excluded (LRA's score)",
             "avg6": "6-task mean, failed/missing Path-X = 50 (S4 convention)"}


def as_percent(runs: pd.DataFrame) -> pd.DataFrame:
    runs = runs.copy()
    cols = [c for c in ACC_COLUMNS if c in runs]
    for c in cols:
        runs[c] = pd.to_numeric(runs[c], errors="coerce")
    values = runs[[c for c in cols if c not in PRIOR_COLUMNS]].stack()
    if len(values) and values.max() <= 1.0:  # fractions: no real run scores <= 1 % everywhere
        runs[cols] = runs[cols] * 100
    else:
        for c in [c for c in PRIOR_COLUMNS if c in runs and runs[c].max() <= 1.0]:
            runs[c] = runs[c] * 100
    return runs


def read_reference(path: str | Path, what: str) -> pd.DataFrame:
    """A CSV the reports read beside the results (``what`` it holds, for the message): a DataError saying where it
    looked when it is not there."""
    if not Path(path).is_file():
        shipped = Path(path) in (PUBLISHED, BASELINES)
        raise DataError(f"no {what} at {path}: " + ("reinstall lra, whose package ships it" if shipped else
                                                      "name an existing file"))
    return pd.read_csv(path)


def read_baselines(path: str | Path | None = BASELINES) -> pd.DataFrame | None:
    """``lra.baseline``'s table (one row per task, accuracies as fractions), indexed by task; None for no path."""
    return None if path is None else read_reference(path, "stall baselines (lra.baseline)").set_index("task")


def stall_baselines(runs: pd.DataFrame, baselines: pd.DataFrame | None = None) -> pd.Series:
    """Each row's stall baseline (%): the higher of its ``val_majority`` and ``val_baseline``, each taken from its
    task's row of ``baselines`` (``read_baselines``) where the run's row has none (rows older than the column)."""
    prior = pd.DataFrame(index=runs.index)
    for c in PRIOR_COLUMNS:
        own = pd.to_numeric(runs[c], errors="coerce") if c in runs else pd.Series(float("nan"), index=runs.index)
        if baselines is not None and c in baselines:
            own = own.fillna(runs["task"].map(100 * pd.to_numeric(baselines[c], errors="coerce")))
        prior[c] = own
    return prior.max(axis=1)  # NaN only where neither is known: never flagged


def normalise(runs: pd.DataFrame) -> pd.DataFrame:
    """Percentages; ``status`` and ``experiment`` present (a row without a status is read as ok). A self-pretrained
    run (its ``pretrain``: mlm or causal) reads ``<preset>+pretrain_<objective>``, beside the preset's runs from
    scratch. A run with length-grouped batches did not follow its preset's protocol: its experiment reads
    ``<preset>+length_grouped``,
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
    if "pretrain" in runs:  # self-pretrained first (pretrain=mlm|causal): another protocol than from scratch
        objective = runs["pretrain"].fillna("").astype(str)
        pretrained = objective != ""
        runs.loc[pretrained, "experiment"] = runs.loc[pretrained, "experiment"] + "+pretrain_" + objective[pretrained]
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


def select_runs(runs: pd.DataFrame, experiment: str | None = "lra",
                baselines: pd.DataFrame | None = None) -> pd.DataFrame:
    """All rows of the chosen experiments, with ``best`` marking one ok row per (experiment, model, task, seed):
    the best by validation accuracy (the latest on a tie; the latest where validation is the test set), their
    ``stall_baseline`` (``stall_baselines``) and ``stalled`` on those that stalled."""
    return select_normalised(normalise(runs), experiment, baselines)


def select_normalised(runs: pd.DataFrame, experiment: str | None = "lra",
                      baselines: pd.DataFrame | None = None) -> pd.DataFrame:
    """``select_runs`` on rows ``normalise`` has read already."""
    if experiment not in (None, "", "all"):
        runs = runs[runs["experiment"].isin(experiment.split(","))]
    ok = runs[(runs["status"] == "ok") & runs["test_acc"].notna()]
    ok = ok.assign(_by=ok["val_acc"].where(~ok["val_is_test"]))  # no choice by validation where it is the test set
    order = ["_by"] + (["timestamp"] if "timestamp" in ok else [])
    best = ok.sort_values(order, na_position="first", kind="stable")
    best = best.drop_duplicates(["experiment", "model", "task", "seed"], keep="last")
    runs = runs.assign(best=runs.index.isin(best.index), stall_baseline=stall_baselines(runs, baselines))
    unknown = pd.Series(float("nan"), index=runs.index)
    at_baseline = runs["stall_baseline"] + STALL_BAND  # within the band: no better than what needs no structure
    stalled = runs["best"] & (runs["val_acc"] <= at_baseline)
    return runs.assign(stalled=stalled,
                       collapsed=runs["best"] & ~stalled & (runs.get("final_val_acc", unknown) <= at_baseline))


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


def rerun_spread(g: pd.DataFrame) -> tuple[float | None, int]:
    """The default mode's run-to-run spread in one cell: the pooled sample std of the headline accuracy over runs
    that repeat one seed with one config (``config_hash``) on one kind of card, outside deterministic mode
    (``trainer.deterministic``, where repeats agree by construction); and how many (seed, config, card) were run
    more than once. ``None, 0`` where nothing was repeated. Beside ``test_std`` it says how much of the seeds'
    spread the same command alone would give."""
    ok = g[(g["status"] == "ok") & g["test_acc"].notna()]
    if "deterministic" in ok:
        ok = ok[~as_bool(ok["deterministic"]).fillna(False).astype(bool)]
    keys = [c for c in ("seed", "config_hash", "device") if c in ok]
    if "config_hash" not in keys:
        return None, 0
    groups = [v for _, v in ok.assign(value=headline(ok)).groupby(keys, dropna=False)["value"] if len(v) > 1]
    if not groups:
        return None, 0
    squares = sum(((v - v.mean()) ** 2).sum() for v in groups)
    dof = sum(len(v) - 1 for v in groups)
    return float(np.sqrt(squares / dof)), len(groups)


def _cell(experiment, model, task, g: pd.DataFrame) -> dict:
    best = g[g["best"]]
    n = len(best)
    # a failed run counts while its seed has no ok run (a seed rerun to ok after an oom or a fixed error is a result)
    open_seed, ended_early = ~g["seed"].isin(best["seed"]), g["status"].map(is_stopped)  # no ok run yet
    stopped = ended_early & open_seed  # schedule.stop_at, trainer.time_limit
    unresolved = (g["status"] != "ok") & ~ended_early & open_seed
    failed = int(unresolved.sum())
    rerun_std, n_reruns = rerun_spread(g)
    row = dict(experiment=experiment, model=model, task=task, n_seeds=n, rerun_std=rerun_std, n_reruns=n_reruns,
               n_failed=failed, n_stalled=int(best["stalled"].sum()), stall_baseline=best["stall_baseline"].max(),
               note="")
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
        test = "no test yet" if pd.isna(so_far) else f"test {so_far:.2f} so far"  # stopped in pretraining: none
        notes.append(f"seed {run['seed']} {where}, {test} (not averaged)")
    if failed:
        kinds = g.loc[unresolved, "status"].str.split(":").str[0].value_counts()
        notes.append("failed: " + ", ".join(f"{c} {k}" for k, c in kinds.items()))
    if row["n_stalled"]:
        notes.append(f"{row['n_stalled']} of {n} seeds stalled (best val within {STALL_BAND:g} point of the stall "
                     f"baseline {row['stall_baseline']:.2f})")
    if best["collapsed"].any():
        notes.append(f"{int(best['collapsed'].sum())} of {n} seeds collapsed (final val back within {STALL_BAND:g} "
                     f"point of the stall baseline; the best-val checkpoint counts)")
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


NOT_TAKEN = "not applicable: "  # the note of a cell whose task the model cannot take


def not_taken(cells: list[dict]) -> list[dict]:
    """A cell for each task of LRA's five that a model of ``cells`` cannot take (``lra.config.task_mismatch``: a
    2-D mixer on a 1-D task), its note saying why, so that the tables say so instead of leaving it blank. Models
    the registry does not know (a plugin no longer installed) get none."""
    from lra.config import task_mismatch  # the registries (torch): only where a leaderboard is built
    from models import list_models

    known, have = set(list_models()), {(c["experiment"], c["model"], c["task"]) for c in cells}
    out = []
    for experiment, model in dict.fromkeys((c["experiment"], c["model"]) for c in cells):
        for task in TASKS5 if model in known else ():
            why = (experiment, model, task) not in have and task_mismatch(model, task)
            if why:
                out.append(dict(experiment=experiment, model=model, task=task, n_seeds=0, n_reruns=0, n_failed=0,
                                n_stalled=0, note=NOT_TAKEN + why))
    return out


def build_leaderboard(runs: pd.DataFrame, published: pd.DataFrame | None = None,
                      experiment: str | None = "lra", baselines: pd.DataFrame | None = None) -> pd.DataFrame:
    """Long format: one row per (experiment, model, task) and per average; columns ``LEADERBOARD_COLUMNS``.
    ``baselines`` (``read_baselines``) gives rows without their own stall baseline their task's."""
    runs = normalise(runs)
    set_apart = superseded_counts(runs)
    runs = select_normalised(runs, experiment, baselines)
    rows = [_cell(e, m, t, g) for (e, m, t), g in runs.groupby(["experiment", "model", "task"], sort=False)]
    for row in rows:  # say where a cell's rows on older Pathfinder images went
        if n := set_apart.get((row["experiment"], row["model"], row["task"])):
            left_out = f"{n} run(s) on an older Pathfinder generator version left out ({row['experiment']}{SUPERSEDED})"
            row["note"] = "; ".join(x for x in (row["note"], left_out) if x)
    rows += not_taken(rows)
    cells = pd.DataFrame(rows, columns=LEADERBOARD_COLUMNS)
    lb = pd.DataFrame(rows + _averages(cells), columns=LEADERBOARD_COLUMNS)
    pub = {experiment: published_cells(published, experiment) for experiment in lb["experiment"].unique()}
    for i, r in lb.iterrows():
        value, note = pub[r["experiment"]].get((r["model"], r["task"]), (None, ""))
        lb.at[i, "published"] = value
        lb.at[i, "diff"] = None if value is None or pd.isna(r["test_acc"]) else r["test_acc"] - value
        if value is None and note.startswith("FAIL"):
            lb.at[i, "note"] = "; ".join(x for x in (r["note"], "LRA Table 1: FAIL") if x)
    lb["pretrain_gain"] = pretrain_gains(lb)
    lb = add_ranks(lb, runs[runs["best"]])
    for c in ["test_acc", "test_std", "rerun_std", "stall_baseline", "val_acc", "final_test_acc", "final_test_std",
              "published", "diff", "pretrain_gain", "test_lo", "test_hi", "p_best"]:
        lb[c] = pd.to_numeric(lb[c], errors="coerce")
    for c in ["n_seeds", "n_reruns", "n_failed", "n_stalled", "rank", "rank_lo", "rank_hi"]:
        lb[c] = pd.to_numeric(lb[c], errors="coerce").astype("Int64")
    lb["best_group"] = lb["best_group"].astype("boolean")
    return sort_leaderboard(lb)


PRETRAINED = re.compile(r"^(?P<scratch>.+)\+pretrain_(?:mlm|causal)$")  # a self-pretrained cell's experiment


def pretrain_gains(lb: pd.DataFrame) -> pd.Series:
    """What self-pretraining adds: for a cell of ``<preset>+pretrain_<objective>``, its test accuracy less that of
    the same model and task under ``<preset>`` from scratch (averages too); NaN for every other cell and where the
    leaderboard holds no such scratch cell (``--experiment`` must select both)."""
    scratch = lb.set_index(["experiment", "model", "task"])["test_acc"]
    scratch = scratch[~scratch.index.duplicated()]

    def gain(experiment: str, model: str, task: str, acc) -> float:
        match = PRETRAINED.match(str(experiment))
        base = scratch.get((match["scratch"], model, task)) if match else None
        return float("nan") if base is None or pd.isna(base) or pd.isna(acc) else float(acc) - float(base)

    return pd.Series([gain(*r) for r in zip(lb["experiment"], lb["model"], lb["task"], lb["test_acc"])],
                     index=lb.index, dtype=float)


def cell_replicates(best: pd.DataFrame) -> dict[tuple[str, str, str], np.ndarray]:
    """(experiment, model, task) -> ``lra.rank.replicates`` of its selected runs' (``best``) headline accuracies, for
    each task of known test size (``TEST_SIZES``)."""
    seeds = best.assign(value=headline(best)).groupby(["experiment", "model", "task"], sort=False)["value"].agg(list)
    return {key: rank.replicates(values, TEST_SIZES[key[2]], "/".join(map(str, key)))
            for key, values in seeds.items() if key[2] in TEST_SIZES}


def average_replicates(draws: dict, experiment: str, model: str, tasks: list[str]) -> np.ndarray | None:
    """The replicates of a model's mean over ``tasks``: the mean of its tasks' (``cell_replicates``); None unless it
    has every task."""
    parts = [draws.get((experiment, model, t)) for t in tasks]
    return None if any(p is None for p in parts) else np.mean(parts, axis=0)


def add_ranks(lb: pd.DataFrame, best: pd.DataFrame) -> pd.DataFrame:
    """``lra.rank``'s columns on each cell with a value and each ``RANKED_AVERAGES`` row, ranked among the models of
    its experiment with a value in that column; ``best`` = the selected runs behind the cells. A task of unknown
    test size (not in ``TEST_SIZES``) is not ranked."""
    draws = cell_replicates(best)
    for r in lb[lb["task"].isin(RANKED_AVERAGES)].itertuples():
        mean = average_replicates(draws, r.experiment, r.model, AVERAGES[r.task])
        if mean is not None:
            draws[(r.experiment, r.model, r.task)] = mean
    lb = lb.astype({c: object for c in rank.RANK_COLUMNS})  # floats, ints and a bool: typed by the caller
    drawn = pd.Series([k in draws for k in zip(lb["experiment"], lb["model"], lb["task"], strict=True)], index=lb.index)
    ranked = pd.to_numeric(lb["test_acc"], errors="coerce").notna() & drawn
    for (experiment, task), g in lb[ranked].groupby(["experiment", "task"], sort=False):
        table = rank.rank_table(g.set_index("model")["test_acc"].astype(float),
                                {m: draws[(experiment, m, task)] for m in g["model"]})
        lb.loc[g.index, rank.RANK_COLUMNS] = table.loc[g["model"], rank.RANK_COLUMNS].to_numpy()
        one_seed = g.index[pd.to_numeric(g["n_seeds"], errors="coerce") == 1]
        noise = ("one seed: its interval is test-set noise only" if task not in AVERAGES else
                 "a task with one seed varies by test-set noise only")
        lb.loc[one_seed, "note"] = ["; ".join(x for x in (note, noise) if x) for note in lb.loc[one_seed, "note"]]
    return lb


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
    """A console cell: its fields apart, so that a count never runs into a number (``36.00 +-2.00 [3] (-0.37) ~1``)."""
    if pd.isna(r["test_acc"]):
        return "n/a" if str(r["note"]).startswith(NOT_TAKEN) else f"failed x{int(r['n_failed'])}" if r["n_failed"] \
            else "-"
    fields = [f"{r['test_acc']:.2f}"]
    if pd.notna(r["test_std"]):
        fields.append(f"+-{r['test_std']:.2f}")
    if r["task"] not in AVERAGES and r["n_seeds"] > 1:
        fields.append(f"[{int(r['n_seeds'])}]")
    if pd.notna(r["diff"]):
        fields.append(f"({r['diff']:+.2f})")
    elif pd.notna(r.get("pretrain_gain")):
        fields.append(f"({r['pretrain_gain']:+.2f} vs scratch)")
    elif str(r["note"]).startswith("FAIL"):
        fields.append("FAIL")
    if pd.notna(r["n_failed"]) and r["n_failed"]:
        fields.append(f"!{int(r['n_failed'])}")
    if pd.notna(r["n_stalled"]) and r["n_stalled"]:
        fields.append(f"~{int(r['n_stalled'])}")
    return " ".join(fields)


CELL_SEPARATOR = " | "  # between the console table's columns: a cell's last field and the next cell's first apart


def format_leaderboard(lb: pd.DataFrame) -> str:
    if lb.empty:
        return "(no runs)"
    tasks = list(wide(lb).columns)
    labels = {(e, m): m if e == "lra" else f"{m} [{e}]" for e, m in zip(lb["experiment"], lb["model"], strict=True)}
    width = max(12, max(map(len, labels.values())))
    cells = lb.set_index(["experiment", "model", "task"])
    texts = {key: format_cell(r.to_dict() | {"task": key[2]}) for key, r in cells.iterrows()}
    column = max(12, *map(len, texts.values()), *map(len, tasks))
    lines = ["test accuracy %: mean +-std over seeds [n seeds] (diff vs LRA Table 1, or for a recipe vs its paper, "
             "or for a self-pretrained run vs its preset from scratch); !n failed runs, ~n stalled",
             CELL_SEPARATOR.join(["model".ljust(width), *(t.rjust(column) for t in tasks)])]
    for key, label in labels.items():
        out = [texts.get((*key, t), "-") for t in tasks]
        lines.append(CELL_SEPARATOR.join([label.ljust(width), *(c.rjust(column) for c in out)]))
    lines += [f"{name}: {note}" for name, note in AVG_NOTES.items() if name in tasks]
    final = sorted(set(lb.loc[lb["headline"] == "final", "task"])) if "headline" in lb else []
    lines += [f"{t}: final weights' accuracy (its validation split is the test set, as in LRA)" for t in final]
    if "retrieval" not in tasks:
        lines.append("retrieval: no runs (it needs the LRA release's AAN files: data.root=<lra_release>)")
    return "\n".join(lines + format_ranks(lb, labels))


def format_ranks(lb: pd.DataFrame, labels: dict) -> list[str]:
    """One line per ranked column: its models, best first, as ``model rank [lo-hi]``, ``*`` on the best group."""
    if "rank" not in lb or lb["rank"].isna().all():
        return []
    lines = [f"ranks, 1 = best [{rank.LEVEL[0]:g}-{rank.LEVEL[1]:g} percentiles over a bootstrap of seeds and test "
             f"examples]; * = best group (p(first) >= {rank.BEST_P:.1%})"]
    ranked = lb.dropna(subset=["rank"])
    for (experiment, task), g in ranked.groupby(["experiment", "task"], sort=False):
        g = g.sort_values(["rank", "model"], kind="stable")
        entries = [f"{labels[(experiment, r.model)]} {r.rank} [{r.rank_lo}-{r.rank_hi}]"
                   + ("*" if in_best_group(r.best_group) else "") for r in g.itertuples()]
        lines.append(f"{task}: " + ", ".join(entries))
    return lines


README_BEGIN = ("<!-- results: generated by python -m lra.leaderboard --results results --readme README.md "
                "results/README.md -->")
README_END = "<!-- /results -->"
BENCH_BEGIN = ("<!-- bench: generated by python -m lra.leaderboard --results results --readme README.md "
               "results/README.md -->")
BENCH_END = "<!-- /bench -->"
# the bench table's columns: (sequence length, batch); LRA Table 2's lengths at its batch, then 4K and 16K at 8
BENCH_SHAPES = ((1024, 32), (2048, 32), (3072, 32), (4096, 32), (4096, 8), (16384, 8))


def in_best_group(flag) -> bool:
    """A ``best_group`` cell as read back from the CSV: True, False or blank (not ranked)."""
    return bool(pd.notna(flag) and flag)


def _readme_cell(r) -> str:
    """One task of one model in the README's table: mean +- std, seeds and stalled ones; bold in the best group."""
    if pd.isna(r.test_acc):
        if str(r.note).startswith(NOT_TAKEN):
            return "n/a (2-D mixer)"
        return f"failed x{int(r.n_failed)}" if pd.notna(r.n_failed) and r.n_failed else "-"
    value = f"{r.test_acc:.2f}" + (f" ± {r.test_std:.2f}" if pd.notna(r.test_std) else "")
    value = f"**{value}**" if in_best_group(r.best_group) else value
    seeds = f"{int(r.n_seeds)} seed{'s' if r.n_seeds > 1 else ''}"
    stalled = f", {int(r.n_stalled)} stalled" if pd.notna(r.n_stalled) and r.n_stalled else ""
    return f"{value} ({seeds}{stalled})"


def readme_table(lb: pd.DataFrame, experiment: str = "lra") -> str:
    """The README's results block: every model of ``experiment`` on the four tasks, its 4-task average with its
    interval and its rank with its interval, LRA Table 1's average beside; then what the marks mean."""
    lb = lb[lb["experiment"] == experiment]
    cells = lb.set_index(["model", "task"])
    head = ["model", "ListOps", "Text", "Image", "Pathfinder", "4-task average (95% interval)",
            "rank (95% interval)", "LRA Table 1 average"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in dict.fromkeys(lb["model"]):
        row = [_readme_cell(cells.loc[(model, t)]) if (model, t) in cells.index else "-" for t in TASKS4]
        avg = cells.loc[(model, "avg4")] if (model, "avg4") in cells.index else None
        if avg is None or pd.isna(avg.test_acc):
            row += ["-", "-", "-"]
        else:
            best = in_best_group(avg.best_group)
            row += [f"{avg.test_acc:.2f} ({avg.test_lo:.2f}-{avg.test_hi:.2f})",
                    ("**{}**" if best else "{}").format(f"{avg['rank']:.0f} ({avg.rank_lo:.0f}-{avg.rank_hi:.0f})"),
                    "-" if pd.isna(avg.published) else f"{avg.published:.2f}"]
        lines.append(f"| `{model}` | " + " | ".join(row) + " |")
    stall = lb[lb["task"].isin(TASKS4)].groupby("task")["stall_baseline"].max().reindex(TASKS4)
    baselines = ", ".join(f"{t} {v:.2f}" for t, v in stall.items() if pd.notna(v))
    notes = [
        "Test accuracy %, mean ± std over seeds, of the best-validation checkpoint (Text: of the final weights, its "
        "validation split being the test set, as in LRA); experiment `lra`. The average and its rank cover the models "
        "with all four tasks.",
        f"Intervals and **bold** (the best group of each column: models that rank first in at least "
        f"{rank.BEST_P:.1%} of the replicates) come from a bootstrap over seeds and test examples (`lra.rank`); a "
        f"cell of one seed varies by test-set noise alone, so its interval is narrower than another seed would show.",
        f"Stalled: best validation within {STALL_BAND:g} point of the task's stall baseline, what classifiers that "
        f"cannot use its long-range structure score on validation (`lra.baseline`, `results/baselines.csv`: "
        f"{baselines}); stalled runs count in the means.",
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes)


BENCH_NUMBERS = ("seq_len", "batch_size", "steps_per_s", "examples_per_s", "ms_per_step", "peak_mem_mb", "rel_speed",
                 "rel_mem")
# A card scales every model's speed by much the same factor, so a model's speed relative to the transformer of its
# own card and shape (``rel_speed``) is the code's: two rows of one model, shape and protocol on two cards whose
# relative speeds differ by more than this factor did not time the same thing (the model's code changed between
# them, or a call was disturbed), and the later one stands.
CONTRADICTS = 3.0


def bench_numbers(bench: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``bench`` with its lengths, batches and measurements (``BENCH_NUMBERS``) as numbers, NaN where a
    cell holds none."""
    bench = bench.copy()
    for column in BENCH_NUMBERS:
        if column in bench:
            bench[column] = pd.to_numeric(bench[column], errors="coerce")
    return bench


def contradicted_bench_rows(rows: pd.DataFrame) -> pd.Series:
    """Whether each of ``rows`` (ok bench rows) is contradicted by a later one: a row of the same model, length,
    batch and protocol (``BENCH_PROTOCOL``) on another card whose ``rel_speed`` is more than ``CONTRADICTS`` times
    this row's, or less than its 1 / ``CONTRADICTS``. Rows without a timestamp or ``rel_speed`` are never."""
    from lra.report.results import BENCH_PROTOCOL, as_text  # results brings torch: only where bench rows are read

    if rows.empty or not {"timestamp", "rel_speed"} <= set(rows):
        return pd.Series(False, index=rows.index)
    frame = pd.DataFrame({"key": as_text(rows, ("model", "seq_len", "batch_size", *BENCH_PROTOCOL)).agg(
                              "|".join, axis=1),
                          "device": rows["device"].astype(str), "when": rows["timestamp"].astype(str),
                          "rel": pd.to_numeric(rows["rel_speed"], errors="coerce")}, index=rows.index)
    frame = frame[frame["rel"] > 0].rename_axis("row").reset_index()
    pairs = frame.merge(frame, on="key", suffixes=("", "_later"))
    apart = np.abs(np.log(pairs["rel"] / pairs["rel_later"])) > np.log(CONTRADICTS)
    hit = pairs[(pairs["device"] != pairs["device_later"]) & (pairs["when_later"] > pairs["when"]) & apart]
    return pd.Series(rows.index.isin(hit["row"]), index=rows.index)


def latest_bench_rows(bench: pd.DataFrame) -> pd.DataFrame:
    """The bench rows every table and chart reads: each model's latest ok row per card, shape (``seq_len``,
    ``batch_size``) and protocol (``BENCH_PROTOCOL``), oldest first. A later ok row of the same supersedes an earlier
    one, which stays in the append-only file but is neither tabled nor drawn; so does a later row on another card
    that contradicts it (``contradicted_bench_rows``). A later failed row does not (the last measurement stands, and
    the failure is reported apart). Lengths, batches and measurements as numbers."""
    from lra.report.results import BENCH_PROTOCOL, as_text  # as in contradicted_bench_rows

    rows = bench_numbers(bench)
    rows = rows[rows["status"].astype(str) == "ok"]
    if "timestamp" in rows:
        rows = rows.sort_values("timestamp", kind="stable")
    rows = rows[~contradicted_bench_rows(rows)]
    keys = as_text(rows, ("device", "model", "seq_len", "batch_size", *BENCH_PROTOCOL))
    return rows[~keys.duplicated(keep="last")]


def on_cpu(devices: pd.Series) -> pd.Series:
    """Whether each bench row's ``device`` is the CPU (``lra.report.results.device_name``: ``cpu (...)``)."""
    return devices.astype(str).str.lower().str.startswith("cpu")


def headline_bench_rows(bench: pd.DataFrame) -> pd.DataFrame:
    """``latest_bench_rows`` under the bench's own protocol, the one its tables and length charts show: its defaults
    (``BenchSettings``), i.e. compiled on a GPU and eager on the CPU (``bench.compile=auto``), in torch.compile's
    default mode, attention dropout 0 (``bench.attn_dropout``), registry models only (a variant's ``model`` names
    its options, ``bigbird(block=64)``)."""
    rows = latest_bench_rows(bench)
    compiled = rows["compiled"].astype(str).str.lower().eq("true")
    keep = ((compiled != on_cpu(rows["device"])) & rows["backbone"].astype(str).str.endswith("/0.0")
            & ~rows["model"].astype(str).str.contains("(", regex=False))
    if "compile_mode" in rows:
        keep &= rows["compile_mode"].isna() | rows["compile_mode"].astype(str).eq("")
    return rows[keep]


def bench_table(bench: pd.DataFrame, device: str | None = None) -> str:
    """The bench's headline: steps/s (and speed relative to the transformer's row of that shape) of every model's
    latest row under the bench's own protocol (``headline_bench_rows``: compiled, unvaried, attention dropout 0) at
    ``BENCH_SHAPES`` on one card (``pick_device``), then peak GB at 4K (batch 32, else 8) and at 16K."""
    rows = headline_bench_rows(bench)  # the length charts read the same rows (lra.report.plot)
    card = pick_device(rows, device)
    rows = rows[rows["device"] == card]
    latest = rows.drop_duplicates(["model", "seq_len", "batch_size"], keep="last").set_index(
        ["model", "seq_len", "batch_size"])
    names = [f"{n // 1024}K" + ("" if b == 32 else f" (batch {b})") for n, b in BENCH_SHAPES]
    head = ["model", *names, "GB 4K", "GB 16K"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(model, n, b):
        if (model, n, b) not in latest.index:
            return "–"
        r = latest.loc[(model, n, b)]
        rel = f" ({r.rel_speed:.2f}x)" if pd.notna(r.rel_speed) else ""
        return f"{r.steps_per_s:.1f}{rel}"

    def gb(model, shapes):
        for key in shapes:
            if (model, *key) in latest.index:
                return f"{latest.loc[(model, *key)].peak_mem_mb / 1000:.2f}"
        return "–"

    order = latest.reset_index()
    order["at4k"] = order["steps_per_s"].where((order["seq_len"] == 4096) & (order["batch_size"] == 32))
    order["at16k"] = order["steps_per_s"].where(order["seq_len"] == 16384)
    ranked = order.groupby("model")[["at4k", "at16k"]].max().sort_values(["at4k", "at16k"], ascending=False)
    for model in ranked.index:
        lines.append(f"| {model} | " + " | ".join([*(cell(model, n, b) for n, b in BENCH_SHAPES),
                                                  gb(model, [(4096, 32), (4096, 8)]), gb(model, [(16384, 8)])]) + " |")
    precision = ", ".join(sorted(rows["precision"].astype(str).unique())) if "precision" in rows else ""
    compiled = "eager" if on_cpu(pd.Series([card])).all() else "compiled"
    note = (f"Training steps/s of the LRA Table 2 protocol (`bench.csv`: the byte-level Text backbone, {precision}, "
            f"{compiled}, attention dropout 0) on the {card}, each model's latest row; in brackets, relative to the "
            f"transformer's row of that shape; peak memory in GB. `python -m lra.bench` measures them.")
    return "\n".join(lines) + "\n\n" + note


def replace_block(text: str, begin: str, end: str, body: str) -> str:
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def update_readme(path: Path, lb: pd.DataFrame, bench: pd.DataFrame | None = None) -> bool:
    """Replace the blocks between the results markers (``readme_table``) and, where the file has them and ``bench``
    is given, the bench markers (``bench_table``); returns whether the file changed."""
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise SystemExit(f"{path} has no results block ({README_BEGIN} ... {README_END})")
    new = replace_block(text, README_BEGIN, README_END, readme_table(lb))
    if bench is not None and BENCH_BEGIN in new and BENCH_END in new:
        new = replace_block(new, BENCH_BEGIN, BENCH_END, bench_table(bench))
    if new != text:
        path.write_text(new)
    return new != text


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
    ap.add_argument("--published", default=str(PUBLISHED), help="the papers' numbers (default: the package's "
                    "copy of results/published.csv)")
    ap.add_argument("--baselines", default=str(BASELINES),
                    help="stall baselines per task (python -m lra.baseline), for rows without their own (default: "
                         "the package's copy of results/baselines.csv)")
    ap.add_argument("--experiment", default="lra", help="comma-separated experiment names, or 'all'")
    ap.add_argument("--readme", type=Path, nargs="+", default=[], help="rewrite these files' results blocks, and "
                    "their bench blocks from RESULTS/bench.csv (the project's: README.md results/README.md)")
    args = ap.parse_args(argv)
    runs_path = Path(args.runs or Path(args.results) / "runs.csv")
    out = Path(args.out or Path(args.results) / "leaderboard.csv")
    if not runs_path.exists():
        raise DataError(f"no runs at {runs_path}: train with `python -m lra` first (or --results results for the "
                        f"project's published runs)")
    published = read_reference(args.published, "published results (LRA Table 1)")
    lb = build_leaderboard(pd.read_csv(runs_path), published, args.experiment, read_baselines(args.baselines))
    out.parent.mkdir(parents=True, exist_ok=True)
    lb.to_csv(out, index=False, float_format="%.4f")
    print(format_leaderboard(lb))
    minutes = whole_lra_minutes(pd.read_csv(runs_path), args.experiment)
    if not minutes.empty:
        print("\nWall time of a whole LRA (the four tasks run here), minutes:")
        print(minutes.to_string(index=False))
    print(f"written to {out}")
    bench_path = Path(args.results) / "bench.csv"
    bench = pd.read_csv(bench_path) if bench_path.exists() else None
    for readme in args.readme:
        print(f"{readme}: {'updated' if update_readme(readme, pd.read_csv(out), bench) else 'unchanged'}")
    return lb


if __name__ == "__main__":
    main()
