"""Data generation and the tensor cache under concurrent runs on a cold cache (one builds, the others wait, no one
reads a partial set), and a cache file changed on disk is detected and rebuilt, never trusted."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
from pathlib import Path

import pandas as pd
import pytest
import torch

import lra.train.run as runner
from lra.data import load_task
from tests.conftest import compose_cfg

pytestmark = pytest.mark.heavy  # CI's second tier (.ci/run): many processes on one cold cache


def fingerprint(data) -> str:
    h = hashlib.sha256()
    for split in (data.train, data.val, data.test):
        h.update(split.tokens.numpy().tobytes())
        h.update(split.labels.numpy().tobytes())
    return h.hexdigest()


def _load_and_train(cfg, train: bool, queue) -> None:
    torch.set_num_threads(1)
    try:
        digest = fingerprint(load_task(cfg))
        row = runner.run(cfg) if train else None
        queue.put(("ok", digest, row and row["status"]))
    except BaseException as e:
        queue.put(("error", f"{type(e).__name__}: {e}", None))


def start_together(cfgs, train: bool) -> list:
    # Processes of their own, as concurrent runs are, but forked from a server that imported the runner once (it never
    # ran torch, so no thread pool is forked mid-use, as forking this process could deadlock): a spawned child spent
    # its first seconds importing torch, eight of them about half of this module's time on two cores.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["lra.train.run"])
    queue = ctx.Queue()
    procs = [ctx.Process(target=_load_and_train, args=(cfg, train, queue)) for cfg in cfgs]
    for p in procs:
        p.start()
    results = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return results


def cfgs(tmp_path: Path, n: int, *overrides: str) -> list:
    return [compose_cfg(["experiment=smoke", f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / f'run{i}'}",
                         f"results.dir={tmp_path / 'results'}", "schedule.steps=2", "schedule.eval_every=2",
                         *overrides]) for i in range(n)]


def test_eight_listops_runs_on_a_cold_cache_see_one_dataset_and_write_eight_rows(tmp_path):
    results = start_together(cfgs(tmp_path, 8, "data.limit.train=64", "data.limit.val=16", "data.limit.test=16",
                                  "backbone.n_layers=1", "task.seq_len=256"), train=True)
    assert all(r[0] == "ok" for r in results), [r for r in results if r[0] != "ok"]
    assert len({r[1] for r in results}) == 1  # eight identical datasets
    rows = pd.read_csv(tmp_path / "results" / "runs.csv")
    assert len(rows) == 8 and (rows.status == "ok").all()
    assert len(list((tmp_path / "cache" / "listops").glob("*/listops-1000/basic_train.tsv"))) == 1


def test_four_pathfinder_loads_on_a_cold_cache_see_one_dataset(tmp_path):
    results = start_together(cfgs(tmp_path, 4, "task=pathfinder", "data.limit.train=16", "data.limit.val=2",
                                  "data.limit.test=2", "data.workers=1"), train=False)
    assert all(r[0] == "ok" for r in results), [r for r in results if r[0] != "ok"]
    assert len({r[1] for r in results}) == 1


def test_a_cache_file_changed_in_place_is_rebuilt(tmp_path, caplog):
    cfg = cfgs(tmp_path, 1, "data.limit.train=16", "data.limit.val=4", "data.limit.test=4")[0]
    first = load_task(cfg)
    cache = next((tmp_path / "cache").glob("listops-*.pt"))
    raw = bytearray(cache.read_bytes())
    raw[-200:-100] = bytes(100)  # bit rot: bytes overwritten, the size unchanged
    cache.write_bytes(bytes(raw))
    again = load_task(cfg)
    assert again.info["cache"] == "miss" and "does not match its recorded SHA-256" in caplog.text
    assert fingerprint(again) == fingerprint(first)
    assert load_task(cfg).info["cache"] == "hit"
