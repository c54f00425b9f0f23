"""Speed and memory of whole training steps: the protocol of LRA Table 2.

Tay et al. 2021, "Long Range Arena: A Benchmark for Efficient Transformers" (ICLR 2021,
https://arxiv.org/abs/2011.04006), §4.2 / Table 2: the byte-level Text model at N = 1K, 2K, 3K, 4K, batch 32,
steps per second and peak memory, speed also relative to the Transformer at the same N.

Each (model, length) builds the shared :class:`~lra.train.encoder.Encoder` + :class:`~lra.train.encoder.Classifier` with
the task's backbone and the model's ``conf/model/<name>.yaml`` options, feeds one batch of random byte ids
(1..256, no padding) and times full training steps (forward, cross-entropy, backward, AdamW step) in the
training precision: ``warmup`` untimed steps, then ``steps`` timed ones, each between two
``torch.cuda.synchronize`` calls; steps/s = 1 / median. Peak memory is that of the timed steps:
``torch.cuda.max_memory_allocated`` (parameters, gradients, AdamW state, activations; the warm-up's compilation
transients excluded) on a GPU, less what was still allocated before the model was built (an earlier case's
leftovers: ``engine.release_leftovers``), the process's peak RSS on CPU. The last warm-up step runs under the
profiler to record which SDPA kernel ran (cudnn, flash, efficient, math, flash_cpu; blank when the model calls
none). A case to be compiled (``bench.compile``) first meets the runner's compile decision (``bench.compile_check``,
on CUDA by default: ``checked_compile``), so its row says what training would run: compiled, or eager and why.

Differences from LRA: one GPU instead of a 4x4 TPU v3 slice (their memory is per device); the model is built
for each bench length (position table and mixer ``max_len`` = N); an OOM or a failure is a row, not a crash.
"""
from __future__ import annotations

import copy
import gc
import html
import logging
import re
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import hydra
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from lra.config import CHOICES, BenchRunConfig  # noqa: F401 - BenchRunConfig registers the bench schema
from lra.data import get_task
from lra.provenance import error_status
from lra.report import plot
from lra.report.results import (
    BENCH_COLUMNS,
    BENCH_PROTOCOL,
    BenchRow,
    append_row,
    as_text,
    device_name,
    git_sha,
    now_iso,
)
from lra.report.taxonomy import STEP, length_range, measured_exponents
from lra.train import engine
from lra.train.encoder import Classifier
from models import get_model_class, list_models
from models.base import checked_setting, execution_settings
from models.registry import unknown_options

log = logging.getLogger("lra.bench")

BASELINE = "transformer"


def is_square(n: int) -> bool:
    """Whether ``n`` positions make a square grid, as a 2-D mixer (``needs_grid``) needs."""
    return round(n ** 0.5) ** 2 == n


def bench_shape(name: str, task: str, seq_len: int, vocab_size: int) -> engine.TaskShape:
    """Random bytes with no pad token, so the model is built mask-free by the runner's rule (the transformer
    baseline gets SDPA's unmasked kernels, the strongest exact baseline). A 2-D mixer gets a square grid."""
    grid = None
    if getattr(get_model_class(name), "needs_grid", False):
        if not is_square(seq_len):
            raise ValueError(f"{name} attends over a 2-D grid: bench it at square lengths (1024, 4096, 16384)")
        side = round(seq_len ** 0.5)
        grid = (side, side)
    return engine.TaskShape(vocab_size, seq_len, get_task(task).n_classes, padded=False, grid=grid)


def bench_model(name: str, cfg: DictConfig, seq_len: int, options: dict | None = None) -> Classifier:
    """The model at one bench length; ``options`` override the model config's (a variant)."""
    shape = bench_shape(name, cfg.task.name, seq_len, cfg.bench.vocab_size)
    return engine.build_model(name, dict(options or {}), cfg.backbone, shape)


def split_attributes(name: str, options: dict | None) -> tuple[dict, dict]:
    """A variant's options for model ``name`` -> (constructor options, the settings of how its mixers run: those
    ``models.base.execution_settings`` lists, e.g. ``backend``, ``scan``, set on the built mixers by
    ``engine.set_mixer_attributes``)."""
    options = dict(options or {})
    settings = execution_settings(get_model_class(name))
    return options, {k: options.pop(k) for k in list(options) if k in settings}


def variant_cases(variants, also: tuple[str, ...] = ()) -> list[tuple[str, str, dict]]:
    """``bench.variants`` ([{model: bigbird, block: 64}, ...]) -> (label, model, options), the label naming the
    changed options as the rows' ``model``: ``bigbird(block=64)``. How a mixer runs (``backend``, ``scan``, ...:
    ``split_attributes``) is not a constructor option but set on the built mixers, each value checked here;
    ``also``: more keys the caller takes (layer_bench's ``dropout``)."""
    cases = []
    for variant in variants or []:
        options = dict(variant)
        if "model" not in options:
            raise ValueError(f"bench.variants entry {options} names no model: write {{model: <name>, <option>: ...}}")
        name = options.pop("model")
        constructor, settings = split_attributes(name, options)
        checked = {k: v for k, v in constructor.items() if k not in also}
        error = unknown_options(name, checked, backbone=False)
        if error:
            how = ", ".join(execution_settings(get_model_class(name))) or "none (it runs one way)"
            raise ValueError(f"bench.variants: {error}; its settings of how it runs: {how}")
        for key, value in settings.items():
            checked_setting(get_model_class(name), key, value, f"bench.variants: {name}")
        label = f"{name}({','.join(f'{k}={v}' for k, v in options.items())})"
        cases.append((label, name, options))
    return cases


def backbone_tag(bb: DictConfig) -> str:
    """What the timings depend on, so that relative figures only pair like with like."""
    return (f"L{bb.n_layers} d{bb.d_model} h{bb.n_heads} qkv{bb.d_qkv} ff{bb.d_ff} head{bb.d_classifier} "
            f"{bb.pooling} drop{bb.dropout}/{bb.attn_dropout}")


def dropout_note(tag: str) -> str:
    """What the ``drop<d>/<a>`` of a backbone tag means for the comparison."""
    match = re.search(r"drop([\d.]+)/([\d.]+)", tag)
    if match is None:
        return "not recorded"
    dropout, attn = match.groups()
    same = ("the same for every mixer" if float(attn) == 0 else
            "attention dropout only where a mixer has an attention matrix (SDPA then leaves its fastest kernels)")
    return f"{dropout} / {attn}, {same}"


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


_SDPA = re.compile(r"aten::_scaled_dot_product_(\w+?)(?:_backward)?$")
_SDPA_NAMES = {"cudnn_attention": "cudnn", "flash_attention": "flash", "flash_attention_for_cpu": "flash_cpu",
               "efficient_attention": "efficient", "attention_math": "math"}


def sdpa_backend(event_names) -> str:
    """Which fused SDPA kernels the profiled step ran ('' when the model calls no SDPA)."""
    found = {_SDPA_NAMES.get(m.group(1), m.group(1)) for n in event_names if (m := _SDPA.match(n))}
    return "+".join(sorted(found))


def time_steps(model, tokens: torch.Tensor, labels: torch.Tensor, *, precision: str, warmup: int, steps: int,
            params, cuda_graphs: bool = False) -> dict:
    """Run ``warmup`` + ``steps`` training steps (the runner's step). Returns the timed step durations (s), the SDPA
    backend seen in the last warm-up step, and the peak memory (MB) with its kind: of the timed steps, or under CUDA
    graphs of every step (a replay allocates nothing; the graphs' memory is allocated as they record).
    ``cuda_graphs``: the compiled model replays CUDA graphs, and each step begins a new one (as the runner's)."""
    device = tokens.device
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    autocast = engine.autocast(precision, device)

    def step():
        if cuda_graphs:  # the last step's outputs are dead: the graphs may reuse their memory
            torch.compiler.cudagraph_mark_step_begin()
        engine.train_step(model, opt, (tokens,), labels, autocast=autocast)

    out = dict(times=[], sdpa_backend="")
    # the peak of the timed steps: steady state, AdamW's state exists, compilation and autotuning are done; under CUDA
    # graphs from the first step, since a replay allocates nothing: the graphs' memory is allocated as they record
    peak_from = 0 if cuda_graphs else warmup
    for i in range(warmup + steps):
        if i == peak_from:
            out["mem_kind"] = engine.reset_peak_memory(device)
        if i == warmup - 1:  # the last warm-up step is profiled (the profiler's overhead stays untimed)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                step()
                engine.synchronize(device)
            out["sdpa_backend"] = sdpa_backend({e.name for e in prof.events()})
            continue
        engine.synchronize(device)
        t0 = time.perf_counter()
        step()
        engine.synchronize(device)
        if i >= warmup:
            out["times"].append(time.perf_counter() - t0)
    out["peak_mem_mb"] = engine.peak_memory_mb(device)
    return out


def checked_compile(cfg: DictConfig, row: BenchRow, model: torch.nn.Module, tokens: torch.Tensor,
                    labels: torch.Tensor, device: torch.device, precision: str) -> bool:
    """The runner's compile decision for this case (``bench.compile_check``): the compile check on the batch's first
    ``engine.COMPILE_CHECK_ROWS`` rows (``engine.compiled_gradient_check``, under the bench's autocast where its fp32
    graphs do not compile). Returns whether the case runs compiled: False where the check rejects the compiled model
    (``row.compile_note`` says why), as training with ``compile=auto`` would; with ``bench.compile=true`` the
    rejection is raised (``engine.refuse_compiled``: the row is an error, as the training run would stop)."""
    rows = slice(0, engine.COMPILE_CHECK_ROWS)
    bf16 = engine.autocast(precision, device) if precision == "bf16" else None
    check = engine.compiled_gradient_check(model, (tokens[rows],), labels[rows], bf16)
    for note in check.notes():
        log.info("%s at N=%d, compile check: %s", row.model, row.seq_len, note)
    if not check.rejected:
        return True
    report = engine.refuse_compiled(row.model, f"{check.describe()}, on {len(labels[rows])} rows", cfg.bench.compile,
                                    "bench")
    log.warning("%s at N=%d: %s; timing it eagerly", row.model, row.seq_len, report)
    row.compile_note = f"compile check: {check.describe()}"
    return False


def bench_case(cfg: DictConfig, name: str, row: BenchRow, device: torch.device, precision: str, compile_: bool,
               options: dict | None = None) -> None:
    """Fill ``row`` with one (model, length) measurement; raises on OOM or failure (``params`` set first)."""
    b = cfg.bench
    leftover_mb = engine.release_leftovers(device)  # allocated before the model exists: not this row's memory
    torch.manual_seed(cfg.get("seed", 0))
    options, attributes = split_attributes(name, options)
    model = bench_model(name, cfg, row.seq_len, options)
    engine.set_mixer_attributes(model, name, attributes)
    row.params = sum(p.numel() for p in model.parameters())
    model = model.to(device).train()
    tokens = torch.randint(1, b.vocab_size, (row.batch_size, row.seq_len), device=device)  # (B, N), no padding
    labels = torch.randint(0, get_task(cfg.task.name).n_classes, (row.batch_size,), device=device)  # (B,)
    mode = b.get("compile_mode", "default")
    if engine.compile_check_due(b.compile_check, compile_):
        compile_ = checked_compile(cfg, row, model, tokens, labels, device, precision)
        row.compiled, row.compile_mode = compile_, engine.recorded_compile_mode(compile_, mode)
    if compile_:
        torch._dynamo.reset()  # one graph per case; otherwise the cache limit silently drops to eager
    fn = torch.compile(model, dynamic=False, mode=mode) if compile_ else model
    cuda_graphs = engine.replays_cuda_graphs(compile_, device, mode)
    m = time_steps(fn, tokens, labels, precision=precision, warmup=b.warmup, steps=b.steps, params=model.parameters(),
                cuda_graphs=cuda_graphs)
    ms, row.ms_p10, row.ms_p90 = engine.median_and_spread([t * 1e3 for t in m["times"]])
    row.status, row.ms_per_step, row.steps_per_s, row.examples_per_s = "ok", ms, 1e3 / ms, row.batch_size * 1e3 / ms
    row.peak_mem_mb, row.mem_kind, row.sdpa_backend = m["peak_mem_mb"] - leftover_mb, m["mem_kind"], m["sdpa_backend"]


def _earlier_baselines(path: Path, match: dict) -> dict:
    """(seq_len, batch_size) -> latest ok transformer row in ``path`` with the same ``match`` fields."""
    if not path.exists() or path.stat().st_size == 0:
        return {}
    df = pd.read_csv(path)
    df = df[(df["model"] == BASELINE) & (df["status"] == "ok")]
    wanted = pd.Series({k: str(v) for k, v in match.items()})
    df = df[as_text(df, match).eq(wanted).all(axis=1)]  # a column older rows lack (compile_mode) reads blank
    df = df.sort_values("timestamp")
    return {(int(r.seq_len), int(r.batch_size)): r._asdict() for r in df.itertuples(index=False)}


def run_bench(cfg: DictConfig) -> pd.DataFrame:
    """Sweep models x lengths, append one row per case to ``bench.out``, return this sweep's rows."""
    b = cfg.bench
    if b.steps < 1 or b.warmup < 0:
        raise ValueError(f"bench.steps must be >= 1 and bench.warmup >= 0, got {b.steps} and {b.warmup}")
    mode = b.get("compile_mode", "default")
    for key, value in (("compile_mode", mode), ("compile_check", b.compile_check)):  # the trainer's choices
        allowed = CHOICES[f"trainer.{key}"]
        if value not in allowed:
            raise ValueError(f"bench.{key}={value!r} is not valid: choose one of {', '.join(allowed)}")
    engine.check_graph_warmup(mode, b.warmup, "bench.warmup")
    if b.get("attn_dropout", 0.0) is not None:  # one dropout setting for every mixer; the rows' backbone tag says which
        cfg = copy.deepcopy(cfg)
        cfg.backbone.attn_dropout = float(b.get("attn_dropout", 0.0))
        b = cfg.bench
    device = engine.resolve_device(cfg.get("device", "auto"))
    precision = engine.resolve_precision(b.precision, device)
    compile_ = engine.resolve_compile(b.compile, device)
    names = list(b.models) if b.models else list_models()
    names = sorted(names, key=lambda n: n != BASELINE)  # the baseline first: later rows divide by it
    engine.configure(device)
    per_length = {int(k): int(v) for k, v in (b.get("batch_sizes") or {}).items()}
    out = Path(b.out)
    common = dict(task=cfg.task.name, precision=precision, compiled=compile_, backbone=backbone_tag(cfg.backbone),
                  device=device_name(device), torch=torch.__version__, git_sha=git_sha(), warmup=b.warmup,
                  timed_steps=b.steps, compile_mode=engine.recorded_compile_mode(compile_, mode))
    baselines = _earlier_baselines(out, {k: common[k] for k in (*BENCH_PROTOCOL, "device")})
    models = [(n, n, {}) for n in names] + variant_cases(b.get("variants"))
    cases, all_lengths = [], [int(L) for L in b.lengths]
    for label, name, options in models:
        lengths = all_lengths
        if getattr(get_model_class(name), "needs_grid", False):  # a 2-D mixer: square lengths only, no error rows
            square = [L for L in lengths if is_square(L)]
            if len(square) < len(lengths):
                log.info("%s attends over a 2-D grid: not benched at the non-square lengths %s", label,
                         ", ".join(str(L) for L in lengths if L not in square))
            lengths = square
        cases += [(label, name, options, L) for L in lengths]
    rows = []
    for label, name, options, seq_len in tqdm(cases, desc="bench", disable=not b.get("progress", True)):
        row = BenchRow(model=label, seq_len=seq_len, batch_size=per_length.get(seq_len, int(b.batch_size)),
                       timestamp=now_iso(), **common)
        try:
            bench_case(cfg, name, row, device, precision, compile_, options)
        except Exception as exc:
            oom = is_oom(exc)
            row.status = "oom" if oom else error_status(exc)
            if not oom:  # the row keeps one line; the log keeps the whole traceback
                log.error("%s at N=%d failed", label, seq_len, exc_info=exc)
        if row.status != "ok":  # on CUDA the next case's release_leftovers also empties the allocator's cache
            gc.collect()  # the failed case's traceback held its tensors; the next case needs them freed
        if row.status == "ok" and label == BASELINE:
            baselines[(seq_len, row.batch_size)] = asdict(row)
        base = baselines.get((seq_len, row.batch_size))
        if row.status == "ok" and base is not None:
            row.rel_speed = row.steps_per_s / float(base["steps_per_s"])
            row.rel_mem = row.peak_mem_mb / float(base["peak_mem_mb"])
        append_row(out, asdict(row), BENCH_COLUMNS)
        rows.append(asdict(row))
    df = pd.DataFrame(rows, columns=BENCH_COLUMNS)
    if cfg.get("logger") is not None and cfg.logger.get("name") == "wandb":
        log_to_wandb(cfg, df)
    return df


def format_table(df: pd.DataFrame) -> str:
    """The sweep laid out as LRA Table 2: models down, lengths across; a speed block and a memory block."""
    if df.empty:
        return "(no rows)"
    lengths = sorted(df["seq_len"].astype(int).unique())
    batch = {L: int(df.loc[df["seq_len"] == L, "batch_size"].iloc[0]) for L in lengths}
    mixed = len(set(batch.values())) > 1
    head = [plot.length_label(L) + (f" (B{batch[L]})" if mixed else "") for L in lengths]
    first = df.iloc[0]
    lines = [f"{first['task']} backbone {first['backbone']}, batch {df['batch_size'].iloc[0]}, {first['precision']}"
             f"{', compiled' if str(first['compiled']) == 'True' else ''}, {first['device']}",
             f"dropout / attention dropout: {dropout_note(str(first['backbone']))}"]
    models = list(dict.fromkeys(df["model"]))
    width = max(12, max(map(len, models)) + 2)

    def block(title, value, rel):
        out = [title, "model".ljust(width) + "".join(h.rjust(16) for h in head)]
        for m in models:
            cells = []
            for L in lengths:
                r = df[(df["model"] == m) & (df["seq_len"] == L)]
                if r.empty:
                    cells.append("-")
                    continue
                r = r.iloc[-1]
                status = str(r["status"])
                if status != "ok":
                    cells.append("OOM" if status == "oom" else "ERR")
                    continue
                cell = value(r)
                if pd.notna(r[rel]) and r[rel] != "":
                    cell += f" ({float(r[rel]):.1f}x)"
                cells.append(cell)
            out.append(m.ljust(width) + "".join(c.rjust(16) for c in cells))
        return out

    lines += block("Speed: training steps/s (x transformer)", lambda r: f"{float(r['steps_per_s']):.1f}", "rel_speed")
    lines += block(f"Peak memory, GB ({first['mem_kind']}; x transformer)",
                   lambda r: f"{float(r['peak_mem_mb']) / 1024:.2f}", "rel_mem")
    errors = df[df["status"].astype(str).str.startswith("error")]
    lines += [f"ERR {r.model} @ {r.seq_len}: {r.status}" for r in errors.itertuples()]
    return "\n".join(lines)


def log_to_wandb(cfg: DictConfig, df: pd.DataFrame) -> None:
    """Log the sweep's rows, its Table-2 text and the speed/memory-vs-length charts to Weights & Biases."""
    import wandb  # optional: only this logger needs it

    lg = cfg.logger
    run = wandb.init(project=lg.get("project", "lra"), entity=lg.get("entity"), mode=lg.get("mode", "online"),
                     dir=cfg.get("run_dir"),  # the bench's own folder, as a run's wandb files go to its run folder
                     tags=list(lg.get("tags") or []), job_type="bench", name=f"bench-{cfg.task.name}",
                     config=OmegaConf.to_container(OmegaConf.masked_copy(cfg, ["bench", "task", "backbone"]),
                                                   resolve=True))
    with tempfile.TemporaryDirectory() as tmp:
        rows = df.astype(object).where(df.notna(), None)  # blanks stay blank, numbers stay numbers
        logged = {"bench/rows": wandb.Table(dataframe=rows),
                  "bench/table": wandb.Html(f"<pre>{html.escape(format_table(df))}</pre>")}
        ok = df[df["status"] == "ok"]
        if not ok.empty:
            for metric in ("examples_per_s", "peak_mem_mb"):
                fig = plot.length_chart(ok, metric)
                png, _ = plot.save(fig, Path(tmp), f"bench_{metric}")
                logged[f"bench/{metric}_vs_length"] = wandb.Image(str(png))
        run.log(logged)
        for r in ok.itertuples():
            run.summary[f"{r.model}/{r.seq_len}/steps_per_s"] = float(r.steps_per_s)
            run.summary[f"{r.model}/{r.seq_len}/peak_mem_mb"] = float(r.peak_mem_mb)
        run.finish()


def format_exponents(df: pd.DataFrame) -> str:
    """The measured growth of each model's step time and memory per example in N (``measured_exponents`` of the
    whole step, ``STEP``: the log-log slope over the lengths where the step's time per token has stopped falling)
    beside the complexity it declares; empty when no sweep has two such lengths."""
    exps = measured_exponents(df.assign(device=df["device"].astype(str)), source=STEP)
    if not exps:
        return ""
    lines = ["Measured exponent in N (time / memory per example, over the compute-bound lengths) vs the declared "
             "complexity"]
    for label, e in sorted(exps.items()):
        name = label.split("(")[0]
        declared = get_model_class(name).taxonomy.complexity if name in list_models() else "?"
        lines.append(f"{label:<28}{e.time:6.2f} / {e.memory:4.2f}   declared {declared}   "
                     f"(N {length_range(e.lengths)})")
    return "\n".join(lines)


@hydra.main(config_path="../conf", config_name="bench", version_base=None)
def main(cfg: DictConfig) -> None:
    df = run_bench(cfg)
    print(format_table(df))
    exponents = format_exponents(df)
    if exponents:
        print(exponents)
    print(f"rows appended to {cfg.bench.out}")


if __name__ == "__main__":
    main()
