"""python -m lra.layer_bench: one mixer layer timed on CPU, rows written, and ours set beside the public packages."""
from __future__ import annotations

import dataclasses
import re
import sys
from importlib.metadata import PackageNotFoundError, requires

import pandas as pd
import pytest
import torch

from lra.bench import layer_bench, peers
from lra.bench.bench import variant_cases
from lra.report import results
from lra.train import engine
from models import list_models
from tests.conftest import ROOT


def test_time_layer_on_cpu():
    timing = layer_bench.time_layer("linear", 64, 2, torch.device("cpu"), warmup=1, steps=3)
    assert timing.peak_mb is None  # peak memory is measured on CUDA only
    assert 0 < timing.ms_p10 <= timing.ms_fwd_bwd <= timing.ms_p90  # the median inside the spread of the calls
    with pytest.raises(TypeError, match="no option"):
        layer_bench.time_layer("linear", 64, 2, torch.device("cpu"), warmup=0, steps=1, options={"blok": 1})


def test_public_packages_and_comparison():
    ref = layer_bench.stored_peers()
    assert set(ref.model) >= {"transformer", "linear", "linformer", "reformer", "performer", "local"}
    assert set(ref.seq_len) == {1024, 4096, 16384}
    row = ref[(ref.model == "performer") & (ref.seq_len == 4096)].iloc[0]
    assert row.ms_fwd_bwd == pytest.approx(15.2) and row.peak_mb == pytest.approx(3404)
    ours = pd.DataFrame([dict(model="reformer", seq_len=4096, batch_size=32, ms_fwd_bwd=5.0, peak_mb=900.0),
                         dict(model="sparse", seq_len=4096, batch_size=32, ms_fwd_bwd=3.0, peak_mb=800.0)])
    table = layer_bench.versus_public(ours, ref)
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
    assert (rows.ms_p10 <= rows.ms_fwd_bwd).all() and (rows.ms_fwd_bwd <= rows.ms_p90).all()
    assert "linear" in capsys.readouterr().out


def test_rows_measured_before_a_kill_are_kept(tmp_path, monkeypatch):
    """A sweep stopped midway (a device call's time limit) has written every row it measured."""
    calls = []

    def timer(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a SIGINT raises; a BaseException, so measure() does not record it
        return layer_bench.Timing(1.0, None, 1.0, 1.0)

    monkeypatch.setattr(layer_bench, "time_layer", timer)
    out = tmp_path / "layers.csv"
    with pytest.raises(KeyboardInterrupt):
        layer_bench.main(["--models", "linear,transformer,local", "--shapes", "64x2", "--device", "cpu",
                          "--out", str(out)])
    assert list(pd.read_csv(out).model) == ["linear"]


def test_a_rows_peak_leaves_out_what_earlier_rows_left_allocated(monkeypatch):
    """On CUDA the allocator's peak counts every live tensor: what is still allocated once earlier rows' garbage
    and compiled graphs are freed (a package's cache) is taken off, so the row's peak is its own layer's."""
    calls = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("dynamo reset"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("cublas workspaces"),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty cache"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 960 * 2**20)
    row = layer_bench.measure(dict(implementation="lra linear", seq_len=4096, batch_size=32),
                              lambda: layer_bench.Timing(5.0, 2310.0, 4.9, 5.1), torch.device("cuda"), None)
    assert row["status"] == "ok" and row["peak_mb"] == pytest.approx(1350.0)
    # freed before the count, not inside the timed row or after it
    assert calls == ["dynamo reset", "cublas workspaces", "empty cache"]
    assert engine.release_leftovers(torch.device("cpu")) == 0.0  # no peak off CUDA, nothing to take off


@pytest.mark.gpu
def test_a_rows_peak_is_the_same_beside_a_leftover_tensor():
    """The same layer's peak with nothing else alive and beside 512 MB an earlier row kept (within the allocator's
    rounding). The first row allocates cuBLAS's workspace and the second finds it: both must count it (on an H200 the
    second read 64 MB less before the workspace was freed between rows)."""
    device = torch.device("cuda")

    def peak():
        row = layer_bench.measure(dict(implementation="lra linear", seq_len=1024, batch_size=4),
                                  lambda: layer_bench.time_layer("linear", 1024, 4, device, 1, 2), device, None)
        return row["peak_mb"]

    alone = peak()
    kept = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    assert peak() == pytest.approx(alone, abs=4.0)
    del kept


# --- the public packages in the same process (lra/bench/peers.py, --peers) ---

PEER_ARGS = ["--shapes", "128x2", "--warmup", "0", "--steps", "1", "--device", "cpu", "--peers"]
OLD_HEADER = "model,seq_len,batch_size,status,ms_fwd_bwd,peak_mb,precision,device,torch,git_sha,timestamp"


@pytest.mark.parametrize("peer", [pytest.param(p, marks=pytest.mark.gpu) if p.cuda_only else p for p in peers.PEERS],
                         ids=lambda p: p.name())
def test_every_peer_builds_a_layer_that_trains(peer):
    """At N 128 (past reformer's full-attention threshold of one bucket, so LSH runs), B 2. The CUDA-only packages
    on a GPU (a GPU test), where they are installed (by hand: lra.bench.peers.CUDA_INSTALL)."""
    device = "cuda" if peer.cuda_only else "cpu"
    torch.manual_seed(0)
    try:
        layer = peer.build(128).to(device).train()
    except peers.MissingPeer as missing:
        if not peer.cuda_only:
            raise
        pytest.skip(str(missing))
    x = torch.randn(2, 128, peers.D_MODEL, device=device, requires_grad=True)  # (B, N, D)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=peer.cuda_only):  # as the bench runs them on CUDA
        y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    assert x.grad.abs().sum() > 0
    trained = [name for name, p in layer.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert trained == [name for name, _ in layer.named_parameters()]  # every weight, the projections too, learns


def test_peer_names_line_up_with_the_stored_rows():
    stored = set(layer_bench.stored_peers().implementation)
    names = {p.name() for p in peers.PEERS}
    assert stored <= names  # every stored package row has a live entry of the same name
    # sinkhorn failed under bf16 (nothing stored); the CUDA-only packages have no stored rows: they run live
    assert names - stored == {"sinkhorn-transformer 0.11.4 (bucket 64)"} | {p.name() for p in peers.PEERS
                                                                            if p.cuda_only}
    assert {p.model for p in peers.PEERS} <= set(list_models())


def test_pins_match_the_peers_extra_and_cover_the_dependencies(capsys):
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(extras["peers"]) == sorted(f"{d}=={v}" for d, v in peers.PINS.items())
    assert "lra[peers]" in extras["dev"]  # CI installs [dev]: these tests run against the real packages
    peers.main(["--pins"])
    assert capsys.readouterr().out.split() == peers.pins()
    wheels = set(peers.PINS) | set(peers.DEPENDENCIES)
    for dist in wheels:  # the closure: everything a pinned wheel needs is a wheel too (but torch, packaging)
        needs = {re.split(r"[ ;<>=!~(\[]", r, maxsplit=1)[0].lower() for r in requires(dist) or [] if "extra" not in r}
        assert needs <= wheels | {"torch", "packaging"}, (dist, needs - wheels)


def test_another_version_than_the_pin_is_recorded(monkeypatch):
    monkeypatch.setattr(peers, "version", lambda dist: "9.9.9")
    performer = next(p for p in peers.PEERS if p.model == "performer")
    assert performer.provenance() == dict(implementation="performer-pytorch 9.9.9 (256 features)",
                                          package="performer-pytorch==9.9.9", pin="performer-pytorch==1.1.4")


def test_the_triton_on_the_path_first_is_recorded(monkeypatch):
    """Rows name the Triton that compiled them: the release's distribution, else the nightlies' pytorch-triton."""
    installed = {"pytorch-triton": "3.7.0+git1234"}

    def version(dist):
        if dist not in installed:
            raise PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(results, "version", version)  # results reads importlib.metadata's version
    assert results.triton_version() == "3.7.0+git1234"
    installed["triton"] = "3.6.0"
    assert results.triton_version() == "3.6.0"
    installed.clear()
    assert results.triton_version() == ""


def test_peers_times_ours_and_the_packages_with_one_loop(tmp_path, monkeypatch, capsys):
    out = tmp_path / "layers.csv"
    out.write_text(OLD_HEADER + "\nlinear,64,2,ok,1.5,,fp32,cpu,2.11,abc,2026-01-01T00:00:00Z\n")  # an older file
    timed, real = [], layer_bench.time_forward
    monkeypatch.setattr(layer_bench, "time_forward", lambda layer, *a: timed.append(layer) or real(layer, *a))
    table = layer_bench.main(["--models", "performer,transformer", "--out", str(out), *PEER_ARGS])
    rows = pd.read_csv(out)
    assert list(rows.columns) == OLD_HEADER.split(",") + ["implementation", "package", "pin", "compiled", "ms_p10",
                                                          "ms_p90", "compile_mode", "triton",
                                                          "compile_note", "width"]  # at the end
    assert rows.implementation.isna().tolist() == [True, False, False, False, False]  # the old row is kept
    assert rows.triton.fillna("").astype(str).tolist() == [""] + [results.triton_version()] * 4
    new = rows.iloc[1:].set_index("implementation")
    assert list(new.index) == ["lra performer", "lra transformer", "SDPA exact (cuDNN flash)",
                               "performer-pytorch 1.1.4 (256 features)"]
    assert (new.status == "ok").all() and (new.ms_fwd_bwd > 0).all() and len(timed) == 4  # one timing loop for all
    assert new.loc["performer-pytorch 1.1.4 (256 features)", ["model", "package", "pin"]].tolist() == [
        "performer", "performer-pytorch==1.1.4", "performer-pytorch==1.1.4"]
    performer = table[table.model == "performer"].iloc[0]  # the live rows, not the stored H200 ones
    ms = new.ms_fwd_bwd
    assert performer.implementation == "performer-pytorch 1.1.4 (256 features)"
    assert performer.speedup == pytest.approx(ms["performer-pytorch 1.1.4 (256 features)"] / ms["lra performer"],
                                              rel=1e-4)
    assert performer.x_sdpa == pytest.approx(ms["SDPA exact (cuDNN flash)"] / ms["lra performer"], rel=1e-4)
    transformer = table[table.model == "transformer"].iloc[0]
    assert transformer.implementation == "SDPA exact (cuDNN flash)" and transformer.x_sdpa_public == 1.0
    assert "measured in this call" in capsys.readouterr().out


def test_ours_and_the_packages_are_timed_shape_by_shape(tmp_path, monkeypatch):
    """Each shape's rows, ours and the packages', are timed together, so a change in the machine's load between
    shapes cannot land on one side of a comparison only."""
    monkeypatch.setattr(layer_bench, "time_forward", lambda *args: layer_bench.Timing(1.0, None, 1.0, 1.0))
    out = tmp_path / "layers.csv"
    layer_bench.main(["--models", "transformer", "--shapes", "32x2,64x2", "--device", "cpu", "--peers",
                      "--out", str(out)])
    rows = pd.read_csv(out)
    assert list(zip(rows.seq_len, rows.implementation)) == [
        (32, "lra transformer"), (32, "SDPA exact (cuDNN flash)"), (64, "lra transformer"),
        (64, "SDPA exact (cuDNN flash)")]


def test_profile_writes_a_table_for_every_row_after_its_timing(tmp_path, monkeypatch):
    """``--profile DIR``: ours, the package's and the SDPA layer each get DIR/<implementation>_<N>x<B>/profile.txt,
    profiled after the timed calls (the timing loop is untouched: one median of as many calls as without it)."""
    out, where = tmp_path / "layers.csv", tmp_path / "profiles"
    started = []
    real = layer_bench.engine.StepProfiler
    monkeypatch.setattr(layer_bench.engine, "StepProfiler", lambda *a: started.append(a[1:3]) or real(*a))
    layer_bench.main(["--models", "performer", "--out", str(out), "--profile", str(where), *PEER_ARGS])
    rows = pd.read_csv(out)
    assert (rows.status == "ok").all() and len(rows) == 3
    folders = sorted(p.name for p in where.iterdir())
    assert folders == ["SDPA_exact_cuDNN_flash_128x2", "lra_performer_128x2",
                       "performer-pytorch_1.1.4_256_features_128x2"]
    for name in folders:
        text = (where / name / "profile.txt").read_text()
        assert text.startswith("steps 1-1") and "host time by operator" in text
    assert started == [(0, 1)] * 3  # profiled from call 0 for --steps calls, after the timing


def test_compile_puts_every_timed_layer_through_torch_compile(tmp_path, monkeypatch, capsys):
    """--compile: ours, the package's and SDPA's layers alike (a stand-in for torch.compile records them)."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda layer, dynamic, mode: compiled.append(mode) or layer)
    out = tmp_path / "layers.csv"
    layer_bench.main(["--models", "linear", "--out", str(out), *PEER_ARGS, "--compile", "--compile-check", "false"])
    rows = pd.read_csv(out)
    assert compiled == ["default"] * 3 and len(rows) == 3 and rows.compile_mode.isna().all()  # blank: the default
    assert rows.compiled.all() and (rows.status == "ok").all()
    assert "every layer compiled). speedup" in capsys.readouterr().out
    layer_bench.main(["--models", "linear", "--out", str(out), *PEER_ARGS[:-1]])
    last = pd.read_csv(out).iloc[-1]
    assert len(compiled) == 3 and not last.compiled and pd.isna(last.compile_mode)  # without the flag: eager


class ScaledOutput(torch.nn.Module):
    """A stand-in for torch.compile: the layer's output times ``factor`` (other gradients unless it is 1)."""

    factor = 1.1

    def __init__(self, layer, dynamic=None, mode=None):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.factor * self.layer(x)


def test_the_compile_check_times_a_layer_it_rejects_eagerly_and_the_row_says_why(tmp_path, monkeypatch):
    """--compile-check (as trainer.compile_check; auto checks as true does, on the CPU too): the layer's gradients
    compiled and eager, each against a float64 copy's. Rejected: timed eagerly, compiled False, compile_note the
    finding (a parameter of the mixer, both errors); right: compiled; false: compiled unchecked."""
    monkeypatch.setattr(torch, "compile", ScaledOutput)
    out = tmp_path / "layers.csv"
    args = ["--models", "linear", "--shapes", "64x2", "--warmup", "0", "--steps", "1", "--device", "cpu",
            "--out", str(out), "--compile"]
    layer_bench.main([*args, "--compile-check", "true"])
    row = pd.read_csv(out).iloc[-1]
    assert row.status == "ok" and not row.compiled and row.compile_note.startswith("compile check: mixer.")
    assert "of its size off float64's compiled, " in row.compile_note and " eager (bound 4 x eager" in row.compile_note
    monkeypatch.setattr(ScaledOutput, "factor", 1.0)  # compiled to the same numbers
    layer_bench.main([*args, "--compile-check", "true"])
    row = pd.read_csv(out).iloc[-1]
    assert row.status == "ok" and row.compiled and pd.isna(row.compile_note)
    monkeypatch.setattr(ScaledOutput, "factor", 1.1)
    layer_bench.main(args)  # auto: the check runs here, on the CPU, as on CUDA
    row = pd.read_csv(out).iloc[-1]
    assert not row.compiled and row.compile_note.startswith("compile check: mixer.")
    layer_bench.main([*args, "--compile-check", "false"])
    row = pd.read_csv(out).iloc[-1]
    assert row.compiled and pd.isna(row.compile_note)


def test_compile_mode_compiles_every_layer_in_that_mode_and_says_so(tmp_path, monkeypatch, capsys):
    """--compile-mode reduce-overhead (CUDA graphs) implies --compile: every layer is compiled in that mode and
    the rows and the table's header name it; fewer than 3 warm-up calls (CUDA graphs record in them) is refused."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda layer, dynamic, mode: compiled.append(mode) or layer)
    out = tmp_path / "layers.csv"
    layer_bench.main(["--models", "linear", "--out", str(out), *PEER_ARGS, "--compile-check", "false",
                      "--compile-mode", "reduce-overhead", "--warmup", "3"])
    rows = pd.read_csv(out)
    assert compiled == ["reduce-overhead"] * 3 == list(rows.compile_mode) and rows.compiled.all()
    assert "every layer compiled (reduce-overhead)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        layer_bench.main(["--models", "linear", "--compile-mode", "reduce-overhead", "--warmup", "2"])
    assert "set --warmup to 3 or more" in capsys.readouterr().err


def test_each_compiled_row_is_a_static_graph_of_its_own_shape(monkeypatch):
    """The same layer code at a second shape: Dynamo would reuse its cache and compile it with dynamic shapes
    (other kernels than a training run, which sees one shape, gets). Each row starts afresh, static."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter, real_compile = CompileCounterWithBackend("eager"), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, mode=None: real_compile(fn, dynamic=dynamic,
                                                                                          backend=counter))
    for n, batch in ((16, 4), (32, 4), (64, 2)):
        layer_bench.time_forward(lambda x: torch.nn.functional.gelu(x) * 2, n, batch, torch.device("cpu"), warmup=1,
                                 steps=1, compile_layer=True)
    inputs = [next(iter(g.graph.find_nodes(op="placeholder"))).meta["example_value"].shape for g in counter.graphs]
    assert counter.frame_count == 3 and all(isinstance(size, int) for shape in inputs for size in shape)
    assert [tuple(shape) for shape in inputs] == [(4, 16, 256), (4, 32, 256), (2, 64, 256)]


def test_without_peers_the_header_says_the_numbers_are_stored(capsys):
    layer_bench.main(["--models", "linear", *PEER_ARGS[:-1]])
    assert "STORED numbers" in capsys.readouterr().out


def test_a_missing_package_is_a_row_with_the_install_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "performer_pytorch", None)  # import performer_pytorch now raises ImportError

    def version(dist):
        if dist == "performer-pytorch":
            raise PackageNotFoundError(dist)
        return "0"

    monkeypatch.setattr(peers, "version", version)
    out = tmp_path / "layers.csv"
    table = layer_bench.main(["--models", "performer", "--out", str(out), *PEER_ARGS])
    rows = pd.read_csv(out).set_index("implementation")
    status = rows.loc["performer-pytorch 1.1.4 (256 features)", "status"]
    assert status.startswith("missing: pip install 'lra[peers]'") and "performer-pytorch==1.1.4" in status
    assert rows.loc["lra performer", "status"] == "ok" and rows.loc["SDPA exact (cuDNN flash)", "status"] == "ok"
    assert table.implementation.isna().all() and table.x_sdpa.notna().all()  # ours still set against SDPA
    assert "not measured: performer-pytorch 1.1.4 (256 features): missing" in capsys.readouterr().out


def test_a_cuda_only_package_missing_is_a_row_with_its_own_install_command(tmp_path, monkeypatch):
    for module in ("mamba_ssm", "fla"):  # as if neither were installed, here or on the CI
        monkeypatch.setitem(sys.modules, module, None)
    out = tmp_path / "layers.csv"
    layer_bench.main(["--models", "mamba,gla", "--out", str(out), *PEER_ARGS])
    rows = pd.read_csv(out).set_index("implementation")
    for peer in (p for p in peers.PEERS if p.cuda_only):
        status = rows.loc[peer.name(), "status"]
        assert status.startswith(f"missing: {peers.CUDA_INSTALL[peer.dist]} (") and "lra[peers]" not in status
    assert rows.loc["lra mamba", "status"] == "ok" and rows.loc["lra gla", "status"] == "ok"


class Causal(torch.nn.Module):
    """A causal layer to make bidirectional: the running sum of x W over time, as a tuple (fla's layers' form)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(3, 3, bias=False)

    def forward(self, x):
        return self.w(x).cumsum(1), None


def test_two_ways_reads_the_past_with_one_layer_and_the_future_with_the_other():
    torch.manual_seed(0)
    layer = peers.TwoWays(Causal)
    x = torch.randn(2, 5, 3)
    f, b = layer.forward_pass.w, layer.reversed_pass.w
    want = f(x).cumsum(1) + b(x).flip(1).cumsum(1).flip(1)  # position t: f over x_0..t, b over x_t..N-1
    torch.testing.assert_close(layer(x), want)
    assert f.weight.data_ptr() != b.weight.data_ptr()  # a layer of its own each way


class FailsUnderAutocast(torch.nn.Module):
    """Stands in for sinkhorn-transformer under bf16 autocast on CUDA: it builds, and its forward raises."""

    def forward(self, x):
        raise RuntimeError("expected scalar type Float but found BFloat16\nsecond line")


def test_a_failing_package_is_an_error_row(tmp_path, monkeypatch):
    failing = [dataclasses.replace(p, make=lambda module, n: FailsUnderAutocast()) if p.model == "sinkhorn" else p
               for p in peers.PEERS]
    monkeypatch.setattr(peers, "PEERS", failing)
    out = tmp_path / "layers.csv"
    layer_bench.main(["--models", "linear,sinkhorn", "--out", str(out), *PEER_ARGS])
    rows = pd.read_csv(out).set_index("implementation")
    assert rows.loc["sinkhorn-transformer 0.11.4 (bucket 64)", "status"] == \
        "error: RuntimeError: expected scalar type Float but found BFloat16"
    assert (rows.drop("sinkhorn-transformer 0.11.4 (bucket 64)").status == "ok").all()  # the sweep went on


def test_variants_are_rows_of_their_own_labelled_by_their_options(tmp_path):
    assert layer_bench.parse_variants("performer:n_features=64,recompute=false; linear:chunk_size=16") == [
        ("performer(n_features=64,recompute=False)", "performer", {"n_features": 64, "recompute": False}),
        ("linear(chunk_size=16)", "linear", {"chunk_size": 16})]
    with pytest.raises(SystemExit, match="not <model>:<option>=<value>"):
        layer_bench.parse_variants("nosuchmodel:x=1")
    with pytest.raises(SystemExit, match="--variants: .*n_feature"):  # a misspelt option fails before any timing
        layer_bench.parse_variants("performer:n_feature=64")
    out = tmp_path / "layers.csv"
    table = layer_bench.main(["--models", "linear", "--variants", "linear:chunk_size=16", "--shapes", "64x2",
                              "--warmup", "0", "--steps", "1", "--device", "cpu", "--out", str(out)])
    assert pd.read_csv(out).implementation.tolist() == ["lra linear", "lra linear(chunk_size=16)"]
    assert table.ours.tolist() == ["lra linear", "lra linear(chunk_size=16)"]


def test_a_variant_may_choose_how_a_mixer_runs(monkeypatch):
    """backend=<name>, scan=<form>, recompute=..., chunk_size=... (models.base.execution_settings) are set on the
    built mixer (how it runs, not constructor options); a setting the mixer lacks, or a value it does not allow,
    fails before any timing, naming its settings."""
    assert layer_bench.parse_variants("performer:backend=torch,recompute=false,chunk_size=16; gla:scan=recurrent") \
        == [("performer(backend=torch,recompute=False,chunk_size=16)", "performer",
             {"backend": "torch", "recompute": False, "chunk_size": 16}),
            ("gla(scan=recurrent)", "gla", {"scan": "recurrent"})]
    built, create = [], layer_bench.create_model
    monkeypatch.setattr(layer_bench, "create_model", lambda *a, **k: built.append(create(*a, **k)) or built[-1])
    monkeypatch.setattr(layer_bench, "time_forward", lambda *args: layer_bench.Timing(1.0, None, 1.0, 1.0))
    layer_bench.time_layer("performer", 64, 2, torch.device("cpu"),
                           options={"backend": "torch", "recompute": False, "chunk_size": 16})
    assert (built[0].backend, built[0].recompute, built[0].chunk_size) == ("torch", False, 16)
    with pytest.raises(SystemExit, match="no option.*backend.*its settings of how it runs: chunk_size, compile_core"):
        layer_bench.parse_variants("linear:backend=torch")
    with pytest.raises(SystemExit, match="gla: scan must be 'auto', 'fla', 'chunked', 'recurrent', got 'fast'"):
        layer_bench.parse_variants("gla:scan=fast")


def test_a_variant_may_time_the_training_path_with_attention_dropout(monkeypatch):
    """``dropout=<p>`` builds the mixer with that attention dropout (0 otherwise), labelled in the row; the bench's
    ``bench.variants`` keep refusing it as an unknown option, since the backbone sets it there."""
    assert layer_bench.parse_variants("etc:backend=flex,dropout=0.1") == [
        ("etc(backend=flex,dropout=0.1)", "etc", {"backend": "flex", "dropout": 0.1})]
    with pytest.raises(ValueError, match="no option"):
        variant_cases([{"model": "etc", "dropout": 0.1}])
    built, create = [], layer_bench.create_model
    monkeypatch.setattr(layer_bench, "create_model", lambda *a, **k: built.append(create(*a, **k)) or built[-1])
    monkeypatch.setattr(layer_bench, "time_forward", lambda *args: layer_bench.Timing(1.0, None, 1.0, 1.0))
    layer_bench.time_layer("etc", 64, 2, torch.device("cpu"), options={"dropout": 0.1})
    layer_bench.time_layer("etc", 64, 2, torch.device("cpu"))
    assert [m.dropout_p for m in built] == [0.1, 0.0]  # both in training mode


def test_width_times_our_mixers_at_a_tasks_backbone_and_the_rows_say_so(tmp_path, monkeypatch, capsys):
    """--width 32x4x16 builds our mixers at Pathfinder's backbone (heads of 4) and fills the rows' ``width``; the
    protocol's width leaves it blank; the packages are built at the protocol's width only, so --peers is refused
    with another; the taxonomy's exponents read protocol rows alone."""
    from lra.report import taxonomy

    built, create = [], layer_bench.create_model
    monkeypatch.setattr(layer_bench, "create_model", lambda *a, **k: built.append(k) or create(*a, **k))
    out = tmp_path / "layers.csv"
    args = ["--models", "transformer", "--shapes", "64x2", "--warmup", "0", "--steps", "1", "--device", "cpu",
            "--out", str(out)]
    layer_bench.main([*args, "--width", "32x4x16", "--variants", "transformer:dropout=0.1"])
    layer_bench.main(args)
    assert [(k["d_model"], k["n_heads"], k["d_qkv"]) for k in built] == [(32, 4, 16)] * 2 + [(256, 4, 256)]
    rows = pd.read_csv(out)
    assert rows.width.fillna("").tolist() == ["32x4x16", "32x4x16", ""] and (rows.status == "ok").all()
    assert "Our layers at width 32x4x16" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        layer_bench.main([*args, "--width", "32x4x16", "--peers"])
    assert "--peers times the public packages at the protocol's width" in capsys.readouterr().err
    for bad, why in (("32x4", "is not D_MODELxHEADSxD_QKV"), ("32x3x16", "a multiple of the heads"),
                     ("axbxc", "is not D_MODELxHEADSxD_QKV")):
        with pytest.raises(SystemExit) as exit_:
            layer_bench.main([*args, "--width", bad])
        assert exit_.value.code == 2 and why in capsys.readouterr().err
    rows = rows.assign(compiled=True)
    assert taxonomy.layer_rows(rows).width.fillna("").tolist() == [""]


@pytest.mark.gpu
def test_a_layer_is_timed_replaying_cuda_graphs():
    """--compile-mode reduce-overhead on a GPU: the layer compiles, records and replays CUDA graphs over the timed
    calls without tripping on a gradient the last replay left in the graphs' memory, and times about what the
    default mode times for a layer of large kernels (a 4K transformer layer: SDPA's time, not launches)."""
    device = torch.device("cuda")
    graphs = layer_bench.time_layer("transformer", 4096, 8, device, warmup=3, steps=10, compile_layer=True,
                                    compile_mode="reduce-overhead")
    default = layer_bench.time_layer("transformer", 4096, 8, device, warmup=3, steps=10, compile_layer=True)
    assert 0 < graphs.ms_fwd_bwd < 1.5 * default.ms_fwd_bwd
    # the graphs' memory counts (allocated as they record): not the timed replays' alone, which allocate nothing (an
    # H200 read 769 MB so for every layer and shape of a call, SDPA's at 4K x 32 too, whose default mode's is 1,350 MB)
    assert 0.7 * default.peak_mb < graphs.peak_mb < 2 * default.peak_mb
