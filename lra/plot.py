"""Charts drawn from the result CSVs alone: the LRA bubble chart and speed / memory against sequence length.

(a) ``bubble_chart``: LRA Figure 3 (Tay et al. 2021, "Long Range Arena: A Benchmark for Efficient Transformers",
https://arxiv.org/abs/2011.04006): x = training examples/s at one length (4K) from ``bench.csv``, y = the 5-task
LRA average from ``leaderboard.csv``, bubble *area* = peak memory at that length. Optionally the paper's own
points (Table 1 average, Table 2 4K steps/s x 32, 4K memory on TPU v3) in a hollow style beside ours.
(b), (c) ``length_chart``: steps/s or peak memory against N, one line per model, log-log.

Figures are plain ``matplotlib.figure.Figure`` objects on the Agg canvas (no pyplot, no display needed).

    python -m lra.plot [--bench results/bench.csv] [--leaderboard results/leaderboard.csv] [--length 4096]
                       [--out results/charts] [--published [results/published.csv]] [--device NAME]
                       [--tasks listops,text,image,pathfinder]
"""
from __future__ import annotations

import argparse
import io
import math
from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lra.leaderboard import DEFAULT_RESULTS

matplotlib.rcParams["svg.hashsalt"] = "lra"  # SVG element ids from a fixed salt, not random: same chart, same bytes

PUBLISHED = Path(__file__).resolve().parent.parent / "results" / "published.csv"
MARKERS = "os^Dv<>pPXh*"  # with the colours, tells a dozen lines apart in print

NUMERIC = ["seq_len", "batch_size", "steps_per_s", "examples_per_s", "peak_mem_mb", "rel_speed", "rel_mem"]
METRIC_LABELS = {"steps_per_s": "training steps/s", "examples_per_s": "training examples/s",
                 "peak_mem_mb": "peak memory (MB)", "rel_speed": "speed relative to transformer"}


def _numeric(bench: pd.DataFrame) -> pd.DataFrame:
    bench = bench.copy()
    for c in NUMERIC:
        if c in bench:
            bench[c] = pd.to_numeric(bench[c], errors="coerce")
    return bench


def pick_device(bench: pd.DataFrame, device: str | None = None) -> str:
    """``device`` if given, else the device of the most recent row."""
    if device is not None:
        return device
    rows = bench.sort_values("timestamp", kind="stable") if "timestamp" in bench else bench
    return str(rows["device"].iloc[-1])


def latest_ok(bench: pd.DataFrame, device: str | None = None) -> pd.DataFrame:
    """The latest ok row per (model, seq_len, batch_size) on one device (rows are appended, never edited)."""
    bench = _numeric(bench)
    bench = bench[bench["device"].astype(str) == pick_device(bench, device)]
    if "timestamp" in bench:
        bench = bench.sort_values("timestamp", kind="stable")
    ok = bench[bench["status"].astype(str) == "ok"]
    return ok.drop_duplicates(["model", "seq_len", "batch_size"], keep="last").reset_index(drop=True)


def length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _new_figure(w: float, h: float) -> Figure:
    fig = Figure(figsize=(w, h), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _nice(v: float) -> float:
    """``v`` rounded to 2 significant digits, for legend sizes."""
    if v <= 0:
        return v
    p = 10 ** (math.floor(math.log10(v)) - 1)
    return round(v / p) * p


def task_average(accuracy: pd.DataFrame, tasks: list[str]) -> pd.Series:
    """Mean ``test_acc`` per model over ``tasks`` (rows ``model, task, test_acc``), for the models that have a
    number on every one of them."""
    cells = accuracy[accuracy["task"].isin(tasks)].copy()
    cells["test_acc"] = pd.to_numeric(cells["test_acc"], errors="coerce")
    wide = cells.dropna(subset=["test_acc"]).pivot_table(index="model", columns="task", values="test_acc",
                                                         aggfunc="last")
    wide = wide.reindex(columns=tasks).dropna()
    return wide.mean(axis=1)


def bubble_chart(bench: pd.DataFrame, leaderboard: pd.DataFrame, length: int = 4096, device: str | None = None,
                 published: pd.DataFrame | None = None, max_area: float = 2500.0,
                 tasks: list[str] | None = None) -> Figure:
    """LRA Figure 3 with our numbers. Our bubbles are one scatter collection (gid ``ours``), one offset per
    model; the paper's (``published``) are a second collection (gid ``published``).

    ``tasks`` = None: y is the LRA score (the ``avg5`` rows; the paper's 5-task average). A list of tasks: y is
    the mean over those tasks, for ours and for the paper's Table 1 alike (say, the four tasks without
    Retrieval when its AAN files are missing), and the axis and title name them."""
    bench = _numeric(bench)
    device = pick_device(bench, device)
    if "experiment" in leaderboard:  # LRA's protocol only: recipes and variants are other experiments
        leaderboard = leaderboard[leaderboard["experiment"].astype(str) == "lra"]
    at_len = bench[(bench["device"].astype(str) == device) & (bench["seq_len"] == length)]
    if "timestamp" in at_len:
        at_len = at_len.sort_values("timestamp", kind="stable")
    last = at_len.drop_duplicates("model", keep="last").set_index("model")
    if tasks is None:
        avg = leaderboard[leaderboard["task"] == "avg5"].set_index("model")["test_acc"].astype(float).dropna()
        no_avg = "no 5-task LRA average"
    else:
        avg = task_average(leaderboard, tasks)
        no_avg = f"no result on all of {', '.join(tasks)}"

    shown, missing = [], {}  # missing: reason -> models
    for m in sorted(set(last.index) | set(avg.index)):
        if m not in last.index:
            missing.setdefault(f"no bench row at {length_label(length)}", []).append(m)
        elif str(last.loc[m, "status"]) != "ok":
            status = "OOM" if last.loc[m, "status"] == "oom" else "error"
            missing.setdefault(f"{status} at {length_label(length)}", []).append(m)
        elif m not in avg.index:
            missing.setdefault(no_avg, []).append(m)
        else:
            r = last.loc[m]
            shown.append((m, float(r["examples_per_s"]), float(avg[m]), float(r["peak_mem_mb"]) / 1024))

    paper = []
    if published is not None:
        p = published.copy()
        p["value"] = pd.to_numeric(p["value"], errors="coerce")
        t1 = p[p["source"] == "lra_table1"]
        if tasks is None:
            p_avg = t1[t1["metric"] == "avg5"].set_index("model")["value"]
        else:
            p_avg = task_average(t1[t1["metric"] == "test_acc"].rename(columns={"value": "test_acc"}), tasks)
        t2 = p[(p["source"] == "lra_table2") & (pd.to_numeric(p["seq_len"], errors="coerce") == length)]
        steps = t2[t2["metric"] == "steps_per_s"].set_index("model")["value"]
        mem = t2[t2["metric"] == "peak_mem_gb"].set_index("model")["value"]
        batch = 32  # LRA Table 2's batch: Figure 3's x positions fit 4K steps/s x 32
        paper = [(m, steps[m] * batch, p_avg[m], mem[m]) for m in steps.index if m in p_avg.index and m in mem.index]

    fig = _new_figure(10.5, 6.5)
    ax = fig.add_subplot()
    mems = [s[3] for s in shown + paper]
    scale = max_area / max(mems) if mems else 1.0
    if shown:
        sc = ax.scatter([s[1] for s in shown], [s[2] for s in shown], s=[s[3] * scale for s in shown],
                        alpha=0.55, color="tab:blue", edgecolors="black", linewidths=0.8, label="ours")
        sc.set_gid("ours")
        for m, x, y, _ in shown:
            ax.annotate(m, (x, y), ha="center", va="center", fontsize=9)
    if paper:
        sc = ax.scatter([s[1] for s in paper], [s[2] for s in paper], s=[s[3] * scale for s in paper],
                        facecolors="none", edgecolors="tab:gray", linestyles="--", linewidths=1.2,
                        label="LRA paper (TPU v3, Tables 1-2)")
        sc.set_gid("published")
        # Labels go below their bubble, or above it when a neighbour's label already sits there: the paper's
        # efficient models cluster near one spot.
        x_span = max(s[1] for s in paper) - min(s[1] for s in paper) or 1.0
        y_span = max(s[2] for s in paper) - min(s[2] for s in paper) or 1.0
        below = []
        for m, x, y, mem in sorted(paper, key=lambda s: s[1]):
            crowded = any(abs(x - bx) < 0.1 * x_span and abs(y - by) < 0.08 * y_span for bx, by in below)
            radius = math.sqrt(mem * scale) / 2 + 1
            ax.annotate(f"{m} (LRA)", (x, y), xytext=(0, radius if crowded else -radius), textcoords="offset points",
                        ha="center", va="bottom" if crowded else "top", fontsize=7, color="dimgray")
            if not crowded:
                below.append((x, y))
    xs = [s[1] for s in shown + paper]
    if xs and max(xs) / max(min(xs), 1e-9) > 8:
        ax.set_xscale("log")
    if mems:  # a size legend: area is proportional to memory, the same scale for every bubble
        refs = sorted({_nice(v) for v in (max(mems) / 4, max(mems) / 2, max(mems))})
        handles = [ax.scatter([], [], s=v * scale, color="none", edgecolors="black") for v in refs]
        size_legend = ax.legend(handles, [f"{v:g} GB" for v in refs], title="peak memory", loc="upper left",
                                bbox_to_anchor=(1.02, 1), labelspacing=2.5, borderpad=1.4, handlelength=3.5,
                                handletextpad=1.8, frameon=False)
        if paper:
            ax.add_artist(size_legend)
            ax.legend(loc="lower left", bbox_to_anchor=(1.02, 0), fontsize=8, markerscale=0.3, frameon=False)
    ax.margins(0.12, 0.15)  # room for the bubbles themselves (their size is not in data units)
    ax.set_xlabel(f"speed: training examples/s at N = {length_label(length)}")
    if tasks is None:
        ax.set_ylabel("LRA score: 5-task average test accuracy (%)")
        score = "accuracy"
    else:
        ax.set_ylabel(f"mean test accuracy over {len(tasks)} tasks (%)")
        score = f"mean accuracy over {', '.join(tasks)}"
    ax.set_title(f"LRA: {score} vs speed at {length_label(length)}, bubble area = peak memory\nours: {device}",
                 fontsize=11)
    ax.grid(alpha=0.3)
    if missing:
        note = "; ".join(f"{reason}: {', '.join(models)}" for reason, models in missing.items())
        fig.text(0.01, 0.0, f"Ours not shown ({note})", fontsize=8, va="bottom", wrap=True)
        fig.get_layout_engine().set(rect=(0, 0.05, 1, 0.95))
    return fig


def length_chart(bench: pd.DataFrame, metric: str = "steps_per_s", device: str | None = None) -> Figure:
    """``metric`` against sequence length, one colour and marker per model; a sweep that changed the batch size
    (32 to 4K, 8 beyond in LRA's protocol) draws one segment per batch size in the model's colour."""
    ok = latest_ok(bench, device)
    device = pick_device(_numeric(bench), device)
    fig = _new_figure(8.5, 5)
    ax = fig.add_subplot()
    models = sorted(ok["model"].unique())
    pairs = matplotlib.colormaps["tab20"].colors  # (dark, light) pairs: all the dark ones first
    colours = pairs[0::2] + pairs[1::2]
    others = [m for m in models if m != "transformer"]
    style = {m: (colours[i % len(colours)], MARKERS[i % len(MARKERS)]) for i, m in enumerate(others)}
    style["transformer"] = ("black", "o")  # the baseline: black and dashed
    for (model, _batch), g in ok.groupby(["model", "batch_size"], sort=True):
        g = g.sort_values("seq_len")
        colour, marker = style[model]
        label = model if model not in [line.get_label() for line in ax.get_lines()] else "_nolegend_"
        ax.plot(g["seq_len"], g[metric], marker=marker, color=colour, label=label,
                linestyle="--" if model == "transformer" else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    lengths = sorted(ok["seq_len"].dropna().astype(int).unique())
    ax.set_xticks(lengths, [length_label(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("sequence length N")
    ax.set_ylabel(METRIC_LABELS.get(metric, metric))
    precision = ", ".join(sorted(ok["precision"].astype(str).unique())) if "precision" in ok else ""
    batches = []
    for batch, g in ok.groupby("batch_size", sort=False):
        lo, hi = int(g["seq_len"].min()), int(g["seq_len"].max())
        span = length_label(lo) if lo == hi else f"{length_label(lo)}-{length_label(hi)}"
        batches.append((lo, f"{int(batch)} at {span}"))
    batch = ", batch " + ", ".join(text for _, text in sorted(batches)) if batches else ""
    ax.set_title(f"{METRIC_LABELS.get(metric, metric)} vs length ({precision}{batch})\n{device}", fontsize=11)
    ax.grid(alpha=0.3, which="both")
    if not ok.empty:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    return fig


def save(fig: Figure, out_dir: Path, stem: str) -> tuple[Path, Path]:
    """PNG and SVG, reproducibly (no dates, fixed ids); a file whose bytes would not change is left untouched, so
    regenerating the charts does not dirty a checkout."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / f"{stem}.png", out_dir / f"{stem}.svg"
    for path, fmt, extra in ((paths[0], "png", {"dpi": 150, "metadata": {"Software": None}}),
                             (paths[1], "svg", {"metadata": {"Date": None}})):
        buf = io.BytesIO()
        fig.savefig(buf, format=fmt, **extra)
        data = buf.getvalue()
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
    return paths


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(prog="python -m lra.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=DEFAULT_RESULTS,
                    help="results folder: reads bench.csv and leaderboard.csv, writes charts/ (the project's: results)")
    ap.add_argument("--bench", default=None, help="bench file (default: RESULTS/bench.csv)")
    ap.add_argument("--leaderboard", default=None, help="leaderboard file (default: RESULTS/leaderboard.csv)")
    ap.add_argument("--length", type=int, default=4096, help="bench length for the bubble chart's speed and memory")
    ap.add_argument("--device", default=None, help="bench device (default: the device of the latest row)")
    ap.add_argument("--out", default=None, help="chart folder (default: RESULTS/charts)")
    ap.add_argument("--published", nargs="?", const=str(PUBLISHED), default=None,
                    help="also draw the LRA paper's points (default file results/published.csv)")
    ap.add_argument("--tasks", default=None,
                    help="bubble chart's y = mean over these comma-separated tasks (ours and the paper's alike) "
                         "instead of the 5-task LRA score; the file is then lra_bubble_<length>_<n>tasks")
    args = ap.parse_args(argv)
    tasks = None
    if args.tasks:
        from lra.data import list_tasks

        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = sorted(set(tasks) - set(list_tasks()))
        if unknown:
            raise SystemExit(f"--tasks: unknown task(s) {', '.join(unknown)}; the tasks are {', '.join(list_tasks())}")

    results = Path(args.results)
    bench_path = Path(args.bench or results / "bench.csv")
    lb_path = Path(args.leaderboard or results / "leaderboard.csv")
    args.out = args.out or results / "charts"
    if not bench_path.exists():
        raise SystemExit(f"no bench results at {bench_path}: run `python -m lra.bench` first")
    bench = pd.read_csv(bench_path)
    written = []
    if lb_path.exists():
        published = pd.read_csv(args.published) if args.published else None
        fig = bubble_chart(bench, pd.read_csv(lb_path), args.length, args.device, published, tasks=tasks)
        suffix = f"_{len(tasks)}tasks" if tasks else ""
        written += save(fig, args.out, f"lra_bubble_{length_label(args.length)}{suffix}")
    else:
        print(f"no leaderboard at {lb_path} (`python -m lra.leaderboard`): skipping the bubble chart")
    written += save(length_chart(bench, "steps_per_s", args.device), args.out, "speed_vs_length")
    written += save(length_chart(bench, "peak_mem_mb", args.device), args.out, "memory_vs_length")
    for p in written:
        print(p)
    return written


if __name__ == "__main__":
    main()
