"""Ranks with confidence on constructed leaderboards whose answer is known: the bootstrap over seeds and test
examples (``lra.rank``) as the leaderboard applies it per task and on the 4-task average."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lra.report import leaderboard, rank
from lra.report.results import RUN_COLUMNS

ROOT = Path(__file__).resolve().parent.parent


def runs_of(cells: dict, task: str = "listops", experiment: str = "lra") -> list[dict]:
    """One ok row per (model, seed) of ``cells``: model -> test accuracy of each seed (%)."""
    return [dict(task=task, model=m, seed=s, experiment=experiment, status="ok", val_acc=v, test_acc=v,
                 final_test_acc=v, val_majority=10.0) for m, seeds in cells.items() for s, v in enumerate(seeds)]


def board(*rows: list[dict]) -> pd.DataFrame:
    runs = pd.DataFrame([r for rs in rows for r in rs]).reindex(columns=RUN_COLUMNS)
    lb = leaderboard.build_leaderboard(runs, experiment="all")
    return lb.set_index(["experiment", "model", "task"])


def test_models_far_apart_get_exact_ranks_and_a_single_best():
    lb = board(runs_of({"a": [60.0, 61.0, 60.5], "b": [40.0, 41.0, 40.5], "c": [20.0, 21.0, 20.5]}))
    got = lb.xs("listops", level="task").loc["lra"]
    assert list(got.loc[["a", "b", "c"], "rank"]) == [1, 2, 3]
    assert list(got["rank_lo"]) == list(got["rank"]) == list(got["rank_hi"])
    assert list(got.loc[["a", "b", "c"], "best_group"]) == [True, False, False] and got.at["a", "p_best"] == 1.0
    assert got.at["b", "test_lo"] < 40.5 < got.at["b", "test_hi"]


def test_models_with_identical_seeds_share_the_best_group_and_the_rank():
    lb = board(runs_of({"a": [38.0, 37.0, 39.0], "twin": [38.0, 37.0, 39.0], "c": [20.0, 21.0, 20.5]}))
    got = lb.xs("listops", level="task").loc["lra"]
    assert list(got.loc[["a", "twin"], "rank"]) == [1, 1] and got.loc[["a", "twin"], "best_group"].all()
    assert got.loc[["a", "twin"], "p_best"].between(0.3, 0.7).all()  # each first in about half the replicates
    assert list(got.loc[["a", "twin"], "rank_hi"]) == [2, 2]


def test_the_interval_carries_the_spread_over_seeds():
    """``wide`` has the higher mean but one seed near chance: a bootstrap of test examples alone (25,000 of them on
    Text) would put it first every time, with a narrow interval; over seeds it can fall behind ``steady``."""
    lb = board(runs_of({"steady": [60.0, 60.2, 59.8], "wide": [70.0, 70.0, 45.0]}, task="text"))
    got = lb.xs("text", level="task").loc["lra"]
    assert got.at["wide", "rank"] == 1 and (got.at["wide", "rank_lo"], got.at["wide", "rank_hi"]) == (1, 2)
    assert got.at["steady", "best_group"] and got.at["wide", "test_hi"] - got.at["wide", "test_lo"] > 10
    test_noise_only = rank.replicates([61.67], leaderboard.TEST_SIZES["text"], "x")
    assert np.percentile(test_noise_only, 97.5) - np.percentile(test_noise_only, 2.5) < 1.5


def test_one_seed_has_a_test_noise_interval_and_says_so():
    lb = board(runs_of({"one": [36.0], "three": [30.0, 31.0, 29.0]}))
    one = lb.loc[("lra", "one", "listops")]
    sd = 100 * np.sqrt(0.36 * 0.64 / leaderboard.TEST_SIZES["listops"])  # the binomial's
    assert one["test_hi"] - one["test_lo"] == pytest.approx(2 * 1.96 * sd, rel=0.1)
    assert "one seed: its interval is test-set noise only" in one["note"]
    assert "test-set noise" not in lb.loc[("lra", "three", "listops"), "note"]


def test_the_average_is_ranked_over_models_with_every_task_within_each_experiment():
    tasks = leaderboard.TASKS4
    rows = [runs_of({"a": [50.0 + i], "b": [40.0 + i], "c": [45.0 + i]}, task=t) for i, t in enumerate(tasks)]
    rows.append(runs_of({"a": [90.0], "b": [91.0]}, task="listops", experiment="recipe"))
    lb = board(*rows, runs_of({"partial": [99.0]}, task="listops"))
    avg = lb.xs("avg4", level="task").loc["lra"]
    assert list(avg.loc[["a", "c", "b"], "rank"]) == [1, 2, 3] and "partial" not in avg.index
    assert lb.loc[("lra", "partial", "listops"), "rank"] == 1  # ranked where it has a value
    recipe = lb.xs("listops", level="task").loc["recipe"]  # its own ranking, not among lra's models
    assert list(recipe.loc[["b", "a"], "rank"]) == [1, 2]
    assert lb.loc[("lra", "a", "avg4"), "test_lo"] < 51.5 < lb.loc[("lra", "a", "avg4"), "test_hi"]


def test_the_bootstrap_is_reproducible_and_a_cells_draws_ignore_the_other_models():
    few = board(runs_of({"a": [38.0, 37.0], "b": [36.0, 35.0]}))
    again = board(runs_of({"a": [38.0, 37.0], "b": [36.0, 35.0]}))
    more = board(runs_of({"a": [38.0, 37.0], "b": [36.0, 35.0], "c": [10.0]}))
    pd.testing.assert_frame_equal(few, again)
    assert few.loc[("lra", "a", "listops"), "test_lo"] == more.loc[("lra", "a", "listops"), "test_lo"]


@pytest.mark.parametrize("path", ["README.md", "results/README.md"])
def test_the_readmes_hold_the_generated_tables(path):
    """The committed tables are what the command prints from the committed CSVs: the results block from
    leaderboard.csv, and (results/README.md) the bench block from bench.csv."""
    text = (ROOT / path).read_text()
    command = "python -m lra.leaderboard --results results --readme README.md results/README.md"
    block = text.split(leaderboard.README_BEGIN, 1)[1].split(leaderboard.README_END, 1)[0].strip()
    assert block == leaderboard.readme_table(pd.read_csv(ROOT / "results" / "leaderboard.csv")), \
        f"{path}'s results table is stale: {command}"
    if path == "results/README.md":
        block = text.split(leaderboard.BENCH_BEGIN, 1)[1].split(leaderboard.BENCH_END, 1)[0].strip()
        assert block == leaderboard.bench_table(pd.read_csv(ROOT / "results" / "bench.csv")), \
            f"{path}'s bench table is stale: {command}"


def test_the_results_reference_stays_short():
    """results/README.md is a reference of files, columns and commands (explanations live in docs/)."""
    assert len((ROOT / "results" / "README.md").read_bytes()) <= 20_000
