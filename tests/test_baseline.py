"""The stall baseline: each classifier on small data whose labels it can or cannot see, the table of measured
baselines, and the leaderboard's use of it on the committed runs."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from lra.data import Split, TaskData
from lra.report import baseline, leaderboard

ROOT = Path(__file__).resolve().parent.parent


def task(tokens_of, n_classes: int, vocab: int = 17, length: int = 40, grid=None, n=(600, 200)) -> TaskData:
    """Random examples, labelled by ``tokens_of`` (tokens -> labels)."""
    g = torch.Generator().manual_seed(0)
    splits = []
    for size in (*n, n[1]):
        tokens = torch.randint(1, vocab, (size, length), generator=g)
        tokens[:, length // 2 :] *= torch.rand(size, 1, generator=g) < 0.5  # half the rows padded at their end
        splits.append(Split(tokens, tokens_of(tokens)))
    return TaskData(*splits, vocab_size=vocab, n_classes=n_classes, seq_len=length, grid=grid, info={"task": "t"})


def test_a_label_set_by_the_first_token_is_the_first_token_baseline():
    row = baseline.measure(task(lambda t: t[:, 0] % 4, 4))
    assert row.how == "first token" and row.val_first_token == row.val_baseline == 1.0
    assert row.val_bag_of_tokens < 0.6 and row.val_majority < 0.4


def test_a_label_set_by_token_counts_is_the_bag_of_tokens_baseline():
    row = baseline.measure(task(lambda t: ((t == 3).sum(1) > (t == 4).sum(1)).long(), 2))
    assert row.how == "bag of tokens" and row.val_bag_of_tokens > 0.9 and row.val_first_token < 0.7


def test_pixels_are_a_binned_histogram_and_an_unlearnable_label_leaves_the_majority():
    bright = task(lambda t: (t.float().mean(1) > 64).long(), 2, vocab=257, length=64, grid=(8, 8))
    assert baseline.bag_of_tokens(bright.train.tokens, 257, image=True).shape == (600, baseline.PIXEL_BINS + 1)
    assert baseline.measure(bright).val_bag_of_tokens > 0.9
    noise = torch.Generator().manual_seed(1)
    constant = task(lambda t: (torch.rand(len(t), generator=noise) < 0.1).long(), 2)  # no token tells the label
    row = baseline.measure(constant)
    assert row.how == "majority class" and row.val_baseline == row.val_majority > 0.8


def test_the_table_keeps_one_row_per_task(tmp_path):
    path = tmp_path / "baselines.csv"
    first = baseline.measure(task(lambda t: t[:, 0] % 4, 4))
    baseline.write_baseline(path, first)
    baseline.write_baseline(path, baseline.Baseline(**{**first.__dict__, "task": "other"}))
    baseline.write_baseline(path, baseline.Baseline(**{**first.__dict__, "val_baseline": 0.5}))  # measured again
    table = pd.read_csv(path)
    assert list(table.columns) == baseline.BASELINE_COLUMNS and list(table.task) == ["other", "t"]
    assert table.set_index("task").loc["t", "val_baseline"] == 0.5


def test_the_committed_listops_plateaus_are_stalled_and_the_runs_that_learned_are_not():
    """The runs that end at 24.30 validation (the transformer's seed 2, the performer's seeds 0 and 2) are below the
    first-token baseline, which the committed table applies to rows older than the column."""
    runs = pd.read_csv(ROOT / "results" / "runs.csv")
    table = leaderboard.read_baselines(ROOT / "results" / "baselines.csv")
    picked = leaderboard.select_runs(runs, baselines=table)
    listops = picked[picked["best"] & (picked["task"] == "listops")].set_index(["model", "seed"])
    assert listops.loc[("transformer", 2), "stalled"] and listops.loc[("performer", 0), "stalled"]
    assert listops.loc[("performer", 2), "stalled"] and not listops.loc[("performer", 1), "stalled"]
    assert not listops.loc[listops["val_acc"] > 37.0, "stalled"].any()
    assert table.loc["listops", "how"] == "first token"
    lb = leaderboard.build_leaderboard(runs, baselines=table)
    cells = lb.set_index(["model", "task"])
    assert cells.loc[("transformer", "listops"), "n_stalled"] == 2  # seed 0's 32.4 plateau too
    assert cells.loc[("performer", "listops"), "n_stalled"] == 2


@pytest.mark.parametrize("own", [None, 0.2])
def test_a_rows_own_baseline_wins_over_the_table(own):
    runs = pd.DataFrame([dict(task="listops", model="m", seed=0, experiment="lra", status="ok", val_acc=0.243,
                              test_acc=0.2315, final_test_acc=0.2315, val_majority=0.183, val_baseline=own)])
    table = pd.DataFrame([dict(task="listops", val_majority=0.183, val_baseline=0.354)]).set_index("task")
    picked = leaderboard.select_runs(runs, baselines=table)
    assert picked["stall_baseline"].iloc[0] == pytest.approx(35.4 if own is None else 20.0)
    assert bool(picked["stalled"].iloc[0]) is (own is None)
