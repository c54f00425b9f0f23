"""A `trainer=smoke` run of every task through run(cfg) on CPU, on small files in each task's original
format (written by the fixtures of test_data_tasks.py). Path-X keeps its 16,384-token length."""
from __future__ import annotations

import time

import lra.run as runner
from tests.test_data_tasks import aan_root, cifar_parquet, imdb_parquet, write_pathfinder  # noqa: F401 (fixtures)

FAST = ("train.steps=4", "train.eval_every=2", "train.batch_size=4", "trainer.eval_batch_size=4")


def smoke(smoke_cfg, task: str, *overrides: str) -> dict:
    start = time.perf_counter()
    row = runner.run(smoke_cfg(f"task={task}", *FAST, *overrides))
    assert time.perf_counter() - start < 60, f"{task}: smoke run took over a minute"
    assert row["task"] == task and row["trainer"] == "smoke" and row["steps"] > 0
    assert 0.0 <= row["test_acc"] <= 1.0
    return row


def test_text_smoke(smoke_cfg, imdb_parquet):  # noqa: F811
    assert smoke(smoke_cfg, "text", f"data.path={imdb_parquet}")["seq_len"] == 4096


def test_retrieval_smoke_is_a_two_tower_run(smoke_cfg, aan_root):  # noqa: F811
    assert smoke(smoke_cfg, "retrieval", f"data.root={aan_root}")["seq_len"] == 4000


def test_image_smoke(smoke_cfg, cifar_parquet):  # noqa: F811
    assert smoke(smoke_cfg, "image", f"data.path={cifar_parquet}")["seq_len"] == 1024


def test_pathfinder_smoke_generates_its_slice(smoke_cfg):
    row = smoke(smoke_cfg, "pathfinder", "data.limit.train=8", "data.limit.val=4", "data.limit.test=4")
    assert row["seq_len"] == 1024


def test_pathx_smoke_keeps_16k_tokens(smoke_cfg, tmp_path):
    root, _ = write_pathfinder(tmp_path / "release", res=128)
    # 16K tokens of attention on 2 CPU cores: one layer, two steps, a few examples per split
    row = smoke(smoke_cfg, "pathx", f"data.root={root}", "train.batch_size=2", "trainer.eval_batch_size=2",
                "train.steps=2", "backbone.n_layers=1", "data.limit.train=4", "data.limit.val=2", "data.limit.test=2")
    assert row["seq_len"] == 16384
