"""Leaderboard aggregation (best-by-validation, seed averaging, both LRA averages, published diffs), the
published numbers file, and the comparison of two result sets."""
from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd
import pytest

from lra.provenance import departures
from lra.report import compare, leaderboard
from lra.report.results import RUN_COLUMNS

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ROOT / "results" / "published.csv"


def run(task, model, seed, val, test, experiment="lra", ts="2026-01-01T00:00:00Z", final=None, status="ok",
        majority=10.0):
    return dict(task=task, model=model, seed=seed, experiment=experiment, status=status, val_acc=val, test_acc=test,
                final_test_acc=test if final is None else final, timestamp=ts, val_majority=majority)


def hand_made_runs() -> pd.DataFrame:
    rows = [
        # transformer, ListOps: seed 0 ran twice (the better validation wins), 3 seeds -> 34, 38, 36
        run("listops", "transformer", 0, 30.0, 31.0, ts="2026-01-01T00:00:00Z"),
        run("listops", "transformer", 0, 35.0, 34.0, ts="2026-01-02T00:00:00Z", final=33.0),
        run("listops", "transformer", 1, 36.0, 38.0),
        run("listops", "transformer", 2, 33.0, 36.0),
        run("listops", "transformer", 3, 99.0, 99.0, experiment="smoke"),  # smoke runs never count
        run("listops", "transformer", 4, 99.0, None),  # no test accuracy: not a finished run
        run("listops", "transformer", 5, None, None, status="diverged"),  # counted as failed, never averaged
        run("listops", "transformer", 6, 99.0, 99.0, status="error: ValueError: x"),  # a number but not ok
        run("listops", "transformer", 1, None, None, status="oom"),  # rerun to ok (seed 1 above): not a failure
        run("text", "transformer", 0, 64.0, 65.0),
        run("retrieval", "transformer", 0, 59.0, 60.0),
        run("image", "transformer", 0, 41.0, 40.0),
        run("pathfinder", "transformer", 0, 70.5, 70.0),
        run("pathx", "transformer", 0, 50.2, 50.3),  # chance: FAIL
        # local: four tasks only -> no averages
        *[run(t, "local", 0, 50.0, 50.0 + i) for i, t in enumerate(["listops", "text", "retrieval", "image"])],
        # a model LRA never had, with a real Path-X
        *[run(t, "mymodel", 0, 80.0, 80.0) for t in ["listops", "text", "retrieval", "image", "pathfinder"]],
        run("pathx", "mymodel", 0, 70.0, 68.0),
    ]
    return pd.DataFrame(rows).reindex(columns=RUN_COLUMNS)


def cell(lb, model, task, col="test_acc"):
    r = lb[(lb.model == model) & (lb.task == task)]
    assert len(r) == 1, (model, task)
    return r.iloc[0][col]


@pytest.fixture
def published():
    return pd.read_csv(PUBLISHED)


def test_leaderboard_aggregation(published):
    lb = leaderboard.build_leaderboard(hand_made_runs(), published)
    assert list(lb.columns) == leaderboard.LEADERBOARD_COLUMNS
    assert cell(lb, "transformer", "listops") == pytest.approx(36.0)  # mean of 34 (best-val re-run), 38, 36
    assert cell(lb, "transformer", "listops", "test_std") == pytest.approx(2.0)
    assert cell(lb, "transformer", "listops", "n_seeds") == 3
    assert cell(lb, "transformer", "listops", "n_failed") == 2 and "1 diverged" in cell(lb, "transformer", "listops",
                                                                                            "note")
    assert "oom" not in cell(lb, "transformer", "listops", "note")  # its seed has an ok run
    assert cell(lb, "transformer", "listops", "final_test_acc") == pytest.approx((33 + 38 + 36) / 3)
    assert cell(lb, "transformer", "listops", "final_test_std") == pytest.approx(2.5166, abs=1e-3)
    assert pd.isna(cell(lb, "transformer", "text", "test_std")) and cell(lb, "transformer", "text", "n_seeds") == 1
    # the two averages, each labelled
    assert cell(lb, "transformer", "avg5") == pytest.approx((36 + 65 + 60 + 40 + 70) / 5)
    assert cell(lb, "transformer", "avg6") == pytest.approx((36 + 65 + 60 + 40 + 70 + 50) / 6)  # failed Path-X = 50
    assert "FAIL" in cell(lb, "transformer", "pathx", "note")
    assert "Path-X failed = 50" in cell(lb, "transformer", "avg6", "note")
    assert cell(lb, "mymodel", "avg6") == pytest.approx((5 * 80 + 68) / 6)  # a real Path-X counts as run
    assert cell(lb, "transformer", "avg5", "n_seeds") == 1
    assert not ((lb.model == "local") & lb.task.isin(["avg5", "avg6"])).any()  # incomplete: no average
    # LRA Table 1 beside ours
    assert cell(lb, "transformer", "listops", "published") == pytest.approx(36.37)
    assert cell(lb, "transformer", "listops", "diff") == pytest.approx(36.0 - 36.37)
    assert cell(lb, "transformer", "avg5", "diff") == pytest.approx(54.2 - 54.39)
    assert cell(lb, "transformer", "avg6", "published") == pytest.approx(53.66)
    assert pd.isna(cell(lb, "transformer", "pathx", "published"))  # LRA: FAIL
    assert "LRA Table 1: FAIL" in cell(lb, "transformer", "pathx", "note")
    assert pd.isna(cell(lb, "mymodel", "avg5", "published"))
    # ordering: best 5-task average first, models without one last; tasks in LRA order
    assert list(dict.fromkeys(lb.model)) == ["mymodel", "transformer", "local"]
    assert list(lb[lb.model == "transformer"].task) == leaderboard.TASKS6 + ["avg4", "avg5", "avg6"]
    assert cell(lb, "transformer", "avg4") == pytest.approx((36 + 65 + 40 + 70) / 4)
    assert cell(lb, "transformer", "avg4", "published") == pytest.approx((36.37 + 64.27 + 42.44 + 71.40) / 4)
    assert not ((lb.model == "local") & (lb.task == "avg4")).any()  # no Pathfinder: no 4-task mean

    text = leaderboard.format_leaderboard(lb)
    assert "36.00 +-2.00 [3] (-0.37) !2" in text and "FAIL" in text and "avg6" in text


def test_stalled_runs_count_and_are_flagged():
    runs = pd.DataFrame([run("listops", "m", 0, 17.0, 16.0, majority=16.5),  # within 1 point of the majority class
                         run("listops", "m", 1, 38.0, 37.0, majority=16.5)]).reindex(columns=RUN_COLUMNS)
    lb = leaderboard.build_leaderboard(runs)
    assert cell(lb, "m", "listops") == pytest.approx(26.5) and cell(lb, "m", "listops", "n_stalled") == 1
    assert "1 of 2 seeds stalled" in cell(lb, "m", "listops", "note")
    assert "~1" in leaderboard.format_leaderboard(lb)


def test_the_console_table_keeps_cells_and_their_fields_apart():
    """A stalled count beside the next column's mean once read as one number (``~1`` then ``44.79``: ``~144.79``):
    columns are separated by ``|`` and a cell's fields (mean, +-std, [seeds], (diff), !failed, ~stalled) by spaces."""
    listops = [run("listops", "m", s, acc, acc, majority=16.5) for s, acc in enumerate((17.0, 38.0, 40.0))]
    text = [run("text", "m", s, acc, acc) for s, acc in enumerate((44.0, 45.58))]
    lb = leaderboard.build_leaderboard(pd.DataFrame(listops + text).reindex(columns=RUN_COLUMNS))
    line = next(line for line in leaderboard.format_leaderboard(lb).splitlines() if line.startswith("m "))
    cells = [c.strip() for c in line.split(leaderboard.CELL_SEPARATOR)]
    assert cells[0] == "m" and cells[1].split() == ["31.67", "+-12.74", "[3]", "~1"]
    assert cells[2].split() == ["44.79", "+-1.12", "[2]"]


def test_a_run_that_learned_then_fell_back_to_the_majority_class_is_flagged_as_collapsed():
    rows = [run("listops", "m", 0, 37.0, 36.5, final=18.6, majority=18.3),  # best at step 100, then the prior
            run("listops", "m", 1, 38.0, 37.0, majority=18.3),
            run("listops", "m", 2, 18.5, 18.0, final=18.0, majority=18.3)]  # stalled, not collapsed
    finals = [18.4, 37.5, 18.2]
    runs = pd.DataFrame([{**r, "final_val_acc": f} for r, f in zip(rows, finals, strict=True)]).reindex(
        columns=RUN_COLUMNS)
    lb = leaderboard.build_leaderboard(runs)
    note = cell(lb, "m", "listops", "note")
    assert "1 of 3 seeds collapsed" in note and "1 of 3 seeds stalled" in note
    assert cell(lb, "m", "listops") == pytest.approx((36.5 + 37.0 + 18.0) / 3)  # still counted, as the checkpoint


def test_a_run_stopped_early_is_named_with_its_accuracy_but_never_averaged_or_failed():
    runs = pd.DataFrame([run("text", "s4d", 0, 70.0, 71.0, status="stopped: at step 10,000 of 50,000"),
                         run("text", "s4d", 0, 80.0, 81.0, ts="2026-01-02T00:00:00Z",
                             status="stopped: at step 30,000 of 50,000"),
                         run("image", "s4d", 0, 85.0, 86.0, status="stopped: at step 100 of 200"),
                         run("image", "s4d", 0, 88.0, 87.0, ts="2026-01-03T00:00:00Z")]).reindex(columns=RUN_COLUMNS)
    lb = leaderboard.build_leaderboard(runs)
    assert pd.isna(cell(lb, "s4d", "text")) and cell(lb, "s4d", "text", "n_failed") == 0
    note = "seed 0 stopped at step 30,000 of 50,000, test 81.00 so far (not averaged)"  # the furthest run
    assert cell(lb, "s4d", "text", "note") == note
    assert cell(lb, "s4d", "image") == 87.0  # finished since: that counts, with nothing stopped in its note
    assert cell(lb, "s4d", "image", "note") == "one seed: its interval is test-set noise only"


def test_a_stopped_run_whose_validation_is_the_test_set_is_named_with_its_weights_at_the_stop():
    """Its best validation accuracy was chosen on the test set: the note gives the final weights' test accuracy."""
    runs = pd.DataFrame([dict(run("text", "s4d", 0, 85.8, 85.8, final=73.4, status="stopped: at step 28,431 of 49,984"),
                              val_is_test=True)]).reindex(columns=RUN_COLUMNS)
    note = leaderboard.build_leaderboard(runs).pipe(cell, "s4d", "text", "note")
    assert note == "seed 0 stopped at step 28,431 of 49,984, test 73.40 so far (not averaged)"


def test_where_validation_is_the_test_set_the_final_weights_of_the_latest_run_count(tmp_path):
    """Text validates on its test set (as LRA): choosing a checkpoint or a re-run by validation would choose on test."""
    text = dict(val_is_test=True, split="train=train, val=test, test=test")
    runs = pd.DataFrame([
        dict(run("text", "m", 0, 72.0, 72.0, final=66.0, ts="2026-01-01T00:00:00Z"), **text),
        dict(run("text", "m", 0, 70.0, 70.0, final=64.0, ts="2026-01-02T00:00:00Z"), **text),  # the latest counts
        dict(run("text", "m", 1, 69.0, 69.0, final=62.0), split=text["split"]),  # older row: its recipe says so
        dict(run("listops", "m", 0, 40.0, 38.0, final=35.0), val_is_test=False, split="LRA files"),
    ]).reindex(columns=RUN_COLUMNS)
    runs.to_csv(tmp_path / "runs.csv", index=False)  # as the CLI reads them: True / False / blank
    lb = leaderboard.build_leaderboard(pd.read_csv(tmp_path / "runs.csv"))
    assert cell(lb, "m", "text") == pytest.approx(63.0) and cell(lb, "m", "text", "test_std") == pytest.approx(2**0.5)
    assert cell(lb, "m", "text", "headline") == "final" and cell(lb, "m", "text", "val_acc") == pytest.approx(69.5)
    assert "validation split is the test set" in cell(lb, "m", "text", "note")
    assert cell(lb, "m", "listops") == 38.0 and cell(lb, "m", "listops", "headline") == "best_val"
    assert "text: final weights" in leaderboard.format_leaderboard(lb)


def test_other_experiments_are_rows_of_their_own():
    runs = pd.DataFrame([run("listops", "m", 0, 30.0, 30.0),
                         run("listops", "m", 0, 40.0, 40.0, experiment="mean_pool")]).reindex(columns=RUN_COLUMNS)
    assert len(leaderboard.build_leaderboard(runs)) == 1
    both = leaderboard.build_leaderboard(runs, experiment="all")
    assert set(zip(both.experiment, both.test_acc)) == {("lra", 30.0), ("mean_pool", 40.0)}
    assert "m [mean_pool]" in leaderboard.format_leaderboard(both)


def test_length_grouped_runs_are_never_averaged_with_their_presets_own():
    grouped = dict(run("listops", "m", 1, 40.0, 40.0), batching="length_grouped")
    runs = pd.DataFrame([dict(run("listops", "m", 0, 30.0, 30.0), batching="random"), grouped,
                         run("listops", "m", 2, 32.0, 32.0)]).reindex(columns=RUN_COLUMNS)  # an older row: blank
    both = leaderboard.build_leaderboard(runs, experiment="all")
    cells = both[both.task == "listops"].set_index("experiment")
    assert cells.loc["lra", "test_acc"] == 31.0 and cells.loc["lra", "n_seeds"] == 2
    assert cells.loc["lra+length_grouped", "test_acc"] == 40.0


def test_a_preset_changed_on_the_command_line_is_kept_apart_from_it():
    """Overrides that change what the preset computes make the row ``<preset>+modified``; the choice of task, model
    and seed, data and output places, execution settings, and (where validation is the test set) the evaluation
    cadence do not."""
    neutral = ("task=listops model=m seed=1 sweep=g trainer.progress=False device=cuda:1 hydra/launcher=gpus "
               "data.path=x results.dir=y trainer.pack=true")
    runs = pd.DataFrame([dict(run("listops", "m", 0, 30.0, 30.0), overrides="task=listops model=m"),
                         dict(run("listops", "m", 1, 32.0, 32.0), overrides=neutral),
                         dict(run("listops", "m", 2, 60.0, 60.0), overrides="model=m backbone.n_layers=2"),
                         dict(run("listops", "m", 3, 50.0, 50.0), overrides="schedule.eval_every=10"),
                         dict(run("text", "m", 0, 70.0, 70.0), overrides="train.eval_every=1000", split="val=test"),
                         dict(run("listops", "m", 0, 90.0, 90.0, experiment="scaling"), overrides="schedule.steps=9")])
    cells = leaderboard.build_leaderboard(runs, experiment="all").set_index(["experiment", "task"])
    assert cells.loc[("lra", "listops"), "test_acc"] == 31.0 and cells.loc[("lra", "listops"), "n_seeds"] == 2
    assert cells.loc[("lra+modified", "listops"), "test_acc"] == 55.0  # seeds 2 and 3
    assert cells.loc[("lra", "text"), "test_acc"] == 70.0 and ("scaling", "listops") in cells.index
    assert departures("+backbone.norm=batchnorm optim.lr=0.1 seed=3") == ["+backbone.norm=batchnorm", "optim.lr=0.1"]


def test_fractions_are_read_as_percent_and_experiment_filter():
    runs = hand_made_runs()
    frac = runs.copy()
    for c in ["val_acc", "test_acc", "final_test_acc", "val_majority"]:
        frac[c] = frac[c] / 100
    frac.loc[frac.experiment == "smoke", ["val_acc", "test_acc"]] = 0.99
    a = leaderboard.build_leaderboard(runs)
    b = leaderboard.build_leaderboard(frac)
    pd.testing.assert_series_equal(a.test_acc, b.test_acc)
    smoke = leaderboard.build_leaderboard(runs, experiment="smoke")
    assert set(smoke.model) == {"transformer"} and cell(smoke, "transformer", "listops") == pytest.approx(99.0)
    assert len(leaderboard.build_leaderboard(runs, experiment="lra,smoke")) > len(a)


def test_cli_writes_csv(tmp_path, capsys):
    hand_made_runs().to_csv(tmp_path / "runs.csv", index=False)
    out = tmp_path / "lb.csv"
    leaderboard.main(["--results", str(tmp_path), "--out", str(out), "--published", str(PUBLISHED)])
    lb = pd.read_csv(out)
    assert cell(lb, "transformer", "avg5", "published") == pytest.approx(54.39)
    assert "mymodel" in capsys.readouterr().out


def test_a_recipe_is_set_beside_its_own_paper(published):
    """S4D trained by its paper's recipe is compared with S4D-LegS's published numbers, not LRA Table 1's (which
    has no S4D); the same model under LRA's protocol keeps no published cell."""
    runs = pd.DataFrame([run("listops", "s4d", 0, 60.25, 60.30, experiment="s4d_lra"),
                         run("listops", "s4d", 0, 37.0, 37.9)]).reindex(columns=RUN_COLUMNS)
    lb = leaderboard.build_leaderboard(runs, published, experiment="all")
    recipe = lb[(lb.experiment == "s4d_lra") & (lb.task == "listops")].iloc[0]
    assert recipe.published == pytest.approx(60.47) and recipe["diff"] == pytest.approx(-0.17)
    assert pd.isna(lb[(lb.experiment == "lra") & (lb.task == "listops")].iloc[0].published)
    assert leaderboard.RECIPE_PAPERS.keys() <= {p.stem for p in (ROOT / "lra" / "conf" / "experiment").glob("*.yaml")}


def test_published_cells_name_models_without_warnings(published):
    """LRA's own rows need no renaming; mapping names through an empty table once filled an all-NaN float column
    with strings, which pandas warns will become an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lra_cells = leaderboard.published_cells(published)
        recipe_cells = leaderboard.published_cells(published, experiment="s4d_lra")
    assert lra_cells[("transformer", "listops")][0] == pytest.approx(36.37)
    assert recipe_cells[("s4d", "listops")][0] == pytest.approx(60.47)


def test_published_numbers(published):
    t1 = published[published.source == "lra_table1"]
    models = {"transformer", "local", "sparse", "longformer", "linformer", "reformer", "sinkhorn", "synthesizer",
              "bigbird", "linear", "performer"}
    assert set(t1.model) == models
    acc = t1[t1.metric == "test_acc"]
    assert len(acc) == 66 and set(acc.task) == set(leaderboard.TASKS6)
    assert acc[acc.task == "pathx"].value.isna().all() and acc[acc.task == "pathx"].note.str.startswith("FAIL").all()
    wide = acc[acc.task != "pathx"].pivot(index="model", columns="task", values="value")
    avg5 = t1[t1.metric == "avg5"].set_index("model").value
    avg6 = t1[t1.metric == "avg6"].set_index("model").value
    for m in models:  # the paper's averages agree with its cells (Sinkhorn's printed average is the known slip)
        tol = 0.1 if m == "sinkhorn" else 0.006
        assert wide.loc[m].mean() == pytest.approx(avg5[m], abs=tol)
        assert (wide.loc[m].sum() + 50) / 6 == pytest.approx(avg6[m], abs=0.006)
    t2 = published[published.source == "lra_table2"]
    speed = t2[t2.metric == "steps_per_s"].dropna(subset=["value"])
    assert len(speed) == 36 and set(speed.seq_len) == {1024, 2048, 3072, 4096}
    assert speed.set_index(["model", "seq_len"]).value[("transformer", 4096)] == pytest.approx(1.4)
    mem = t2[t2.metric == "peak_mem_gb"]
    assert mem.set_index(["model", "seq_len"]).value[("performer", 4096)] == pytest.approx(1.06)
    assert {"s4", "s5", "mega", "lru", "nystromformer", "skyformer", "flash_attention"} <= set(published.model)


def test_compare_leaderboards_and_run_files(tmp_path, capsys):
    runs_a = hand_made_runs()
    runs_b = runs_a.copy()
    runs_b.loc[(runs_b.model == "transformer") & (runs_b.task == "text"), "test_acc"] = 67.5
    runs_b = runs_b[runs_b.model != "local"]
    table = compare.compare(runs_a, runs_b)
    assert list(table.columns) == compare.COMPARE_COLUMNS
    t = table.set_index(["model", "task"])
    assert t.loc[("transformer", "text"), "diff"] == pytest.approx(2.5)
    assert t.loc[("transformer", "listops"), "diff"] == pytest.approx(0.0)
    assert t.loc[("transformer", "avg5"), "diff"] == pytest.approx(0.5)
    assert pd.isna(t.loc[("local", "text"), "b"]) and t.loc[("local", "text"), "a"] == pytest.approx(51.0)
    assert t.loc[("transformer", "listops"), "n_seeds_a"] == 3

    runs_a.to_csv(tmp_path / "a_runs.csv", index=False)
    leaderboard.build_leaderboard(runs_b).to_csv(tmp_path / "b_lb.csv", index=False)  # a leaderboard file
    out = compare.main([str(tmp_path / "a_runs.csv"), str(tmp_path / "b_lb.csv"), "--out", str(tmp_path / "d.csv")])
    printed = capsys.readouterr().out
    assert "(runs)" in printed and "(leaderboard)" in printed and "2.50" in printed
    assert pd.read_csv(tmp_path / "d.csv").shape == out.shape
    with pytest.raises(ValueError, match="neither"):
        compare.kind_of(pd.DataFrame({"x": [1]}))


def test_compare_two_bench_files(tmp_path, capsys):
    def bench_rows(speed, mem):
        return pd.DataFrame([dict(model=m, task="text", seq_len=n, batch_size=32, status="ok", steps_per_s=speed * k,
                                  peak_mem_mb=mem * k, timestamp="2026-01-01T00:00:00Z")
                             for k, (m, n) in enumerate([("transformer", 1024), ("linear", 1024)], start=1)])

    a, b = bench_rows(10.0, 100.0), bench_rows(20.0, 50.0)
    b.loc[len(b)] = dict(model="linear", task="text", seq_len=1024, batch_size=32, status="oom", steps_per_s=None,
                         peak_mem_mb=None, timestamp="2026-01-02T00:00:00Z")  # a later failure does not replace
    table = compare.compare_bench(a, b).set_index("model")
    assert table.loc["linear", "speed_ratio"] == pytest.approx(2.0) and table.loc["linear", "mem_ratio"] == 0.5
    a.to_csv(tmp_path / "a.csv", index=False)
    b.to_csv(tmp_path / "b.csv", index=False)
    compare.main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])
    assert "(bench)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="only with another bench"):
        leaderboard.build_leaderboard(hand_made_runs()).to_csv(tmp_path / "lb.csv", index=False)
        compare.main([str(tmp_path / "a.csv"), str(tmp_path / "lb.csv")])


def test_whole_lra_minutes_sum_the_four_tasks_of_the_selected_runs():
    rows = [dict(run(t, "m", 0, 50.0, 50.0), wall_time_s=60.0 * (i + 1), device="GPU A")
            for i, t in enumerate(["listops", "text", "image", "pathfinder"])]
    rows.append(dict(run("listops", "m", 1, 60.0, 60.0), wall_time_s=600.0, device="GPU B"))  # a later seed: not it
    rows.append(dict(run("listops", "m", 0, 40.0, 40.0, ts="2026-01-03T00:00:00Z"), wall_time_s=900.0,
                     device="GPU B"))  # a worse rerun of seed 0: not selected
    rows += [dict(run(t, "partial", 0, 50.0, 50.0), wall_time_s=60.0) for t in ["listops", "text"]]
    table = leaderboard.whole_lra_minutes(pd.DataFrame(rows).reindex(columns=RUN_COLUMNS))
    assert table.model.tolist() == ["m"]  # a model without all four tasks has no whole-LRA time
    got = table.iloc[0]
    assert (got.listops, got.text, got.image, got.pathfinder, got.total) == (1.0, 2.0, 3.0, 4.0, 10.0)
    assert got.devices == "GPU A"


def test_pathfinder_rows_on_an_older_generator_version_are_kept_apart():
    """Images of another generator version are another dataset: a v1 row (or one from before rows named their
    data) never counts beside today's, however good its validation accuracy; other tasks' data names do not matter."""
    from lra.data.pathfinder_gen import GENERATOR_VERSION

    today, older = (f"pathfinder_gen v{v} seed 0" for v in (GENERATOR_VERSION, GENERATOR_VERSION - 1))
    runs = pd.DataFrame([dict(run("pathfinder", "m", 0, 70.0, 70.0), data=None),
                         dict(run("pathfinder", "m", 0, 68.0, 68.0), data=older),
                         dict(run("pathfinder", "m", 0, 62.0, 62.0), data=today),
                         dict(run("pathfinder", "m", 1, 64.0, 64.0), data=today),
                         dict(run("image", "m", 0, 40.0, 40.0), data=None),
                         dict(run("image", "m", 1, 42.0, 42.0), data="parquet cifar10")]).reindex(columns=RUN_COLUMNS)
    cells = leaderboard.build_leaderboard(runs, experiment="all").set_index(["experiment", "task"])
    assert cells.loc[("lra", "pathfinder"), "test_acc"] == 63.0 and cells.loc[("lra", "pathfinder"), "n_seeds"] == 2
    assert cells.loc[("lra+superseded_data", "pathfinder"), "test_acc"] == 70.0
    assert "2 run(s) on an older Pathfinder generator version left out (lra+superseded_data)" in \
        leaderboard.build_leaderboard(runs).set_index("task").at["pathfinder", "note"]
    assert cells.loc[("lra", "image"), "n_seeds"] == 2
    assert ("lra+superseded_data", "image") not in cells.index


def test_rerun_spread_pools_repeats_of_one_seed_config_and_card_outside_deterministic_mode():
    """Seed 0 twice (30, 34: variance 8 on 1 degree of freedom) and seed 1 twice (36, 36: 0 on 1) in default mode give
    a pooled std of 2; a deterministic pair, a pair on two kinds of card and a pair of two configs are no reruns."""
    def again(seed, test, config="a", device="H100", deterministic=False, ts="2026-01-01T00:00:00Z"):
        return {**run("listops", "m", seed, test, test, ts=ts), "config_hash": config, "device": device,
                "deterministic": deterministic}
    rows = [again(0, 30.0), again(0, 34.0, ts="2026-01-02T00:00:00Z"), again(1, 36.0), again(1, 36.0),
            again(2, 20.0, deterministic=True), again(2, 40.0, deterministic=True),
            again(3, 20.0, device="H100"), again(3, 40.0, device="H200"),
            again(4, 20.0, config="a"), again(4, 40.0, config="b")]
    lb = leaderboard.build_leaderboard(pd.DataFrame(rows).reindex(columns=RUN_COLUMNS))
    assert cell(lb, "m", "listops", "rerun_std") == pytest.approx(2.0)
    assert cell(lb, "m", "listops", "n_reruns") == 2 and cell(lb, "m", "listops", "n_seeds") == 5
    alone = leaderboard.build_leaderboard(pd.DataFrame(rows[6:]).reindex(columns=RUN_COLUMNS))
    assert pd.isna(cell(alone, "m", "listops", "rerun_std")) and cell(alone, "m", "listops", "n_reruns") == 0


def test_a_task_a_model_cannot_take_is_named_not_blank():
    """axial mixes over the pixel grid: its ListOps, Text and Retrieval cells say why they are empty, in the CSV,
    the console and the README table; its image cell is its own; a model with runs on every task gets no such cell."""
    rows = [run("image", "axial", 0, 45.0, 44.0), run("image", "transformer", 0, 41.0, 40.0),
            run("listops", "transformer", 0, 36.0, 35.0)]
    lb = leaderboard.build_leaderboard(pd.DataFrame(rows).reindex(columns=RUN_COLUMNS))
    for task in ("listops", "text", "retrieval"):
        assert pd.isna(cell(lb, "axial", task)) and "2-D mixer" in cell(lb, "axial", task, "note")
    assert cell(lb, "axial", "image") == pytest.approx(44.0)
    assert not lb[(lb["model"] == "transformer") & lb["note"].str.startswith(leaderboard.NOT_TAKEN)].shape[0]
    line = next(line for line in leaderboard.format_leaderboard(lb).splitlines() if line.startswith("axial "))
    assert [c.strip() for c in line.split(leaderboard.CELL_SEPARATOR)][1:4] == ["n/a"] * 3
    assert "| `axial` | n/a (2-D mixer) | n/a (2-D mixer) | **44.00** (1 seed) |" in leaderboard.readme_table(lb)


def test_a_self_pretrained_cell_shows_its_gain_over_the_same_preset_from_scratch():
    """pretrain_gain: a <preset>+pretrain_<objective> cell's test accuracy less the same model and task from scratch
    under <preset> (averages too), NaN elsewhere and where no scratch cell is selected; the console says it."""
    rows = [run("listops", "transformer", s, 40.0, acc, experiment="trainable") for s, acc in enumerate([36, 38, 37])]
    rows += [dict(run("listops", "transformer", s, 50.0, acc, experiment="trainable"), pretrain="mlm")
             for s, acc in enumerate([45, 47, 46])]
    rows += [dict(run("image", "transformer", 0, 60.0, 60.0, experiment="trainable"), pretrain="mlm")]  # no scratch
    lb = leaderboard.build_leaderboard(pd.DataFrame(rows), experiment="all")
    cells = lb.set_index(["experiment", "task"])
    assert cells.loc[("trainable+pretrain_mlm", "listops"), "pretrain_gain"] == pytest.approx(9.0)
    assert pd.isna(cells.loc[("trainable+pretrain_mlm", "image"), "pretrain_gain"])
    assert pd.isna(cells.loc[("trainable", "listops"), "pretrain_gain"])
    assert "46.00 +-1.00 [3] (+9.00 vs scratch)" in leaderboard.format_leaderboard(lb)
    alone = leaderboard.build_leaderboard(pd.DataFrame(rows), experiment="trainable+pretrain_mlm")
    assert alone["pretrain_gain"].isna().all()  # the scratch cells were not selected
