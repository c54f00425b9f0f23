"""Charts render from small CSVs alone: the LRA bubble chart and speed / memory against length."""
from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image

from lra import plot
from lra.results import BENCH_COLUMNS

ROOT = Path(__file__).resolve().parent.parent
GPU, CPU = "NVIDIA H100 80GB HBM3", "cpu (x86_64, 2 cores)"


def bench_rows() -> pd.DataFrame:
    rows = []
    speed = {"transformer": 26.5, "local": 37.7, "linear": 25.8, "performer": 9.2, "reformer": 5.0}
    mem = {"transformer": 5326, "local": 5326, "linear": 6874, "performer": 15528, "reformer": 9000}
    for i, L in enumerate([1024, 2048, 4096]):
        for m in speed:
            status = "oom" if (m == "reformer" and L == 4096) else "ok"
            s = speed[m] * 4096 / L
            ok = status == "ok"
            rows.append(dict(model=m, task="text", seq_len=L, batch_size=32, status=status, precision="bf16",
                             steps_per_s=s if ok else None, examples_per_s=32 * s if ok else None,
                             peak_mem_mb=mem[m] * L / 4096 if ok else None, device=GPU,
                             timestamp=f"2026-01-0{i + 1}T00:00:00Z"))
    # an older, slower transformer row at 4K (superseded) and a CPU row (another device)
    old = dict(model="transformer", task="text", seq_len=4096, status="ok")
    rows.append(dict(old, batch_size=32, steps_per_s=1.0, examples_per_s=32.0, peak_mem_mb=100.0, precision="bf16",
                     device=GPU, timestamp="2025-01-01T00:00:00Z"))
    rows.append(dict(old, batch_size=2, steps_per_s=0.1, examples_per_s=0.2, peak_mem_mb=500.0, precision="fp32",
                     device=CPU, timestamp="2025-06-01T00:00:00Z"))
    return pd.DataFrame(rows).reindex(columns=BENCH_COLUMNS)


def leaderboard_rows() -> pd.DataFrame:
    avg = {"transformer": 54.0, "local": 47.0, "linear": 50.5, "reformer": 50.0, "sinkhorn": 51.0}  # no performer
    return pd.DataFrame([dict(model=m, task="avg5", test_acc=v) for m, v in avg.items()]
                        + [dict(model="transformer", task="listops", test_acc=36.0)])


def ours(fig):
    (ax,) = fig.axes
    return [c for c in ax.collections if c.get_gid() == "ours"]


def test_bubble_chart(tmp_path):
    fig = plot.bubble_chart(bench_rows(), leaderboard_rows(), length=4096)
    (sc,) = ours(fig)
    ax = fig.axes[0]
    offsets = {tuple(o) for o in sc.get_offsets()}
    assert len(offsets) == 3  # transformer, local, linear have both a speed and an average
    assert (32 * 26.5, 54.0) in offsets  # the latest transformer row, not the superseded one
    sizes = dict(zip([t.get_text() for t in ax.texts], sc.get_sizes(), strict=True))
    assert sizes["linear"] / sizes["transformer"] == pytest.approx(6874 / 5326)  # area proportional to memory
    assert sorted(t.get_text() for t in ax.texts) == ["linear", "local", "transformer"]
    assert GPU in ax.get_title()
    note = " ".join(t.get_text() for t in fig.texts)
    assert "no 5-task LRA average: performer" in note and "OOM at 4K: reformer" in note
    assert "no bench row at 4K: sinkhorn" in note
    assert ax.get_legend() is not None and "GB" in ax.get_legend().get_texts()[0].get_text()

    png, svg = plot.save(fig, tmp_path, "bubble")
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 800 and im.size[1] > 600
    assert svg.read_text().lstrip().startswith("<?xml") and png.stat().st_size > 20_000


def test_bubble_chart_with_published_points():
    published = pd.read_csv(ROOT / "results" / "published.csv")
    fig = plot.bubble_chart(bench_rows(), leaderboard_rows(), length=4096, published=published)
    ax = fig.axes[0]
    (paper,) = [c for c in ax.collections if c.get_gid() == "published"]
    offsets = {tuple(o) for o in paper.get_offsets()}
    assert len(offsets) == 9  # LRA Table 2's models
    assert (1.4 * 32, 54.39) in offsets and (8.0 * 32, 51.41) in offsets
    assert "transformer (LRA)" in [t.get_text() for t in ax.texts]
    assert len(ours(fig)[0].get_offsets()) == 3
    assert ax.get_xscale() == "log"  # TPU v3 and H100 speeds are orders of magnitude apart


def test_other_device_and_length():
    fig = plot.bubble_chart(bench_rows(), leaderboard_rows(), length=4096, device=CPU)
    (sc,) = ours(fig)
    assert [tuple(o) for o in sc.get_offsets()] == [(0.2, 54.0)] and CPU in fig.axes[0].get_title()
    fig = plot.bubble_chart(bench_rows(), leaderboard_rows(), length=1024)
    assert len(ours(fig)[0].get_offsets()) == 4  # reformer ran at 1K


def test_length_charts(tmp_path):
    for metric in ("steps_per_s", "peak_mem_mb"):
        fig = plot.length_chart(bench_rows(), metric)
        ax = fig.axes[0]
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {"transformer", "local", "linear", "performer", "reformer"}
        assert list(lines["transformer"].get_xdata()) == [1024, 2048, 4096]
        assert len(lines["reformer"].get_xdata()) == 2  # its 4K OOM has no point
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert lines["transformer"].get_ydata()[-1] == pytest.approx(5326)


def test_length_chart_with_two_batch_sizes():
    """LRA's protocol changes the batch beyond 4K: one colour, marker and legend entry per model, one segment per
    batch size, and the title says which batch ran where."""
    rows = bench_rows()
    long = rows[(rows.seq_len == 4096) & rows.model.isin(["transformer", "local"]) & (rows.device == GPU)]
    long = long.drop_duplicates("model", keep="last").assign(seq_len=16384, batch_size=8,
                                                             timestamp="2026-02-01T00:00:00Z")
    fig = plot.length_chart(pd.concat([rows, long]), "steps_per_s")
    ax = fig.axes[0]
    (local,) = [line for line in ax.get_lines() if line.get_label() == "local"]
    segments = [line for line in ax.get_lines() if line.get_color() == local.get_color()]
    assert len(ax.get_lines()) == 7 and len(segments) == 2  # local: B32 at 1K-4K and B8 at 16K
    assert segments[0].get_marker() == segments[1].get_marker()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["linear", "local", "performer", "reformer",
                                                                   "transformer"]
    assert "batch 32 at 1K-4K, 8 at 16K" in ax.get_title()


def test_cli(tmp_path, capsys):
    bench_rows().to_csv(tmp_path / "bench.csv", index=False)
    leaderboard_rows().to_csv(tmp_path / "lb.csv", index=False)
    out = tmp_path / "charts"
    written = plot.main(["--bench", str(tmp_path / "bench.csv"), "--leaderboard", str(tmp_path / "lb.csv"),
                         "--out", str(out), "--published", str(ROOT / "results" / "published.csv")])
    names = sorted(p.name for p in written)
    assert names == sorted(f"{s}.{e}" for s in ("lra_bubble_4K", "speed_vs_length", "memory_vs_length")
                           for e in ("png", "svg"))
    assert all((out / n).stat().st_size > 5_000 for n in names)
    plot.main(["--bench", str(tmp_path / "bench.csv"), "--leaderboard", str(tmp_path / "none.csv"), "--out", str(out)])
    assert "skipping the bubble chart" in capsys.readouterr().out


def test_bubble_chart_over_a_task_subset():
    """Without Retrieval (no AAN files), y is the mean over the tasks named, for ours and the paper's alike."""
    cells = {"transformer": {"listops": 30.0, "text": 66.0, "image": 44.0, "pathfinder": 70.0},
             "local": {"listops": 20.0, "text": 50.0, "image": 40.0}}  # no pathfinder: left out
    board = pd.DataFrame([dict(model=m, task=t, test_acc=v) for m, c in cells.items() for t, v in c.items()])
    published = pd.read_csv(ROOT / "results" / "published.csv")
    tasks = ["listops", "text", "image", "pathfinder"]
    fig = plot.bubble_chart(bench_rows(), board, length=4096, published=published, tasks=tasks)
    ax = fig.axes[0]
    assert [tuple(o) for o in ours(fig)[0].get_offsets()] == [(32 * 26.5, 52.5)]
    (paper,) = [c for c in ax.collections if c.get_gid() == "published"]
    assert (1.4 * 32, pytest.approx((36.37 + 64.27 + 42.44 + 71.40) / 4)) in [tuple(o) for o in paper.get_offsets()]
    assert "4 tasks" in ax.get_ylabel() and "listops, text, image, pathfinder" in ax.get_title()
    note = " ".join(t.get_text() for t in fig.texts)
    assert "no result on all of listops, text, image, pathfinder: linear, local, performer" in note


def test_cli_task_subset(tmp_path):
    bench, board = tmp_path / "bench.csv", tmp_path / "leaderboard.csv"
    bench_rows().to_csv(bench, index=False)
    pd.DataFrame([dict(model="transformer", task=t, test_acc=50.0) for t in ("listops", "image")]).to_csv(board)
    out = tmp_path / "charts"
    plot.main(["--bench", str(bench), "--leaderboard", str(board), "--out", str(out), "--tasks", "listops,image"])
    assert (out / "lra_bubble_4K_2tasks.png").exists()
    with pytest.raises(SystemExit, match="unknown task.*retreival.*image, listops, pathfinder, pathx, retrieval"):
        plot.main(["--bench", str(bench), "--leaderboard", str(board), "--out", str(out), "--tasks", "retreival"])


def test_saving_an_unchanged_chart_leaves_the_files_untouched(tmp_path):
    """Regenerating charts from unchanged CSVs must not dirty a checkout: the same bytes (no dates, fixed ids), and an
    unchanged file is not rewritten."""
    first = plot.save(plot.length_chart(bench_rows(), "steps_per_s"), tmp_path, "speed")
    stamps = [(p.read_bytes(), p.stat().st_mtime_ns) for p in first]
    os.utime(first[0], ns=(1, 1))  # an old mtime: a rewrite would change it
    second = plot.save(plot.length_chart(bench_rows(), "steps_per_s"), tmp_path, "speed")
    assert [p.read_bytes() for p in second] == [s[0] for s in stamps]
    assert second[0].stat().st_mtime_ns == 1 and second[1].stat().st_mtime_ns == stamps[1][1]
    assert b"<dc:date>" not in second[1].read_bytes()
