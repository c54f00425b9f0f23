"""``python -m lra.prepare``: the data a run would load, made and cached beforehand, so the run starts on a hit."""
from __future__ import annotations

import sys

import lra.train.run as runner
from lra.prepare import prepare
from tests.conftest import ROOT, finish_all, in_background, started


def test_prepared_data_is_what_the_run_loads(smoke_cfg, tmp_path, caplog):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    # the run's length is not the data's (2 steps, not 20), and the slice is the smoke preset's cut further: its 224
    # Pathfinder images were most of the test's time, and the prepared slice must follow such overrides too
    short = ("schedule.steps=2", "schedule.eval_every=2", "data.limit.train=16", "data.limit.val=4",
             "data.limit.test=4")
    first, second = prepare(["-m", "task=listops,pathfinder", "experiment=smoke", cache, *short])  # -m by habit: fine
    assert first.info["task"] == "listops" and second.info["task"] == "pathfinder"
    assert "cache miss" in first.summary() and "cache miss" in second.summary()
    caplog.set_level("INFO", logger="lra")
    runner.run(smoke_cfg("task=pathfinder", cache, *short))  # the same overrides (run and result folders aside)
    assert "pathfinder: train" in caplog.text and "cache hit" in caplog.text and "cache miss" not in caplog.text


BAD_OPTIONS = ((["task=nope"], "task=nope is not valid: choose one of image, listops,"),
               (["task=listops", "data.limit.train=0"], "data.limit.train=0 is not valid"))


@in_background(lambda folder, environ: finish_all(*(  # side by side
    started([sys.executable, "-m", "lra.prepare", *args], cwd=folder, env=dict(environ, PYTHONPATH=str(ROOT)))
    for args, _ in BAD_OPTIONS), timeout=120))
def test_a_bad_option_is_one_line_and_exit_code_2(ran_in_background):
    procs, tmp_path = ran_in_background()
    for p, (_, says) in zip(procs, BAD_OPTIONS, strict=True):
        assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and says in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "outputs").exists()  # no Hydra output folder: nothing ran
