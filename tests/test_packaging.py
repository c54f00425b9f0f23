"""A non-editable install works from any folder: the configs ship inside the package, and the papers' numbers and stall
baselines the leaderboard sets beside ours; the `lra` console script runs the smoke command, the leaderboard fills
LRA Table 1 beside its row, and the commit is reported plainly as unknown, with the package's version, without a
checkout; plugin models from outside the package register through an entry point and the registry-wide tests run
against them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

import lra
from lra.report import leaderboard
from tests.conftest import ROOT, finish_all, in_background, started


def install(folder: Path, environ: dict[str, str]) -> Path:
    """``pip install --no-deps .`` (a built wheel, not editable) into folder/site."""
    target, src = folder / "site", folder / "src" / "lra"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "outputs", "*.egg-info", "__pycache__", "results",
                                                              "notebooks", "tests", "build"))  # .*: .git, caches
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(src)], env=environ, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def smoke_command_of_the_installed_script(folder: Path, environ: dict[str, str]) -> tuple:
    """Installs the package, then runs its console script's smoke command in folder/elsewhere: (the installed
    folder, the command, where ``import lra`` finds the package there, the project's runs.csv as it was before)."""
    before = (ROOT / "results" / "runs.csv").read_bytes()
    installed, elsewhere = install(folder, environ), folder / "elsewhere"
    elsewhere.mkdir()
    env = {**environ, "PYTHONPATH": str(installed), "LRA_CACHE_DIR": str(elsewhere / "cache")}
    env.pop("LRA_GIT_SHA", None)
    env.pop("LRA_RESULTS_DIR", None)
    script = "import sys; sys.argv[0] = 'lra'; from lra.__main__ import cli; sys.exit(cli())"
    proc = subprocess.run([sys.executable, "-c", script, "task=listops", "model=transformer", "experiment=smoke",
                           "schedule.steps=2", "schedule.eval_every=2"], cwd=elsewhere, env=env, capture_output=True,
                          text=True, timeout=600)
    import_check = subprocess.run([sys.executable, "-c", "import lra; print(lra.__file__)"], cwd=elsewhere, env=env,
                                  capture_output=True, text=True)
    board = subprocess.run([sys.executable, "-m", "lra.leaderboard", "--experiment", "smoke"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, timeout=600)
    return installed, proc, import_check, before, board


@in_background(smoke_command_of_the_installed_script)
def test_the_console_script_runs_the_smoke_command_from_another_folder(ran_in_background):
    """... writing its outputs under ./outputs of the folder it runs in, never into the project's results/."""
    (installed, proc, import_check, before, board), folder = ran_in_background()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert import_check.stdout.startswith(str(installed))  # the installed copy ran, not this checkout
    for package in ("train", "bench", "report", "data", "conf"):  # lra's subpackages and its configs are installed
        assert (installed / "lra" / package / "__init__.py").exists(), package
    assert (installed / "lra" / "bench" / "__main__.py").exists()  # python -m lra.bench
    shipped = sorted(p.relative_to(ROOT / "lra") for p in (ROOT / "lra" / "conf").rglob("*.yaml"))
    assert sorted(p.relative_to(installed / "lra") for p in (installed / "lra" / "conf").rglob("*.yaml")) == shipped
    rows = pd.read_csv(folder / "elsewhere" / "outputs" / "results" / "runs.csv")
    assert len(rows) == 1 and (ROOT / "results" / "runs.csv").read_bytes() == before
    row = rows.iloc[0]
    assert row.status == "ok" and row.git_sha == f"unknown (lra {lra.__version__}, no git checkout)"
    assert (installed / f"lra-{lra.__version__}.dist-info").is_dir()  # the version the code says is the package's
    # the leaderboard of the installed package sets LRA Table 1 beside its row (the transformer's ListOps: 36.37)
    assert board.returncode == 0, board.stderr[-3000:]
    board_csv = folder / "elsewhere" / "outputs" / "results" / "leaderboard.csv"
    cell = pd.read_csv(board_csv).set_index("task").loc["listops"]
    assert cell.published == pytest.approx(36.37) and pd.notna(cell["diff"])


@pytest.mark.parametrize("name", ["published.csv", "baselines.csv"])
def test_the_package_ships_the_results_papers_numbers_and_baselines(name):
    """The leaderboard and the charts read the package's files (an install has no results/ folder); in the tree they
    are links to results/'s, one file each, which a wheel copies (the installed wheel's test reads them)."""
    shipped = leaderboard.PUBLISHED if name == "published.csv" else leaderboard.BASELINES
    assert shipped.parent == ROOT / "lra" / "report" and shipped.is_symlink()
    assert shipped.resolve() == (ROOT / "results" / name).resolve()


PLUGIN = '''
"""A mixer from outside the lra package (a test plugin): every token becomes the mean of the real tokens.
Complexity: O(N d). Paper: none, a stand-in (arxiv.org/abs/0000.00000)."""
from torch import nn

from models import register_model
from models.registry import Taxonomy


@register_model(name="plugin_mean")
class PluginMean(nn.Module):
    taxonomy = Taxonomy("Nobody 2026, arXiv 0000.00000", "N", ("M",), decode=False)

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *, scale: float = 1.0):
        super().__init__()
        self.proj, self.scale = nn.Linear(d_model, d_model), scale

    def forward(self, x, mask):
        m = mask.unsqueeze(-1).to(x.dtype)  # (B, N, 1)
        return self.scale * self.proj((x * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp_min(1)).expand_as(x)
'''


def write_plugin(folder: Path) -> Path:
    """A distribution in ``folder`` (for sys.path) with an ``lra.models`` entry point, as ``pip install`` would leave
    it."""
    (folder / "lra_plugin_demo.py").write_text(textwrap.dedent(PLUGIN))
    info = folder / "lra_plugin_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lra-plugin-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lra.models]\nplugin_mean = lra_plugin_demo\n")
    return folder


def train_the_plugin_and_run_the_registry_tests(folder: Path, environ: dict[str, str]) -> list:
    plugin = write_plugin(folder)
    env = {**environ, "PYTHONPATH": os.pathsep.join([str(plugin), str(ROOT)]),
           "LRA_CACHE_DIR": str(folder / "cache"), "LRA_RESULTS_DIR": str(folder / "results")}
    return finish_all(  # independent: side by side
        started([sys.executable, "-m", "lra", "model=plugin_mean", "model.scale=0.5", "experiment=smoke",
                 "schedule.steps=2", "schedule.eval_every=2", "task.seq_len=256", f"hydra.run.dir={folder / 'run'}"],
                cwd=ROOT, env=env),
        started([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_models.py", "-k",
                 "plugin_mean"], cwd=ROOT, env=env))


@in_background(train_the_plugin_and_run_the_registry_tests)
def test_a_plugin_model_trains_and_passes_the_registry_wide_tests(ran_in_background):
    (run, tests), tmp_path = ran_in_background()
    assert run.returncode == 0, run.stderr[-3000:]
    assert pd.read_csv(tmp_path / "results" / "runs.csv").model.tolist() == ["plugin_mean"]
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-3000:]
    assert "failed" not in tests.stdout


def list_the_models_with_the_plugin_named_in_the_environment(folder: Path, environ: dict[str, str]) -> list:
    plugin = write_plugin(folder)
    env = {**environ, "PYTHONPATH": os.pathsep.join([str(plugin), str(ROOT)]), "LRA_MODEL_MODULES": "lra_plugin_demo"}
    (plugin / "lra_plugin_demo-0.1.dist-info" / "entry_points.txt").unlink()
    return finish_all(  # side by side
        started([sys.executable, "-c", "import models; print(models.list_models())"], env=env),
        started([sys.executable, "-c", "import models; models.list_models()"],
                env={**env, "LRA_MODEL_MODULES": "no_such_plugin_module"}), timeout=300)


@in_background(list_the_models_with_the_plugin_named_in_the_environment)
def test_a_plugin_named_in_the_environment_registers(ran_in_background):
    (proc, broken), _ = ran_in_background()
    assert "plugin_mean" in proc.stdout, proc.stderr[-2000:]
    assert broken.returncode != 0 and "model plugin 'no_such_plugin_module'" in broken.stderr
