"""python -m lra.layer_bench: one mixer layer timed on CPU, rows written, and ours set beside the public packages."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from lra import layer_bench


def test_time_layer_on_cpu():
    ms, peak = layer_bench.time_layer("linear", 64, 2, torch.device("cpu"), warmup=1, steps=2)
    assert ms > 0 and peak is None  # peak memory is measured on CUDA only
    with pytest.raises(TypeError, match="no option"):
        layer_bench.time_layer("linear", 64, 2, torch.device("cpu"), warmup=0, steps=1, options={"blok": 1})


def test_public_packages_and_comparison():
    ref = layer_bench.peers()
    assert set(ref.model) >= {"transformer", "linear", "linformer", "reformer", "performer", "local"}
    assert set(ref.seq_len) == {1024, 4096, 16384}
    row = ref[(ref.model == "performer") & (ref.seq_len == 4096)].iloc[0]
    assert row.ms_fwd_bwd == pytest.approx(15.2) and row.peak_mb == pytest.approx(3404)
    ours = pd.DataFrame([dict(model="reformer", seq_len=4096, batch_size=32, ms_fwd_bwd=5.0, peak_mb=900.0),
                         dict(model="sparse", seq_len=4096, batch_size=32, ms_fwd_bwd=3.0, peak_mb=800.0)])
    table = layer_bench.compare(ours, ref)
    reformer = table[table.model == "reformer"].set_index("implementation")
    assert len(reformer) == 2  # one row per public implementation (1 and 4 hashes)
    assert reformer.loc["reformer-pytorch 1.4.4 (1 hash)", "speedup"] == pytest.approx(11.3 / 5.0)
    assert table[table.model == "sparse"].implementation.isna().all()  # no public package measured


def test_main_writes_rows(tmp_path, capsys):
    out = tmp_path / "layers.csv"
    layer_bench.main(["--models", "linear,transformer", "--shapes", "64x2", "--warmup", "0", "--steps", "1",
                      "--device", "cpu", "--out", str(out)])
    rows = pd.read_csv(out)
    assert list(rows.columns) == layer_bench.COLUMNS and list(rows.model) == ["linear", "transformer"]
    assert (rows.status == "ok").all() and (rows.ms_fwd_bwd > 0).all() and (rows.precision == "fp32").all()
    assert "linear" in capsys.readouterr().out
