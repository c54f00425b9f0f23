"""Every config composes: each task with each model and trainer; overrides and multirun work."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from models import list_models, model_options
from tests.conftest import CONF, ROOT, compose_cfg

TASKS = sorted(p.stem for p in (CONF / "task").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
TRAINERS = sorted(p.stem for p in (CONF / "trainer").glob("*.yaml"))


def test_every_registered_model_has_a_config_and_back():
    assert MODELS == list_models()


@pytest.mark.parametrize("model", MODELS)
def test_model_config_holds_only_its_own_options(model):
    cfg = OmegaConf.load(CONF / "model" / f"{model}.yaml")
    assert cfg.name == model
    own = model_options(model)
    assert set(cfg) - {"name"} <= set(own), f"{model}.yaml sets options its constructor does not take"


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_task_composes_with_every_trainer(task, trainer):
    cfg = compose_cfg([f"task={task}", f"trainer={trainer}", "run_dir=x"])
    assert cfg.task.name == task and cfg.trainer.name == trainer
    for key in ("n_layers", "d_model", "n_heads", "d_qkv", "d_ff", "d_head", "dropout", "attn_dropout", "pooling"):
        assert key in cfg.backbone, f"{task}: backbone.{key} missing"
    assert cfg.train.steps > 0 and cfg.train.batch_size > 0 and cfg.optim.schedule in ("rsqrt", "cosine", "constant")
    if trainer == "smoke":
        assert cfg.device == "cpu" and all(v is not None for v in cfg.data.limit.values())


@pytest.mark.parametrize("model", MODELS)
def test_every_model_composes_with_every_task(model):
    for task in TASKS:
        cfg = compose_cfg([f"task={task}", f"model={model}", "run_dir=x"])
        assert cfg.model.name == model


def test_overrides_reach_the_config():
    cfg = compose_cfg(["model=transformer", "train.steps=7", "backbone.d_model=32", "seed=5", "run_dir=x"])
    assert (cfg.train.steps, cfg.backbone.d_model, cfg.seed) == (7, 32, 5)


def test_listops_task_is_the_lra_config():
    cfg = compose_cfg(["run_dir=x"])
    b, o, t = cfg.backbone, cfg.optim, cfg.train
    assert (b.n_layers, b.n_heads, b.d_model, b.d_ff, t.batch_size, t.steps) == (4, 8, 512, 1024, 32, 5000)
    assert (o.schedule, o.warmup_steps, list(o.betas), o.eps) == ("rsqrt", 1000, [0.9, 0.98], 1e-9)
    assert (cfg.task.seq_len, cfg.task.n_classes, cfg.trainer.name) == (2000, 10, "lra")


def test_multirun_sweeps_models(tmp_path):
    """`-m model=a,b` runs both through the CLI and both rows land in one runs.csv."""
    cmd = [sys.executable, "-m", "lra", "-m", "model=transformer,linear", "seed=1", "trainer=smoke",
           "train.steps=3", "train.eval_every=3", "data.limit.train=24", "data.limit.val=8", "data.limit.test=8",
           f"results.dir={tmp_path / 'results'}", f"data.cache_dir={tmp_path / 'cache'}",
           f"hydra.sweep.dir={tmp_path / 'multirun'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (tmp_path / "results" / "runs.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 2 and {r.split(",")[1] for r in rows[1:]} == {"transformer", "linear"}
    assert len(list(Path(tmp_path / "multirun").glob("listops/*/*/result.json"))) == 2
