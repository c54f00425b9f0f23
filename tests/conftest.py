"""Shared fixtures: Hydra composition from conf/, and isolated cache/result folders per test."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

# Triton kernels (models/_favor_triton.py) run on the CPU through Triton's interpreter where there is no GPU. Triton
# reads this when first imported, and torch imports it, so it is set before anything imports torch.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hydra import compose, initialize_config_dir

import lra.config  # registers the config schema with Hydra's ConfigStore

lra.config.register_plugin_model_configs()  # models from outside the package compose as model=<name> too

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "lra" / "conf"
SHARED_DATA = ROOT.parent / "shared" / "data"


def compose_cfg(overrides: list[str], config_name: str = "config"):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name, overrides=overrides)


@pytest.fixture
def smoke_cfg(tmp_path):
    """Compose a smoke config writing only under tmp_path; pass extra overrides."""

    def make(*overrides: str):
        return compose_cfg([
            "experiment=smoke", f"run_dir={tmp_path / 'run'}", f"results.dir={tmp_path / 'results'}",
            f"data.cache_dir={tmp_path / 'cache'}", *overrides,
        ])

    return make


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests need CUDA: without it they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (a GPU test); run `python -m pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
