"""Charts from small CSVs: the data each chart draws (which models, where, how big, which are missing and why) is
checked on the pure functions; a few checks draw and save the figures."""
from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.text import Text
from PIL import Image

from lra.report import labels, plot
from lra.report.results import BENCH_COLUMNS

ROOT = Path(__file__).resolve().parent.parent
GPU, CPU = "NVIDIA H100 80GB HBM3", "cpu (x86_64, 2 cores)"
TASKS4 = ["listops", "text", "image", "pathfinder"]
BACKBONE = "L4 d256 drop0.1/0.0"  # the bench's default: attention dropout 0


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
                             peak_mem_mb=mem[m] * L / 4096 if ok else None, device=GPU, compiled=True,
                             backbone=BACKBONE, timestamp=f"2026-01-0{i + 1}T00:00:00Z"))
    # an older, slower transformer row at 4K (superseded) and a CPU row (another device; the bench runs eager there)
    old = dict(model="transformer", task="text", seq_len=4096, status="ok", backbone=BACKBONE)
    rows.append(dict(old, batch_size=32, steps_per_s=1.0, examples_per_s=32.0, peak_mem_mb=100.0, precision="bf16",
                     device=GPU, compiled=True, timestamp="2025-01-01T00:00:00Z"))
    rows.append(dict(old, batch_size=2, steps_per_s=0.1, examples_per_s=0.2, peak_mem_mb=500.0, precision="fp32",
                     device=CPU, compiled=False, timestamp="2025-06-01T00:00:00Z"))
    return pd.DataFrame(rows).reindex(columns=BENCH_COLUMNS)


def leaderboard_rows() -> pd.DataFrame:
    avg = {"transformer": 54.0, "local": 47.0, "linear": 50.5, "reformer": 50.0, "sinkhorn": 51.0}  # no performer
    rows = [dict(experiment="lra", model=m, task="avg5", test_acc=v) for m, v in avg.items()]
    rows.append(dict(experiment="lra", model="transformer", task="listops", test_acc=36.0, n_seeds=1,
                     published=36.37))
    rows.append(dict(experiment="defaults", model="performer", task="avg5", test_acc=60.0))  # not LRA's protocol
    return pd.DataFrame(rows)


def published() -> pd.DataFrame:
    return pd.read_csv(ROOT / "results" / "published.csv")


def as_tuples(points: pd.DataFrame) -> list[tuple]:
    return [(r.model, pytest.approx(r.x), pytest.approx(r.y), pytest.approx(r.mem_gb)) for r in points.itertuples()]


# --- the bubble chart's data ----------------------------------------------------------------------------------


def test_bubble_points_latest_ok_row_a_score_and_the_reasons_for_the_rest():
    ours, missing = plot.bubble_points(bench_rows(), leaderboard_rows(), length=4096)
    assert list(ours.columns) == ["model", "x", "y", "mem_gb"]
    assert as_tuples(ours) == [("linear", 32 * 25.8, 50.5, 6874 / 1024), ("local", 32 * 37.7, 47.0, 5326 / 1024),
                               ("transformer", 32 * 26.5, 54.0, 5326 / 1024)]  # not the superseded 4K row
    assert missing == {"no 5-task LRA average": ["performer"],  # its `defaults` average does not count
                       "OOM at 4K": ["reformer"], "no bench row at 4K": ["sinkhorn"]}


def test_bubble_points_keep_the_latest_ok_row_when_a_later_one_failed():
    bench = bench_rows()
    later = dict(model="local", task="text", seq_len=4096, batch_size=32, status="error: RuntimeError: boom",
                 device=GPU, timestamp="2026-03-01T00:00:00Z")
    bench = pd.concat([bench, pd.DataFrame([later])], ignore_index=True)
    ours, missing = plot.bubble_points(bench, leaderboard_rows())
    assert ours.set_index("model").at["local", "x"] == pytest.approx(32 * 37.7)
    assert "error at 4K" not in missing
    bench.loc[(bench.model == "linear") & (bench.seq_len == 4096), "status"] = "error: ValueError: x"
    _, missing = plot.bubble_points(bench, leaderboard_rows())
    assert missing["error at 4K"] == ["linear"]


def test_bubble_points_take_the_papers_batch_over_a_later_row_at_another_batch():
    """The bench also runs 4K at batch 8 (for the exponents over 4K-16K); the bubble stays on the batch-32 row."""
    later = dict(model="transformer", task="text", seq_len=4096, batch_size=8, status="ok", steps_per_s=99.0,
                 precision="bf16", examples_per_s=8 * 99.0, peak_mem_mb=1500.0, device=GPU, compiled=True,
                 backbone=BACKBONE, timestamp="2026-03-01T00:00:00Z")
    only8 = dict(later, model="sinkhorn", steps_per_s=50.0, examples_per_s=400.0)  # no batch-32 row: its batch 8
    bench = pd.concat([bench_rows(), pd.DataFrame([later, only8])], ignore_index=True)
    ours, _ = plot.bubble_points(bench, leaderboard_rows())
    assert ours.set_index("model").at["transformer", "x"] == pytest.approx(32 * 26.5)
    assert ours.set_index("model").at["sinkhorn", "x"] == pytest.approx(400.0)


def test_bubble_points_time_every_model_under_one_protocol():
    """Rows timed another way (here compiled, without attention dropout) do not mix with the chart's: the protocol
    under which most scored models have a row wins, and the title names it."""
    bench = bench_rows().assign(compiled=False, backbone="L4 drop0.1/0.1")
    faster = dict(model="transformer", task="text", seq_len=4096, batch_size=32, status="ok", steps_per_s=60.0,
                  examples_per_s=32 * 60.0, peak_mem_mb=5000.0, precision="bf16", device=GPU, compiled=True,
                  backbone="L4 drop0.1/0.0", timestamp="2026-03-01T00:00:00Z")
    bench = pd.concat([bench, pd.DataFrame([faster])], ignore_index=True)
    ours, missing = plot.bubble_points(bench, leaderboard_rows())
    assert ours.set_index("model").at["transformer", "x"] == pytest.approx(32 * 26.5)  # not the compiled row
    assert ours.attrs["protocol"] == "bf16, eager, L4 drop0.1/0.1"
    assert missing["no bench row at 4K under this protocol"] == ["sinkhorn"]
    assert plot.chart_protocol(bench, 4096, GPU, ["transformer"])["compiled"] == "True"  # a tie: the latest


def test_a_later_row_in_another_compile_mode_does_not_mix_with_the_charts():
    """A transformer row replayed as CUDA graphs (bench.compile_mode=reduce-overhead) is another protocol: the
    bubble keeps the default mode's row (blank compile_mode, as in rows older than the column), and a chart
    drawn from that mode's rows says so in its title."""
    bench = bench_rows().assign(compiled=True)
    graphs = dict(model="transformer", task="text", seq_len=4096, batch_size=32, status="ok", steps_per_s=60.0,
                  examples_per_s=32 * 60.0, peak_mem_mb=5000.0, precision="bf16", device=GPU, compiled=True,
                  compile_mode="reduce-overhead", timestamp="2026-03-01T00:00:00Z")
    bench = pd.concat([bench, pd.DataFrame([graphs])], ignore_index=True)
    ours, _ = plot.bubble_points(bench, leaderboard_rows())
    assert ours.set_index("model").at["transformer", "x"] == pytest.approx(32 * 26.5)
    protocol = plot.chart_protocol(bench, 4096, GPU, ["transformer"])  # a tie: the latest, CUDA graphs
    assert protocol["compile_mode"] == "reduce-overhead"
    assert plot.protocol_label(protocol).startswith("bf16, compiled (reduce-overhead)")


def test_bubble_points_on_another_device_and_length():
    ours, missing = plot.bubble_points(bench_rows(), leaderboard_rows(), length=4096, device=CPU)
    assert as_tuples(ours) == [("transformer", 0.2, 54.0, 500 / 1024)]
    assert missing == {"no bench row at 4K": ["linear", "local", "reformer", "sinkhorn"]}
    ours, _ = plot.bubble_points(bench_rows(), leaderboard_rows(), length=1024)
    assert list(ours["model"]) == ["linear", "local", "reformer", "transformer"]  # reformer ran at 1K


def test_the_chart_keeps_the_card_that_timed_the_most_models_when_another_card_has_newer_rows():
    """A rerun of two models on whichever machine came (an H200) is newer than every H100 row, but the H100 timed
    five models: the charts stay on the H100 unless told otherwise."""
    h200 = "NVIDIA H200"
    newer = [dict(model=m, task="text", seq_len=4096, batch_size=32, status="ok", precision="bf16", steps_per_s=50.0,
                  examples_per_s=1600.0, peak_mem_mb=4000.0, device=h200, timestamp="2026-09-01T00:00:00Z")
             for m in ("transformer", "linear")]
    bench = pd.concat([bench_rows(), pd.DataFrame(newer)], ignore_index=True)
    assert plot.pick_device(bench) == GPU
    ours, _ = plot.bubble_points(bench, leaderboard_rows())
    assert list(ours["model"]) == ["linear", "local", "transformer"]  # the H100's rows
    assert ours.set_index("model").at["transformer", "x"] == pytest.approx(32 * 26.5)
    ours, _ = plot.bubble_points(bench, leaderboard_rows(), device=h200)
    assert list(ours["model"]) == ["linear", "transformer"]
    more = pd.DataFrame([dict(newer[0], model=m) for m in ("local", "performer", "reformer", "sinkhorn")])
    assert plot.pick_device(pd.concat([bench, more], ignore_index=True)) == h200  # now it covers more models


def test_the_bubble_chart_takes_the_card_that_draws_the_most_bubbles_at_its_length():
    """The H100 timed five models (over three lengths), the H200 four, all at 4K; the H100's 4K rows draw three
    bubbles (performer has no LRA score, reformer's 4K row ran out of memory), the H200's four (sinkhorn too): the
    bubble chart draws the H200's, the other charts stay on the H100. Level, the card that timed more models at 4K
    takes it, and on a level count the H100 (pick_device's card) keeps it."""
    h200 = "NVIDIA H200"
    rows = [dict(model=m, task="text", seq_len=4096, batch_size=32, status="ok", precision="bf16", steps_per_s=50.0,
                 examples_per_s=1600.0, peak_mem_mb=4000.0, device=h200, timestamp="2025-09-01T00:00:00Z")
            for m in ("transformer", "linear", "local", "sinkhorn")]
    bench = pd.concat([bench_rows(), pd.DataFrame(rows)], ignore_index=True)
    assert plot.pick_device(bench) == GPU
    ours, missing = plot.bubble_points(bench, leaderboard_rows())
    assert list(ours["model"]) == ["linear", "local", "sinkhorn", "transformer"]
    assert missing == {"no bench row at 4K": ["reformer"]}  # the H200 never timed it; its H100 row is not drawn
    assert plot.bubble_card(bench, plot.our_scores(leaderboard_rows()), 4096) == h200
    fig = plot.bubble_chart(bench, leaderboard_rows())
    assert h200 in fig.axes[0].get_title()
    level = pd.concat([bench_rows(), pd.DataFrame(rows[:3])], ignore_index=True)  # three bubbles each
    assert plot.bubble_card(level, plot.our_scores(leaderboard_rows()), 4096) == GPU
    unscored = [dict(rows[0], model=m) for m in ("cosformer", "fnet")]  # timed, no LRA score
    fuller = pd.concat([level, pd.DataFrame(unscored)], ignore_index=True)  # level bubbles; at 4K the H200 timed 5
    assert plot.pick_device(fuller) == GPU  # the H100 timed as many models over all lengths, 4 of them at 4K
    assert plot.bubble_card(fuller, plot.our_scores(leaderboard_rows()), 4096) == h200


def test_bubble_points_over_a_task_subset_count_lra_rows_only():
    """Without Retrieval (no AAN files), y is the mean over the tasks named, from experiment=lra rows; a
    leaderboard without the experiment column counts as all lra."""
    cells = {"transformer": {"listops": 30.0, "text": 66.0, "image": 44.0, "pathfinder": 70.0},
             "local": {"listops": 20.0, "text": 50.0, "image": 40.0}}  # no pathfinder: left out
    board = pd.DataFrame([dict(model=m, task=t, test_acc=v) for m, c in cells.items() for t, v in c.items()])
    ours, missing = plot.bubble_points(bench_rows(), board, tasks=TASKS4)
    assert as_tuples(ours) == [("transformer", 32 * 26.5, 52.5, 5326 / 1024)]
    assert missing == {"no result on all of listops, text, image, pathfinder": ["linear", "local", "performer",
                                                                              "reformer"]}

    board["experiment"] = "lra"
    recipe = pd.DataFrame([dict(experiment="defaults", model="local", task="pathfinder", test_acc=60.0)])
    ours, _ = plot.bubble_points(bench_rows(), pd.concat([board, recipe]), tasks=TASKS4)
    assert list(ours["model"]) == ["transformer"]  # a recipe's Pathfinder does not complete local's four


def test_paper_points_from_tables_1_and_2():
    paper = plot.paper_points(published(), length=4096).set_index("model")
    assert len(paper) == 9  # LRA Table 2's models at 4K (no sparse, no longformer)
    assert tuple(paper.loc["transformer"]) == pytest.approx((1.4 * 32, 54.39, 9.48))
    assert tuple(paper.loc["performer"]) == pytest.approx((8.0 * 32, 51.41, 1.06))
    subset = plot.paper_points(published(), length=4096, tasks=TASKS4).set_index("model")
    assert subset.at["transformer", "y"] == pytest.approx((36.37 + 64.27 + 42.44 + 71.40) / 4)
    assert plot.paper_points(published(), length=1024).set_index("model").at["local", "x"] == pytest.approx(9.2 * 32)


def test_one_axis_rule_and_one_speed_range_for_every_bubble_chart():
    assert plot.axis_scale(10, 80) == "linear" and plot.axis_scale(10, 81) == "log"
    # every ok bench speed at 4K on the device, scored or not, and the paper's: the task choice cannot change it
    assert plot.speed_range(bench_rows()) == pytest.approx((32 * 9.2, 32 * 37.7))
    assert plot.speed_range(bench_rows(), published=published()) == pytest.approx((1.1 * 32, 32 * 37.7))
    five = plot.bubble_chart(bench_rows(), leaderboard_rows(), published=published()).axes[0]
    board = pd.DataFrame([dict(model="transformer", task=t, test_acc=50.0) for t in TASKS4])
    four = plot.bubble_chart(bench_rows(), board, published=published(), tasks=TASKS4).axes[0]
    assert five.get_xscale() == four.get_xscale() == "log" and five.get_xlim() == four.get_xlim()
    assert "log scale" in five.get_xlabel()


# --- label placement ------------------------------------------------------------------------------------------


def boxes(bubbles, sizes, offsets):
    return [(x + dx - w / 2, y + dy - h / 2, x + dx + w / 2, y + dy + h / 2)
            for (x, y, _), (w, h), (dx, dy) in zip(bubbles, sizes, offsets)]


def overlap(a, b):
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def hits(box, bubble):
    x, y, r = bubble
    nx, ny = min(max(x, box[0]), box[2]), min(max(y, box[1]), box[3])
    return (nx - x) ** 2 + (ny - y) ** 2 < r * r


BOUNDS = (0.0, 0.0, 400.0, 300.0)


def test_labels_of_coinciding_bubbles_do_not_overlap_and_clear_every_bubble():
    bubbles = [(200.0, 150.0, 10.0), (203.0, 152.0, 8.0), (206.0, 149.0, 9.0)]  # the paper's linear-model cluster
    sizes = [(60.0, 9.0)] * 3
    placed = boxes(bubbles, sizes, labels.place_labels(bubbles, sizes, BOUNDS))
    assert not any(overlap(a, b) for a, b in itertools.combinations(placed, 2))
    assert not any(hits(box, bubble) for box in placed for bubble in bubbles)
    assert all(BOUNDS[0] <= b[0] and b[2] <= BOUNDS[2] and BOUNDS[1] <= b[1] and b[3] <= BOUNDS[3] for b in placed)


def test_a_label_goes_below_its_bubble_unless_that_is_taken():
    alone = labels.place_labels([(100.0, 100.0, 10.0)], [(40.0, 8.0)], BOUNDS)
    assert alone == [(0.0, -(10.0 + 2.0 + 4.0))]  # just below: the paper's figure
    assert labels.place_labels([(100.0, 100.0, 10.0)], [(40.0, 8.0)], BOUNDS, centre_first=[True]) == [(0.0, 0.0)]
    below = [(100.0, 100.0, 10.0), (100.0, 80.0, 6.0)]  # a bubble where the label would go
    assert labels.place_labels(below, [(40.0, 8.0)] * 2, BOUNDS)[0] == (0.0, 16.0)  # above instead
    assert labels.place_labels([(100.0, 5.0, 10.0)], [(40.0, 8.0)], BOUNDS) == [(0.0, 16.0)]  # at the bottom edge


def test_drawn_labels_do_not_collide():
    """The paper's efficient models sit close together (performer, linformer, linear): their labels, measured after
    the draw, overlap neither each other nor our labels."""
    fig = plot.bubble_chart(bench_rows(), leaderboard_rows(), published=published(), tasks=None)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    texts = [t for t in ax.texts if t.get_text()]
    assert {"transformer", "performer (LRA)", "linformer (LRA)"} <= {t.get_text() for t in texts}
    extents = [text_extent(t, renderer) for t in texts]
    assert not [(a, b) for (a, ea), (b, eb) in itertools.combinations(zip(texts, extents), 2) if ea.overlaps(eb)]


def text_extent(text, renderer):
    """A label's own box in display pixels: an annotation's extent would include its leader line."""
    return Text.get_window_extent(text, renderer)


def drawn_bubbles(fig, ours: pd.DataFrame, paper: pd.DataFrame) -> dict[str, tuple[np.ndarray, float]]:
    """label text -> (centre, radius) in display pixels of the bubble it names, read off the drawn collections
    (ours: gid ``ours``, labelled by model; the paper's: gid ``published``, "<model> (LRA)"), in points' order."""
    ax, out = fig.axes[0], {}
    for gid, points, fmt in (("ours", ours, "{}"), ("published", paper, "{} (LRA)")):
        for coll in (c for c in ax.collections if c.get_gid() == gid):
            centres = ax.transData.transform(coll.get_offsets())
            radii = np.broadcast_to(np.sqrt(coll.get_sizes()) / 2 * fig.dpi / 72, len(centres))
            out.update({fmt.format(m): (c, r) for m, c, r in zip(points["model"], centres, radii, strict=True)})
    return out


def misplaced_labels(fig, ours: pd.DataFrame, paper: pd.DataFrame) -> list[str]:
    """Each drawn label that does not name its own bubble: one nearer another bubble's edge (or as near), or further
    from its own than one and a half label heights; a label with a leader line instead, where the line does not end
    nearer its own bubble's centre than any other's."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bubbles = drawn_bubbles(fig, ours, paper)

    def gap(box, bubble):
        (x, y), r = bubble
        return math.hypot(min(max(x, box.x0), box.x1) - x, min(max(y, box.y0), box.y1) - y) - r

    wrong = []
    texts = [t for t in fig.axes[0].texts if t.get_text() in bubbles]
    assert sorted(t.get_text() for t in texts) == sorted(bubbles)  # one label per bubble
    for t in texts:
        name, box = t.get_text(), text_extent(t, renderer)
        if t.arrow_patch is not None:  # drawn in display pixels: where the leader line ends
            end = t.arrow_patch.get_path().vertices[-1]
            nearest = min(bubbles, key=lambda o: np.hypot(*(bubbles[o][0] - end)))
            wrong += [f"{name}: its line ends at {nearest}"] if nearest != name else []
            continue
        own = gap(box, bubbles[name])
        closer = [o for o, b in bubbles.items() if o != name and gap(box, b) <= own]
        if closer or own > 1.5 * box.height:
            wrong.append(f"{name}: {own:.1f} px from its bubble, no nearer than {closer}")
    return wrong


def committed_bubble_charts():
    """The bubble charts of the committed results (5, 4 and 2 tasks), as ``python -m lra.plot`` draws them, each
    with the points it draws."""
    bench, board, runs = (pd.read_csv(ROOT / "results" / f"{n}.csv") for n in ("bench", "leaderboard", "runs"))
    for tasks in (None, TASKS4, ["listops", "image"]):
        ours, missing = plot.bubble_points(bench, board, 4096, None, tasks)
        device, attrs = ours.attrs["device"], ours.attrs
        ours = ours.merge(plot.average_spread(runs, tasks), on="model", how="left")
        ours.attrs = attrs
        paper = plot.paper_points(published(), 4096, tasks)
        fig = plot.draw_bubbles(ours, paper, missing, length=4096, device=device, tasks=tasks,
                                x_range=plot.speed_range(bench, 4096, device, published()))
        yield tasks, fig, ours, paper


def test_every_label_of_the_committed_bubble_charts_names_its_own_bubble():
    """Read back from the drawn charts: each label is nearer its own bubble than any other (the paper's transformer
    label once sat on the synthesizer's circle, our longformer's away from its bubble), or draws a line to it."""
    for tasks, fig, ours, paper in committed_bubble_charts():
        assert not misplaced_labels(fig, ours, paper), tasks


def test_every_label_of_a_crowded_bubble_chart_names_its_own_bubble():
    """A cluster of ours of several sizes (near-equal speeds and scores, as the linear models' at 4K) beside the
    paper's points: no label nearer another bubble, none over another label."""
    speeds = {"a": 1000, "bb": 1040, "ccc": 1090, "dddd": 1010, "eeeee": 1150, "f": 700, "gg": 1300, "hhh": 980}
    scores = {"a": 36.0, "bb": 36.3, "ccc": 35.8, "dddd": 35.5, "eeeee": 36.1, "f": 36.2, "gg": 35.9, "hhh": 36.6}
    ours = pd.DataFrame([dict(model=m, x=x, y=scores[m], mem_gb=1 + i % 4) for i, (m, x) in enumerate(speeds.items())])
    paper = plot.paper_points(published())
    fig = plot.draw_bubbles(ours, paper, length=4096)
    assert not misplaced_labels(fig, ours, paper)
    renderer = fig.canvas.get_renderer()
    extents = [text_extent(t, renderer) for t in fig.axes[0].texts if t.get_text()]
    assert not [(a, b) for a, b in itertools.combinations(extents, 2) if a.overlaps(b)]


def test_each_row_label_of_the_accuracy_chart_sits_on_its_own_row():
    """The accuracy chart's labels are its y tick labels: each one's centre is nearer its own row's marker than any
    other row's, in the committed leaderboard's chart."""
    board, runs = (pd.read_csv(ROOT / "results" / f"{n}.csv") for n in ("leaderboard", "runs"))
    points = plot.accuracy_points(board, "listops", runs)
    fig = plot.draw_accuracy(points, "listops")
    fig.canvas.draw()
    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    rows = {m: ax.transData.transform((mean, y))[1]
            for m, mean, y in zip(points["model"], points["mean"], ax.get_yticks(), strict=True)}
    for tick in ax.get_yticklabels():
        model = tick.get_text().split("\n")[0]
        box = tick.get_window_extent(renderer)
        centre = (box.y0 + box.y1) / 2
        assert min(rows, key=lambda m: abs(rows[m] - centre)) == model


# --- the bubble chart drawn -----------------------------------------------------------------------------------


def test_bubble_chart_draws_its_points_and_saves(tmp_path):
    fig = plot.bubble_chart(bench_rows(), leaderboard_rows(), published=published())
    ax = fig.axes[0]
    (sc,) = [c for c in ax.collections if c.get_gid() == "ours"]
    (paper,) = [c for c in ax.collections if c.get_gid() == "published"]
    ours, _ = plot.bubble_points(bench_rows(), leaderboard_rows())
    assert np.allclose(sc.get_offsets(), ours[["x", "y"]].to_numpy()) and len(paper.get_offsets()) == 9
    sizes = dict(zip(ours["model"], sc.get_sizes()))
    assert sizes["linear"] / sizes["transformer"] == pytest.approx(6874 / 5326)  # area proportional to memory
    assert "OOM at 4K: reformer" in " ".join(t.get_text() for t in fig.texts)
    png, svg = plot.save(fig, tmp_path, "bubble")
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 800 and im.size[1] > 600
    assert svg.read_text().lstrip().startswith("<?xml")


def test_a_bubble_whose_score_rests_on_several_seeds_has_a_bar_over_its_interval():
    """Given the runs behind the leaderboard, the transformer (three ListOps seeds far apart) gets a vertical bar
    over the bootstrap interval of its mean, the leaderboard's; local (one seed per task) gets none."""
    from lra.report.leaderboard import build_leaderboard

    def row(task, model, seed, test):
        return dict(task=task, model=model, seed=seed, experiment="lra", status="ok", val_acc=test, test_acc=test,
                    final_test_acc=test, val_majority=10.0)
    runs = pd.DataFrame([row("listops", "transformer", s, v) for s, v in enumerate([24.0, 36.0, 37.0])]
                        + [row("image", "transformer", 0, 44.0), row("listops", "local", 0, 36.0),
                           row("image", "local", 0, 40.0)])
    tasks = ["listops", "image"]
    spread = plot.average_spread(runs, tasks).set_index("model")
    assert list(spread.index) == ["transformer"] and spread.at["transformer", "y_hi"] - spread.at["transformer",
                                                                                                 "y_lo"] > 4
    ax = plot.bubble_chart(bench_rows(), build_leaderboard(runs), tasks=tasks, runs=runs).axes[0]
    (bars,) = [c for c in ax.collections if c.get_gid() == "ours_spread"]
    ((x, lo), (_, hi)), = bars.get_segments()
    assert (x, lo, hi) == (pytest.approx(32 * 26.5), pytest.approx(spread.at["transformer", "y_lo"]),
                           pytest.approx(spread.at["transformer", "y_hi"]))
    assert lo < (sum([24.0, 36.0, 37.0]) / 3 + 44.0) / 2 < hi
    assert "ours: 95% bootstrap interval" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert not [c for c in plot.bubble_chart(bench_rows(), build_leaderboard(runs), tasks=tasks).axes[0].collections
                if c.get_gid() == "ours_spread"]  # no runs given: no bars


def test_title_names_our_device_only_when_our_points_are_drawn():
    assert GPU in plot.bubble_chart(bench_rows(), leaderboard_rows()).axes[0].get_title()
    no_avg5 = leaderboard_rows()[lambda d: d.task != "avg5"]
    title = plot.bubble_chart(bench_rows(), no_avg5, published=published()).axes[0].get_title()
    assert GPU not in title and "none drawn, no model of ours has a result on all 5 tasks" in title


# --- the accuracy chart ---------------------------------------------------------------------------------------


def accuracy_rows() -> pd.DataFrame:
    rows = [dict(model="transformer", test_acc=36.0, test_std=0.5, n_seeds=3, n_stalled=0, published=36.37),
            dict(model="linear", test_acc=36.7, test_std=0.3, n_seeds=1, n_stalled=0, published=16.13),  # stray std
            dict(model="mymodel", test_acc=20.0, test_std=2.0, n_seeds=2, n_stalled=1, published=None)]
    board = pd.DataFrame([dict(r, experiment="lra", task="listops") for r in rows])
    others = pd.DataFrame([dict(experiment="defaults", model="transformer", task="listops", test_acc=50.0),
                           dict(experiment="lra", model="linear", task="text", test_acc=60.0)])
    return pd.concat([board, others], ignore_index=True)


def test_accuracy_points_sorted_by_mean_with_a_bar_only_over_several_seeds():
    points = plot.accuracy_points(accuracy_rows(), "listops")
    assert list(points["model"]) == ["linear", "transformer", "mymodel"]  # the lra rows only, best first
    assert list(points["mean"]) == [36.7, 36.0, 20.0] and list(points["n_seeds"]) == [1, 3, 2]
    assert math.isnan(points.at[0, "std"]) and list(points["std"][1:]) == [0.5, 2.0]  # one seed: no bar
    assert points.at[0, "paper"] == 16.13 and math.isnan(points.at[2, "paper"])
    assert plot.accuracy_label(points.iloc[0]) == "linear\n36.70 (1 seed, no bar); LRA 16.13"
    assert plot.accuracy_label(points.iloc[2]) == "mymodel\n20.00 ± 2.00 (2 seeds, 1 stalled)"
    assert plot.accuracy_points(accuracy_rows(), "image").empty


def test_each_seed_of_the_selected_runs_is_drawn_beside_the_mean():
    """Given the runs, every seed behind a bar is a tick at its own accuracy: the values of the leaderboard's cell."""
    from lra.report.leaderboard import build_leaderboard

    def row(model, seed, test, val=40.0, ts="2026-01-01T00:00:00Z"):
        return dict(task="listops", model=model, seed=seed, experiment="lra", status="ok", val_acc=val,
                    test_acc=test, final_test_acc=test, timestamp=ts, val_majority=10.0)
    runs = pd.DataFrame([row("m", 0, 31.8), row("m", 1, 36.2), row("m", 2, 23.0),
                         row("m", 0, 20.0, val=30.0, ts="2026-01-02T00:00:00Z"),  # a worse re-run of seed 0: not drawn
                         row("one", 0, 35.0)])
    points = plot.accuracy_points(build_leaderboard(runs), "listops", runs)
    seeds = dict(zip(points["model"], points["seeds"], strict=True))
    assert seeds == {"m": [31.8, 36.2, 23.0], "one": [35.0]}
    assert points.set_index("model").loc["m", "mean"] == pytest.approx(sum(seeds["m"]) / 3)
    ax = plot.draw_accuracy(points, "listops").axes[0]
    ticks = [line for line in ax.get_lines() if line.get_label() == "ours: each seed"]
    assert len(ticks) == 1 and sorted(ticks[0].get_xdata()) == [23.0, 31.8, 36.2]  # one seed alone: no tick
    assert plot.accuracy_points(build_leaderboard(runs), "listops")["seeds"].map(len).eq(0).all()  # no runs given


def test_accuracy_chart_draws_and_saves(tmp_path):
    fig = plot.accuracy_chart(accuracy_rows(), "listops")
    ax = fig.axes[0]
    rows = sorted(zip(ax.get_yticks(), [t.get_text() for t in ax.get_yticklabels()]))
    assert [label.split("\n")[0] for _, label in rows] == ["mymodel", "transformer", "linear"]  # the best on top
    png, _ = plot.save(fig, tmp_path, "listops_accuracy")
    assert png.stat().st_size > 10_000
    assert ax.get_xlabel().endswith("best-validation checkpoint")
    text = accuracy_rows().assign(headline=lambda d: d.task.map({"text": "final", "listops": "best_val"}))
    assert plot.accuracy_chart(text, "text").axes[0].get_xlabel() == "text test accuracy (%), final weights"


# --- speed and memory against length -------------------------------------------------------------------------


def latest_rows(bench: pd.DataFrame, device: str = GPU) -> pd.DataFrame:
    """The test's own reading of the rule: the latest ok row per model, length and batch on ``device``."""
    rows = bench[(bench["status"] == "ok") & (bench["device"] == device)].sort_values("timestamp", kind="stable")
    return rows.drop_duplicates(["model", "seq_len", "batch_size"], keep="last").set_index(
        ["model", "seq_len", "batch_size"])


def drawn_lines(fig) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """panel title -> model -> (x, y) of the line drawn for it (its gid), read back from the figure."""
    return {ax.get_title(): {line.get_gid(): (np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float))
                             for line in ax.get_lines() if line.get_gid() and "(" not in line.get_gid()}
            for ax in fig.axes if ax.get_title()}


def test_length_points_are_the_latest_ok_rows():
    """Each point drawn is a row of the CSV: its model's latest ok row at that length on the card, its value that
    row's examples/s; the superseded 4K row, the failed one and the CPU's are not drawn."""
    bench = bench_rows()
    points = plot.length_points(bench, "examples_per_s")
    assert list(points.columns) == ["model", "family", "batch_size", "seq_len", "value", "x"]
    latest = latest_rows(bench)
    assert len(points) == len(latest)  # every such row once, no other
    for p in points.itertuples():
        assert p.value == pytest.approx(latest.at[(p.model, p.seq_len, p.batch_size), "examples_per_s"])
    by_model = {m: g for m, g in points.groupby("model")}
    assert list(by_model["transformer"]["value"]) == pytest.approx([32 * 26.5 * 4, 32 * 26.5 * 2, 32 * 26.5])
    assert list(by_model["reformer"]["seq_len"]) == [1024, 2048]  # its 4K OOM has no point
    assert (points["x"] == points["seq_len"]).all()  # no two speed series of a panel coincide: nothing is shifted
    assert dict(zip(points["model"], points["family"])) == {
        "linear": "kernels", "local": "fixed patterns", "performer": "kernels",
        "reformer": "memory, learnable patterns", "transformer": "exact attention"}  # the registry's taxonomy


def test_one_point_per_model_and_length_the_batch_32_row_at_4k():
    """LRA's protocol runs 4K at batch 32 and the exponents' sweep at batch 8: the chart draws one 4K point per
    model, the batch-32 row where both exist, else the batch-8 one; memory is per example (peak / batch)."""
    rows = bench_rows()
    at8 = [dict(model=m, task="text", seq_len=n, batch_size=8, status="ok", precision="bf16", steps_per_s=v,
                examples_per_s=8 * v, peak_mem_mb=1000.0 * n / 4096, device=GPU, compiled=True, backbone=BACKBONE,
                timestamp="2026-02-01T00:00:00Z")
           for m, v in (("transformer", 90.0), ("sinkhorn", 80.0)) for n in (4096, 16384)]
    bench = pd.concat([rows, pd.DataFrame(at8)], ignore_index=True)
    for metric, column in (("examples_per_s", "examples_per_s"), ("peak_mem_mb", "peak_mem_mb")):
        points = plot.length_points(bench, metric)
        assert not points.duplicated(["model", "seq_len"]).any()
        at = points.set_index(["model", "seq_len"])
        assert at.at[("transformer", 4096), "batch_size"] == 32 and at.at[("sinkhorn", 4096), "batch_size"] == 8
        assert at.at[("transformer", 16384), "batch_size"] == 8
        latest = latest_rows(bench)
        for p in points.itertuples():
            row = latest.loc[(p.model, p.seq_len, p.batch_size)]
            per_example = row[column] / (p.batch_size if column == "peak_mem_mb" else 1)
            assert p.value == pytest.approx(per_example)
    fig = plot.length_chart(bench, "examples_per_s")
    assert "(batch 32 at 1K-4K, 8 at 4K-16K, hollow markers batch 8)" in fig.get_suptitle()
    x, y = drawn_lines(fig)["exact attention"]["transformer"]
    assert list(x) == [1024, 2048, 4096, 16384] and y[2] == pytest.approx(32 * 26.5)  # 4K once, batch 32's


def test_length_charts_draw_the_benchs_own_protocol_only():
    """Rows timed another way (eager on a GPU, attention dropout, another compile mode) and a model's variant are
    not drawn, however late; on the CPU, where the bench runs eager, the eager rows are."""
    base = dict(task="text", seq_len=1024, batch_size=32, status="ok", precision="bf16", steps_per_s=500.0,
                examples_per_s=16000.0, peak_mem_mb=10.0, device=GPU, compiled=True, backbone=BACKBONE,
                timestamp="2026-03-01T00:00:00Z")
    others = [dict(base, model="local", compiled=False), dict(base, model="linear", backbone="L4 d256 drop0.1/0.1"),
              dict(base, model="performer", compile_mode="reduce-overhead"),
              dict(base, model="local(window=64)")]
    points = plot.length_points(pd.concat([bench_rows(), pd.DataFrame(others)], ignore_index=True), "examples_per_s")
    assert 16000.0 not in set(points["value"]) and "local(window=64)" not in set(points["model"])
    cpu = plot.length_points(bench_rows(), "examples_per_s", device=CPU)
    assert list(zip(cpu["model"], cpu["seq_len"], cpu["value"])) == [("transformer", 4096, 0.2)]


def test_a_row_contradicted_by_a_later_one_on_another_card_is_not_drawn():
    """An H100 row of one model (its speed a thirtieth of the transformer's) that a later H200 row of the same
    model, shape and protocol contradicts (four tenths of the H200's transformer): the H100's chart leaves it out,
    as do the tables. Within a factor of CONTRADICTS a row stands, and a later row is never dropped for an earlier
    one (at 2K the H100's row is the later: the H200's gives way)."""
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"

    def row(model, device, speed, rel, ts, n=1024):
        return dict(model=model, task="text", seq_len=n, batch_size=32, status="ok", precision="bf16",
                    steps_per_s=speed, examples_per_s=32 * speed, peak_mem_mb=3000.0, rel_speed=rel, device=device,
                    compiled=True, backbone=BACKBONE, timestamp=ts)
    bench = pd.DataFrame([row("transformer", h100, 90.0, 1.0, "2026-01-01T00:00:00Z"),
                          row("deberta", h100, 2.1, 2.1 / 90, "2026-01-01T00:01:00Z"),
                          row("linear", h100, 60.0, 60 / 90, "2026-01-01T00:02:00Z"),
                          row("transformer", h200, 100.0, 1.0, "2026-01-02T00:00:00Z"),
                          row("deberta", h200, 38.0, 0.38, "2026-01-02T00:01:00Z"),
                          row("linear", h200, 150.0, 1.5, "2026-01-02T00:02:00Z"),  # 2.25x apart: stands
                          row("deberta", h100, 2.0, 2.0 / 90, "2026-01-01T00:03:00Z", n=2048),
                          row("deberta", h200, 30.0, 0.3, "2025-12-01T00:00:00Z", n=2048)])  # earlier: no say
    points = plot.length_points(bench, "examples_per_s", device=h100)
    assert set(zip(points["model"], points["seq_len"])) == {("transformer", 1024), ("linear", 1024),
                                                             ("deberta", 2048)}
    from lra.report.leaderboard import bench_table, latest_bench_rows

    dropped = bench.drop(latest_bench_rows(bench).index)
    assert set(zip(dropped["device"], dropped["seq_len"])) == {(h100, 1024), (h200, 2048)}  # the later row stands
    assert "| deberta | – | 2.0 (0.02x) |" in bench_table(bench, device=h100)


def test_equal_memory_series_of_a_panel_are_drawn_side_by_side():
    """local and sparse (one panel: fixed patterns) use the same memory at every length: one would hide the other,
    so they are shifted apart in x by the same small step at every length; the other series keep their x, the
    transformer too (its memory is theirs, but it is drawn in its own panel and beneath as the reference)."""
    rows = bench_rows()
    sparse = rows[(rows.model == "local") & (rows.device == GPU)].assign(
        model="sparse", steps_per_s=lambda d: d.steps_per_s / 2, examples_per_s=lambda d: d.examples_per_s / 2)
    points = plot.length_points(pd.concat([rows, sparse], ignore_index=True), "peak_mem_mb")
    assert plot.coinciding_groups(points[points.family == "fixed patterns"]) == [["local", "sparse"]]
    octaves = np.log2(points["x"] / points["seq_len"]).groupby(points["model"]).agg(["min", "max"])
    assert octaves.loc["local"].tolist() == pytest.approx([-0.025, -0.025])
    assert octaves.loc["sparse"].tolist() == pytest.approx([0.025, 0.025])
    assert (octaves.loc[["linear", "performer", "reformer", "transformer"]] == 0).all().all()


def test_log_axes_label_enough_ticks():
    assert plot.log_ticks(1500, 28000) == [2000, 5000, 10000, 20000]  # 1-2-5: the memory chart's range
    assert plot.log_ticks(1, 1e4) == [1, 10, 100, 1000, 10000]
    assert plot.log_ticks(1500, 12000) == [2000, 5000, 10000]
    assert plot.log_ticks(4500, 9500) == [5000, 6000, 7000, 8000, 9000]  # narrower than 1-2-5 can label
    ax = plot.length_chart(bench_rows(), "peak_mem_mb").axes[0]
    lo, hi = ax.get_ylim()
    assert ax.get_yscale() == "log" and len([v for v in ax.get_yticks() if lo <= v <= hi]) >= 3
    assert "100" in [t.get_text() for t in ax.get_yticklabels()]


def test_the_length_chart_draws_its_points_one_panel_per_family():
    """Read back from the figure: one panel per family of the drawn models, each model's line in its family's panel
    through its points (hollow markers at the smaller batch), no two lines of a panel in one colour, the transformer
    a reference in every other panel, and every legend inside the figure, over no other panel."""
    rows = bench_rows()
    long = rows[(rows.seq_len == 4096) & rows.model.isin(["transformer", "local"]) & (rows.device == GPU)]
    long = long.drop_duplicates("model", keep="last").assign(seq_len=16384, batch_size=8,
                                                             timestamp="2026-02-01T00:00:00Z")
    bench = pd.concat([rows, long])
    points = plot.length_points(bench, "examples_per_s")
    fig = plot.length_chart(bench, "examples_per_s")
    lines = drawn_lines(fig)
    assert list(lines) == ["exact attention", "fixed patterns", "memory, learnable patterns", "kernels"]
    for panel, models in lines.items():
        own = points[points["family"] == panel]
        assert set(models) - {"reference"} == set(own["model"])
        for model, (x, y) in models.items():
            g = points[points["model"] == ("transformer" if model == "reference" else model)]
            assert list(x) == pytest.approx(list(g["x"])) and list(y) == pytest.approx(list(g["value"]))
        assert ("reference" in models) == (panel != "exact attention")
    for ax in fig.axes:
        colours = [line.get_color() for line in ax.get_lines() if line.get_gid() and "(" not in line.get_gid()]
        assert len(set(map(str, colours))) == len(colours)
        hollow = [line for line in ax.get_lines() if str(line.get_gid()).endswith("(smaller batch)")]
        assert all(len(line.get_xdata()) == (line.get_gid().startswith(("local", "transformer"))) for line in hollow)
    assert not misfit_legends(fig)


def misfit_legends(fig) -> list[str]:
    """Each panel's legend that leaves the figure or lies over another panel, measured after the draw."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    wrong = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        if not (page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1):
            wrong.append(f"{ax.get_title()}: outside the figure")
        wrong += [f"{ax.get_title()}: over {other.get_title()}" for other in fig.axes
                  if other is not ax and other.axison and box.overlaps(other.get_window_extent(renderer))]
    return wrong


def test_the_committed_length_charts_draw_the_latest_rows_with_legends_that_fit():
    """The charts of the committed bench, as ``python -m lra.plot`` draws them: every point a latest row of the CSV
    under the bench's protocol, one per model and length, distinct colours within a panel, legends that fit."""
    from lra.report.leaderboard import headline_bench_rows

    bench = pd.read_csv(ROOT / "results" / "bench.csv")
    for metric in ("examples_per_s", "peak_mem_mb"):
        points = plot.length_points(bench, metric)
        assert len(points) and not points.duplicated(["model", "seq_len"]).any()
        rows = headline_bench_rows(bench)
        card = plot.pick_device(rows)
        rows = rows[rows["device"] == card].set_index(["model", "seq_len", "batch_size"])
        assert points.set_index(["model", "seq_len", "batch_size"]).index.isin(rows.index).all()
        fig = plot.length_chart(bench, metric)
        assert not misfit_legends(fig)
        for ax in fig.axes:
            colours = [str(line.get_color()) for line in ax.get_lines()
                       if line.get_gid() and "(" not in line.get_gid()]
            assert len(set(colours)) == len(colours), ax.get_title()


# --- the command line and the files ---------------------------------------------------------------------------


def write_inputs(tmp_path) -> list[str]:
    bench_rows().to_csv(tmp_path / "bench.csv", index=False)
    leaderboard_rows().to_csv(tmp_path / "lb.csv", index=False)
    return ["--bench", str(tmp_path / "bench.csv"), "--leaderboard", str(tmp_path / "lb.csv"),
            "--out", str(tmp_path / "charts")]


def test_cli_writes_every_chart(tmp_path):
    written = plot.main(write_inputs(tmp_path) + ["--published", str(ROOT / "results" / "published.csv")])
    names = sorted(p.name for p in written)
    stems = ("lra_bubble_4K", "listops_accuracy", "speed_vs_length", "memory_vs_length")
    assert names == sorted(f"{s}.{e}" for s in stems for e in ("png", "svg"))
    assert all((tmp_path / "charts" / n).stat().st_size > 5_000 for n in names)


def test_cli_accuracy_chart_of_another_task(tmp_path, capsys):
    args = write_inputs(tmp_path)
    with pytest.raises(SystemExit, match="--errorbars-task: unknown task.*listop[^s]"):
        plot.main(args + ["--errorbars-task", "listop"])
    plot.main(args + ["--errorbars-task", "image"])  # the leaderboard has no image row
    assert "skipping the image accuracy chart" in capsys.readouterr().out
    assert not list((tmp_path / "charts").glob("*_accuracy.*"))


def test_cli_without_a_leaderboard(tmp_path, capsys):
    args = write_inputs(tmp_path)
    (tmp_path / "lb.csv").unlink()
    assert sorted(p.stem for p in plot.main(args)) == ["memory_vs_length"] * 2 + ["speed_vs_length"] * 2
    assert "skipping the bubble and accuracy charts" in capsys.readouterr().out


def test_cli_task_subset(tmp_path):
    bench, board = tmp_path / "bench.csv", tmp_path / "leaderboard.csv"
    bench_rows().to_csv(bench, index=False)
    pd.DataFrame([dict(model="transformer", task=t, test_acc=50.0) for t in ("listops", "image")]).to_csv(board)
    out = tmp_path / "charts"
    plot.main(["--bench", str(bench), "--leaderboard", str(board), "--out", str(out), "--tasks", "listops,image"])
    assert (out / "lra_bubble_4K_2tasks.png").exists() and (out / "listops_accuracy.png").exists()
    with pytest.raises(SystemExit, match="unknown task.*retreival.*image, listops, pathfinder, pathx, retrieval"):
        plot.main(["--bench", str(bench), "--leaderboard", str(board), "--out", str(out), "--tasks", "retreival"])


def test_saving_an_unchanged_chart_leaves_the_files_untouched(tmp_path):
    """Regenerating charts from unchanged CSVs must not dirty a checkout: the same bytes (no dates, fixed ids), and an
    unchanged file is not rewritten."""
    first = plot.save(plot.bubble_chart(bench_rows(), leaderboard_rows(), published=published()), tmp_path, "b")
    stamps = [(p.read_bytes(), p.stat().st_mtime_ns) for p in first]
    os.utime(first[0], ns=(1, 1))  # an old mtime: a rewrite would change it
    second = plot.save(plot.bubble_chart(bench_rows(), leaderboard_rows(), published=published()), tmp_path, "b")
    assert [p.read_bytes() for p in second] == [s[0] for s in stamps]
    assert second[0].stat().st_mtime_ns == 1 and second[1].stat().st_mtime_ns == stamps[1][1]
    assert b"<dc:date>" not in second[1].read_bytes()
