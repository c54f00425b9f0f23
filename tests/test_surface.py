"""The commands as a new user meets them, each in a folder of its own (no run_dir=, no checkout's results/): a run
stopped by schedule.stop_at or trainer.time_limit goes on in its own folder; every mistake a user can fix ends in one
line and exit code 2, leaving no folder behind; run_dir= takes Hydra's files along; --help names the command; the
reports say where they looked for a file they need."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import lra
from lra.errors import DataError
from lra.report import plot
from tests.conftest import ROOT, finish_all, in_background, started

INSTALLED = Path(lra.__file__).resolve().parents[1]  # the folder holding the lra under test
TINY = ("experiment=smoke", "task.seq_len=256", "backbone.n_layers=1", "schedule.steps=12", "schedule.eval_every=4",
        "data.limit.train=64", "data.limit.val=16", "data.limit.test=16")


def user_env(folder: Path, environ: dict[str, str]) -> dict[str, str]:
    """A user's environment in ``folder``: the lra these tests import (a checkout's, or an installed wheel's)
    importable, the caches and results under the folder's."""
    env = {k: v for k, v in environ.items() if k not in ("LRA_RESULTS_DIR", "HYDRA_FULL_ERROR", "LRA_FULL_ERROR")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(INSTALLED), environ.get("PYTHONPATH")) if p)
    env["LRA_CACHE_DIR"] = str(folder / "cache")
    return env


def lra(folder: Path, environ: dict[str, str], *args: str, module: str = "lra") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=folder, env=user_env(folder, environ),
                          capture_output=True, text=True, timeout=600)


def stop_then_go_on(folder: Path, environ: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """The smoke run stopped by schedule.stop_at, then given a time limit of a moment, then run to its end."""
    return [lra(folder, environ, *TINY, *extra) for extra in
            (["schedule.stop_at=5"], ["trainer.time_limit=0.0001"], [])]


@in_background(stop_then_go_on)
def test_a_stopped_run_goes_on_in_its_own_folder_through_the_cli(ran_in_background):
    """docs/cli.md: without stop_at (or with a time limit) the run resumes from its checkpoint. Neither names the run's
    folder (they are not what it computes), so each command finds the run where the last left it: one folder, and
    one row per command, the stopped ones then the finished one."""
    procs, folder = ran_in_background()
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = folder / "outputs" / "smoke" / "listops" / "transformer"
    assert [p.name for p in runs.iterdir()] == ["backbone.n_layers=1,data.limit.test=16,data.limit.train=64,"
                                                "data.limit.val=16,schedule.eval_every=4,schedule.steps=12,"
                                                "task.seq_len=256"]
    rows = pd.read_csv(folder / "outputs" / "results" / "runs.csv")
    assert rows.run_dir.nunique() == 1 and Path(rows.run_dir[0]).resolve().parent == runs.resolve()
    assert rows.status[0] == "stopped: at step 5 of 12" and rows.steps[0] == 5
    assert rows.status[1].startswith("stopped: at step ") and 5 <= rows.steps[1] < 12
    assert rows.status[2] == "ok" and rows.steps[2] == 12 and len(rows) == 3
    assert rows.config_hash.nunique() == 1
    log = (runs / next(runs.iterdir()).name / "__main__.log").read_text()
    assert "from step 5" in log and f"from step {rows.steps[1]}" in log  # resumed, twice


def mistakes(folder: Path, environ: dict[str, str]) -> dict[str, subprocess.CompletedProcess]:
    """Commands with one mistake each, side by side (a process each), in ``folder``."""
    (folder / "a_file").write_text("")
    device = "device=cuda" if not torch.cuda.is_available() else "device=cuda:99"
    cases = {
        "task=foo": ["task=foo"], "model=foo": ["model=foo"], "model.foo=1": ["model.foo=1"],
        "trainer.foo=1": ["trainer.foo=1"], "schedule.steps=abc": ["schedule.steps=abc"],
        "optim.lr=-1": [*TINY, "optim.lr=-1"], "device": [*TINY, device],
        "hydra.run.dir": [*TINY, f"hydra.run.dir={folder / 'a_file' / 'run'}"],
        "run_dir": [*TINY, f"run_dir={folder / 'a_file' / 'run'}"],
    }
    commands = {name: [sys.executable, "-m", "lra", *args] for name, args in cases.items()}
    commands["compare"] = [sys.executable, "-m", "lra.compare", "missing_a.csv", "missing_b.csv"]
    commands["leaderboard"] = [sys.executable, "-m", "lra.leaderboard", "--results", str(ROOT / "results"), "--out",
                               str(folder / "lb.csv"), "--published", "missing.csv"]
    commands["evaluate"] = [sys.executable, "-m", "lra.evaluate", "no_such_run"]
    env = user_env(folder, environ)
    done = {}
    names = list(commands)
    for i in range(0, len(names), 4):  # four at a time: each imports torch
        batch = names[i : i + 4]
        for name, proc in zip(batch, finish_all(*(started(commands[n], cwd=folder, env=env) for n in batch))):
            done[name] = proc
    return done


MISTAKES = {  # a command's mistake -> what its one line says
    "task=foo": "task=foo is not valid: choose one of image, listops, pathfinder, pathx, retrieval, text",
    "model=foo": "model=foo is not valid: choose one of axial, bigbird,",
    "model.foo=1": "model 'transformer' has no option(s) ['foo']; its options are: none",
    "trainer.foo=1": "trainer.foo is not a setting of trainer: its keys are precision, compile,",
    "schedule.steps=abc": "schedule.steps=abc is not valid: Value 'abc' of type 'str' could not be converted",
    "optim.lr=-1": "optim.lr=-1.0 is not valid: the learning rate must be positive",
    "device": "is not valid here",
    "hydra.run.dir": "cannot write the run folder",
    "run_dir": "cannot write the run folder",
    "compare": "no file at missing_a.csv",
    "leaderboard": "no published results (LRA Table 1) at missing.csv",
    "evaluate": "no run folder at no_such_run",
}


@in_background(mistakes)
def test_a_mistake_is_one_line_and_exit_code_2(ran_in_background):
    """docs/cli.md: a setting or data the user can fix ends the command with exit code 2 and one line on stderr,
    naming the key and what to do; a run refused before it began leaves no folder (Hydra makes one first)."""
    done, folder = ran_in_background()
    assert sorted(done) == sorted(MISTAKES)
    wrong = {case: done[case].stderr[-2000:] for case, message in MISTAKES.items()
             if done[case].returncode != 2 or len(done[case].stderr.strip().splitlines()) != 1
             or not done[case].stderr.startswith("error: ") or message not in done[case].stderr}
    assert not wrong, wrong
    assert not (folder / "outputs" / "smoke").exists()  # no run folder from a refused run


def helped_and_run_dir(folder: Path, environ: dict[str, str]) -> tuple:
    run = lra(folder, environ, *TINY, "schedule.steps=2", "schedule.eval_every=2", f"run_dir={folder / 'mine'}")
    return lra(folder, environ, "--help"), run


@in_background(helped_and_run_dir)
def test_help_names_the_command_and_run_dir_takes_hydras_files_along(ran_in_background):
    """``lra --help`` opens with what the command does (not Hydra's "__main__ is powered by Hydra"); ``run_dir=X``
    puts the whole run in X, Hydra's saved config and the command's log included, nothing under outputs/ but the
    results."""
    (helped, run), folder = ran_in_background()
    assert helped.returncode == 0 and helped.stdout.startswith("lra (python -m lra): train a model")
    assert "powered by Hydra" not in helped.stdout.splitlines()[0]
    assert run.returncode == 0, run.stderr[-3000:]
    assert (folder / "mine" / "__main__.log").exists() and (folder / "mine" / ".hydra").is_dir()
    assert (folder / "mine" / "result.json").exists()
    assert sorted(p.name for p in (folder / "outputs").iterdir()) == ["results"]


def test_the_gitignore_keeps_build_outputs_out():
    assert "build/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_charts_say_where_they_looked_for_the_papers_numbers(tmp_path):
    """``lra.plot --published FILE`` with no FILE there: a DataError naming it (the command's one line, exit code 2),
    before any chart is drawn; its default is the package's copy, which an install has."""
    assert plot.PUBLISHED.is_file()
    with pytest.raises(DataError, match=r"no published results \(LRA Tables 1 and 2\) at .*missing.csv"):
        plot.main(["--results", str(ROOT / "results"), "--out", str(tmp_path), "--published",
                   str(tmp_path / "missing.csv")])
    assert not list(tmp_path.iterdir())


ARGV_COMMANDS = ["lra.baseline", "lra.evaluate", "lra.generate", "lra.prepare", "lra.bench.layer_bench",
                 "lra.bench.peers", "lra.report.compare", "lra.report.leaderboard", "lra.report.plot",
                 "lra.report.results", "lra.report.taxonomy"]


@pytest.mark.parametrize("module", ARGV_COMMANDS)
def test_every_command_answers_help_with_what_it_does(module, capsys):
    """``python -m <command> --help`` prints how to call it and exits 0, for every command that takes argv (lra
    itself: the test above; lra.bench: the next)."""
    main = importlib.import_module(module).main
    try:
        main(["--help"])
    except SystemExit as e:
        assert e.code in (0, None)
    out = capsys.readouterr().out
    assert "python -m lra." in out.splitlines()[0] or out.startswith("usage: python -m lra.")


def test_the_bench_help_names_the_bench(monkeypatch, capsys):
    """The bench is a Hydra app: its --help opens with the command, not "bench is powered by Hydra"."""
    from lra.bench import bench

    monkeypatch.setattr(sys, "argv", ["python -m lra.bench", "--help"])
    try:
        bench.main()
    except SystemExit as e:
        assert e.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("python -m lra.bench: LRA Table 2's speed and memory sweep")
    assert "powered by Hydra" not in out


def test_an_error_without_a_message_still_gets_its_one_line():
    """A row's status and the logs' one line from an exception with an empty message (str(e) == ""): the type and
    nothing after it, never an IndexError raised while recording the failure."""
    from lra.errors import first_line
    from lra.provenance import error_status

    assert first_line(RuntimeError()) == "" and first_line(ValueError("a\nb"), 1) == "a"
    assert error_status(KeyError()) == "error: KeyError: "
