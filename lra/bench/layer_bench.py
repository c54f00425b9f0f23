"""One attention layer of each mixer, forward + backward, beside the public PyTorch package of the same method.

    python -m lra.layer_bench                                 # every registered mixer, the three shapes below
    python -m lra.layer_bench --models linear,performer --shapes 4096x32 --out results/layer_bench.csv
    python -m lra.layer_bench --peers                         # the public packages too, here and now
    python -m lra.layer_bench --peers --compile               # every layer through torch.compile, as lra trains
    python -m lra.layer_bench --compile-mode reduce-overhead  # ... replayed as CUDA graphs (no launch overhead)

Protocol (the one the public packages were measured with): d 256, 4 heads of 64, projections included, no
dropout (a ``--variants`` entry may name one, e.g. ``etc:backend=flex,dropout=0.1``), inputs without padding
(mask=None where the mixer takes it, else an all-true mask), bf16 autocast on CUDA (fp32 on CPU); N 1024 and 4096
at batch 32, N 16384 at batch 8; ms per forward + backward (median of ``--steps`` synchronised calls after
``--warmup``, and their 10th and 90th percentiles: two layers whose spreads overlap are not told apart by one run)
and peak MB (``cuda_max_allocated``, CUDA only, less what earlier rows left allocated: each row's own).

``--peers`` times the public packages' layers (lra/bench/peers.py; ``pip install 'lra[peers]'``) of the chosen models,
and the bare SDPA layer as the baseline, in the same process on the same card with the same timing loop, and
sets ours beside them. Without it, the packages' numbers are the stored ``peers_h200_layer`` rows of
``results/published.csv`` (timed on the card and torch their rows name, not this one, so their ms compare only
roughly).
``--compile`` puts every timed layer (ours, the packages', SDPA's) through ``torch.compile`` first, as the runner
compiles the model it trains; the warm-up steps compile it, and rows say ``compiled``. Before that
(``--compile-check``, as ``trainer.compile_check``), the runner's compile check: the layer's gradients compiled and
eager, each against a float64 copy's; a layer it rejects is timed eagerly (``compiled`` False, ``compile_note``
why). ``--compile-mode`` picks torch.compile's mode (``trainer.compile_mode``'s choices; it implies ``--compile``,
and rows say ``compile_mode``): ``reduce-overhead`` replays each layer's graphs as CUDA graphs, which times a layer
whose small kernels leave the GPU waiting on their launches (at batch 8, say) by its device time, as a run with
that mode trains. ``--out`` appends rows (device, torch, commit, implementation) to a CSV. 2-D mixers run at square
lengths only (their grid is the square).
``--width DxHxQ`` times our mixers at another width than the protocol's (d_model D, H heads, d_qkv Q; a task's
backbone, e.g. Pathfinder's 32x4x16: heads of 4), the rows saying ``width``; the public packages are built at the
protocol's width only, so ``--peers`` is refused with it, and the taxonomy's exponents read protocol rows alone.

    python -m lra.layer_bench --models transformer --width 32x4x16 --shapes 1024x512 \
        --variants 'transformer:backend=small_head;transformer:dropout=0.1;transformer:backend=small_head,dropout=0.1'
"""
from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch
import yaml

from lra.bench.bench import split_attributes, variant_cases
from lra.bench.peers import BASELINE, D_MODEL, HEADS, MissingPeer, Peer, for_models
from lra.config import CHOICES
from lra.provenance import error_status
from lra.report.results import LAYER_BENCH_COLUMNS, append_row, device_name, git_sha, now_iso, triton_version
from lra.train import engine
from models import create_model, list_models
from models.registry import Grid

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(1024, 32), (4096, 32), (16384, 8)]  # (N, batch)
COLUMNS = LAYER_BENCH_COLUMNS


class Width(NamedTuple):
    """A layer's width: model width, heads and the width of q, k and v (heads of d_qkv / n_heads)."""
    d_model: int
    n_heads: int
    d_qkv: int

    def label(self) -> str:
        """The rows' ``width``: blank at the protocol's (``PROTOCOL_WIDTH``), else "DxHxQ"."""
        return "" if self == PROTOCOL_WIDTH else f"{self.d_model}x{self.n_heads}x{self.d_qkv}"


PROTOCOL_WIDTH = Width(D_MODEL, HEADS, D_MODEL)  # d 256, 4 heads of 64, as the public packages are built


def parse_width(spec: str) -> Width:
    """'32x4x16' -> Width(32, 4, 16); for anything else, argparse's error (usage, exit code 2) naming the form."""
    try:
        width = Width(*(int(v) for v in spec.lower().split("x")))
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{spec!r} is not D_MODELxHEADSxD_QKV, e.g. 32x4x16") from None
    if min(width) < 1 or width.d_qkv % width.n_heads:
        raise argparse.ArgumentTypeError(f"{spec}: widths must be >= 1 and d_qkv a multiple of the heads")
    return width


class Timing(NamedTuple):
    """One row's measurement, named as its columns: ms of one forward + backward (the median of the timed calls and
    their 10th and 90th percentiles), the peak MB (None off CUDA), whether the layer ran through torch.compile and,
    where the compile check kept it from that, why."""
    ms_fwd_bwd: float
    peak_mb: float | None
    ms_p10: float
    ms_p90: float
    compiled: bool = False
    compile_note: str | None = None


class MixerCall(torch.nn.Module):
    """Our mixer as a layer of one input: ``mixer(x, mask, **extra)``, the mask (all true; None where the mixer takes
    none) cut to x's rows where x has fewer (the compile check runs on a few of the timed rows)."""

    def __init__(self, mixer: torch.nn.Module, mask: torch.Tensor | None, extra: dict):
        super().__init__()
        self.mixer, self.mask, self.extra = mixer, mask, extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.mask
        if mask is not None and mask.shape[0] != x.shape[0]:
            mask = mask[: x.shape[0]]
        return self.mixer(x, mask, **self.extra)


def layer_loss(y: torch.Tensor, _labels=None) -> torch.Tensor:
    """What a timed call backpropagates: the mean square of the layer's output, in fp32 (float64 for the compile
    check's float64 copy)."""
    return engine.full_precision(y).square().mean()


def checked_compile(layer: torch.nn.Module, x: torch.Tensor, device: torch.device) -> str | None:
    """The compile check of the runner and the bench (``engine.compiled_gradient_check``) for one layer: its
    parameters' gradients of ``layer_loss`` on the first ``engine.COMPILE_CHECK_ROWS`` rows of ``x``, compiled and
    eager each against a float64 copy's, in fp32 (under the row's autocast where the fp32 graphs do not compile).
    Returns why the layer is to run eagerly (the row's ``compile_note``), None where it may run compiled."""
    rows = x[: engine.COMPILE_CHECK_ROWS].detach()
    precision = engine.resolve_precision("auto", device)
    bf16 = engine.autocast(precision, device) if precision == "bf16" else None
    check = engine.compiled_gradient_check(layer, (rows,), None, bf16, loss_fn=layer_loss)
    for note in check.notes():
        print(f"compile check: {note}", flush=True)
    return f"compile check: {check.describe()}" if check.rejected else None


def time_forward(layer: torch.nn.Module, n: int, batch: int, device: torch.device,
                 warmup: int = 3, steps: int = 20, compile_layer: bool = False,
                 profile_dir: Path | None = None, compile_mode: str = "default", parameters=(),
                 compile_check: bool = False, d_model: int = D_MODEL) -> Timing:
    """The ``Timing`` of ``layer``'s forward + backward on a (batch, n, D) input,
    through ``torch.compile`` with ``compile_layer``, unless ``compile_check`` is set and the compile check rejects
    the compiled layer (``checked_compile``; then eagerly, the Timing saying why), (compiled during the warm-up, in
    ``compile_mode``: a mode of
    ``engine.CUDA_GRAPH_MODES`` records CUDA graphs then, and the timed calls replay them; each call then drops the
    gradients of the input and of ``parameters``, the layer's, as the runner's step does, since a gradient kept
    from the last call lives in the graphs' memory, which the next replay overwrites). The one timing loop of this
    module: our mixers and the public packages are timed by the same code. ``profile_dir``: after the timed calls,
    as many more under torch.profiler, whose tables (``profile.txt``: kernels by device time on a GPU, operators
    and our own functions by host time) and trace go there; the timing does not include them. The peak is the timed
    calls', or under CUDA graphs the warm-up's and theirs: a replay allocates nothing, its memory is the graphs' pool,
    allocated when they were recorded (the timed calls' peak alone would be the inputs' and the weights')."""
    x = torch.randn(batch, n, d_model, device=device, requires_grad=True)  # (B, N, D)
    note = checked_compile(layer, x, device) if compile_layer and compile_check else None
    compile_layer = compile_layer and note is None
    if compile_layer:  # a fresh, static graph per row, as a training run (one shape) compiles: otherwise the cache
        torch._dynamo.reset()  # of an earlier row's shape makes Dynamo compile this one with dynamic shapes
        layer = torch.compile(layer, dynamic=False, mode=compile_mode)
    autocast = engine.autocast(engine.resolve_precision("auto", device), device)
    cuda_graphs = engine.replays_cuda_graphs(compile_layer, device, compile_mode)
    leaves = [x, *parameters]

    def step():
        if cuda_graphs:  # a new step: the graphs may reuse the last step's buffers (its outputs are dead)
            torch.compiler.cudagraph_mark_step_begin()
            for leaf in leaves:  # no accumulation into a gradient the last replay left in the graphs' memory
                leaf.grad = None
        with autocast():
            y = layer(x)  # (B, N, D)
        layer_loss(y).backward()

    if cuda_graphs:  # the graphs' memory is allocated as they are recorded (warm-up): replays allocate none
        engine.reset_peak_memory(device)
    for _ in range(warmup):
        step()
    engine.synchronize(device)
    if not cuda_graphs:
        engine.reset_peak_memory(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        engine.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = engine.peak_memory_mb(device) if device.type == "cuda" else None
    if profile_dir is not None:
        profiler = engine.StepProfiler(device, 0, steps, profile_dir)
        for done in range(steps):
            profiler.before_step(done)
            step()
            profiler.after_step(done + 1)
    median, p10, p90 = engine.median_and_spread(times)
    return Timing(median, peak, p10, p90, compile_layer, note)


def time_layer(name: str, n: int, batch: int, device: torch.device, warmup: int = 3, steps: int = 20,
               options: dict | None = None, compile_layer: bool = False,
               profile_dir: Path | None = None, compile_mode: str = "default", compile_check: bool = False,
               width: Width = PROTOCOL_WIDTH) -> Timing:
    """``time_forward`` of our mixer ``name`` (registry options, overridden by ``options``) at (batch, n) and
    ``width``. Attention dropout is 0 unless ``options`` names one (``dropout``: a variant that times the training
    path with it)."""
    torch.manual_seed(0)
    options, attributes = split_attributes(name, options)  # backend, scan, ...: how it runs, set once built
    dropout = options.pop("dropout", 0.0)
    mixer = create_model(name, d_model=width.d_model, n_heads=width.n_heads, d_qkv=width.d_qkv, dropout=dropout,
                         max_len=n, **options).to(device).train()
    engine.set_mixer_attributes(mixer, name, attributes)
    mask = None if getattr(mixer, "accepts_no_mask", False) else torch.ones(batch, n, dtype=torch.bool, device=device)
    extra = {}
    if getattr(mixer, "needs_grid", False):
        side = round(n ** 0.5)
        if side * side != n:
            raise ValueError(f"{name} attends over a 2-D grid: time it at square lengths")
        extra["grid"] = Grid(side, side)
    return time_forward(MixerCall(mixer, mask, extra), n, batch, device, warmup, steps, compile_layer,
                        profile_dir, compile_mode, list(mixer.parameters()), compile_check, width.d_model)


def time_peer(peer: Peer, n: int, batch: int, device: torch.device, warmup: int = 3,
              steps: int = 20, compile_layer: bool = False,
              profile_dir: Path | None = None, compile_mode: str = "default", compile_check: bool = False) -> Timing:
    """``time_forward`` of a public package's layer (lra/bench/peers.py), built for length n, at (batch, n)."""
    torch.manual_seed(0)
    layer = peer.build(n).to(device).train()
    return time_forward(layer, n, batch, device, warmup, steps, compile_layer, profile_dir, compile_mode,
                        list(layer.parameters()), compile_check)


def profile_folder(root: Path | None, implementation: str, n: int, batch: int) -> Path | None:
    """``--profile``'s folder for one row: <root>/<implementation>_<N>x<B>, the name made safe for a path."""
    if root is None:
        return None
    return root / f"{re.sub(r'[^A-Za-z0-9._=-]+', '_', implementation).strip('_')}_{n}x{batch}"


def measure(row: dict, timer: Callable[[], Timing], device: torch.device,
            out: Path | None) -> dict:
    """``row`` with the timing, or with why there is none: a failing case is a row and the sweep goes on. The row
    is appended to ``out`` at once, so a sweep killed midway (a time limit, a signal) keeps what it measured."""
    row["timestamp"] = now_iso()
    leftover_mb = engine.release_leftovers(device)
    try:
        timing = timer()
        row.update(timing._asdict())
        if not timing.compiled:  # eager: asked so, or kept from compiling by the compile check
            row["compile_mode"] = engine.recorded_compile_mode(False, "default")
        if timing.peak_mb is not None:
            row["peak_mb"] = timing.peak_mb - leftover_mb  # the allocator's peak counts whatever else is alive
        row["status"] = "ok"
    except torch.cuda.OutOfMemoryError:
        row["status"] = "oom"
    except MissingPeer as missing:
        row["status"] = str(missing)  # "missing: pip install 'lra[peers]' (or <dist>==<pin>; ...)"
    except Exception as error:  # noqa: BLE001 - e.g. sinkhorn-transformer under bf16 autocast
        row["status"] = error_status(error)
    print(f"{row['implementation']:45s} N {row['seq_len']:6d} B {row['batch_size']:3d}: {row['status']:5s} "
          f"{row.get('ms_fwd_bwd', float('nan')):8.2f} ms", flush=True)
    if out is not None:
        append_row(out, row, COLUMNS)  # an older header is rewritten with the new columns at the end
    return row


def stored_peers(published: Path = ROOT / "results" / "published.csv") -> pd.DataFrame:
    """The public packages' per-layer rows: model, implementation, seq_len, ms_fwd_bwd, peak_mb."""
    p = pd.read_csv(published)
    p = p[p["source"] == "peers_h200_layer"]
    wide = p.pivot_table(index=["model", "note", "seq_len"], columns="metric", values="value").reset_index()
    return wide.rename(columns={"note": "implementation", "ms": "ms_fwd_bwd", "mb": "peak_mb"})


def versus_public(ours: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """Our rows beside every public implementation of the same method and length (and batch, where the reference
    has one), with the speed-up (public ms / ours) and the memory ratio (ours MB / public MB)."""
    keys = ["model", "seq_len"] + (["batch_size"] if "batch_size" in reference else [])
    ours = ours.assign(ours=ours["implementation"] if "implementation" in ours else "lra " + ours["model"])
    ours = ours[["model", "ours", "seq_len", "batch_size", "ms_fwd_bwd", "peak_mb"]]  # ours: a variant's label
    merged = ours.merge(reference, on=keys, how="left", suffixes=("", "_public"))
    merged["speedup"] = merged["ms_fwd_bwd_public"] / merged["ms_fwd_bwd"]
    merged["mem_ratio"] = merged["peak_mb"] / merged["peak_mb_public"]
    return merged[["model", "ours", "seq_len", "batch_size", "ms_fwd_bwd", "peak_mb", "implementation",
                   "ms_fwd_bwd_public", "peak_mb_public", "speedup", "mem_ratio"]]


def versus_sdpa(table: pd.DataFrame, sdpa: pd.DataFrame) -> pd.DataFrame:
    """``table`` (``versus_public``'s) with ours and the package each against the bare SDPA layer of the same shape,
    measured in the same call: x_sdpa = SDPA ms / ms (above 1: faster), mem_x_sdpa = MB / SDPA MB."""
    base = sdpa[["seq_len", "batch_size", "ms_fwd_bwd", "peak_mb"]].rename(
        columns={"ms_fwd_bwd": "ms_sdpa", "peak_mb": "mb_sdpa"})
    t = table.merge(base, on=["seq_len", "batch_size"], how="left")
    t["x_sdpa"], t["x_sdpa_public"] = t["ms_sdpa"] / t["ms_fwd_bwd"], t["ms_sdpa"] / t["ms_fwd_bwd_public"]
    t["mem_x_sdpa"], t["mem_x_sdpa_public"] = t["peak_mb"] / t["mb_sdpa"], t["peak_mb_public"] / t["mb_sdpa"]
    return t.drop(columns=["ms_sdpa", "mb_sdpa"])


def live_table(ours: pd.DataFrame, theirs: pd.DataFrame) -> pd.DataFrame:
    """The comparison from rows measured in this call: ours, the packages' and the SDPA baseline's."""
    ok = theirs[theirs["status"] == "ok"]
    reference = ok[["model", "implementation", "seq_len", "batch_size", "ms_fwd_bwd", "peak_mb"]]
    sdpa = ok[ok["implementation"] == BASELINE.name()]
    return versus_sdpa(versus_public(ours[ours["status"] == "ok"], reference), sdpa)


def frame(rows: list[dict]) -> pd.DataFrame:
    """Rows as a table of COLUMNS, timings as floats (NaN where not measured: peak MB off CUDA, failed cases)."""
    table = pd.DataFrame(rows).reindex(columns=COLUMNS)
    table[["ms_fwd_bwd", "peak_mb"]] = table[["ms_fwd_bwd", "peak_mb"]].astype(float)
    return table


def print_table(table: pd.DataFrame, header: str) -> None:
    print(header)
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))


def parse_variants(spec: str) -> list[tuple[str, str, dict]]:
    """'performer:chunk_size=1024,n_features=128;reformer:n_hashes=4' -> [(label, model, options), ...], values
    read as YAML scalars (1024, 0.5, true, null); checked and labelled as the bench's ``bench.variants``, plus
    ``dropout`` (the mixer's attention dropout, 0 otherwise: the training path with its dropout)."""
    variants = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, assignments = part.partition(":")
        if name not in list_models() or not assignments:
            raise SystemExit(f"--variants: {part!r} is not <model>:<option>=<value>[,...] with a registered model")
        options = {k.strip(): yaml.safe_load(v) for k, v in (a.split("=", 1) for a in assignments.split(","))}
        variants.append({"model": name, **options})
    try:
        return variant_cases(variants, also=("dropout",))
    except ValueError as error:  # a misspelt option: before the sweep, in one line
        raise SystemExit(f"--variants: {error}") from None


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(prog="python -m lra.layer_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(list_models()), help="comma-separated registry names")
    parser.add_argument("--shapes", default=",".join(f"{n}x{b}" for n, b in SHAPES), help="NxB,...")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="append the rows to this CSV")
    parser.add_argument("--variants", default="", help="more rows of our mixers with options changed, e.g. "
                        "'performer:chunk_size=1024;reformer:n_hashes=4' (rows 'lra performer(chunk_size=1024)', ...); "
                        "how a mixer runs is set the same way (e.g. 'performer:backend=torch,recompute=false', "
                        "'gla:scan=fla')")
    parser.add_argument("--peers", action="store_true",
                        help="also time the public packages of these models and a bare SDPA layer, here and now")
    parser.add_argument("--compile", action="store_true",
                        help="time every layer (ours, the packages', SDPA's) through torch.compile, as lra trains")
    parser.add_argument("--compile-mode", choices=CHOICES["trainer.compile_mode"], default=None,
                        help="torch.compile's mode (implies --compile): reduce-overhead replays CUDA graphs")
    parser.add_argument("--compile-check", choices=CHOICES["trainer.compile_check"], default="auto",
                        help="before a layer is timed compiled, its compiled gradients against float64's, as the "
                             "runner checks (auto = true); a layer it rejects is timed eagerly, its row saying why")
    parser.add_argument("--width", type=parse_width, default=PROTOCOL_WIDTH, metavar="DxHxQ",
                        help="our mixers at this d_model x heads x d_qkv (e.g. Pathfinder's 32x4x16) instead of the "
                             "protocol's 256x4x256; not with --peers")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="after each row's timing, profile as many calls into DIR/<implementation>_<N>x<B>/ "
                             "(profile.txt: kernels by device time, operators and functions by host time)")
    args = parser.parse_args(argv)
    args.compile = args.compile or args.compile_mode is not None
    if args.peers and args.width != PROTOCOL_WIDTH:
        parser.error("--peers times the public packages at the protocol's width (256x4x256) only; drop --width, or "
                     "time the SDPA path as our transformer at that width (--models transformer)")
    mode = args.compile_mode or "default"
    try:
        engine.check_graph_warmup(mode, args.warmup, "--warmup")  # mode: "default" unless --compile-mode
    except ValueError as error:
        parser.error(str(error))
    device = engine.resolve_device(args.device)
    engine.configure(device)
    check = engine.compile_check_due(args.compile_check, args.compile)
    models = args.models.split(",")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    common = dict(precision="bf16" if device.type == "cuda" else "fp32", device=device_name(device),
                  torch=torch.__version__, triton=triton_version(), git_sha=git_sha(), compiled=args.compile,
                  compile_mode=engine.recorded_compile_mode(args.compile, mode), width=args.width.label())
    cases = [(name, name, {}) for name in models] + parse_variants(args.variants)
    ours, theirs = [], []
    for n, batch in shapes:  # shape by shape, so ours and the packages at one shape are timed minutes apart at most
        ours += [measure(dict(common, model=name, seq_len=n, batch_size=batch, implementation=f"lra {label}"),
                         lambda: time_layer(name, n, batch, device, args.warmup, args.steps, options, args.compile,
                                            profile_folder(args.profile, f"lra {label}", n, batch), mode, check,
                                            args.width),
                         device, args.out)
                 for label, name, options in cases]
        theirs += [measure(dict(common, model=peer.model, seq_len=n, batch_size=batch, **peer.provenance()),
                           lambda: time_peer(peer, n, batch, device, args.warmup, args.steps, args.compile,
                                             profile_folder(args.profile, peer.name(), n, batch), mode, check),
                           device, args.out)
                   for peer in (for_models(models) if args.peers else [])]
    ours, theirs = frame(ours), frame(theirs)
    if args.width != PROTOCOL_WIDTH:  # no package was timed at this width: ours alone
        print_table(ours[["implementation", "seq_len", "batch_size", "status", "ms_fwd_bwd", "peak_mb"]],
                    f"Our layers at width {args.width.label()} (d_model x heads x d_qkv) on {common['device']}.")
        return ours
    if not args.peers:
        table = versus_public(ours[ours["status"] == "ok"], stored_peers())
        print_table(table, "Public packages: STORED numbers (results/published.csv, source peers_h200_layer: the card "
                           "and torch its note names), measured elsewhere; --peers measures them here.")
        return table
    table = live_table(ours, theirs)
    how = f", every layer compiled{'' if mode == 'default' else f' ({mode})'}" if args.compile else ""
    print_table(table, f"Public packages measured in this call on {common['device']} (torch {torch.__version__}{how}). "
                       "speedup = package ms / ours, mem_ratio = ours MB / package MB, x_sdpa = SDPA ms / ms, "
                       "mem_x_sdpa = MB / SDPA MB.")
    for _, row in theirs[theirs["status"] != "ok"].drop_duplicates("implementation").iterrows():
        print(f"not measured: {row['implementation']}: {row['status']}")
    return table


if __name__ == "__main__":
    main()
