"""The speed/memory bench: rows, relative figures, OOM and error rows, the printed table, the Hydra app, W&B."""
from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from lra.bench import bench
from lra.config import BenchSettings
from lra.report.results import BENCH_COLUMNS
from lra.train import engine
from models import registry
from tests.conftest import ROOT, compose_cfg, in_background

TINY = dict(n_layers=1, d_model=32, n_heads=2, d_qkv=32, d_ff=64, d_classifier=32, dropout=0.1, attn_dropout=0.1,
            positions="learned", pooling="mean", cls_token=None)


class MeanMixer(nn.Module):
    """A cheap non-attention mixer (every token gets the masked mean), registered only inside these tests."""

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, mask):
        m = mask.unsqueeze(-1).to(x.dtype)  # (B, N, 1)
        mean = (x * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)  # (B, 1, D)
        return self.proj(mean).expand_as(x)  # (B, N, D)


@pytest.fixture
def mean_mixer(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "bench_mean", MeanMixer)
    return "bench_mean"


def make_cfg(tmp_path, models, lengths, **bench_overrides):
    b = dict(models=models, lengths=lengths, batch_size=2, batch_sizes={}, warmup=1, steps=2, compile="auto",
             compile_check=BenchSettings.compile_check, precision="auto", vocab_size=257,
             out=str(tmp_path / "bench.csv"), progress=False)
    b.update(bench_overrides)
    return OmegaConf.create(dict(seed=0, device="cpu", task=dict(name="text", seq_len=1000),
                                 backbone=dict(TINY), bench=b, logger=dict(name="none")))


def test_a_rows_peak_leaves_out_what_was_allocated_before_its_model(tmp_path, monkeypatch, mean_mixer):
    """What is still allocated once earlier cases are freed (a mixer's module-level cache, say) is not the row's:
    it is taken off the peak, and the relative memory divides the rows' own peaks."""
    freed = []
    monkeypatch.setattr(engine, "release_leftovers", lambda device: freed.append(device.type) or 100.0)
    monkeypatch.setattr(engine, "peak_memory_mb", lambda device: 350.0)
    df = bench.run_bench(make_cfg(tmp_path, ["transformer", mean_mixer], [64]))
    assert freed == ["cpu", "cpu"] and df["peak_mem_mb"].tolist() == [250.0, 250.0]  # once a case, before it
    assert df["rel_mem"].tolist() == [1.0, 1.0]


def test_bench_rows_and_relative_figures(tmp_path, mean_mixer):
    cfg = make_cfg(tmp_path, [mean_mixer, "transformer"], [64, 128])
    df = bench.run_bench(cfg)
    assert list(df["model"]) == ["transformer", "transformer", mean_mixer, mean_mixer]  # baseline first
    assert (df["status"] == "ok").all()
    csv = pd.read_csv(tmp_path / "bench.csv")
    assert list(csv.columns) == BENCH_COLUMNS and len(csv) == 4
    for r in csv.itertuples():
        assert r.steps_per_s > 0 and r.examples_per_s == pytest.approx(2 * r.steps_per_s, rel=1e-4)
        assert r.ms_per_step == pytest.approx(1000 / r.steps_per_s, rel=1e-4)
        assert r.peak_mem_mb > 0 and r.params > 0 and r.precision == "fp32" and not r.compiled
        assert r.ms_p10 <= r.ms_per_step <= r.ms_p90  # the spread of the timed steps
        base = csv[(csv.model == "transformer") & (csv.seq_len == r.seq_len)].iloc[0]
        assert r.rel_speed == pytest.approx(r.steps_per_s / base.steps_per_s, rel=1e-3)
        assert r.rel_mem == pytest.approx(r.peak_mem_mb / base.peak_mem_mb, rel=1e-3)
    t = csv[csv.model == "transformer"]
    assert (t.rel_speed == 1).all() and t.sdpa_backend.notna().all()  # the transformer runs a fused SDPA kernel
    assert csv[csv.model == mean_mixer].sdpa_backend.isna().all()  # ... and the mean mixer none
    # learned positions grow with N: the parameter count shows the model was built at the bench length
    assert t.params.iloc[1] - t.params.iloc[0] == 64 * 32

    table = bench.format_table(df)
    assert "transformer" in table and mean_mixer in table and "64" in table and "128" in table
    assert "(1.0x)" in table and "Peak memory" in table

    # a later sweep without the transformer takes its baseline from the earlier rows of bench.csv
    df2 = bench.run_bench(make_cfg(tmp_path, [mean_mixer], [128]))
    base = csv[(csv.model == "transformer") & (csv.seq_len == 128)].iloc[0]
    assert df2["rel_speed"].iloc[0] == pytest.approx(df2["steps_per_s"].iloc[0] / base.steps_per_s, rel=1e-3)
    # ... but not from rows of another backbone
    other = make_cfg(tmp_path, [mean_mixer], [128])
    other.backbone.d_ff = 96
    assert pd.isna(bench.run_bench(other)["rel_speed"].iloc[0])
    assert len(pd.read_csv(tmp_path / "bench.csv")) == 6  # append-only


def test_compile_mode_is_passed_recorded_and_compared_within_its_mode(tmp_path, monkeypatch, mean_mixer):
    """bench.compile_mode=reduce-overhead (CUDA graphs, as trainer.compile_mode) compiles every model in that mode
    and the rows say so (the default mode stays blank, as in rows older than the column); a later sweep in that mode
    takes no baseline from the default mode's transformer; a mode torch.compile lacks, or fewer than 3 warm-up steps
    to record the graphs in, are refused before any case runs."""
    modes, unchecked = [], dict(compile="true", compile_check="false")  # the compile check: its own tests
    monkeypatch.setattr(torch, "compile", lambda model, dynamic, mode: modes.append(mode) or model)
    default = bench.run_bench(make_cfg(tmp_path, ["transformer"], [64], **unchecked))
    assert modes == ["default"] and default["compile_mode"].tolist() == [""]
    cfg = make_cfg(tmp_path, [mean_mixer], [64], **unchecked, compile_mode="reduce-overhead", warmup=3)
    graphs = bench.run_bench(cfg)
    assert modes[1:] == ["reduce-overhead"] and graphs["compile_mode"].tolist() == ["reduce-overhead"]
    assert pd.isna(graphs["rel_speed"].iloc[0])  # the only transformer row ran in the default mode
    assert pd.read_csv(tmp_path / "bench.csv")["compile_mode"].fillna("").tolist() == ["", "reduce-overhead"]
    with pytest.raises(ValueError, match="choose one of default, reduce-overhead"):
        bench.run_bench(make_cfg(tmp_path, [mean_mixer], [64], **unchecked, compile_mode="fast"))
    with pytest.raises(ValueError, match="set bench.warmup to 3 or more"):
        bench.run_bench(make_cfg(tmp_path, [mean_mixer], [64], **unchecked, compile_mode="reduce-overhead"))


class ScaledLogits(nn.Module):
    """A stand-in for torch.compile whose model computes other numbers (logits x ``factor``: other gradients)."""

    factor = 2.0

    def __init__(self, model, **kwargs):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.factor * self.model(*args)


def test_the_compile_check_decides_as_the_runner_and_the_row_says_so(tmp_path, monkeypatch, mean_mixer, caplog):
    """bench.compile_check (as trainer.compile_check; true here, off the GPU): a compiled model whose gradients the
    check rejects is timed eagerly, as training with compile=auto would run it: compiled False and compile_note the
    finding (the parameter, both errors). With compile=true the row is an error, as the training run would stop;
    right gradients leave it compiled."""
    monkeypatch.setattr(engine, "resolve_compile", lambda flag, device: True)  # compile=auto compiles here
    monkeypatch.setattr(torch, "compile", ScaledLogits)
    df = bench.run_bench(make_cfg(tmp_path, [mean_mixer], [64], compile_check="true"))
    row = df.iloc[0]
    assert row["status"] == "ok" and not row["compiled"]  # the check's compile, none for the timing
    note = row["compile_note"]
    assert note.startswith("compile check: ") and "of its size off float64's compiled, " in note
    assert "timing it eagerly" in caplog.text
    stored = pd.read_csv(tmp_path / "bench.csv").iloc[-1]
    assert not stored.compiled and stored.compile_note == note
    refused = bench.run_bench(make_cfg(tmp_path, [mean_mixer], [64], compile="true", compile_check="true")).iloc[0]
    assert refused["status"].startswith("error: RuntimeError: torch.compile gives bench_mean other gradients")
    assert "bench.compile=auto runs it eagerly instead" in caplog.text  # the row keeps a line, the log the rest
    monkeypatch.setattr(ScaledLogits, "factor", 1.0)  # compiled to the same numbers
    right = bench.run_bench(make_cfg(tmp_path, [mean_mixer], [64], compile_check="true")).iloc[0]
    assert right["status"] == "ok" and right["compiled"] and pd.isna(right["compile_note"])
    with pytest.raises(ValueError, match="bench.compile_check='sometimes' is not valid"):
        bench.run_bench(make_cfg(tmp_path, [mean_mixer], [64], compile_check="sometimes"))


def test_the_compile_check_runs_wherever_a_model_is_compiled_unless_turned_off(tmp_path, monkeypatch, mean_mixer):
    """bench.compile_check=auto (its default) checks a compiled case on the CPU as on CUDA (Inductor's CPU code is
    wrong in places too); false compiles unchecked; an eager case is never checked."""
    calls = []
    monkeypatch.setattr(engine, "compiled_gradient_check",
                        lambda *a, **k: calls.append(1) or engine.GradientCheck(precision="fp32"))
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    row = bench.run_bench(make_cfg(tmp_path, [mean_mixer], [64], compile="true")).iloc[0]
    assert calls == [1] and row["compiled"] and pd.isna(row["compile_note"])
    row = bench.run_bench(make_cfg(tmp_path, [mean_mixer], [64], compile="true", compile_check="false")).iloc[0]
    assert calls == [1] and row["compiled"]
    row = bench.run_bench(make_cfg(tmp_path, [mean_mixer], [64], compile="false")).iloc[0]
    assert calls == [1] and not row["compiled"]


def test_variants_are_rows_labelled_by_their_options(tmp_path, monkeypatch):
    """bench.variants benches a model with options changed, in rows named after them; a misspelt option fails
    before the sweep."""
    built = []
    real = engine.build_model

    def spy(name, options, *args, **kwargs):
        built.append((name, dict(options)))
        return real(name, options, *args, **kwargs)

    monkeypatch.setattr(engine, "build_model", spy)
    cfg = make_cfg(tmp_path, ["transformer", "local"], [128], variants=[{"model": "local", "block": 64}])
    df = bench.run_bench(cfg)
    assert list(df["model"]) == ["transformer", "local", "local(block=64)"] and (df["status"] == "ok").all()
    assert built[1] == ("local", {}) and built[2] == ("local", {"block": 64})
    assert "local(block=64)" in bench.format_table(df)
    with pytest.raises(ValueError, match="no option.*blok"):
        bench.run_bench(make_cfg(tmp_path, ["transformer"], [128], variants=[{"model": "local", "blok": 64}]))
    with pytest.raises(ValueError, match="names no model"):
        bench.run_bench(make_cfg(tmp_path, ["transformer"], [128], variants=[{"block": 64}]))
    assert len(pd.read_csv(tmp_path / "bench.csv")) == 3  # the failed configurations wrote nothing


def test_a_variant_can_choose_how_a_mixer_runs(tmp_path, monkeypatch):
    """bench.variants may set how a mixer runs (its ``backend``, or another of ``execution_settings``: attributes,
    not constructor options) on every layer of the model; a setting the mixer lacks fails before the sweep."""
    seen = []
    real = bench.time_steps

    def spy(fn, *args, **kwargs):
        seen.append([(getattr(m, "backend", None), getattr(m, "compile_sinkhorn", None)) for m in fn.modules()
                     if type(m).__name__ in ("Synthesizer", "Sinkhorn")])
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(bench, "time_steps", spy)
    variants = [{"model": "synthesizer", "backend": "explicit"}, {"model": "sinkhorn", "compile_sinkhorn": False}]
    cfg = make_cfg(tmp_path, ["synthesizer"], [128], compile=False, variants=variants)
    df = bench.run_bench(cfg)
    assert list(df["model"]) == ["synthesizer", "synthesizer(backend=explicit)", "sinkhorn(compile_sinkhorn=False)"]
    layers = TINY["n_layers"]
    assert seen == [[("auto", None)] * layers, [("explicit", None)] * layers, [(None, False)] * layers]
    assert list(df["status"]) == ["ok", "ok", "ok"]
    with pytest.raises(ValueError, match="linformer.*no option.*backend.*how it runs: none"):
        bench.run_bench(make_cfg(tmp_path, ["synthesizer"], [128], compile=False,
                                 variants=[{"model": "linformer", "backend": "torch"}]))


def test_oom_and_errors_are_rows_and_the_sweep_goes_on(tmp_path, monkeypatch, mean_mixer, caplog):
    real = bench.time_steps

    def flaky(model, tokens, labels, **kw):
        if tokens.shape[-1] == 128:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if tokens.shape[-1] == 96:
            raise RuntimeError("CUDA error: out of memory")
        if tokens.shape[-1] == 80:
            raise ValueError("no kernel for this shape\nsecond line")
        return real(model, tokens, labels, **kw)

    monkeypatch.setattr(bench, "time_steps", flaky)
    df = bench.run_bench(make_cfg(tmp_path, ["transformer", mean_mixer], [64, 80, 96, 128]))
    status = {(r.model, r.seq_len): r.status for r in df.itertuples()}
    for m in ("transformer", mean_mixer):
        assert status[(m, 64)] == "ok"
        assert status[(m, 96)] == status[(m, 128)] == "oom"
        assert status[(m, 80)] == "error: ValueError: no kernel for this shape"
    csv = pd.read_csv(tmp_path / "bench.csv")
    failed = csv[csv.status != "ok"]
    assert len(csv) == 8 and failed.steps_per_s.isna().all() and failed.rel_speed.isna().all()
    assert (failed.params > 0).all()  # the model was built before it ran out of memory
    table = bench.format_table(df)
    assert "OOM" in table and "ERR" in table and "no kernel for this shape" in table
    logged = [r for r in caplog.records if r.name == "lra.bench" and r.levelname == "ERROR"]
    assert len(logged) == 2 and all(r.exc_info and "second line" in str(r.exc_info[1]) for r in logged)


def test_oom_detection():
    assert bench.is_oom(torch.cuda.OutOfMemoryError("x"))
    assert bench.is_oom(RuntimeError("CUDA out of memory. Tried to allocate"))
    assert bench.is_oom(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory"))
    assert not bench.is_oom(RuntimeError("shape mismatch"))
    assert not bench.is_oom(ValueError("out of memory"))


def test_sdpa_backend_names():
    names = ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_cudnn_attention",
             "aten::_scaled_dot_product_cudnn_attention_backward", "aten::mm"]
    assert bench.sdpa_backend(names) == "cudnn"
    assert bench.sdpa_backend(["aten::_scaled_dot_product_flash_attention_for_cpu",
                               "aten::_scaled_dot_product_attention_math"]) == "flash_cpu+math"
    assert bench.sdpa_backend(["aten::mm"]) == ""


def test_per_length_batch_sizes(tmp_path):
    df = bench.run_bench(make_cfg(tmp_path, ["transformer"], [32, 64], batch_sizes={64: 1}, steps=1))
    assert list(df["batch_size"]) == [2, 1]
    assert df["examples_per_s"].iloc[1] == pytest.approx(df["steps_per_s"].iloc[1])
    assert "(B1)" in bench.format_table(df)


def test_bench_config_is_the_lra_table2_protocol():
    cfg = compose_cfg(["run_dir=x"], config_name="bench")
    assert cfg.task.name == "text" and cfg.bench.lengths == [1024, 2048, 3072, 4096]
    assert cfg.bench.batch_size == 32 and cfg.bench.models is None and cfg.bench.out.endswith("results/bench.csv")
    assert {"n_layers", "d_model", "n_heads", "d_qkv", "d_ff", "d_classifier", "pooling"} <= set(cfg.backbone)


def test_a_2d_mixer_is_benched_on_a_square_grid_only():
    assert bench.bench_shape("transformer", "text", 1000, 257).grid is None

    class Grid2D:
        needs_grid = True

    registry._REGISTRY["bench_grid"] = Grid2D
    try:
        assert bench.bench_shape("bench_grid", "text", 1024, 257).grid == (32, 32)
        with pytest.raises(ValueError, match="square lengths"):
            bench.bench_shape("bench_grid", "text", 2048, 257)
    finally:
        del registry._REGISTRY["bench_grid"]


def test_a_sweep_skips_a_2d_mixers_non_square_lengths_without_error_rows(tmp_path, caplog):
    with caplog.at_level("INFO", logger="lra.bench"):
        df = bench.run_bench(make_cfg(tmp_path, ["axial"], [16, 32]))
    assert list(df["seq_len"]) == [16] and (df["status"] == "ok").all()
    assert "not benched at the non-square lengths 32" in caplog.text


def test_wandb_logging_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "600")  # a busy machine starts the wandb service slowly
    cfg = make_cfg(tmp_path, ["transformer"], [32, 64], steps=1)
    cfg.logger = OmegaConf.create(dict(name="wandb", project="lra-test", entity=None, mode="offline", tags=["test"]))
    cfg.run_dir = str(tmp_path / "bench_run")  # the bench's folder takes its wandb files, whatever ran before
    bench.run_bench(cfg)
    runs = list((tmp_path / "bench_run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    media = list(runs[0].rglob("*.png"))
    names = sorted(p.name for p in media)  # both charts went up as images, named by their keys
    assert len(names) == 2 and names[0].startswith("examples_per_s_vs_length") and names[1].startswith("peak_mem")
    assert list(runs[0].rglob("*.table.json"))


def test_a_sweep_from_4k_up_prints_the_measured_exponent_beside_the_declared_complexity():
    rows = pd.DataFrame([dict(model=m, seq_len=n, batch_size=8, status="ok", ms_per_step=ms, peak_mem_mb=ms * 10,
                              device="GPU", timestamp=f"2026-01-01T00:00:{i:02d}Z")
                         for i, (m, n, ms) in enumerate([("transformer", 4096, 1.0), ("transformer", 8192, 4.0),
                                                          ("linear", 4096, 1.0), ("linear", 8192, 2.0)])])
    text = bench.format_exponents(rows)
    assert "transformer" in text and " 2.00 / 2.00   declared N^2" in text and " 1.00 / 1.00   declared N" in text
    assert bench.format_exponents(rows[rows.seq_len == 4096]) == ""  # one length: nothing to fit


def test_attention_dropout_is_the_same_for_every_mixer_and_stated(tmp_path):
    cfg = make_cfg(tmp_path, ["transformer"], [32])
    cfg.backbone.attn_dropout = 0.1  # the task's, which only mixers with an attention matrix would pay
    df = bench.run_bench(cfg)
    assert df.backbone.iloc[0].endswith("drop0.1/0.0") and cfg.backbone.attn_dropout == 0.1  # the caller's is kept
    assert "0.1 / 0.0, the same for every mixer" in bench.format_table(df)
    cfg.bench.attn_dropout = None  # the task's own
    df = bench.run_bench(cfg)
    assert df.backbone.iloc[0].endswith("drop0.1/0.1")
    assert "attention dropout only where a mixer has an attention matrix" in bench.format_table(df)


def test_median_and_spread_of_timed_calls():
    """The bench and the layer bench summarise their timed calls alike: median, 10th and 90th percentile."""
    assert engine.median_and_spread([float(t) for t in range(1, 11)]) == pytest.approx((5.5, 1.9, 9.1))
    # a few calls far apart: the percentiles stay between the fastest and the slowest (never extrapolated past them)
    assert engine.median_and_spread([6.3, 6.3, 7.9]) == pytest.approx((6.3, 6.3, 7.58))
    median, _, p90 = engine.median_and_spread([4.0, 4.0, 4.0, 4.0, 40.0])
    assert median == 4.0 and p90 > 20  # one slow call moves the spread, not the median
    assert engine.median_and_spread([3.0]) == (3.0, 3.0, 3.0)  # a single call is its own spread


@pytest.mark.gpu
def test_under_cuda_graphs_the_peak_counts_the_graphs_memory(tmp_path, mean_mixer):
    """bench.compile_mode=reduce-overhead on a GPU: the row's peak counts the memory the graphs took as they were
    recorded (in the warm-up), not the replays' alone, which allocate nothing: about the default mode's peak. The
    mixer runs no attention kernel, so both modes run the same operations (the transformer read 687 MB in the
    default mode and 65 under CUDA graphs on an H200, its SDPA kernel perhaps another under graph capture)."""
    peaks, rows = {}, {}
    for mode in ("default", "reduce-overhead"):
        cfg = make_cfg(tmp_path, [mean_mixer], [1024], batch_size=16, compile="true", compile_mode=mode, warmup=3)
        cfg.device = "cuda"
        cfg.backbone.update(d_model=256, n_heads=4, d_qkv=256, d_ff=512, d_classifier=256)
        rows[mode] = bench.run_bench(cfg).iloc[0]
        peaks[mode] = float(rows[mode]["peak_mem_mb"])
    seen = {mode: (row["mem_kind"], row["status"]) for mode, row in rows.items()}
    assert 0.7 * peaks["default"] < peaks["reduce-overhead"] < 2 * peaks["default"], (peaks, seen)


# The commands below run in the background from the session's first test (``in_background``): last here, so that
# the tests above run beside them.
def tiny_bench(args: list[str], cwd, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -m lra.bench`` over a one-step, length-32 bench of the TINY backbone, with ``args`` added."""
    tiny = ["bench.lengths=[32]", "bench.batch_size=2", "bench.warmup=1", "bench.steps=1", "bench.progress=false"]
    tiny += [f"backbone.{k}={v}" for k, v in TINY.items() if k not in ("positions", "pooling", "cls_token")]
    return subprocess.run([sys.executable, "-m", "lra.bench", *args, *tiny], cwd=cwd,
                          env=dict(env, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)


def bench_cli(folder, environ: dict[str, str]) -> subprocess.CompletedProcess:
    return tiny_bench(["bench.models=[transformer]", "device=cpu", f"bench.out={folder / 'b.csv'}",
                       f"hydra.run.dir={folder}/h"], ROOT, environ)


@in_background(bench_cli)
def test_cli(ran_in_background):
    p, tmp_path = ran_in_background()
    out = tmp_path / "b.csv"
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Speed: training steps/s" in p.stdout and "transformer" in p.stdout
    row = pd.read_csv(out).iloc[0]
    assert row.status == "ok" and row.seq_len == 32 and row.task == "text"


def bench_sweep_under_the_gpu_launcher(folder, environ: dict[str, str]) -> subprocess.CompletedProcess:
    return tiny_bench(["-m", "hydra/launcher=gpus", "hydra.launcher.gpus=2", "bench.models=[linear],[local]",
                       f"bench.out={folder / 'b.csv'}"], folder, dict(environ, LRA_GPU_LOCKS=str(folder / "locks")))


@pytest.mark.heavy  # CI's second tier: a launcher and its processes
@in_background(bench_sweep_under_the_gpu_launcher)
def test_the_bench_runs_its_models_side_by_side_under_the_gpu_launcher(ran_in_background):
    """`python -m lra.bench -m hydra/launcher=gpus bench.models=[a],[b]`: one job per GPU slot, each appending its
    rows to the one bench file (a host of N GPUs times N models at once)."""
    p, tmp_path = ran_in_background()
    assert p.returncode == 0, p.stderr[-3000:]
    rows = pd.read_csv(tmp_path / "b.csv")
    assert sorted(rows.model) == ["linear", "local"] and (rows.status == "ok").all()
    assert len(list((tmp_path / "outputs" / "bench" / "multirun").rglob("gpu_slot.json"))) == 2
