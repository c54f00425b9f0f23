"""A non-editable install works from any folder: the configs ship inside the package, the `lra` console script
runs the smoke command, and the commit is reported plainly as unknown without a checkout; plugin models from
outside the package register through an entry point and the registry-wide tests run against them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

from tests.conftest import ROOT, finish_all, started


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``pip install --no-deps .`` (a built wheel, not editable) into a folder of its own."""
    target = tmp_path_factory.mktemp("site")
    src = tmp_path_factory.mktemp("src") / "lra"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "outputs", "*.egg-info", "__pycache__", "results",
                                                              "notebooks", "tests", "build"))  # .*: .git, caches
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def test_the_console_script_runs_the_smoke_command_from_another_folder(installed, tmp_path):
    """... writing its outputs under ./outputs of the folder it runs in, never into the project's results/."""
    before = (ROOT / "results" / "runs.csv").read_bytes()
    env = {**os.environ, "PYTHONPATH": str(installed), "LRA_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("LRA_GIT_SHA", None)
    env.pop("LRA_RESULTS_DIR", None)
    script = "import sys; sys.argv[0] = 'lra'; from lra.__main__ import cli; sys.exit(cli())"
    proc = subprocess.run([sys.executable, "-c", script, "task=listops", "model=transformer", "experiment=smoke",
                           "schedule.steps=2", "schedule.eval_every=2"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import_check = subprocess.run([sys.executable, "-c", "import lra; print(lra.__file__)"], cwd=tmp_path, env=env,
                                  capture_output=True, text=True)
    assert import_check.stdout.startswith(str(installed))  # the installed copy ran, not this checkout
    rows = pd.read_csv(tmp_path / "outputs" / "results" / "runs.csv")
    assert len(rows) == 1 and (ROOT / "results" / "runs.csv").read_bytes() == before
    row = rows.iloc[0]
    assert row.status == "ok" and row.git_sha.startswith("unknown (lra ") and "no git checkout" in row.git_sha


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


@pytest.fixture
def plugin(tmp_path):
    """A distribution on sys.path with an ``lra.models`` entry point, as ``pip install`` would leave it."""
    (tmp_path / "lra_plugin_demo.py").write_text(textwrap.dedent(PLUGIN))
    info = tmp_path / "lra_plugin_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lra-plugin-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lra.models]\nplugin_mean = lra_plugin_demo\n")
    return tmp_path


def test_a_plugin_model_trains_and_passes_the_registry_wide_tests(plugin, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), str(ROOT)]),
           "LRA_CACHE_DIR": str(tmp_path / "cache"), "LRA_RESULTS_DIR": str(tmp_path / "results")}
    run, tests = finish_all(  # independent: side by side
        started([sys.executable, "-m", "lra", "model=plugin_mean", "model.scale=0.5", "experiment=smoke",
                 "schedule.steps=2", "schedule.eval_every=2", "task.seq_len=256", f"hydra.run.dir={tmp_path / 'run'}"],
                cwd=ROOT, env=env),
        started([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_models.py", "-k",
                 "plugin_mean"], cwd=ROOT, env=env))
    assert run.returncode == 0, run.stderr[-3000:]
    assert pd.read_csv(tmp_path / "results" / "runs.csv").model.tolist() == ["plugin_mean"]
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-3000:]
    assert "failed" not in tests.stdout


def test_a_plugin_named_in_the_environment_registers(plugin):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), str(ROOT)]),
           "LRA_MODEL_MODULES": "lra_plugin_demo"}
    (plugin / "lra_plugin_demo-0.1.dist-info" / "entry_points.txt").unlink()
    proc, broken = finish_all(  # side by side
        started([sys.executable, "-c", "import models; print(models.list_models())"], env=env),
        started([sys.executable, "-c", "import models; models.list_models()"],
                env={**env, "LRA_MODEL_MODULES": "no_such_plugin_module"}), timeout=300)
    assert "plugin_mean" in proc.stdout, proc.stderr[-2000:]
    assert broken.returncode != 0 and "model plugin 'no_such_plugin_module'" in broken.stderr
