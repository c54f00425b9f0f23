"""Where a chart's labels go: one label per bubble, each beside its own bubble and nearer to it than to any other, no
two labels over each other. Pure geometry in points (no matplotlib), so the tests check it directly.

A label that sits nearer another bubble than its own names the wrong point: in LRA's bubble chart the paper's
transformer, synthesizer and bigbird sit a few points apart, and a label put below one of them can end up closer to
its neighbour. So the first rule of a position is that the label is unambiguous: its box is nearer its own bubble's
edge than any other bubble's by at least ``MARGIN``. Then, in order: no overlap with another label, inside the axes,
over no other bubble, as close to its own bubble as possible. Where the close positions are all taken, the label goes
one or more label heights further out and the chart draws a leader line from it to its bubble's centre
(``leaders``); so do bubbles that nearly coincide (the paper's performer and linformer), where no position is nearer
one than the other and only the line tells which label is whose.

Positions are tried around the bubble at ``ANGLES`` (below first, as in the paper's figure, then above, beside and
between), on rings one label height apart; every label is placed greedily, the most crowded bubbles first, then each
is moved again, given where the others ended, until none moves (``place_labels``).
"""
from __future__ import annotations

import math

GAP = 2.0  # points between a bubble's edge and its label
MARGIN = 3.0  # points by which a label must be nearer its own bubble than any other
RINGS = 4  # how far out a label may go: the closest ring, then up to three label heights further
PASSES = 8  # rounds of moving each label again given the others
# Directions (degrees, counter-clockwise from +x) tried in order: below, above, beside, the diagonals, then between.
ANGLES = (270, 90, 0, 180, 315, 225, 45, 135, 292.5, 247.5, 67.5, 112.5, 337.5, 202.5, 22.5, 157.5)

Box = tuple[float, float, float, float]  # (x0, y0, x1, y1)
Bubble = tuple[float, float, float]  # (x, y, radius)


def _sign(v: float) -> float:
    return 0.0 if abs(v) < 1e-9 else math.copysign(1.0, v)


def candidates(r: float, w: float, h: float, centre_first: bool) -> list[tuple[tuple[float, float], int]]:
    """(offset of a w x h label's centre from its bubble's, ring) for every position tried, in order of preference:
    the bubble's centre when ``centre_first``, then ring by ring, each ring at ``ANGLES``. A label at angle a on a ring
    at distance d puts its nearest corner (or edge, on an axis) d from the centre."""
    out = [((0.0, 0.0), 0)] if centre_first else []
    for ring in range(RINGS):
        d = r + GAP + ring * (h + GAP)
        for angle in ANGLES:
            c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
            c, s = (0.0 if abs(c) < 1e-9 else c), (0.0 if abs(s) < 1e-9 else s)
            out.append(((c * d + _sign(c) * w / 2, s * d + _sign(s) * h / 2), ring))
    return out


def label_box(x: float, y: float, size: tuple[float, float], offset: tuple[float, float]) -> Box:
    """(x0, y0, x1, y1) of a label of ``size`` whose centre is ``offset`` away from (x, y)."""
    cx, cy, (w, h) = x + offset[0], y + offset[1], size
    return (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)


def gap_to(box: Box, bubble: Bubble) -> float:
    """Distance from a label's box to a bubble's edge: negative inside the bubble (down to minus its radius, where
    the box holds the centre)."""
    x, y, r = bubble
    nearest_x, nearest_y = min(max(x, box[0]), box[2]), min(max(y, box[1]), box[3])
    return math.hypot(nearest_x - x, nearest_y - y) - r


def overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def nearest_other(box: Box, own: int, bubbles: list[Bubble]) -> float:
    """The smallest gap from ``box`` to a bubble other than ``bubbles[own]`` (inf when there is none)."""
    return min((gap_to(box, b) for i, b in enumerate(bubbles) if i != own), default=math.inf)


def unambiguous(box: Box, own: int, bubbles: list[Bubble]) -> bool:
    """Whether a label's box is nearer its own bubble's edge than any other bubble's by ``MARGIN``."""
    return nearest_other(box, own, bubbles) >= gap_to(box, bubbles[own]) + MARGIN


def leaders(bubbles: list[Bubble], sizes: list[tuple[float, float]], offsets: list[tuple[float, float]]) -> list[bool]:
    """Which labels (placed at ``offsets``) need a line to their bubble's centre: those past the ring next to their
    bubble, and those no position could make unambiguous (bubbles that nearly coincide, where only the line tells
    which label is whose)."""
    out = []
    for i, ((x, y, r), size, offset) in enumerate(zip(bubbles, sizes, offsets, strict=True)):
        box = label_box(x, y, size, offset)
        out.append(gap_to(box, (x, y, r)) > GAP + 0.5 * size[1] or not unambiguous(box, i, bubbles))
    return out


def _cost(i: int, box: Box, ring: int, boxes: list[Box | None], bubbles: list[Bubble], bounds: Box) -> tuple:
    ambiguous = not unambiguous(box, i, bubbles)
    over_labels = sum(overlaps(box, b) for j, b in enumerate(boxes) if j != i and b is not None)
    outside = box[0] < bounds[0] or box[1] < bounds[1] or box[2] > bounds[2] or box[3] > bounds[3]
    over_bubbles = sum(gap_to(box, b) < 0 for j, b in enumerate(bubbles) if j != i)
    return (ambiguous, over_labels, outside, over_bubbles, ring)


def _crowding(i: int, bubbles: list[Bubble], sizes: list[tuple[float, float]]) -> int:
    """How many other bubbles lie within two label widths of bubble ``i``: the crowded are placed first."""
    x, y, r = bubbles[i]
    reach = r + 2 * sizes[i][0]
    return sum(math.hypot(x - bx, y - by) - br < reach for j, (bx, by, br) in enumerate(bubbles) if j != i)


def place_labels(bubbles: list[Bubble], sizes: list[tuple[float, float]], bounds: Box,
                 centre_first: list[bool] | None = None) -> list[tuple[float, float]]:
    """One label per bubble, all in points: ``bubbles`` are (x, y, radius), ``sizes`` the labels' (width, height),
    ``bounds`` the axes (x0, y0, x1, y1); ``centre_first``: try the bubble's centre before the positions around it.
    Each label takes the position of least cost (the module docstring's rules, in that order; among equals, the
    first tried). Returns the offset of each label's centre from its bubble's centre."""
    centre_first = centre_first or [False] * len(bubbles)
    options = [[(offset, ring, label_box(x, y, size, offset))
                for offset, ring in candidates(r, *size, first)]
               for (x, y, r), size, first in zip(bubbles, sizes, centre_first, strict=True)]
    chosen: list[int | None] = [None] * len(bubbles)
    boxes: list[Box | None] = [None] * len(bubbles)

    def best(i: int) -> int:
        costs = [(_cost(i, box, ring, boxes, bubbles, bounds), k) for k, (_, ring, box) in enumerate(options[i])]
        return min(costs)[1]

    order = sorted(range(len(bubbles)), key=lambda i: -_crowding(i, bubbles, sizes))  # stable: ties keep order
    for _ in range(PASSES):
        moved = False
        for i in order:
            k = best(i)
            if k != chosen[i]:
                chosen[i], boxes[i], moved = k, options[i][k][2], True
        if not moved:
            break
    return [options[i][k][0] for i, k in enumerate(chosen)]
