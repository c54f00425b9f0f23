"""Charts drawn from the result CSVs alone: the LRA bubble chart, one task's accuracy over seeds, and speed / memory
against sequence length.

Every chart is two steps: a pure function returns a DataFrame of what is drawn (the tests check those), and a
drawing function turns it into a figure.

(a) The bubble chart, LRA Figure 3 (Tay et al. 2021, "Long Range Arena: A Benchmark for Efficient Transformers",
https://arxiv.org/abs/2011.04006): x = training examples/s at one length (4K) from ``bench.csv``, y = the 5-task
LRA average (or the mean over chosen tasks) from ``leaderboard.csv``, bubble *area* = peak memory at that length.
``bubble_points`` (ours), ``paper_points`` (the paper's Table 1 score, Table 2 4K steps/s x 32 and 4K memory on
TPU v3, drawn hollow beside ours), ``draw_bubbles``. Given the runs behind the leaderboard, a vertical bar through
each of our bubbles whose score rests on several seeds of some task spans the score's 95 % interval from the
leaderboard's bootstrap over seeds and test examples (``average_spread``, ``lra.rank``).
(b) The accuracy chart of one task: our mean test accuracy per model with the std over seeds as error bars, LRA
Table 1's value beside. ``accuracy_points``, ``draw_accuracy``.
(c) Training examples/s or peak memory per example against N, one line per model, log-log, one panel per family of
the survey's taxonomy (``FAMILIES``): the bench table's rows (each model's latest under the bench's own protocol),
one point per model and length. ``length_points``, ``draw_lengths``.

Only the leaderboard's ``experiment == lra`` rows count (LRA's protocol; a leaderboard without the column is all
``lra``). Figures are plain ``matplotlib.figure.Figure`` objects on the Agg canvas (no pyplot, no display needed).

    python -m lra.plot [--results DIR] [--bench FILE] [--leaderboard FILE] [--length 4096] [--out DIR]
                       [--published [FILE]] [--device NAME]
                       [--tasks listops,text,image,pathfinder] [--errorbars-task listops]
"""
from __future__ import annotations

import argparse
import io
import math
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from lra.errors import DataError
from lra.report import labels, rank
from lra.report.leaderboard import (
    DEFAULT_RESULTS,
    PUBLISHED,
    TASKS5,
    average_replicates,
    bench_numbers,
    cell_replicates,
    headline_bench_rows,
    latest_bench_rows,
    pick_device,
    read_reference,
    seed_accuracies,
    select_runs,
)
from lra.report.results import BENCH_PROTOCOL, as_text
from models import get_model_class, list_models

matplotlib.rcParams["svg.hashsalt"] = "lra"  # SVG element ids from a fixed salt, not random: same chart, same bytes

MARKERS = "os^Dv<>pPXh*"  # with the colours, tells a dozen lines apart in print

METRIC_LABELS = {"steps_per_s": "training steps/s", "examples_per_s": "training examples/s",
                 "peak_mem_mb": "peak memory per example (MB)", "rel_speed": "speed relative to transformer"}
POINT_COLUMNS = ["model", "x", "y", "mem_gb"]
ACCURACY_COLUMNS = ["model", "mean", "std", "n_seeds", "n_stalled", "paper", "headline", "seeds"]

PAPER_BATCH = 32  # LRA Table 2's batch: Figure 3's x positions fit 4K steps/s x 32
LOG_SPAN = 8.0  # an axis whose values span more than this factor is drawn log
COINCIDE_TOL = 0.02  # series within 2 % of each other at every shared length are drawn side by side
DODGE_STEP, DODGE_SPAN = 0.05, 0.3  # octaves between side-by-side series, and at most across a whole group


# ---------------------------------------------------------------------------------------------------------------
# Reading the CSVs


def _on_device(bench: pd.DataFrame, device: str | None) -> pd.DataFrame:
    """Numeric rows of one device, oldest first (rows are appended, never edited: the last one is the latest)."""
    bench = bench_numbers(bench)
    bench = bench[bench["device"].astype(str) == pick_device(bench, device)]
    return bench.sort_values("timestamp", kind="stable") if "timestamp" in bench else bench


def _ok_rows(bench: pd.DataFrame, device: str | None = None) -> pd.DataFrame:
    """Each model's latest ok row per shape and protocol on one device (``latest_bench_rows`` over every card, as the
    bench table reads them: a superseded or contradicted row is not drawn), oldest first."""
    rows = latest_bench_rows(bench)
    return rows[rows["device"].astype(str) == pick_device(bench, device)]


def length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def lra_rows(leaderboard: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard rows of LRA's protocol: recipes, variants and smoke runs are other experiments. A leaderboard
    written before the ``experiment`` column existed holds LRA rows only."""
    if "experiment" not in leaderboard:
        return leaderboard
    return leaderboard[leaderboard["experiment"].fillna("lra").astype(str) == "lra"]


def task_average(accuracy: pd.DataFrame, tasks: list[str]) -> pd.Series:
    """Mean ``test_acc`` per model over ``tasks`` (rows ``model, task, test_acc``), for the models that have a
    number on every one of them."""
    cells = accuracy[accuracy["task"].isin(tasks)].copy()
    cells["test_acc"] = pd.to_numeric(cells["test_acc"], errors="coerce")
    wide = cells.dropna(subset=["test_acc"]).pivot_table(index="model", columns="task", values="test_acc",
                                                         aggfunc="last")
    wide = wide.reindex(columns=tasks).dropna()
    return wide.mean(axis=1)


# ---------------------------------------------------------------------------------------------------------------
# (a) The bubble chart: what is drawn


def no_score_reason(tasks: list[str] | None) -> str:
    """Why a model with a bench row has no y: the note under the chart groups such models under this."""
    return "no 5-task LRA average" if tasks is None else f"no result on all of {', '.join(tasks)}"


def our_scores(leaderboard: pd.DataFrame, tasks: list[str] | None = None) -> pd.Series:
    """y per model: the ``avg5`` rows (LRA's score), or the mean over ``tasks`` of the per-task rows."""
    board = lra_rows(leaderboard)
    if tasks is not None:
        return task_average(board, tasks)
    avg = board[board["task"] == "avg5"]
    return pd.to_numeric(avg.set_index("model")["test_acc"], errors="coerce").dropna()


def _latest_at(rows: pd.DataFrame, length: int) -> pd.DataFrame:
    """The latest of ``rows`` (oldest first) per model at ``length``, at LRA Table 2's batch where the model has a
    row at it, else at its largest batch: a 4K row at batch 8 (run for the exponents over 4K-16K) never stands in
    for the batch-32 row the paper's bubbles are measured at."""
    rows = rows[rows["seq_len"] == length]
    at_paper = rows["model"].isin(rows.loc[rows["batch_size"] == PAPER_BATCH, "model"])
    largest = rows["batch_size"] == rows.groupby("model")["batch_size"].transform("max")
    chosen = rows[(rows["batch_size"] == PAPER_BATCH) | (~at_paper & largest)]
    return chosen.drop_duplicates("model", keep="last")


def _protocols(rows: pd.DataFrame) -> pd.DataFrame:
    """Each row's ``BENCH_PROTOCOL`` values as text ('' where a column is blank or absent, as in older rows)."""
    return as_text(rows, BENCH_PROTOCOL)


def _protocol_key(rows: pd.DataFrame) -> pd.Series:
    return _protocols(rows).agg(" | ".join, axis=1)


def _under(rows: pd.DataFrame, protocol: dict | None) -> pd.DataFrame:
    if protocol is None:
        return rows
    return rows[_protocol_key(rows) == " | ".join(protocol[c] for c in BENCH_PROTOCOL)]


def chart_protocol(bench: pd.DataFrame, length: int, device: str | None, models) -> dict | None:
    """The protocol (``BENCH_PROTOCOL``'s values) a chart's speeds come from, so that its bubbles compare like with
    like: the one under which most of ``models`` have an ok row at ``length``; on a tie, the one measured last. None
    without any ok row there."""
    ok = _ok_rows(bench, device)
    ok = ok[ok["seq_len"] == length]
    if ok.empty:
        return None
    ok = ok.assign(key=_protocol_key(ok), counted=ok["model"].where(ok["model"].isin(list(models))),
                   when=ok["timestamp"].astype(str) if "timestamp" in ok else "")
    stats = ok.groupby("key").agg(n=("counted", "nunique"), last=("when", "max"))
    chosen = stats.sort_values(["n", "last"], kind="stable").index[-1]
    return _protocols(ok[ok["key"] == chosen]).iloc[0].to_dict()


def protocol_label(protocol: dict | None) -> str:
    if protocol is None:
        return ""
    compiled = {"True": "compiled", "False": "eager"}.get(protocol["compiled"], "")
    if compiled and protocol.get("compile_mode"):  # blank: torch.compile's default mode
        compiled += f" ({protocol['compile_mode']})"
    return ", ".join(v for v in (protocol["precision"], compiled, protocol["backbone"]) if v)


def bench_at(bench: pd.DataFrame, length: int, device: str | None = None, protocol: dict | None = None) -> pd.DataFrame:
    """The latest ok row per model at ``length`` on one device (at the paper's batch: ``_latest_at``), under
    ``protocol`` when given (``chart_protocol``), indexed by model."""
    return _latest_at(_under(_ok_rows(bench, device), protocol), length).set_index("model")


def _bench_failures(bench: pd.DataFrame, length: int, device: str | None,
                    protocol: dict | None = None) -> dict[str, str]:
    """model -> "OOM" or "error": the status of its latest row at ``length``, for models whose latest row failed."""
    last = _latest_at(_under(_on_device(bench, device), protocol), length)
    failed = last[last["status"].astype(str) != "ok"]
    return {m: "OOM" if s == "oom" else "error" for m, s in zip(failed["model"], failed["status"].astype(str))}


def _why_missing(model: str, speed: pd.DataFrame, scores: pd.Series, failed: dict[str, str], length: int,
                 tasks: list[str] | None, several_protocols: bool = False) -> str | None:
    """None for a model with a score and an ok bench row, else the reason it is not drawn: the score first, so a
    model listed under a bench reason has a score."""
    if model not in scores.index:
        return no_score_reason(tasks)
    if model not in speed.index:
        where = " under this protocol" if several_protocols else ""
        return f"{failed.get(model, 'no bench row')} at {length_label(length)}{where}"
    return None


def bubble_card(bench: pd.DataFrame, scores: pd.Series, length: int) -> str:
    """The card whose bench rows at ``length``, under one protocol (``chart_protocol``), give the most models of
    ``scores`` a bubble; on a tie, the one that timed the most models there under that protocol (the fuller
    bench: charts over different tasks then share a card where they can), then ``pick_device``'s card, then the
    one with the latest row. A card that timed more models over all lengths and protocols (``pick_device``) can
    still draw fewer: its rows at this length may predate the newer models, or be split between an eager and a
    compiled sweep."""
    bench = bench_numbers(bench)
    default = pick_device(bench)
    ok = bench[bench["status"].astype(str) == "ok"]
    latest = ok.groupby(ok["device"].astype(str))["timestamp"].max().astype(str) if "timestamp" in ok else {}

    def drawn(card: str) -> tuple[int, int, bool, str]:
        speed = bench_at(bench, length, card, chart_protocol(bench, length, card, scores.index))
        return len(set(speed.index) & set(scores.index)), len(speed), card == default, latest.get(card, "")

    return max(sorted(ok["device"].astype(str).unique()), key=drawn, default=default)


def bubble_points(bench: pd.DataFrame, leaderboard: pd.DataFrame, length: int = 4096, device: str | None = None,
                  tasks: list[str] | None = None) -> tuple[pd.DataFrame, dict[str, list[str]]]:
    """Our bubbles: (``model, x, y, mem_gb`` per model with a speed and a score, sorted by model; reason -> models
    for every other model of the bench or the leaderboard).

    x = training examples/s of the model's latest ok bench row at ``length`` on one device, under one protocol
    for all (``chart_protocol``), y = its score (``our_scores``), mem_gb = that bench row's peak memory. A model
    is missing when it has no score, or no ok row there (its latest row failed, or there is none). Without a
    ``device``, the card that draws the most of them (``bubble_card``); ``ours.attrs`` names card and protocol."""
    scores = our_scores(leaderboard, tasks)
    device = bubble_card(bench, scores, length) if device is None else device
    protocol = chart_protocol(bench, length, device, scores.index)
    speed = bench_at(bench, length, device, protocol)
    failed = _bench_failures(bench, length, device, protocol)
    rows, missing = [], {}
    several = _protocol_key(_ok_rows(bench, device).query("seq_len == @length")).nunique() > 1
    for m in sorted(set(speed.index) | set(scores.index) | set(failed)):
        reason = _why_missing(m, speed, scores, failed, length, tasks, several)
        if reason:
            missing.setdefault(reason, []).append(m)
        else:
            rows.append(dict(model=m, x=float(speed.at[m, "examples_per_s"]), y=float(scores[m]),
                             mem_gb=float(speed.at[m, "peak_mem_mb"]) / 1024))
    ours = pd.DataFrame(rows, columns=POINT_COLUMNS)
    ours.attrs["protocol"] = protocol_label(protocol)  # named in the chart's title, with the card
    ours.attrs["device"] = device
    return ours, missing


def average_spread(runs: pd.DataFrame, tasks: list[str] | None = None) -> pd.DataFrame:
    """``model, y_lo, y_hi``: the 2.5th and 97.5th percentiles of the bootstrap of each ``lra`` model's mean over
    ``tasks`` (None: LRA's five), for the models with every task and more than one seed on at least one of them:
    the spread a bubble's bar shows (a single seed everywhere has only test-set noise, no seed spread)."""
    tasks = TASKS5 if tasks is None else tasks
    best = select_runs(runs)
    best = best[best["best"] & best["task"].isin(tasks)]
    draws = cell_replicates(best)
    rows = []
    for model, g in best.groupby("model"):
        mean = average_replicates(draws, "lra", model, tasks)
        if mean is not None and g.groupby("task")["seed"].nunique().max() > 1:
            lo, hi = np.percentile(mean, rank.LEVEL)
            rows.append(dict(model=model, y_lo=lo, y_hi=hi))
    return pd.DataFrame(rows, columns=["model", "y_lo", "y_hi"])


def _table2_at(published: pd.DataFrame, length: int) -> pd.DataFrame:
    """LRA Table 2 at ``length``: ``steps_per_s`` and ``peak_mem_gb`` columns, indexed by model."""
    t2 = published[(published["source"] == "lra_table2")
                   & (pd.to_numeric(published["seq_len"], errors="coerce") == length)].copy()
    t2["value"] = pd.to_numeric(t2["value"], errors="coerce")
    wide = t2.pivot_table(index="model", columns="metric", values="value", aggfunc="last")
    return wide.reindex(columns=["steps_per_s", "peak_mem_gb"]).dropna()


def paper_points(published: pd.DataFrame, length: int = 4096, tasks: list[str] | None = None) -> pd.DataFrame:
    """The paper's bubbles (``model, x, y, mem_gb``, sorted by model): x = Table 2 steps/s at ``length`` x 32
    examples, y = Table 1's 5-task average, or its mean over ``tasks`` as for ours, mem_gb = Table 2 memory."""
    t1 = published[published["source"] == "lra_table1"].copy()
    t1["value"] = pd.to_numeric(t1["value"], errors="coerce")
    if tasks is None:
        scores = t1[t1["metric"] == "avg5"].set_index("model")["value"].dropna()
    else:
        scores = task_average(t1[t1["metric"] == "test_acc"].rename(columns={"value": "test_acc"}), tasks)
    t2 = _table2_at(published, length).join(scores.rename("y"), how="inner").sort_index()
    return pd.DataFrame({"model": t2.index, "x": t2["steps_per_s"].to_numpy() * PAPER_BATCH,
                         "y": t2["y"].to_numpy(), "mem_gb": t2["peak_mem_gb"].to_numpy()}, columns=POINT_COLUMNS)


def speed_range(bench: pd.DataFrame, length: int = 4096, device: str | None = None,
                published: pd.DataFrame | None = None) -> tuple[float, float] | None:
    """The x range of every bubble chart at ``length``: the speed of every model with an ok bench row there, scored
    or not, and of the paper's Table 2. The speeds do not depend on the tasks, so the 5-task chart and a task subset's
    share one x axis, and it does not jump as scores arrive."""
    xs = list(bench_at(bench, length, device)["examples_per_s"])
    if published is not None:
        xs += list(_table2_at(published, length)["steps_per_s"] * PAPER_BATCH)
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return (min(xs), max(xs)) if xs else None


def axis_scale(lo: float, hi: float) -> str:
    """One rule for every chart: log when the values span more than a factor of ``LOG_SPAN``, else linear."""
    return "log" if lo > 0 and hi / lo > LOG_SPAN else "linear"


# ---------------------------------------------------------------------------------------------------------------
# (a) The bubble chart: drawing


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


def _plain(v: float, _pos=None) -> str:
    """A tick label without powers of ten: 2,000 rather than 2x10^3."""
    return f"{v:,.0f}" if v >= 1000 else f"{v:g}"


def log_ticks(lo: float, hi: float, min_ticks: int = 3) -> list[float]:
    """Tick values in [lo, hi] for a log axis: the powers of ten, or 1-2-5 per decade, or 1-9 per decade, whichever
    first gives ``min_ticks`` (a log axis over a narrow range otherwise labels a single tick)."""
    ticks: list[float] = []
    for mantissas in ((1,), (1, 2, 5), tuple(range(1, 10))):
        decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
        ticks = [m * 10.0 ** e for e in decades for m in mantissas if lo <= m * 10.0 ** e <= hi]
        if len(ticks) >= min_ticks:
            break
    return ticks


def _label_log_axis(axis, lo: float, hi: float) -> None:
    axis.set_major_locator(FixedLocator(log_ticks(lo, hi)))
    axis.set_major_formatter(FuncFormatter(_plain))
    axis.set_minor_locator(NullLocator())


def _set_speed_axis(ax, x_range: tuple[float, float] | None, length: int) -> None:
    """x scale by ``axis_scale``, limits = ``x_range`` with room for the bubbles, and the axis label says which."""
    scale = axis_scale(*x_range) if x_range else "linear"
    ax.set_xscale(scale)
    if x_range:
        lo, hi = x_range
        if scale == "log":
            ax.set_xlim(lo / 1.4, hi * 1.4)
            _label_log_axis(ax.xaxis, lo / 1.4, hi * 1.4)
        else:
            pad = 0.12 * (hi - lo) or 0.12 * hi or 1.0
            ax.set_xlim(lo - pad, hi + pad)
    ax.set_xlabel(f"speed: training examples/s at N = {length_label(length)}" + (", log scale" if scale == "log"
                                                                                 else ""))


def _size_legend(ax, mems: list[float], scale: float, with_series: bool) -> None:
    """Area is proportional to memory, the same scale for every bubble: three reference sizes, and the ours / paper
    legend under it."""
    refs = sorted({_nice(v) for v in (max(mems) / 4, max(mems) / 2, max(mems))})
    handles = [ax.scatter([], [], s=v * scale, color="none", edgecolors="black") for v in refs]
    size_legend = ax.legend(handles, [f"{v:g} GB" for v in refs], title="peak memory", loc="upper left",
                            bbox_to_anchor=(1.02, 1), labelspacing=2.5, borderpad=1.4, handlelength=3.5,
                            handletextpad=1.8, frameon=False)
    if with_series:
        ax.add_artist(size_legend)
        ax.legend(loc="lower left", bbox_to_anchor=(1.02, 0), fontsize=8, markerscale=0.3, frameon=False)


def _ours_caption(ours: pd.DataFrame, missing: dict, device: str | None, tasks: list[str] | None) -> str:
    """The title names our device only when our bubbles are drawn."""
    if len(ours):
        protocol = ours.attrs.get("protocol")
        return f"ours: {device}" + (f"; bench {protocol}" if protocol else "")
    if set(missing) <= {no_score_reason(tasks)}:
        return f"ours: none drawn, no model of ours has a result on all {len(tasks or TASKS5)} tasks yet"
    return "ours: none drawn, no model of ours has both a score and a bench row (see below)"


def _bubble_texts(fig: Figure, ax, ours: pd.DataFrame, missing: dict, length: int, device: str | None,
                  tasks: list[str] | None) -> None:
    if tasks is None:
        ax.set_ylabel("LRA score: 5-task average test accuracy (%)")
        score = "LRA score (5-task average accuracy)"
    else:
        ax.set_ylabel(f"mean test accuracy over {len(tasks)} tasks (%)")
        score = f"LRA: mean accuracy over {', '.join(tasks)}"
    ax.set_title(f"{score} vs speed at {length_label(length)}, bubble area = peak memory\n"
                 f"{_ours_caption(ours, missing, device, tasks)}", fontsize=11)
    if missing:
        note = "; ".join(f"{reason}: {', '.join(models)}" for reason, models in missing.items())
        fig.text(0.01, 0.0, f"Ours not shown ({note})", fontsize=8, va="bottom", wrap=True)
        fig.get_layout_engine().set(rect=(0, 0.05, 1, 0.95))


def _label_bubbles(fig: Figure, ax, groups: list[tuple[pd.DataFrame, float, dict, bool]]) -> None:
    """Labels placed by ``labels.place_labels`` once the layout is final: ``groups`` = (points, points^2 per GB, text
    style, label inside the bubble first). A label that ``labels.leaders`` names gets a line to its bubble's centre.
    Labels stay out of the layout, so placing them does not move the axes."""
    fig.canvas.draw()  # runs the layout: data -> points is final from here
    renderer = fig.canvas.get_renderer()
    to_pt = 72.0 / fig.dpi
    texts, bubbles, sizes, centre_first = [], [], [], []
    for points, scale, style, inside in groups:
        for r in points.itertuples():
            text = dict(text=style["fmt"].format(r.model), xy=(r.x, r.y), textcoords="offset points", ha="center",
                        va="center", fontsize=style["fontsize"], color=style["color"])
            probe = ax.annotate(**text, xytext=(0, 0))  # measured, then drawn again where it goes
            extent = probe.get_window_extent(renderer)
            probe.remove()
            cx, cy = ax.transData.transform((r.x, r.y)) * to_pt
            texts.append(text)
            bubbles.append((cx, cy, math.sqrt(r.mem_gb * scale) / 2 + 1))  # + the edge line
            sizes.append((extent.width * to_pt + 2, extent.height * to_pt))
            centre_first.append(inside)
    bounds = tuple(np.asarray(ax.bbox.extents) * to_pt)
    offsets = labels.place_labels(bubbles, sizes, bounds, centre_first)
    for text, offset, leader in zip(texts, offsets, labels.leaders(bubbles, sizes, offsets), strict=True):
        arrow = dict(arrowstyle="-", color=text["color"], linewidth=0.6, shrinkA=0, shrinkB=0)  # to the centre
        ax.annotate(**text, xytext=offset, arrowprops=arrow if leader else None).set_in_layout(False)


OURS_STYLE = dict(alpha=0.55, color="tab:blue", edgecolors="black", linewidths=0.8, label="ours")
PAPER_STYLE = dict(facecolors="none", edgecolors="tab:gray", linestyles="--", linewidths=1.2,
                   label="LRA paper (TPU v3, Tables 1-2)")
OURS_TEXT = dict(fmt="{}", fontsize=9, color="black")
PAPER_TEXT = dict(fmt="{} (LRA)", fontsize=7, color="dimgray")


def draw_bubbles(ours: pd.DataFrame, paper: pd.DataFrame | None = None, missing: dict | None = None, *,
                 length: int = 4096, device: str | None = None, tasks: list[str] | None = None,
                 x_range: tuple[float, float] | None = None, max_area: float = 2500.0) -> Figure:
    """The bubble chart of ``bubble_points`` (ours, filled, gid ``ours``) and ``paper_points`` (hollow, gid
    ``published``); ``missing`` is listed under it. Where ``ours`` has ``y_lo``, ``y_hi`` (``average_spread``), a
    vertical bar through the bubble spans them (gid ``ours_spread``). ``x_range`` (``speed_range``) fixes the x axis;
    by default the drawn points'."""
    paper = paper if paper is not None else pd.DataFrame(columns=POINT_COLUMNS)
    missing = missing or {}
    drawn = pd.concat([p for p in (ours, paper) if len(p)] or [ours])
    x_range = x_range or ((drawn["x"].min(), drawn["x"].max()) if len(drawn) else None)
    mems = list(drawn["mem_gb"])
    scale = max_area / max(mems) if mems else 1.0  # points^2 per GB

    fig = _new_figure(10.5, 6.5)
    ax = fig.add_subplot()
    for points, style, gid in ((ours, OURS_STYLE, "ours"), (paper, PAPER_STYLE, "published")):
        if len(points):
            ax.scatter(points["x"], points["y"], s=points["mem_gb"] * scale, **style).set_gid(gid)
    spread = ours.dropna(subset=["y_lo", "y_hi"]) if {"y_lo", "y_hi"} <= set(ours) else ours.iloc[:0]
    if len(spread):  # over the bubbles: a bar hidden behind its own bubble would show nothing
        ax.vlines(spread["x"], spread["y_lo"], spread["y_hi"], colors="tab:blue", linewidths=1.5, zorder=3,
                  label="ours: 95% bootstrap interval").set_gid("ours_spread")
    _set_speed_axis(ax, x_range, length)
    ax.margins(y=0.15)  # room for the bubbles themselves (their size is not in data units)
    ax.grid(alpha=0.3)
    if mems:
        _size_legend(ax, mems, scale, with_series=bool(len(paper)) or bool(len(spread)))
    _bubble_texts(fig, ax, ours, missing, length, device, tasks)
    _label_bubbles(fig, ax, [(ours, scale, OURS_TEXT, True), (paper, scale, PAPER_TEXT, False)])
    return fig


def bubble_chart(bench: pd.DataFrame, leaderboard: pd.DataFrame, length: int = 4096, device: str | None = None,
                 published: pd.DataFrame | None = None, max_area: float = 2500.0,
                 tasks: list[str] | None = None, runs: pd.DataFrame | None = None) -> Figure:
    """LRA Figure 3 with our numbers, from the CSVs: ``bubble_points``, ``paper_points`` (when ``published`` is
    given) and ``speed_range`` drawn by ``draw_bubbles``, with ``average_spread``'s bars given the ``runs`` behind the
    leaderboard.

    ``tasks`` = None: y is the LRA score (the ``avg5`` rows; the paper's 5-task average). A list of tasks: y is
    the mean over those tasks, for ours and for the paper's Table 1 alike (say, the four tasks without
    Retrieval when its AAN files are missing), and the axis and title name them."""
    ours, missing = bubble_points(bench, leaderboard, length, device, tasks)
    device = ours.attrs["device"]  # the card bubble_points chose when none was given
    if runs is not None:
        attrs = ours.attrs
        ours = ours.merge(average_spread(runs, tasks), on="model", how="left")
        ours.attrs = attrs
    paper = paper_points(published, length, tasks) if published is not None else None
    return draw_bubbles(ours, paper, missing, length=length, device=device, tasks=tasks, max_area=max_area,
                        x_range=speed_range(bench, length, device, published))


# ---------------------------------------------------------------------------------------------------------------
# (b) One task's accuracy with error bars over seeds


def accuracy_points(leaderboard: pd.DataFrame, task: str = "listops", runs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per model with a result on ``task`` (experiment ``lra``): ``mean`` test accuracy, ``std`` over seeds (NaN
    with one seed: no bar), ``n_seeds``, ``n_stalled``, ``paper`` = the leaderboard's LRA Table 1 cell,
    ``headline`` = which weights the accuracy is of (``best_val`` or ``final``) and, given the ``runs`` behind the
    leaderboard, ``seeds`` = each seed's accuracy (a list; empty without them); the best mean first."""
    rows = lra_rows(leaderboard)
    rows = rows[rows["task"] == task]

    def column(name, default=np.nan):
        return pd.to_numeric(rows[name], errors="coerce") if name in rows else pd.Series(default, index=rows.index)

    points = pd.DataFrame({"model": rows["model"], "mean": column("test_acc"), "std": column("test_std"),
                           "n_seeds": column("n_seeds", 1).fillna(1).astype(int),
                           "n_stalled": column("n_stalled", 0).fillna(0).astype(int), "paper": column("published"),
                           "headline": rows.get("headline", "best_val")},
                          columns=ACCURACY_COLUMNS).dropna(subset=["mean"])
    per_seed = {}
    if runs is not None:
        chosen = seed_accuracies(runs)
        per_seed = chosen[chosen["task"] == task].sort_values("seed").groupby("model")["test_acc"].agg(list)
    points["seeds"] = [per_seed.get(m, []) for m in points["model"]]
    points.loc[points["n_seeds"] < 2, "std"] = np.nan  # one seed has no spread to show, whatever the cell says
    return points.sort_values(["mean", "model"], ascending=[False, True], kind="stable").reset_index(drop=True)


def accuracy_label(r) -> str:
    """A row's tick label (``r``: one row of ``accuracy_points``): the model, then the numbers, so none of them is
    drawn over a marker or the legend."""
    if r["n_seeds"] > 1:
        ours = f"{r['mean']:.2f} ± {r['std']:.2f} ({r['n_seeds']} seeds"
    else:
        ours = f"{r['mean']:.2f} (1 seed, no bar"
    stalled = f", {r['n_stalled']} stalled" if r["n_stalled"] else ""
    paper = "" if pd.isna(r["paper"]) else f"; LRA {r['paper']:.2f}"
    return f"{r['model']}\n{ours}{stalled}){paper}"


PAPER_ROW_SHIFT = 0.22  # the paper's marker sits just below ours, so equal values stay apart
SEED_ROW_SHIFT = 0.2  # and each seed's tick just above


def draw_accuracy(points: pd.DataFrame, task: str) -> Figure:
    """``accuracy_points`` as one row per model, the best on top: our mean with the std over seeds as a bar (filled
    marker), each seed as a small tick just above it (where ``seeds`` lists them), a single seed as a hollow marker
    without a bar, LRA Table 1's value as a grey diamond just below."""
    fig = _new_figure(8.5, 1.8 + 0.5 * max(len(points), 1))
    ax = fig.add_subplot()
    pos = np.arange(len(points))[::-1].astype(float)  # the first (best) row on top
    seeds, paper = points["n_seeds"] > 1, points["paper"].notna()
    handles = []  # in this order in the legend: ours, then the paper
    if seeds.any():
        handles.append(ax.errorbar(points["mean"][seeds], pos[seeds], xerr=points["std"][seeds], fmt="o",
                                   color="tab:blue", capsize=4, label="ours: mean ± std over seeds"))
    each = [(value, y + SEED_ROW_SHIFT) for values, y, several in zip(points["seeds"], pos, seeds, strict=True)
            if several for value in values]  # (accuracy, row) of every seed behind a bar
    if each:
        handles += ax.plot(*zip(*each, strict=True), "|", color="tab:blue", markersize=7, linestyle="none",
                           label="ours: each seed")
    if (~seeds).any():
        handles += ax.plot(points["mean"][~seeds], pos[~seeds], "o", mfc="white", color="tab:blue",
                           linestyle="none", label="ours: one seed (no bar)")
    if paper.any():
        handles += ax.plot(points["paper"][paper], pos[paper] - PAPER_ROW_SHIFT, "D", mfc="none", color="tab:gray",
                           linestyle="none", label="LRA Table 1")
    ax.set_yticks(pos, [accuracy_label(r) for r in points.to_dict("records")], fontsize=8)
    ax.set_ylim(-0.7, len(points) - 0.3)
    ax.margins(x=0.08)
    final = bool(len(points)) and (points["headline"] == "final").all()  # validation is the test set (Text)
    ax.set_xlabel(f"{task} test accuracy (%), " + ("final weights" if final else "best-validation checkpoint"))
    ax.set_title(f"{task}: our test accuracy per model (experiment lra), LRA Table 1 beside", fontsize=11)
    ax.grid(alpha=0.3, axis="x")
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    return fig


def accuracy_chart(leaderboard: pd.DataFrame, task: str = "listops") -> Figure:
    return draw_accuracy(accuracy_points(leaderboard, task), task)


# ---------------------------------------------------------------------------------------------------------------
# (c) Speed or memory against length


def _coincide(a: pd.Series, b: pd.Series, tol: float) -> bool:
    """Two series within ``tol`` (relative) of each other at every length both have, and at least one."""
    shared = a.notna() & b.notna()
    return bool(shared.any()) and bool((np.abs(np.log(a[shared] / b[shared])) <= tol).all())


def coinciding_groups(points: pd.DataFrame, tol: float = COINCIDE_TOL) -> list[list[str]]:
    """Models whose series lie on top of one another (``length_points``' ``value`` per ``seq_len``), grouped: a
    model joins every group it coincides with a member of. Only groups of two or more, each sorted."""
    wide = points.pivot_table(index="seq_len", columns="model", values="value", aggfunc="last")
    groups: list[list[str]] = []
    for m in sorted(wide.columns):
        touching = [g for g in groups if any(_coincide(wide[m], wide[o], tol) for o in g)]
        groups = [g for g in groups if g not in touching] + [sorted([m] + [o for g in touching for o in g])]
    return [g for g in groups if len(g) > 1]


def _dodges(points: pd.DataFrame) -> dict[str, float]:
    """model -> horizontal shift in octaves: coinciding series side by side around their length, the rest unshifted."""
    shift = {}
    for group in coinciding_groups(points):
        step = min(DODGE_STEP, DODGE_SPAN / (len(group) - 1))
        shift.update({m: (i - (len(group) - 1) / 2) * step for i, m in enumerate(group)})
    return shift


def length_rows(bench: pd.DataFrame, device: str | None = None) -> pd.DataFrame:
    """The rows of the length charts: the bench table's (``headline_bench_rows``: each model's latest row under the
    bench's own protocol) on one card (``pick_device`` of those rows unless given), one per model and length: at 4K,
    where LRA's protocol has both, the batch-32 row (``_latest_at``'s rule)."""
    rows = headline_bench_rows(bench)
    if rows.empty:
        return rows
    rows = rows[rows["device"].astype(str) == pick_device(rows, device)]
    lengths = sorted(rows["seq_len"].dropna().astype(int).unique())
    return pd.concat([_latest_at(rows, n) for n in lengths] or [rows.iloc[:0]], ignore_index=True)


def per_example(rows: pd.DataFrame, metric: str) -> pd.Series:
    """``metric`` of each row per training example, so that batch 32 (to 4K) and batch 8 (beyond) share one axis:
    examples/s as measured, peak memory divided by the batch (its activations grow with the batch; the weights
    and optimiser state, a few tens of MB here, are shared)."""
    if metric == "examples_per_s":
        return rows["examples_per_s"]
    if metric == "peak_mem_mb":
        return rows["peak_mem_mb"] / rows["batch_size"]
    raise ValueError(f"length charts draw examples_per_s or peak_mem_mb, not {metric!r}")


# The taxonomy's classes (models.registry.CLASSES) grouped into one panel each: few enough lines to tell apart.
FAMILIES = (("exact attention", ("exact",)), ("fixed patterns", ("FP",)),
            ("memory, learnable patterns", ("M", "LP")), ("low rank", ("LR",)), ("kernels", ("KR",)),
            ("recurrence, state space, Fourier", ("RC", "SSM", "FT", "DS")))
OTHER_FAMILY = "other"


def family_of(model: str) -> str:
    """The panel of ``model``: its first taxonomy class's family; a model not registered here, ``OTHER_FAMILY``."""
    name = model.split("(")[0]
    if name not in list_models():
        return OTHER_FAMILY
    first = (get_model_class(name).taxonomy.classes or ("exact",))[0]
    return next((family for family, classes in FAMILIES if first in classes), OTHER_FAMILY)


def length_points(bench: pd.DataFrame, metric: str = "examples_per_s", device: str | None = None) -> pd.DataFrame:
    """What the length chart draws: ``model, family, batch_size, seq_len, value, x``, one row per model and length
    (``length_rows``), ``value`` per example (``per_example``), sorted; ``x`` = ``seq_len``, shifted a little
    (``_dodges``) for series of one panel (``family``) that would hide one another."""
    rows = length_rows(bench, device)
    points = rows[["model", "batch_size", "seq_len"]].assign(value=per_example(rows, metric)).dropna(subset=["value"])
    points.insert(1, "family", [family_of(m) for m in points["model"]])
    shift = {m: octaves for _, panel in points.groupby("family") for m, octaves in _dodges(panel).items()}
    points["x"] = points["seq_len"] * 2.0 ** np.array([shift.get(m, 0.0) for m in points["model"]], dtype=float)
    return points.sort_values(["model", "seq_len"], kind="stable").reset_index(drop=True)


def _panel_palette() -> list[tuple]:
    """Colours for the lines of one panel, all distinct: tab10's, then tab20's lighter shades, grey left out (the
    transformer's reference line is grey)."""
    tab20 = matplotlib.colormaps["tab20"].colors  # (dark, light) pairs; the dark ones are tab10's
    grey = 7
    return [tab20[2 * i] for i in range(10) if i != grey] + [tab20[2 * i + 1] for i in range(10) if i != grey]


def _line_styles(points: pd.DataFrame) -> dict[str, tuple[tuple, str, str]]:
    """model -> (colour, marker, linestyle): the models of a panel (``family``), by name, take the palette's colours
    and ``MARKERS`` in turn, so that no two lines of a panel share a colour; the transformer, the baseline, black
    and dashed."""
    palette, style = _panel_palette(), {}
    for _, panel in points.groupby("family"):
        others = sorted(set(panel["model"]) - {"transformer"})
        style.update({m: (palette[i % len(palette)], MARKERS[i % len(MARKERS)], "-") for i, m in enumerate(others)})
    style["transformer"] = ((0.0, 0.0, 0.0), "o", "--")
    return style


def _length_title(points: pd.DataFrame, metric: str, device: str, protocol: str) -> str:
    """The metric, the protocol and which batch ran at which lengths (LRA's protocol: 32 to 4K, 8 beyond)."""
    batches = []
    for batch, g in points.groupby("batch_size", sort=False):
        lo, hi = int(g["seq_len"].min()), int(g["seq_len"].max())
        span = length_label(lo) if lo == hi else f"{length_label(lo)}-{length_label(hi)}"
        batches.append((lo, f"{int(batch)} at {span}"))
    batch = "batch " + ", ".join(text for _, text in sorted(batches)) if batches else ""
    smaller = f", hollow markers batch {int(points['batch_size'].min())}" if points["batch_size"].nunique() > 1 else ""
    return f"{METRIC_LABELS.get(metric, metric)} vs length ({batch}{smaller})\n{device}; bench {protocol}"


LENGTH_PANEL_COLUMNS = 3


def draw_lengths(points: pd.DataFrame, metric: str, title: str) -> Figure:
    """``length_points``, one panel per family (``FAMILIES``) on shared axes: each model one line in its own
    colour and marker (``_line_styles``), filled at the largest batch and hollow at a smaller one; the transformer
    in every panel (in the others a grey dashed reference, beneath), each panel's legend under it."""
    families = [f for f, _ in FAMILIES if f in set(points["family"])]
    families += [OTHER_FAMILY] if OTHER_FAMILY in set(points["family"]) else []
    columns = min(LENGTH_PANEL_COLUMNS, max(len(families), 1))
    rows = -(-max(len(families), 1) // columns)
    fig = _new_figure(4.6 * columns, 1.4 + 3.6 * rows)
    axes = fig.subplots(rows, columns, sharex=True, sharey=True, squeeze=False).ravel()
    style = _line_styles(points)
    largest = points["batch_size"].max()
    base = points[points["model"] == "transformer"]
    for ax, family in zip(axes, families):
        if family != "exact attention" and len(base):
            ax.plot(base["x"], base["value"], color="0.6", linestyle="--", linewidth=1.0, zorder=1.0,
                    label="transformer (reference)", gid="reference")
        for model, g in points[points["family"] == family].groupby("model", sort=True):
            colour, marker, line = style[model]
            ax.plot(g["x"], g["value"], marker=marker, color=colour, linestyle=line, label=model, markersize=5,
                    zorder=1.5 if model == "transformer" else 2.0, gid=model)
            small = g[g["batch_size"] < largest]
            ax.plot(small["x"], small["value"], marker=marker, color=colour, mfc="white", linestyle="none",
                    markersize=5, zorder=2.5, label="_smaller batch", gid=f"{model} (smaller batch)")
        ax.set_title(family, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=2, frameon=False)
    for ax in axes[len(families):]:
        ax.set_axis_off()
    lengths = sorted(points["seq_len"].dropna().astype(int).unique())
    axes[0].set_xscale("log", base=2)
    if lengths:
        axes[0].set_xticks(lengths, [length_label(n) for n in lengths])
    for ax in axes:
        ax.xaxis.set_minor_locator(NullLocator())
    if len(points):
        lo, hi = points["value"].min(), points["value"].max()
        axes[0].set_yscale(axis_scale(lo, hi))
        if axes[0].get_yscale() == "log":
            _label_log_axis(axes[0].yaxis, *axes[0].get_ylim())
    dodged = bool((points["x"] != points["seq_len"]).any())
    fig.supxlabel("sequence length N" + (" (equal series drawn side by side)" if dodged else ""), fontsize=10)
    fig.supylabel(METRIC_LABELS.get(metric, metric), fontsize=10)
    fig.suptitle(title, fontsize=11)
    return fig


def length_chart(bench: pd.DataFrame, metric: str = "examples_per_s", device: str | None = None) -> Figure:
    """``metric`` per example against sequence length on one card: ``length_points`` drawn by ``draw_lengths``."""
    rows = headline_bench_rows(bench)
    device = pick_device(rows, device) if len(rows) or device else None
    points = length_points(bench, metric, device)
    protocol = _protocols(length_rows(bench, device)).drop_duplicates()
    label = protocol_label(protocol.iloc[0].to_dict()) if len(protocol) == 1 else "several protocols"
    if points.empty:
        device, label = device or "no card", "no ok row under the bench's own protocol (bench defaults)"
    return draw_lengths(points, metric, _length_title(points, metric, device, label))


# ---------------------------------------------------------------------------------------------------------------
# Files and the command line


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


def _known_tasks(names: list[str], option: str) -> list[str]:
    from lra.data import list_tasks  # lra.data brings torch: only where tasks are named

    unknown = sorted(set(names) - set(list_tasks()))
    if unknown:
        raise SystemExit(f"{option}: unknown task(s) {', '.join(unknown)}; the tasks are {', '.join(list_tasks())}")
    return names


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lra.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=DEFAULT_RESULTS,
                    help="results folder: reads bench.csv and leaderboard.csv, writes charts/ (the project's: results)")
    ap.add_argument("--bench", default=None, help="bench file (default: RESULTS/bench.csv)")
    ap.add_argument("--leaderboard", default=None, help="leaderboard file (default: RESULTS/leaderboard.csv)")
    ap.add_argument("--length", type=int, default=4096, help="bench length for the bubble chart's speed and memory")
    ap.add_argument("--device", default=None, help="bench device (default: the card whose rows cover the most "
                    "models; for the bubble chart, the card that draws the most bubbles)")
    ap.add_argument("--out", default=None, help="chart folder (default: RESULTS/charts)")
    ap.add_argument("--published", nargs="?", const=str(PUBLISHED), default=None,
                    help="also draw the LRA paper's points (default: the package's copy of results/published.csv)")
    ap.add_argument("--tasks", default=None,
                    help="bubble chart's y = mean over these comma-separated tasks (ours and the paper's alike) "
                         "instead of the 5-task LRA score; the file is then lra_bubble_<length>_<n>tasks")
    ap.add_argument("--errorbars-task", default="listops",
                    help="the task of the accuracy chart with error bars over seeds, <task>_accuracy (default listops)")
    return ap


def _leaderboard_charts(args, bench: pd.DataFrame, board: pd.DataFrame, tasks: list[str] | None) -> list[Path]:
    published = read_reference(args.published, "published results (LRA Tables 1 and 2)") if args.published else None
    runs_path = Path(args.results) / "runs.csv"  # the runs behind the leaderboard: each seed's accuracy
    runs = pd.read_csv(runs_path) if runs_path.exists() else None
    fig = bubble_chart(bench, board, args.length, args.device, published, tasks=tasks, runs=runs)
    suffix = f"_{len(tasks)}tasks" if tasks else ""
    written = list(save(fig, args.out, f"lra_bubble_{length_label(args.length)}{suffix}"))
    task = args.errorbars_task
    points = accuracy_points(board, task, runs)
    if len(points):
        written += save(draw_accuracy(points, task), args.out, f"{task}_accuracy")
    else:
        print(f"no experiment=lra {task} rows in the leaderboard: skipping the {task} accuracy chart")
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    args = _parser().parse_args(argv)
    tasks = _known_tasks([t.strip() for t in args.tasks.split(",") if t.strip()], "--tasks") if args.tasks else None
    _known_tasks([args.errorbars_task], "--errorbars-task")
    results = Path(args.results)
    bench_path = Path(args.bench or results / "bench.csv")
    lb_path = Path(args.leaderboard or results / "leaderboard.csv")
    args.out = args.out or results / "charts"
    if not bench_path.exists():
        raise DataError(f"no bench results at {bench_path}: run `python -m lra.bench` first")
    bench = pd.read_csv(bench_path)
    written = []
    if lb_path.exists():
        written += _leaderboard_charts(args, bench, pd.read_csv(lb_path), tasks)
    else:
        print(f"no leaderboard at {lb_path} (`python -m lra.leaderboard`): skipping the bubble and accuracy charts")
    written += save(length_chart(bench, "examples_per_s", args.device), args.out, "speed_vs_length")
    written += save(length_chart(bench, "peak_mem_mb", args.device), args.out, "memory_vs_length")
    for p in written:
        print(p)
    return written


if __name__ == "__main__":
    main()
