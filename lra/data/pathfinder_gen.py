"""Pathfinder / Path-X generator: a seeded, parallel port of ``snakes2`` with LRA's parameters.

Papers: Linsley, Kim, Veerabadran, Windolf, Serre, "Learning long-range spatial dependencies with horizontal
gated recurrent units", NeurIPS 2018, https://arxiv.org/abs/1805.08315 (the Pathfinder challenge); Kim*, Linsley*,
Thakkar, Serre, "Disentangling neural mechanisms for perceptual grouping", ICLR 2020 (the ``snakes2`` generator,
drewlinsley/pathfinder at ab9c130); Tay et al., "Long Range Arena", ICLR 2021, https://arxiv.org/abs/2011.04006
(per-resolution overrides in ``lra_benchmarks/data/pathfinder.py``).

An image holds two target snakes of ``contour_length`` paddles whose first tips are ``seed_distance`` apart,
distractor snakes of ``distractor_length`` paddles, and two marker discs; label 1 = both markers sit on the two
ends of one snake, label 0 = on different snakes. Paddles are PIL lines on an ``antialias_scale`` canvas, shrunk
with bytescale + LANCZOS; each carries a keep-out mask (its line dilated by a disk) so snakes keep their distance.

Cost: snakes2 redraws a failed target pair until one fits, so an image costs hundreds of attempts (32 px hard
~300, most failing at the first seed angle; 128 px hard ~350-700 of ~10 growth steps each). Two implementations
draw the same images with the same random calls. The canvas code (``_Scene.targets`` / ``extend`` /
``many_snakes``; ``_render(..., reference=True)``) reads the H x W keep-out mask at every growth step
(O(candidates * |margin disk|)). The default decides each step from the list of kept-out paddles (the section above
``_PairGeometry`` gives the arithmetic): per-heading cumulative tables over fixed candidate offsets, occupancy
bitmasks as prefilters, per-angle-pair collision shifts, and the canvas arithmetic wherever a shortcut cannot decide
(a draw within 1e-10 of a cumulative boundary, a pivot whose candidate circle does not translate, a total near
extend's 1e-4 threshold). Where numba is installed, the default's target-pair attempts run compiled
(``pathfinder_jit``: the same draws and arithmetic on the caches copied into arrays), each handing back to Python
what those arrays cannot decide. Memory O(H*W) plus caches (a few hundred MB at 128 px, bounded).

Random calls mirror snakes2 one for one (``rng.integers`` for ``np.random.randint``, ``rng.random`` for
``np.random.rand``), so with a RandomState adapter this code reproduces a literal Python 3 + cv2 port of
snakes2/snakes pixel for pixel (checked offline against ab9c130 under Python 3, cv2 5.0 and Pillow 13: 300 + 300
32 px hard + easy and 20 64 px hard images and labels identical since version 2; cv2 is not a dependency).
Differences from the original: numpy ``Generator`` seeded per batch from ``SeedSequence(seed, spawn_key=(k,))``
(the original seeds are unknown); ``random.shuffle`` of the doubled contrast list is skipped when its entries are
equal (all LRA configs); metadata is written as the release's text lines, not ``np.save``; scipy.misc is
replaced by its bytescale + PIL LANCZOS, cv2.dilate by a numpy shift-max.

Dtypes, step by step as in snakes ``draw_line_n_mask`` (version 2; ``GENERATOR_VERSION``):
- the paddle is drawn on a PIL 'F' (float32) canvas holding 0 and 255 only, so its bytescale and its dilation
  (cv2 keeps float32) are exact; both shrink to uint8 k, and ``k / 255`` and ``* contrast`` are float64;
- line and mask are then pasted into ``np.array(Image.new('F', ...))``: float32, so each patch value is
  rounded to float32 (``_contrast_line``; the mask of ``_paddle_patch``);
- the image and the keep-out mask they join are ``np.zeros`` (float64) in snakes2, so ``np.maximum`` keeps the
  float32 values exactly and the acceptance test ``max(mask + m_im) < 1.8`` adds them in float64; our canvases
  are float64 for the same reason (a float32 sum would round a second time). The mask's float32 values also
  feed the growth weights ``1 - dilate(mask)``;
- markers never touch an 'F' canvas (float64 k / 255) and the final bytescale is float64, scaled by the
  brightest value (1.0 for a marker, else float32(2k/255) of the brightest distractor pixel at 32 px).
At 32 px the float32 rounding moves 3-4 % of hard (~1.7 % of easy) ink pixels one grey level, nearly all down:
values exactly half-way between two levels (e.g. a target's 1.5k/255 for odd k when a marker is the brightest
value) round the way float32 pushes them, so grey 22 occurs and 77, 158, 218 never do (float64: the reverse;
the tests derive this). Two mask values summing to 459/255 (210 + 249, 211 + 248) pass the acceptance test in
float64 but not in snakes2: 3 decisions in 300 hard images, none in 300 easy; each changes that image and,
through the random stream, every later image of its batch.

Versions (``GENERATOR_VERSION``; a change of any image for the same seed bumps it):
1. the first release: patches, masks and contrast kept in float64 (not the original's arithmetic, see above).
2. line and mask patches rounded to float32 as snakes2 pastes them (images, labels and placements change).

Uncertain points (bit-exact reproduction of the release is impossible) and what we chose:
1. num_distractor_snakes = K // distractor_length recomputed per level (32 px: 10 / 6 / 5 for easy /
   intermediate / hard), as in the LRA docstrings; the original wrapper may have used 10 at every level.
2. use_single_paddles = False (the wrapper body; the Args default says True). A field, so either can be run.
3. paddle_length = 5 (the Args default) at 64/128/256; 2 at 32 (confirmed by released metadata).
4. Seeds and the 2019 Pillow/scipy versions are unknown: bit-exact release images are impossible; we keep
   np.unique ordering, ceil/int truncations, Python-2 integer divisions and the original's dtypes (above).
5. Path-X (128) data were reported unlearnable (LRA #38); we generate it as specified, nothing is changed.
Quirks of the original that we reproduce (each behind a field where it is a choice):
- cv2.dilate on float images gives -DBL_MAX where every kernel sample falls outside the image, and
  snakes2 then finds "no room". The seed kernel is off-centre, so only some seed angles can ever succeed:
  30/360 at 32 px, 95/360 at 64 px, ~all at 128/256. This restricts first-paddle angles and thins the
  distractors: 32 px hard draws ~1.2 of its 5 distractor snakes (4.6 without the quirk), easy ~2.9 of 10;
  128 px is unaffected (``cv2_border``; False ignores the border instead). Verified against cv2 5.0; that
  2019's OpenCV did the same is a reading of its source, not checked against the released images.
- Only the second target's last paddle joins the keep-out mask (``mask_both_target_ends``), the second seed
  paddle is never checked against the first, a paddle's mask joins one step late, and masks may overlap up
  to a sum of 1.8: at 32 px the two targets share inked pixels in ~30 % of images and the strokes of
  different snakes often touch, so pixel connectivity does not decide the label (tests measure this).
- A failed target pair is redrawn until it succeeds; ``max_target_pair_attempts`` only guards bad configs.
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import hashlib
import io
import itertools
import json
import math
import operator
import os
import platform
import tempfile
import time
import types
from dataclasses import asdict, dataclass
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from lra.data import pathfinder_jit

GENERATOR_VERSION = 2  # what this code draws for a given seed; the versions are listed in the module docstring
DIFFICULTIES = {"easy": "curv_baseline", "intermediate": "curv_contour_length_9", "hard": "curv_contour_length_14"}
CONTOUR_LENGTHS = {"easy": 6, "intermediate": 9, "hard": 14}
# resolution -> (LRA overrides of the snakes2 defaults, distractor numerator K)
_LRA = {
    32: ({"padding": 1, "paddle_margin_list": (1,), "seed_distance": 7, "marker_radius": 1.5, "paddle_length": 2,
          "paddle_thickness": 0.5, "continuity": 1.0, "snake_contrast_list": (2.0,), "paddle_contrast_list": (0.75,)},
         20),
    64: ({"padding": 1, "paddle_margin_list": (1,), "seed_distance": 12, "marker_radius": 2.5, "paddle_length": 5,
          "paddle_thickness": 1, "continuity": 1.8, "snake_contrast_list": (0.8,), "paddle_contrast_list": (1.0,)},
         22),
    128: ({"padding": 1, "paddle_margin_list": (2, 3), "seed_distance": 20, "marker_radius": 3, "paddle_length": 5,
           "paddle_thickness": 1.5, "continuity": 1.8, "snake_contrast_list": (0.9,), "paddle_contrast_list": (1.0,)},
          35),
    256: ({"padding": 22, "paddle_margin_list": (3,), "seed_distance": 27, "marker_radius": 5, "paddle_length": 5,
           "paddle_thickness": 2, "continuity": 1.8, "snake_contrast_list": (1.0,), "paddle_contrast_list": (1.0,)},
          30),
}


@dataclass(frozen=True)
class PathfinderParams:
    """snakes2 arguments; the defaults are LRA's 32 px hard set (``for_lra(32, "hard")``)."""
    window_size: tuple[int, int] = (32, 32)
    padding: int = 1                          # border kept clear of target seeds
    antialias_scale: int = 2                  # paddles and markers are drawn this much larger, then shrunk
    paddle_margin_list: tuple[int, ...] = (1,)  # keep-out margin, one drawn per image
    seed_distance: int = 7                    # distance between the two targets' first tips
    marker_radius: float = 1.5
    paddle_length: int = 2
    paddle_thickness: float = 0.5             # thickness * antialias_scale must be integral
    continuity: float = 1.0                   # turn penalty; 1.0 allows turns up to 90 degrees
    snake_contrast_list: tuple[float, ...] = (2.0,)
    paddle_contrast_list: tuple[float, ...] = (0.75,)  # targets only, times the snake contrast
    contour_length: int = 14                  # paddles per target snake
    distractor_length: int = 4                # paddles per distractor snake
    num_distractor_snakes: int = 5
    max_distractor_contour_retrial: int = 4
    max_paddle_retrial: int = 2
    use_single_paddles: bool = False
    stop_with_availability: float = 0.01      # no new distractor once < 1 % of the canvas is free
    cv2_border: bool = True                   # reproduce cv2's -DBL_MAX dilation border (module docstring)
    mask_both_target_ends: bool = False       # snakes2 masks only the second target's last paddle
    max_target_pair_attempts: int = 100_000   # safety net: snakes2 loops forever on an impossible config

    @classmethod
    def for_lra(cls, resolution: int, difficulty: str) -> PathfinderParams:
        if resolution not in _LRA or difficulty not in DIFFICULTIES:
            raise ValueError(f"LRA has resolutions {sorted(_LRA)} and difficulties {list(DIFFICULTIES)}, "
                             f"got {resolution!r}, {difficulty!r}")
        overrides, k = _LRA[resolution]
        contour = CONTOUR_LENGTHS[difficulty]
        return cls(window_size=(resolution, resolution), contour_length=contour, distractor_length=contour // 3,
                   num_distractor_snakes=k // (contour // 3), **overrides)

    def metadata_line(self, batch: int, i: int, label: int, margin: int) -> str:
        """The 11 fields of a release metadata line, formatted like the original's str() of each value."""
        return " ".join(str(v) for v in (f"imgs/{batch}", f"sample_{i}.png", i, label, self.continuity,
                                          self.contour_length, self.distractor_length, self.paddle_length,
                                          self.paddle_thickness, margin, len(self.paddle_contrast_list)))


# ---------------------------------------------------------------- primitives (coordinates [y, x])
def _step(c, theta: float, d) -> tuple[int, int]:
    return int(np.ceil(c[0] + float(d) * np.sin(theta))), int(np.ceil(c[1] + float(d) * np.cos(theta)))


def _flip(theta: float) -> float:
    return theta + np.pi if theta < 0 else theta - np.pi


@functools.cache
def _disk(r: int) -> np.ndarray:
    y, x = np.ogrid[-r:r + 1, -r:r + 1]
    return np.argwhere(x ** 2 + y ** 2 <= r ** 2) - r  # (k, 2) offsets from the anchor


def _dilate(a: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """cv2.dilate (float ``a``) with the kernel unreflected: out[p] = max over offsets d of a[p + d], samples
    outside the image skipped; a pixel whose samples are all outside gets -inf (cv2's border for float images)."""
    h, w = a.shape
    out = np.full((h, w), -np.inf, a.dtype)  # cv2 keeps the input's float type
    for dy, dx in offsets:
        y0, y1, x0, x1 = max(0, -dy), min(h, h - dy), max(0, -dx), min(w, w - dx)
        if y0 < y1 and x0 < x1:
            np.maximum(out[y0:y1, x0:x1], a[y0 + dy:y1 + dy, x0 + dx:x1 + dx], out=out[y0:y1, x0:x1])
    return out


def _blocked(hit: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Boolean twin of ``_dilate``: out[p] = any hit[p + d] over in-image samples (all outside: False)."""
    h, w = hit.shape
    out = np.zeros((h, w), bool)
    for dy, dx in offsets:
        y0, y1, x0, x1 = max(0, -dy), min(h, h - dy), max(0, -dx), min(w, w - dx)
        if y0 < y1 and x0 < x1:
            out[y0:y1, x0:x1] |= hit[y0 + dy:y1 + dy, x0 + dx:x1 + dx]
    return out


def _blocked_flat(hit: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``_blocked`` as ORs of contiguous runs of a zero-padded copy: the same booleans (a sample outside the
    image reads a padding False, as ``_blocked`` skips it)."""
    h, w = hit.shape
    pad = int(np.abs(offsets).max()) if len(offsets) else 0
    side = w + 2 * pad
    padded = np.zeros((h + 2 * pad + 2, side), bool)  # a spare row at each end keeps every run inside the buffer
    padded[pad + 1:pad + 1 + h, pad:pad + w] = hit
    flat, out = padded.ravel(), np.zeros(h * side, bool)
    for dy, dx in offsets.tolist():
        start = (pad + 1 + dy) * side + dx
        out |= flat[start:start + h * side]
    return out.reshape(h, side)[:, pad:pad + w]


def _bytescale(a: np.ndarray) -> np.ndarray:
    lo, hi = a.min(), a.max()
    scale = 255.0 / ((hi - lo) or 1)
    return (((a - lo) * scale).clip(0, 255) + 0.5).astype(np.uint8)


def _shrink(a: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """scipy.misc.imresize(a, hw, 'lanczos'): bytescale unless already uint8, PIL LANCZOS, uint8 out."""
    a = a if a.dtype == np.uint8 else _bytescale(a)
    return np.asarray(Image.fromarray(a, "L").resize((hw[1], hw[0]), Image.LANCZOS))


@functools.cache
def _paddle_patch(theta: float, length: int, thick: float, margin: int, aa: int):
    """(line, mask) patches of side 2R+1 centred on the paddle's start, as snakes2's ``draw_line_n_mask`` makes
    them: line = ``miniline_im`` (float64 k/255, before contrast; ``_contrast_line`` applies contrast and the
    float32 paste), mask = ``m_im`` (k/255 computed in float64, then rounded to float32 by the paste onto the
    'F' canvas). line peaks near 1, mask is <= 1."""
    if round(thick * aa) != thick * aa:
        raise ValueError(f"paddle_thickness * antialias_scale must be integral, got {thick} * {aa}")
    r = length + math.ceil(thick) + margin
    c = r * aa
    big = Image.new("F", (2 * c + 1, 2 * c + 1), 0)
    head = _step((c, c), theta, length * aa)
    ImageDraw.Draw(big).line([(c, c), (head[1], head[0])], fill=255, width=round(thick * aa))
    big = np.asarray(big)  # float32, 0 or 255: its bytescale and dilation are exact
    line = _shrink(big, (2 * r + 1,) * 2).astype(np.float64) / 255
    mask = _shrink(_dilate(big, _disk(margin * aa)).astype(np.uint8), (2 * r + 1,) * 2).astype(np.float64) / 255
    mask = mask.astype(np.float32)
    line.flags.writeable = mask.flags.writeable = False
    return line, mask


@functools.cache
def _contrast_line(theta: float, length: int, thick: float, margin: int, aa: int, contrast: float) -> np.ndarray:
    """The line patch as snakes2 pastes it: ``miniline_im *= contrast`` in float64, then rounded to float32 by
    the assignment into ``l_im = np.array(Image.new('F', ...))``."""
    line = (_paddle_patch(theta, length, thick, margin, aa)[0] * contrast).astype(np.float32)
    line.flags.writeable = False
    return line


@functools.cache
def _seed_kernel(theta: float, length: int, thick: float, margin: int, aa: int) -> np.ndarray:
    """Offsets of the seed kernel: a paddle's mask drawn from one pixel below-right of the centre of a
    (2(L+m)+1)^2 canvas, where it is exactly 1 (cv2 casts the float kernel to uint8)."""
    _, mask = _paddle_patch(theta, length, thick, margin, aa)
    s, r = 2 * (length + margin) + 1, mask.shape[0] // 2
    canvas = np.zeros((s + 2 * r, s + 2 * r), np.float32)  # snakes2's 'F' canvas; cv2 casts it to uint8
    canvas[length + margin + 1:length + margin + 2 + 2 * r, length + margin + 1:length + margin + 2 + 2 * r] = mask
    return np.argwhere(canvas[r:r + s, r:r + s] >= 1.0) - (length + margin)


@functools.cache
def _seed_info(p: PathfinderParams, margin: int, theta: float):
    """Per seed angle: (kernel offsets, whether cv2's border leaves the kernel usable, the target seeds' free
    pixels). The targets' lined mask depends only on (params, margin), so their free set is cached too."""
    off = _seed_kernel(theta, p.paddle_length, p.paddle_thickness, margin, p.antialias_scale)
    h, w = p.window_size
    usable = not p.cv2_border or _dilate(np.zeros((h, w)), off).min() == 0  # no pixel left at -inf
    lined, pad, sd2 = np.ones((h, w)), p.padding, 2 * p.seed_distance
    lined[max(pad, sd2):h - max(pad, sd2), max(pad, sd2):w - max(pad, sd2)] = 0
    free = [a.astype(np.int16) for a in np.nonzero(~_blocked(lined > 0.3, off))] if usable else [()]
    return off, usable, (free if len(free[0]) else None)


@functools.cache
def _circle(r: int) -> tuple[np.ndarray, np.ndarray]:
    """Proposal points on a circle of radius r around a pivot, one per pixel of arc (as snakes2)."""
    angles = np.arange(0, 360, 360. / (2 * r * np.pi)) * np.pi / 180
    return r * np.sin(angles), r * np.cos(angles)


@functools.lru_cache(maxsize=1 << 15)
def _candidates(pivot: tuple[int, int], r: int, margin: int, h: int, w: int):
    """Distinct on-canvas pixels at distance r from ``pivot`` in np.unique's (y, x) order: rows, cols, angles
    seen from the pivot, and the flat indices into the mask buffer (rim ``margin``) of the margin disk around each.
    Depends on the pivot only."""
    dy, dx = _circle(r)
    fy, fx = pivot[0] + dy, pivot[1] + dx
    ok = (fy < h) & (fy >= 0) & (fx < w) & (fx >= 0)
    if not ok.any():
        return None
    key = np.unique(fy[ok].astype(int) * w + fx[ok].astype(int))  # y-major: the order of np.unique(axis=0)
    cy, cx = key // w, key % w  # (n,)
    near = ((cy + margin) * (w + 2 * margin) + cx + margin)[:, None] + _disk_flat(margin, w)  # (n, |disk|)
    found = cy, cx, np.arctan2(cy - pivot[0], cx - pivot[1]), near
    for a in found:
        a.flags.writeable = False
    return found


@functools.lru_cache(maxsize=1 << 16)
def _turn_weights(pivot: tuple[int, int], r: int, margin: int, h: int, w: int, theta: float,
                  continuity: float) -> np.ndarray:
    """Per candidate of ``_candidates(pivot, ...)``, the growth weight of its turn from heading ``theta``:
    cos(min(continuity * turn, pi/2))^2 (>= 0, so snakes2's clip at 0 is a no-op). Kept: the hundreds of target
    pairs an image redraws reach the same pivots from the same headings again and again (~4 in 5 at 32 px hard)."""
    t = np.abs(_candidates(pivot, r, margin, h, w)[2] - theta)  # (n,) turn angle
    np.minimum(t, 2 * np.pi - t, out=t)
    t *= continuity
    np.minimum(t, 0.5 * np.pi, out=t)
    np.cos(t, out=t)
    t *= t
    t.flags.writeable = False
    return t


@functools.cache
def _disk_flat(margin: int, w: int) -> np.ndarray:
    """Offsets of disk(margin) as flat steps in a buffer of width w + 2 * margin."""
    d = _disk(margin)
    return d[:, 0] * (w + 2 * margin) + d[:, 1]


# ---------------------------------------------------------------- one image
class _Paddle:
    """A paddle pasted at ``start``, clipped to the canvas: canvas window + the line and mask patches (read-only
    views of the cached patches). ``key``: (theta, length, thickness, margin, antialias scale)."""

    def __init__(self, hw, start, key, contrast):
        line, mask = _contrast_line(*key, contrast), _paddle_patch(*key)[1]
        r = line.shape[0] // 2
        y0, x0 = start[0] - r, start[1] - r
        cy0, cy1, cx0, cx1 = max(y0, 0), min(y0 + 2 * r + 1, hw[0]), max(x0, 0), min(x0 + 2 * r + 1, hw[1])
        self.win = (slice(cy0, max(cy1, cy0)), slice(cx0, max(cx1, cx0)))
        patch = (slice(cy0 - y0, max(cy1, cy0) - y0), slice(cx0 - x0, max(cx1, cx0) - x0))
        self.line, self.mask = line[patch], mask[patch]


@functools.lru_cache(maxsize=1 << 16)
def _placed(hw, start, key, contrast) -> _Paddle:
    """The paddle at ``start``, shared (paddles are never written to): the redrawn target pairs place the same
    paddles again and again (~4 in 5 at 32 px hard)."""
    return _Paddle(hw, start, key, contrast)


# ---------------------------------------------------------------- target pairs without canvases
# An image redraws its target pair hundreds of times; a pair's mask is the padding band and the pair's own paddles,
# so a growth step can be decided from the paddles kept out so far instead of the H x W mask:
# - g(c) = max over disk(m) of the mask at c is the max of the band's and each kept-out paddle P's mask dilated by
#   disk(m) (max is exact and commutes with dilation). A candidate whose disk meets the band has g = 1 (masks are
#   <= 1), so pmf = (1 - g) * w = 0 exactly; so has a candidate whose disk leaves the canvas (it crosses the band),
#   and a candidate off the canvas, which ``_candidates`` drops, adds nothing to the cumulative sum either.
# - Where every circle point floors to pivot + a fixed offset, the candidates are pivot + fixed offsets in
#   np.unique's order and a turn's weights depend on the heading alone. Candidates of negligible turn weight (past
#   continuity's cut-off, cos(pi/2)^2 ~ 4e-33) move the normalised cumulative sum by < 1e-14 whatever their g;
#   rounding moves it by < 1e-13. So a cumulative sum over the non-negligible candidates, from their weights and g,
#   picks the candidate the exact one picks whenever the draw u is more than _TIE from both bracketing entries;
#   closer draws take the exact arithmetic on a mask built from the kept-out paddles.
# - The acceptance test max(mask + Q) < 1.8 fails iff the band or one kept-out paddle P alone reaches 1.8 with Q
#   at an on-canvas pixel (rounding is monotone: max(a, b) + q = max(a + q, b + q)). Masks are <= 1, so only
#   pixels >= 0.8 of both can reach it: per pair of angles, the shifts P's start - Q's start at which they do.
# Which kept paddles reach which pixels is read from occupancy bitmasks (Python ints) of their g > 0 and mask
# >= _HOT; g itself as mask levels (every mask value is float32(k / 255) for an integer k, and k -> value is
# increasing, so the max of levels gives the max of values) from each kept paddle near the pivot.
_NEGLIGIBLE = 1e-20  # a turn weight at or below it is past the cut-off
_TIE = 1e-10         # |u - cumulative| below it: resolved by the exact arithmetic
_HOT = 0.79          # mask values below it cannot reach 1.8 with another mask (<= 1; a value is float32(k / 255))
_NO_ROOM = False     # a cumulative table's value where extend gives up (total < 1e-4) without a draw
_MISSING = object()
_UNSTEPPED = 1 << 62  # a heading's ``dpos`` where _step is no fixed pos offset (``_PairGeometry.next_pivot`` then)
_NEAR_KEPT = 100_000  # cached near-candidate tables per geometry (a few hundred bytes each)


def _integers_0_1_draws() -> bool:
    """Whether ``rng.integers(0, 1)`` advances the stream (numpy returns ``low`` for a one-value range)."""
    rng = np.random.default_rng(0)
    before = rng.bit_generator.state
    rng.integers(0, 1)
    return rng.bit_generator.state != before


_INTEGERS_0_1_DRAWS = _integers_0_1_draws()


def _lemire(next32, wide):
    """integers(low, high) drawn as numpy draws them from 32-bit outputs ``next32()``: its Lemire draw for ranges
    below 2**32 (a one-value range draws nothing); wider ranges go to ``wide(low, high)``."""
    def integers(low: int, high: int) -> int:
        n = high - low
        if n == 1:
            return low
        if n > 0xFFFFFFFF:
            return wide(low, high)
        m = next32() * n
        if m & 0xFFFFFFFF < n:
            floor = (0x100000000 - n) % n
            while m & 0xFFFFFFFF < floor:
                m = next32() * n
        return (m >> 32) + low

    return integers


def _bounded(integers):
    """bounded(low, high) -> a function drawing integers(low, high)."""
    return lambda low, high: functools.partial(integers, low, high)


def _direct(rng: np.random.Generator):
    """(integers(low, high), random(), bounded(low, high) -> a function drawing integers(low, high), settle(), no
    tape) of ``rng`` through its bit generator's C functions (``_lemire`` on next_uint32); the bit generator is where
    the draws leave it, so settle() has nothing to do."""
    c = rng.bit_generator.ctypes
    integers = _lemire(functools.partial(c.next_uint32, c.state), lambda low, high: int(rng.integers(low, high)))
    return integers, functools.partial(c.next_double, c.state), _bounded(integers), _settled, None


_WORDS_BLOCK = 1024  # 64-bit outputs ``_words`` draws from the bit generator at a time


def _words(rng: np.random.Generator):
    """``_direct``'s draws made in Python from PCG64's 64-bit outputs, drawn _WORDS_BLOCK at a time (``random_raw``)
    and spent as numpy spends them: random() is (word >> 11) * 2**-53 (next_double); a 32-bit draw takes a word's
    low half and keeps its high half for the next 32-bit draw (next_uint32's has_uint32 / uinteger); integers is
    ``_lemire`` on those. Returns (integers, random, bounded, settle, tape): settle() leaves the bit generator where
    these draws have left the stream (its state before the blocks, advanced by the words spent, with the kept half)
    and must run before anything else draws from ``rng``; a draw after it starts from that state. ``tape`` lends
    the stream to compiled code (``pathfinder_jit``): tape.lend(n) -> (unspent words as uint64, index of the next
    one, has, half) with at least n unspent, tape.spent(index, has, half) takes back where that code left it."""
    bitgen, scale = rng.bit_generator, 1.0 / 9007199254740992.0
    block, array = [], np.zeros(0, np.uint64)  # the drawn words (ints, and as an array for the tape); next: block[i]
    i = n = 0
    start = None  # [state before the blocks, words drawn in them] since the last settle
    has = half = 0

    def refill() -> None:  # the unspent words, then a new block
        nonlocal block, array, i, n, start, has, half
        if start is None:
            state = bitgen.state
            start = [state, 0]
            has, half = state["has_uint32"], state["uinteger"]
        raw = bitgen.random_raw(_WORDS_BLOCK)
        block, array = block[i:] + raw.tolist(), np.concatenate((array[i:], raw))
        i, n = 0, len(block)
        start[1] += _WORDS_BLOCK

    def random() -> float:
        nonlocal i
        if i == n:
            refill()
        i += 1
        return (block[i - 1] >> 11) * scale

    def next32() -> int:
        nonlocal i, has, half
        if i == n:
            refill()
        if has:
            has = 0
            return half
        word = block[i]
        i += 1
        has, half = 1, word >> 32
        return word & 0xFFFFFFFF

    def wide(low: int, high: int) -> int:
        settle()
        return int(rng.integers(low, high))

    def settle() -> None:
        nonlocal start, block, array, i, n
        if start is not None:
            state, drawn = start
            bitgen.state = state
            bitgen.advance(drawn - (n - i))
            state = bitgen.state
            state["has_uint32"], state["uinteger"] = has, half
            bitgen.state = state
            block, array, i, n, start = [], array[:0], 0, 0, None

    def lend(least: int):
        while n - i < least:
            refill()
        return array, i, has, half

    def spent(index: int, has_: int, half_: int) -> None:
        nonlocal i, has, half
        i, has, half = index, has_, half_

    integers = _lemire(next32, wide)
    return integers, random, _bounded(integers), settle, types.SimpleNamespace(lend=lend, spent=spent)


@functools.cache
def _draws_match(draws, kind: type) -> bool:
    """Whether ``draws`` (``_direct`` or ``_words``) draws what the Generator draws for bit generator ``kind``,
    settling where it does: mixed sequences of both calls over several ranges, across ``_words``'s block ends and
    with Generator draws between settles, compared value by value and by the state."""
    try:
        ours, theirs = np.random.Generator(kind(20240607)), np.random.Generator(kind(20240607))
        for run in range(3):
            integers, random, bounded, settle, _ = draws(ours)
            angle = bounded(-180, 180)
            for i in range(2 * _WORDS_BLOCK + 7 * run):
                if i % 5 == run and angle() != int(theirs.integers(-180, 180)):
                    return False
                low, high = ((0, 1), (0, 2), (-180, 180), (0, 360), (0, 7), (0, 1000), (5, 123457))[i % 7]
                if integers(low, high) != int(theirs.integers(low, high)) or (i % 3 and random() != theirs.random()):
                    return False
            settle()
            if ours.bit_generator.state != theirs.bit_generator.state:
                return False
            if int(ours.integers(0, 1000)) != int(theirs.integers(0, 1000)) or ours.random() != theirs.random():
                return False
        return ours.bit_generator.state == theirs.bit_generator.state
    except (AttributeError, TypeError, ValueError, KeyError):  # no ctypes or raw draws, no advance, another state
        return False


def _stream(rng: np.random.Generator):
    """(integers(low, high) -> int, random() -> float, bounded(low, high) -> a function drawing integers(low,
    high), settle(), tape) drawing exactly what ``rng``'s methods draw: from blocks of raw outputs (``_words``, the
    one with a tape for compiled code) or the bit generator's C functions (``_direct``) where they match (a third
    of the cost or less), else the methods; settle() must run before anything else draws from ``rng``."""
    kind = type(rng.bit_generator)
    for draws in (_words, _direct):
        if _draws_match(draws, kind):
            return draws(rng)

    def integers(low: int, high: int) -> int:
        return int(rng.integers(low, high))

    return integers, rng.random, _bounded(integers), _settled, None


def _settled() -> None:
    """The settle() of a stream whose draws are the bit generator's own: nothing to do."""


def _bitmasks(rows: np.ndarray) -> list[int]:
    """Each row of a boolean matrix as an int whose bit j is column j."""
    packed = np.packbits(rows, axis=1, bitorder="little")
    return [int.from_bytes(row.tobytes(), "little") for row in packed]


def _cumulative(terms):
    """extend's cumulative pmf over the non-negligible candidates, from their terms (1 - g) * w (g and turn weight
    w): a tuple between two -inf (tuples of floats leave the cycle collector's lists), _NO_ROOM, or None when the
    total is too close to extend's 1e-4 threshold to decide without the exact sums."""
    cum = list(itertools.accumulate(terms))
    acc = cum[-1] if cum else 0.0
    if acc < 0.5e-4:
        return _NO_ROOM
    if acc < 2e-4:
        return None
    return (-math.inf, *map(operator.mul, cum, itertools.repeat(1.0 / acc)), -math.inf)  # candidate k: entry k + 1


class _Heading:
    """A heading's growth tables: step * sin / cos as _step computes them and, where _step's ceil of a sum is the
    pivot's coordinate + a fixed ceil for every pivot a step starts from, that step as a pos offset ``dpos`` (else
    _UNSTEPPED); over the candidates of non-negligible turn weight (``rel``, also as a bitmask ``rel_bits``):
    weights, pos offsets (``flat``), (pos offset, pid of the paddle drawn back) per candidate, angles; cumulative
    tables and their terms, by edge class; near tables and the level reads they come from (``_Scene._near_cmf``)."""
    __slots__ = ("cands", "dc", "dpos", "ds", "end", "flat", "id", "near", "nxt", "orient", "reads", "rel",
                 "rel_bits", "tables", "terms", "theta", "weights")


class _PairGeometry:
    """Tables and caches for growing target pairs at one (params, margin), in offsets from a pivot or a paddle's
    start; each value is computed with the arithmetic of ``_Scene.extend``. Paddle angles get ids (``pid``)."""

    def __init__(self, p: PathfinderParams, m: int):
        (h, w), length = p.window_size, p.paddle_length
        self.p, self.h, self.w, self.m, self.pad, self.continuity = p, h, w, m, p.padding, p.continuity
        self.r = r = length + m
        self.R = length + math.ceil(p.paddle_thickness) + m  # paddle patch radius
        self.step = float(length + 2 * m)
        self.tries = p.max_paddle_retrial + 1
        self.patch = (length, p.paddle_thickness, m, p.antialias_scale)
        dy, dx = _circle(r)
        fy, fx = np.floor(dy).astype(int), np.floor(dx).astype(int)
        code = np.unique((fy + r) * (2 * r + 1) + fx + r)  # y-major, as np.unique orders the candidate pixels
        oy, ox = code // (2 * r + 1) - r, code % (2 * r + 1) - r
        self.oy, self.ox, self.K = oy, ox, len(code)
        self.orient_arr = np.arctan2(oy, ox)  # as _candidates computes it for a full circle: same ints, same order
        self.exact_y, self.exact_x = self._exact(h, dy, fy), self._exact(w, dx, fx)
        # pivots farther than pad + m + r from an edge see neither the band nor the edge on that axis
        self.lo, self.hi_y, self.hi_x = p.padding + m + r, h - 1 - p.padding - m - r, w - 1 - p.padding - m - r
        # table keys of a pivot's edge class and Q's band class, per coordinate on the canvas
        key_y = [(c + 1 if c < self.lo or c > self.hi_y else 0) << 16 for c in range(h)]
        key_x = [c + 1 if c < self.lo or c > self.hi_x else 0 for c in range(w)]
        qkey_y = [(c + 1 if c - self.R < p.padding or c + self.R > h - 1 - p.padding else 0) << 44 for c in range(h)]
        qkey_x = [(c + 1 if c - self.R < p.padding or c + self.R > w - 1 - p.padding else 0) << 24 for c in range(w)]
        band = np.zeros((h, w))
        band[:p.padding], band[h - p.padding:], band[:, :p.padding], band[:, w - p.padding:] = 1, 1, 1, 1
        self.band = band
        self.band_dilated = _dilate(band, _disk(m))  # g of the band alone (the rim outside the canvas is 0)
        # occupancy bitmasks (Python ints): pixel (y, x) is bit (y + M) * S + x + M, a margin M wide enough that
        # a pattern around an on-canvas anchor never wraps into the next row
        self.M = M = max(self.R + m, r)
        self.S = S = w + 2 * M
        # A point (y, x) is also the int pos = y * S + x, the shift that anchors a bitmask pattern at it; steps and
        # offsets add to it. Pivots lie within L + m + 1 < M of the canvas, where x + M is in [0, S): so pos + B
        # (B = M * S + M) is (y + M) * S + x + M, which ``point`` decodes, and no such pivot off the canvas has the
        # pos of a point on it.
        self.B = M * S + M
        # pos -> the edge key of a pivot on the canvas whose circle translates
        self.pivots = {y * S + x: key_y[y] | key_x[x] for y in range(h) for x in range(w)
                       if self.exact_y[y] and self.exact_x[x]}
        self.qkey = [0] * (h * S)  # pos of a paddle start on the canvas -> its band class (qkey_y | qkey_x)
        for y in range(h):
            self.qkey[y * S:y * S + w] = [qkey_y[y] | qx for qx in qkey_x]
        self.hot_order = {}  # per qid: its hot values by falling value and their prefix bitmasks (``pair``)
        self.ids, self.thetas, self.hot = {}, [], []
        self.support_bits, self.hot_bits = [], []  # per pid: where its g is > 0, where its mask is >= _HOT
        self.reach, self.E = [], self.R + m  # per pid: its g as levels around its start (``near_corner``)
        self.level_values = np.arange(256).astype(np.float64) / 255  # level k -> float32(k / 255), as a mask holds it
        self.level_values = self.level_values.astype(np.float32).astype(np.float64)
        self.free_levels = (1.0 - self.level_values).tolist()  # level k -> 1 - its value
        self.near_count = self.read_count = 0  # entries of the headings' ``near`` / ``reads`` tables (_NEAR_KEPT)
        # a paddle whose g touches a candidate starts within E + r of the pivot on each axis: its pos - the pivot's
        # + near_corner is then in [0, near_rows) with remainder mod S at most near_side (points on the canvas
        # whose columns differ by more than E + r wrap to a remainder of at least S - w + 1 + E + r > near_side)
        self.near_side = 2 * (self.E + r)
        self.near_corner, self.near_rows = (self.E + r) * (S + 1), (self.near_side + 1) * S
        # such a paddle sees a candidate (within r of the pivot) at an offset within H = E + 2r of its start: its
        # levels padded with zeros to rows of width S, 2H + 1 of them, are read there without bounds (``reach``)
        self.H = self.E + 2 * r
        if 2 * self.H + 1 > S:
            raise ValueError("pathfinder_gen: a padded level patch is wider than a bitmask row")
        self.reach_zero = self.H * (S + 1) + self.near_corner  # reach's index of a candidate at d = 0 offset 0
        self.headings, self.edges, self.tables, self.band_hits, self.pairs, self.trig = \
            {}, {}, {}, {}, {}, {}
        self.heading_list = []  # headings by id (the order they were built in)
        # what the lazily built caches gained, in order: ("nxt", heading id, k), ("table", heading id, key),
        # ("band", key), ("seed", deg), ("dead", deg); the compiled attempts' mirror copies them from here
        self.journal, self.mirror = [], None
        self.flipped = [float(_flip(t)) for t in self.orient_arr]
        self.flipped_id = [self.pid(t) for t in self.flipped]
        self.deg = {d: float(np.int64(d) * np.pi / 180) for d in range(-180, 360)}  # rng.integers(...) * pi / 180
        self.dead = [None] * 360  # per first-seed angle + 180: no seed pixel (``seedless``), None until asked
        self.seeds = [None] * 360  # per seed angle + 180: its _Seed, built when first drawn
        far = max(p.padding, 2 * p.seed_distance)  # the targets' lined mask > 0.3, as _seed_info builds it
        self.target_lined = np.ones((h, w), bool)
        self.target_lined[far:h - far, far:w - far] = False
        # per angle a in degrees: the second target's tail row / column per first tail row / column on the canvas,
        # rounded half-even from the float sum as ``seed`` computes it
        self.tail2 = []
        for a in range(360):
            sa, ca = self.sincos(self.deg[a])
            self.tail2.append(([round(t + p.seed_distance * sa) for t in range(h)],
                               [round(t + p.seed_distance * ca) for t in range(w)]))

    @staticmethod
    def _exact(n: int, d: np.ndarray, f: np.ndarray) -> list[bool]:
        """Per pivot coordinate c on the canvas: every circle point c + d floors to c + floor(d)."""
        return [bool(np.array_equal(np.floor(c + d).astype(int) - c, f)) for c in range(n)]

    def point(self, pos: int) -> tuple[int, int]:
        """(y, x) of a pivot's or a paddle start's pos."""
        y, x = divmod(pos + self.B, self.S)
        return y - self.M, x - self.M

    def next_pivot(self, pos: int, hd: _Heading) -> int:
        """The pos of _step(pivot, heading, L + 2m) from the pivot at ``pos``, as _step computes it."""
        y, x = self.point(pos)
        return math.ceil(y + hd.ds) * self.S + math.ceil(x + hd.dc)

    def sincos(self, theta: float) -> tuple[float, float]:
        got = self.trig.get(theta)
        if got is None:
            got = self.trig[theta] = (float(np.sin(theta)), float(np.cos(theta)))  # _step's scalar calls
        return got

    def pid(self, theta: float) -> int:
        """The id of a paddle angle; its tables are built on first sight: pixels of its mask >= _HOT (offsets,
        float64 values, bitmask) and its mask dilated by disk(m) (bitmask of > 0, levels around its start)."""
        got = self.ids.get(theta)
        if got is None:
            mask, m, R, E = _paddle_patch(theta, *self.patch)[1], self.m, self.R, self.E
            if mask.max() > 1:
                raise ValueError("pathfinder_gen: a paddle mask exceeds 1")
            padded = np.zeros((2 * E + 1,) * 2, np.float32)
            padded[E - R:E + R + 1, E - R:E + R + 1] = mask
            dilated = _dilate(padded, _disk(m))  # g around the paddle's start
            levels = np.rint(dilated * 255).astype(np.uint8)  # a mask value is float32(k / 255): level k
            if not np.array_equal(self.level_values[levels], dilated):
                raise ValueError("pathfinder_gen: a paddle mask value is not float32(k / 255)")
            ys, xs = np.nonzero(mask >= _HOT)
            gy, gx = np.nonzero(dilated > 0)
            got = self.ids[theta] = len(self.thetas)
            self.thetas.append(theta)
            self.hot.append((ys - R, xs - R, mask[ys, xs].astype(np.float64)))
            self.hot_bits.append(self.bits(ys - R, xs - R))
            self.support_bits.append(self.bits(gy - E, gx - E))
            reach = np.zeros((2 * self.H + 1, self.S), np.uint8)
            reach[self.H - E:self.H + E + 1, self.H - E:self.H + E + 1] = levels
            self.reach.append(reach.tobytes())
        return got

    def bits(self, oy: np.ndarray, ox: np.ndarray) -> int:
        """The occupancy bitmask of offsets (oy, ox) around an anchor at (0, 0): shift it by y * S + x to anchor
        it at (y, x)."""
        at = np.zeros((2 * self.M + 1) * self.S, bool)
        at[(oy + self.M) * self.S + ox + self.M] = True
        return _bitmasks(at[None])[0]

    def heading(self, theta: float) -> _Heading:
        got = self.headings.get(theta)
        if got is None:
            t = np.abs(self.orient_arr - theta)  # _turn_weights over the full circle
            np.minimum(t, 2 * np.pi - t, out=t)
            t *= self.continuity
            np.minimum(t, 0.5 * np.pi, out=t)
            np.cos(t, out=t)
            t *= t
            rel = np.flatnonzero(t > _NEGLIGIBLE)
            got = self.headings[theta] = _Heading()
            got.theta, got.id = theta, len(self.heading_list)
            self.heading_list.append(got)
            got.ds, got.dc = float(self.step * np.sin(theta)), float(self.step * np.cos(theta))
            reach = range(-self.M, max(self.h, self.w) + self.M)  # pivot coordinates a step starts from
            sy, sx = math.ceil(got.ds), math.ceil(got.dc)
            fixed = all(math.ceil(c + got.ds) == c + sy and math.ceil(c + got.dc) == c + sx for c in reach)
            got.dpos = sy * self.S + sx if fixed else _UNSTEPPED
            got.rel = rel
            got.rel_bits = self.bits(self.oy[rel], self.ox[rel])
            got.weights = t[rel].tolist()
            got.end = len(rel) + 1  # one past a cumulative table's last candidate entry
            # candidate k of the relevant ones at index k + 1, as in the cumulative tables
            got.flat = (self.oy[rel] * self.S + self.ox[rel]).tolist()
            got.cands = [(0, 0), *zip(got.flat, (self.flipped_id[j] for j in rel))]
            got.orient = [0.0, *self.orient_arr[rel].tolist()]
            got.tables, got.terms, got.near, got.reads = {}, {}, {}, {}
            got.nxt = [None] * (len(rel) + 1)  # the heading tables of the relevant candidates' angles, as met
        return got

    def edge(self, by: int, bx: int) -> np.ndarray:
        """Per candidate, 1.0 where it is off the canvas or its disk meets the band, else 0.0; by / bx is the
        pivot's row / column near an edge, -1 in the interior (where the band is out of reach on that axis)."""
        got = self.edges.get((by, bx))
        if got is None:
            y = (by if by >= 0 else self.h // 2) + self.oy
            x = (bx if bx >= 0 else self.w // 2) + self.ox
            on = (y >= 0) & (y < self.h) & (x >= 0) & (x < self.w)
            got = np.ones(self.K)
            got[on] = self.band_dilated[y[on], x[on]]
            if not np.isin(got, (0.0, 1.0)).all():  # _near_cmf's terms rely on it
                raise ValueError("pathfinder_gen: the band's g is not 0 or 1")
            self.edges[(by, bx)] = got
        return got

    def next_heading(self, hd: _Heading, k: int) -> _Heading:
        got = hd.nxt[k] = self.heading(hd.orient[k])
        self.journal.append(("nxt", hd.id, k))
        return got

    def table(self, hd: _Heading, key: int):
        """The cumulative pmf where only the band and the edge touch the candidates, for a heading and a pivot's
        edge class ``key`` = key_y[py] | key_x[px]; its terms (1 - g) * w in ``hd.terms[key]``."""
        values = self.edge((key >> 16) - 1, (key & 0xFFFF) - 1)[hd.rel].tolist()
        terms = hd.terms[key] = tuple(map(operator.mul, map((1.0).__sub__, values), hd.weights))
        got = hd.tables[key] = _cumulative(terms)
        self.journal.append(("table", hd.id, key))
        return got

    def band_hit(self, key: int) -> bool:
        """Does a paddle reach 1.8 with the band? key = qkey_y[hy] | qkey_x[hx] | pid of the paddle at (hy, hx)."""
        got = self.band_hits.get(key)
        if got is None:
            by, bx, qid = (key >> 44) - 1, ((key >> 24) & 0xFFFFF) - 1, key & 0xFFFFFF
            hy, hx = by if by >= 0 else self.h // 2, bx if bx >= 0 else self.w // 2
            ys, xs, vals = self.hot[qid]
            y, x = hy + ys, hx + xs
            on = (y >= 0) & (y < self.h) & (x >= 0) & (x < self.w)
            got = self.band_hits[key] = bool((self.band[y[on], x[on]] + vals[on] >= 1.8).any())
            self.journal.append(("band", key))
        return got

    def pair(self, pid: int, qid: int) -> int:
        """Bitmask over shifts (dy, dx) = P's start - Q's start, bit (dy + 2R) * S + dx + 2R (so a pos difference
        plus 2R (S + 1)), at which paddles pid and qid reach 1.8 together at some pixel, on the canvas or off it.
        P's pixel at offset (y, x) with value v meets Q's pixel at offset (y', x') at shift (y' - y, x' - x); the
        pixels of Q reaching 1.8 with v are a prefix of Q's pixels by falling value (a float64 sum is monotone)."""
        key = pid << 24 | qid
        got = self.pairs.get(key)
        if got is None:
            falling, prefix = self.hot_order.get(qid) or self.order_hot(qid)
            py, px, pv = self.hot[pid]
            reach = (pv[:, None] + falling[None, :] >= 1.8).sum(axis=1)  # float64 sums of the float32 values
            R, S, got = self.R, self.S, 0
            for n, y, x in zip(reach.tolist(), py.tolist(), px.tolist()):
                if n:
                    got |= prefix[n] << (R - y) * S + R - x
            self.pairs[key] = got
        return got

    def order_hot(self, qid: int):
        """Paddle qid's hot values by falling value, and per n the bitmask of the first n of them at bit
        (y + R) * S + x + R for offset (y, x): ``pair``'s pieces."""
        ys, xs, vals = self.hot[qid]
        order = np.argsort(-vals, kind="stable")
        prefix, acc = [0], 0
        for bit in ((ys[order] + self.R) * self.S + xs[order] + self.R).tolist():
            acc |= 1 << bit
            prefix.append(acc)
        got = self.hot_order[qid] = (vals[order], prefix)
        return got

    def hit_on_canvas(self, pid: int, qid: int, dy: int, dx: int, hy: int, hx: int) -> bool:
        """The pair test restricted to the canvas, for Q at (hy, hx) and P at (hy + dy, hx + dx)."""
        R = self.R
        y0, y1 = max(hy - R, hy + dy - R, 0), min(hy + R, hy + dy + R, self.h - 1)
        x0, x1 = max(hx - R, hx + dx - R, 0), min(hx + R, hx + dx + R, self.w - 1)
        if y0 > y1 or x0 > x1:
            return False
        q = _paddle_patch(self.thetas[qid], *self.patch)[1][y0 - hy + R:y1 - hy + R + 1, x0 - hx + R:x1 - hx + R + 1]
        p = _paddle_patch(self.thetas[pid], *self.patch)[1][y0 - hy - dy + R:y1 - hy - dy + R + 1,
                                                            x0 - hx - dx + R:x1 - hx - dx + R + 1]
        return bool((p.astype(np.float64) + q).max() >= 1.8)

    def seed_angle(self, deg: int) -> _Seed:
        got = self.seeds[deg + 180]
        if got is None:
            got = self.seeds[deg + 180] = _Seed()
            theta, length = self.deg[deg], self.p.paddle_length
            got.theta, got.hd, got.pid = theta, self.heading(theta), self.pid(theta)
            sn, cs = self.sincos(theta)
            got.hy, got.hx = float(length) * sn, float(length) * cs  # as _step multiplies, before its sum
            sn, cs = self.sincos(float(_flip(theta)))
            got.py, got.px = float(length + self.m) * sn, float(length + self.m) * cs
            got.pivot_y = self.seed_pivots(got.hy, got.py, self.h)
            got.pivot_x = self.seed_pivots(got.hx, got.px, self.w)
            p, (h, w) = self.p, self.p.window_size  # _seed_info with the padded dilation (the same booleans)
            off = _seed_kernel(theta, p.paddle_length, p.paddle_thickness, self.m, p.antialias_scale)
            usable = not p.cv2_border or bool(_blocked_flat(np.ones((h, w), bool), off).all())  # a sample in-canvas
            got.kernel, got.free = (off if usable else None), None
            if usable:
                ys, xs = np.nonzero(~_blocked_flat(self.target_lined, off))
                got.free = (ys.tolist(), xs.tolist()) if len(ys) else None
            self.journal.append(("seed", deg))
        return got

    @staticmethod
    def seed_pivots(head: float, pivot: float, n: int) -> list:
        """Per tail coordinate t on the canvas (size n): the pivot's coordinate ceil(ceil(t + head) + pivot), as
        _step computes it, where it and the head's lie on the canvas, else None."""
        out = []
        for t in range(n):
            c = math.ceil(t + head)
            d = math.ceil(c + pivot)
            out.append(d if 0 <= c < n and 0 <= d < n else None)
        return out

    def seedless(self, deg: int) -> bool:
        """Whether the first target has no seed pixel at angle deg (an attempt drawing it fails at once)."""
        got = self.dead[deg + 180] = self.seed_angle(deg).free is None
        self.journal.append(("dead", deg))
        return got


@functools.cache
def _pair_geometry(p: PathfinderParams, m: int) -> _PairGeometry:
    return _PairGeometry(p, m)


_COMPILED = pathfinder_jit.available()  # target-pair attempts compiled (numba) where they can be


def _mirror(g: _PairGeometry) -> pathfinder_jit.Mirror:
    """The geometry's caches as the compiled attempts read them (built once per geometry)."""
    g.mirror = pathfinder_jit.Mirror(g, lambda pid: _paddle_patch(g.thetas[pid], *g.patch)[1], _UNSTEPPED, _NO_ROOM)
    return g.mirror


class _Seed:
    """A seed angle (integer degrees): theta, _step's offsets tail -> head (L at theta) and head -> pivot (L + m
    at the flipped angle), the seed kernel where cv2's border leaves it usable, the first target's seed pixels,
    the heading table and the paddle's pid; per tail row / column on the canvas, the pivot's where head and pivot
    lie on the canvas (``seed_pivots``)."""
    __slots__ = ("free", "hd", "hx", "hy", "kernel", "pid", "pivot_x", "pivot_y", "px", "py", "theta")


class _Track:
    """A snake while it is drawn from paddle lists: its pivot's pos (``_PairGeometry``), heading table ``hd`` (its
    angle hd.theta), paddles as (pos of the start, pid) (``last`` the newest), their contrasts. A target pair that
    fits sets the rest (``_Scene._pair_done``): the snake's ``tip`` (its last start, None for a single paddle), and
    the geometry and patch key ``layer`` draws with (as _Snake's)."""
    __slots__ = ("contrasts", "g", "hd", "last", "origin", "paddles", "patch", "pos", "tip")

    def __init__(self, origin, at: int, pos: int, seed: _Seed, contrast):
        self.origin, self.pos, self.hd, self.last = origin, pos, seed.hd, (at, seed.pid)
        self.paddles, self.contrasts = [self.last], [contrast]

    def layer(self, hw) -> np.ndarray:
        """This snake alone on an empty canvas (float, before bytescale): for tests and inspection."""
        out = np.zeros(hw)
        for (at, pid), contrast in zip(self.paddles, self.contrasts):
            pad = _Paddle(hw, self.g.point(at), (self.g.thetas[pid], *self.patch), contrast)
            np.maximum(out[pad.win], pad.line, out=out[pad.win])
        return out


class _Snake:
    def __init__(self, origin, pivot, theta, paddle):
        self.origin, self.pivot, self.theta, self.last, self.tip = origin, pivot, theta, paddle, None
        self.paddles = [paddle]

    def layer(self, hw) -> np.ndarray:
        """This snake alone on an empty canvas (float, before bytescale): for tests and inspection."""
        out = np.zeros(hw)
        for pad in self.paddles:
            np.maximum(out[pad.win], pad.line, out=out[pad.win])
        return out


@functools.lru_cache(maxsize=1 << 16)
def _marker_window(hw, aa: int, radius: float, at) -> tuple:
    """(box, the marker of ``_Scene.marker`` inside box) or (None, None) where the box is the whole canvas. PIL's
    LANCZOS at the integer factor aa weighs the input within 3 aa of an output pixel's centre with weights that
    depend on the offset alone (renormalised only where the image edge cuts them), so an output pixel whose
    inputs all lie in a window aligned to aa is the same shrunk from the window as from the canvas, and one
    whose inputs miss the disc is 0 in both: a window radius + 8 output pixels wide leaves 3 + 3 to spare."""
    (h, w), reach = hw, radius + 8
    box = (max(0, math.floor(at[0] - reach)), min(h, math.ceil(at[0] + reach) + 1),
           max(0, math.floor(at[1] - reach)), min(w, math.ceil(at[1] + reach) + 1))
    if box == (0, h, 0, w):
        return None, None
    y = np.arange(box[0] * aa, box[1] * aa)[:, None] - at[0] * aa
    x = np.arange(box[2] * aa, box[3] * aa)[None, :] - at[1] * aa
    window = _shrink((x ** 2 + y ** 2 <= (radius * aa) ** 2).astype(np.float64), (box[1] - box[0], box[3] - box[2]))
    window.flags.writeable = False
    return box, window


class _Scene:
    def __init__(self, p: PathfinderParams, rng, margin: int):
        self.p, self.rng, self.m = p, rng, margin
        self.hw = tuple(p.window_size)
        self.img = np.zeros(self.hw)  # float64 like snakes2's np.zeros; the pasted patches are float32
        self.buf = np.zeros((self.hw[0] + 2 * margin, self.hw[1] + 2 * margin))  # zero rim: dilation gathers
        self.mask = self.buf[margin:margin + self.hw[0], margin:margin + self.hw[1]]  # (H, W) view
        self.flat = self.buf.reshape(-1)  # ((H + 2m) * (W + 2m),) view for gathers
        self.patch = (p.paddle_length, p.paddle_thickness, margin, p.antialias_scale)  # a paddle's key, less theta
        self.kept, self.synced, self.banded = [], 0, False  # target_pair's kept-out paddles, how many are on mask
        self.support = self.hot = 0  # occupancy bitmasks of the kept paddles' g > 0 and mask >= _HOT

    def clear(self) -> None:
        """Empty canvases, as a new scene's: the next target pair is drawn from scratch."""
        self.img.fill(0)
        self.buf.fill(0)

    def paddle(self, start, theta, contrast) -> _Paddle:
        return _placed(self.hw, start, (theta, *self.patch), contrast)

    def draw(self, pad: _Paddle) -> None:
        np.maximum(self.img[pad.win], pad.line, out=self.img[pad.win])

    def keep_out(self, pad: _Paddle) -> None:
        np.maximum(self.mask[pad.win], pad.mask, out=self.mask[pad.win])

    def inside(self, *points) -> bool:
        return all(0 <= y < self.hw[0] and 0 <= x < self.hw[1] for y, x in points)

    def free_pixels(self, lined: np.ndarray | None, theta: float):
        """Pixels where a seed paddle at angle theta keeps clear of ``lined`` (rows, cols), or None;
        ``lined=None`` means the targets' lined mask."""
        off, usable, target_free = _seed_info(self.p, self.m, theta)
        if not usable:
            return None
        if lined is None:
            return target_free
        ys, xs = np.nonzero(~_blocked(lined > 0.3, off))  # dilated <= 0.3, as snakes2's ceil(d - 0.3) == 0
        return (ys, xs) if len(ys) else None

    def seed(self, lined, contrast, stop=None, tail1=None):
        """First paddle of a snake: a free tail (or one ``seed_distance`` from ``tail1``), <= 1 + retrials."""
        p, rng, length = self.p, self.rng, self.p.paddle_length
        for _ in range(p.max_paddle_retrial + 1):
            theta = rng.integers(-180, 180) * np.pi / 180
            if tail1 is None:
                if stop is not None and np.count_nonzero(self.mask <= 0.3) / self.mask.size < stop:
                    return None
                free = self.free_pixels(lined, theta)
                if free is None:
                    return None
                k = rng.integers(0, len(free[0]))
                tail = (int(free[0][k]), int(free[1][k]))
            else:  # the second target: not checked against the mask, as in snakes2
                a = rng.integers(0, 360) * np.pi / 180
                tail = (int(np.round(tail1[0] + p.seed_distance * np.sin(a))),
                        int(np.round(tail1[1] + p.seed_distance * np.cos(a))))
            head = _step(tail, theta, length)
            pivot = _step(head, _flip(theta), length + self.m)
            if self.inside(head, pivot):
                pad = self.paddle(tail, theta, contrast)
                self.draw(pad)
                return _Snake(tail, pivot, theta, pad)
        return None

    def extend(self, s: _Snake, contrast) -> bool:
        """Grow snake s by one paddle drawn from a sampled head back toward the new pivot."""
        p, m = self.p, self.m
        pivot = _step(s.pivot, s.theta, p.paddle_length + 2 * m)
        cands = _candidates(pivot, p.paddle_length + m, m, *self.hw)
        if cands is None:
            return False
        cy, cx, orient, near = cands
        pmf = 1 - self.flat[near].max(axis=1)  # (n,) free after dilating the mask by the margin
        pmf *= _turn_weights(pivot, p.paddle_length + m, m, *self.hw, s.theta, p.continuity)
        total = pmf.sum()
        if total < 1e-4:
            return False
        pmf /= total
        cmf = pmf.cumsum()
        for _ in range(p.max_paddle_retrial + 1):
            i = int(cmf.searchsorted(self.rng.random(), "right"))  # first cmf > u, as argmax(cmf - u > 0)
            i = 0 if i == len(cmf) else i
            head = (int(cy[i]), int(cx[i]))
            pad = self.paddle(head, _flip(orient[i]), contrast)
            if pad.mask.size == 0 or (self.mask[pad.win] + pad.mask).max() < 1.8:
                self.draw(pad)
                self.keep_out(s.last)  # the previous paddle's mask joins one step late
                s.pivot, s.theta, s.last, s.tip = pivot, orient[i], pad, head
                s.paddles.append(pad)
                return True
        return False

    def targets(self) -> list[_Snake] | None:
        p, rng = self.p, self.rng
        pad_ = p.padding
        self.mask[:pad_], self.mask[-pad_:], self.mask[:, :pad_], self.mask[:, -pad_:] = 1, 1, 1, 1
        mu = list(p.snake_contrast_list) * 2
        if len(set(mu)) > 1:  # snakes2 uses Python's random.shuffle; a no-op for LRA's single-value lists
            mu = [mu[j] for j in rng.permutation(len(mu))]
        snakes = []
        for t in range(2):
            ci = rng.integers(0, len(p.paddle_contrast_list)) if len(p.paddle_contrast_list) > 1 else 0
            s = self.seed(None, p.paddle_contrast_list[ci] * mu[t], tail1=snakes[0].origin if t else None)
            if s is None:
                return None
            snakes.append(s)
        for _ in range(p.contour_length - 1):
            contrast = p.paddle_contrast_list[rng.integers(0, len(p.paddle_contrast_list))]
            for t in range(2):
                if not self.extend(snakes[t], contrast * mu[t]):
                    return None
        self.keep_out(snakes[1].last)  # snakes2 masks only the second target's last paddle
        if p.mask_both_target_ends:
            self.keep_out(snakes[0].last)
        return snakes

    # ---- target pairs without canvases (the section above _PairGeometry says why each shortcut is exact)
    def target_pair(self, reference: bool = False) -> list:
        """``targets`` redrawn until a pair fits. The default decides each step from paddle lists and leaves the
        canvases, the random stream and the snakes exactly as ``reference=True`` (``targets`` on the canvases)."""
        p = self.p
        if not reference:
            return self._pairs(_pair_geometry(p, self.m))
        for _ in range(p.max_target_pair_attempts):
            snakes = self.targets()
            if snakes is not None:
                return snakes
            self.clear()
        raise RuntimeError(f"no target pair fits after {p.max_target_pair_attempts} attempts: check {p}")

    def _keep(self, g: _PairGeometry, paddle) -> None:
        """keep_out for a listed paddle (pos, pid)."""
        self.kept.append(paddle)
        at, pid = paddle
        self.support |= g.support_bits[pid] << at
        self.hot |= g.hot_bits[pid] << at

    def _sync(self, g: _PairGeometry) -> None:
        """Bring the mask canvas up to the kept-out paddles (the band first, as ``targets`` sets it)."""
        if not self.banded:
            pad_ = self.p.padding
            self.mask[:pad_], self.mask[-pad_:], self.mask[:, :pad_], self.mask[:, -pad_:] = 1, 1, 1, 1
            self.banded = True
        h, w, size = g.h, g.w, 2 * g.R + 1
        for at, pid in self.kept[self.synced:]:
            y, x = g.point(at)
            y0, x0 = y - g.R, x - g.R
            cy0, cy1, cx0, cx1 = max(y0, 0), min(y0 + size, h), max(x0, 0), min(x0 + size, w)
            if cy0 < cy1 and cx0 < cx1:
                win = self.mask[cy0:cy1, cx0:cx1]
                patch = _paddle_patch(g.thetas[pid], *g.patch)[1]
                np.maximum(win, patch[cy0 - y0:cy1 - y0, cx0 - x0:cx1 - x0], out=win)
        self.synced = len(self.kept)

    def _exact_cmf(self, g: _PairGeometry, pivot, theta):
        """``extend``'s pmf on the canvas: (cmf, rows, cols, angles) or None where it gives up."""
        self._sync(g)
        cands = _candidates(pivot, g.r, g.m, g.h, g.w)
        if cands is None:
            return None
        cy, cx, orient, near = cands
        pmf = 1 - self.flat[near].max(axis=1)
        pmf *= _turn_weights(pivot, g.r, g.m, g.h, g.w, theta, g.continuity)
        total = pmf.sum()
        if total < 1e-4:
            return None
        pmf /= total
        return pmf.cumsum(), cy, cx, orient

    def _pairs(self, g: _PairGeometry) -> list[_Track]:
        """``targets`` redrawn until a pair fits, with the same random calls: paddles are listed, the mask is
        built only where a step needs the exact arithmetic, and the image is drawn once the pair fits. _grow's
        common case is written out here (a growth step is the inner loop of an image's work), on pos ints: the next
        pivot is the pivot's pos + the heading's dpos, a candidate's start the pivot's + its offset, and the
        bitmasks shift by them. Anything else is left to _grow before any draw, or with the draw made (u0) when it
        lies within _TIE of a boundary."""
        p, rng = self.p, self.rng
        integers, random, bounded, self.settle, tape = _stream(rng)
        self.integers, self.random, turn = integers, random, bounded(0, 360)
        contrasts, mu0 = p.paddle_contrast_list, list(p.snake_contrast_list) * 2
        shuffle, draws = len(set(mu0)) > 1, len(contrasts) > 1 or _INTEGERS_0_1_DRAWS
        # an attempt whose first random call is the first seed's angle fails at once on an angle without seed
        # pixels (30 in 360 have some at 32 px): such attempts take no more than that draw here
        quick, dead = not shuffle and len(contrasts) == 1, g.dead
        # the quick path's attempts run compiled where numba is installed, each handing back to the loop below
        # (rewound) what it cannot decide from the mirrored tables
        fast = None
        if _COMPILED and quick and not draws and tape is not None:
            fast = g.mirror or _mirror(g)
        pivots, qkey, hot_bits, support_bits, band_hits = g.pivots, g.qkey, g.hot_bits, g.support_bits, g.band_hits
        retrials, steps = range(g.tries, 0, -1), range(p.contour_length - 1)
        bisect_right, collides = bisect.bisect_right, self._collides
        # the attempt's bitmasks hold bit b of the canvas's at b - base (base >= 0, below every paddle start and
        # pivot they are shifted to: ``low`` = base + lift keeps a pivot's candidates above it), so they span the
        # rows the attempt reached rather than the canvas above them
        lift, slack = (g.r + 1) * g.S, (g.r + 1 + 2 * (g.p.paddle_length + 2 * g.m)) * g.S
        if g.near_count > _NEAR_KEPT:
            for heading in g.headings.values():
                heading.near.clear()
            g.near_count = 0
        if g.read_count > _NEAR_KEPT:
            for heading in g.headings.values():
                heading.reads.clear()
            g.read_count = 0
        untried = p.max_target_pair_attempts
        while untried:
            if fast is not None:
                why, spent = fast.attempts(untried, tape, _TIE)
                untried -= spent
                if why == pathfinder_jit.OK:
                    return self._adopt(g, fast, contrasts[0], mu0)
                if why == pathfinder_jit.UNAVAILABLE:
                    fast = None
                if not untried:
                    break
            untried -= 1
            deg = None
            if quick:
                deg = turn()  # integers(-180, 180) is this draw - 180
                if dead[deg] if dead[deg] is not None else g.seedless(deg - 180):
                    continue
                deg -= 180
            if self.banded:  # an exact step of the last attempt drew on the mask
                self.buf.fill(0)
                self.banded, self.synced = False, 0
            self.kept = kept = []
            support = hot = base = 0
            if shuffle:
                self.settle()
            mu = [mu0[j] for j in rng.permutation(len(mu0))] if shuffle else mu0
            s0 = self._seed_track(g, contrasts[integers(0, len(contrasts)) if len(contrasts) > 1 else 0] * mu[0],
                                  None, deg)
            s1 = s0 and self._seed_track(g, contrasts[integers(0, len(contrasts)) if len(contrasts) > 1 else 0]
                                         * mu[1], s0.origin)
            if s1 is None:
                continue
            tracks = ((s0, mu[0]), (s1, mu[1]))
            base = max(0, min(s0.last[0], s1.last[0]) - slack)
            low = base + lift
            for _ in steps:
                contrast = contrasts[integers(0, len(contrasts))] if draws else contrasts[0]
                for s, factor in tracks:
                    hd = s.hd
                    pos = s.pos + hd.dpos
                    key = pivots.get(pos)
                    if key is None and hd.dpos == _UNSTEPPED:
                        pos = g.next_pivot(s.pos, hd)
                        key = pivots.get(pos)
                    if key is None:
                        cmf = None
                    else:
                        cmf = hd.tables.get(key, _MISSING)
                        if cmf is _MISSING:
                            cmf = g.table(hd, key)
                        if pos < low:  # the window's base moves down with the pivot
                            support, hot = support << base - max(0, pos - slack), hot << base - max(0, pos - slack)
                            base = max(0, pos - slack)
                            low = base + lift
                        if support >> pos - base & hd.rel_bits:
                            cmf = self._near_cmf(g, hd, key, pos)
                        if cmf is _NO_ROOM:
                            break
                    if cmf is None:
                        self.support, self.hot = support << base, hot << base
                        grown = self._grow(g, s, contrast * factor)
                        support, hot, base, low = self.support, self.hot, 0, lift
                        if not grown:
                            break
                        continue
                    end, cands = hd.end, hd.cands
                    for left in retrials:
                        u = random()
                        k = bisect_right(cmf, u, 1, end)
                        if not (cmf[k] > u + _TIE and cmf[k - 1] < u - _TIE):
                            self.support, self.hot = support << base, hot << base
                            grown = self._grow(g, s, contrast * factor, u, left)
                            support, hot, base, low = self.support, self.hot, 0, lift
                            break
                        at, qid = cands[k]
                        at += pos
                        key = qkey[at]
                        if key and (band_hits[key | qid] if (key | qid) in band_hits else g.band_hit(key | qid)):
                            continue
                        if hot >> at - base & hot_bits[qid] and collides(g, qid, at):
                            continue
                        last = s.last
                        kept.append(last)
                        support |= support_bits[last[1]] << last[0] - base
                        hot |= hot_bits[last[1]] << last[0] - base
                        s.last = last = (at, qid)
                        s.paddles.append(last)
                        if draws:
                            s.contrasts.append(contrast * factor)
                        s.pos, s.hd = pos, hd.nxt[k] or g.next_heading(hd, k)
                        grown = True
                        break
                    else:
                        grown = False
                    if not grown:
                        break
                else:
                    continue
                break
            else:
                self.support, self.hot = support << base, hot << base
                return self._pair_done(g, s0, s1)
        raise RuntimeError(f"no target pair fits after {p.max_target_pair_attempts} attempts: check {p}")

    def _adopt(self, g: _PairGeometry, fast: pathfinder_jit.Mirror, contrast, mu) -> list[_Track]:
        """The pair the compiled attempts fitted, as the Python loop leaves it: kept paddles, bitmasks, tracks."""
        if self.banded:  # an exact step of an earlier attempt drew on the mask
            self.buf.fill(0)
            self.banded, self.synced = False, 0
        kept, tracks = fast.pair()
        self.kept, self.support, self.hot = [], 0, 0
        for paddle in kept:
            self._keep(g, paddle)
        pair = []
        for (origin, paddles, pos, hid), factor in zip(tracks, mu):
            s = _Track.__new__(_Track)
            s.origin, s.paddles, s.last, s.pos, s.hd = origin, paddles, paddles[-1], pos, g.heading_list[hid]
            s.contrasts = [contrast * factor]
            pair.append(s)
        return self._pair_done(g, *pair)

    def _pair_done(self, g: _PairGeometry, s0: _Track, s1: _Track) -> list[_Track]:
        """The pair fits: the last keep-outs, the mask and the image as ``targets`` leaves them, and the snakes
        (origin, tip and layer as _Snake's)."""
        self._keep(g, s1.last)  # the mask catches up with the kept paddles where a distractor seed reads it
        if self.p.mask_both_target_ends:
            self._keep(g, s0.last)
        for s in (s0, s1):
            if len(s.contrasts) < len(s.paddles):  # one paddle contrast, none drawn: all are the seed's
                s.contrasts = [s.contrasts[0]] * len(s.paddles)
            for (at, pid), c in zip(s.paddles, s.contrasts):
                self._draw_listed(g, at, pid, c)
            s.tip, s.g, s.patch = g.point(s.last[0]) if len(s.paddles) > 1 else None, g, self.patch
        return [s0, s1]

    def _seed_track(self, g: _PairGeometry, contrast, tail1, deg: int | None = None):
        """``seed`` for a target (``lined=None``): same draws, same outcome (``deg``: the first angle, drawn)."""
        integers = self.integers
        for _ in range(g.tries):
            if deg is None:
                deg = integers(-180, 180)
            rec = g.seeds[deg + 180] or g.seed_angle(deg)
            deg = None
            if tail1 is None:
                free = rec.free
                if free is None:
                    return None
                k = integers(0, len(free[0]))
                ty, tx = free[0][k], free[1][k]
            else:
                rows, cols = g.tail2[integers(0, 360)]
                ty, tx = rows[tail1[0]], cols[tail1[1]]
            if 0 <= ty < g.h and 0 <= tx < g.w:
                py, px = rec.pivot_y[ty], rec.pivot_x[tx]
                if py is not None and px is not None:
                    return _Track((ty, tx), ty * g.S + tx, py * g.S + px, rec, contrast)
            elif self._seed_fits(rec, ty, tx):  # a tail off the canvas: the head and pivot may still lie on it
                raise RuntimeError("pathfinder_gen: a target tail off the canvas")
        return None

    def _seed_fits(self, rec: _Seed, ty: int, tx: int) -> bool:
        """Whether a seed paddle's head and pivot, from tail (ty, tx), lie on the canvas (as ``seed`` tests them)."""
        h, w = self.hw
        hy, hx = math.ceil(ty + rec.hy), math.ceil(tx + rec.hx)
        py, px = math.ceil(hy + rec.py), math.ceil(hx + rec.px)
        return 0 <= hy < h and 0 <= hx < w and 0 <= py < h and 0 <= px < w

    def _grow(self, g: _PairGeometry, s: _Track, contrast, u0: float | None = None, tries: int | None = None) -> bool:
        """``extend`` on a track: same draws, same outcome. ``u0``: the first retrial's draw, already made by a
        caller that found it too close to a cumulative boundary; ``tries``: the retrials left then."""
        hd = s.hd
        pos = g.next_pivot(s.pos, hd)
        cmf = exact = None
        key = g.pivots.get(pos)
        if key is not None:
            cmf = hd.tables.get(key, _MISSING)
            if cmf is _MISSING:
                cmf = g.table(hd, key)
            if self.support & hd.rel_bits << pos:  # a kept paddle reaches a relevant candidate
                cmf = self._near_cmf(g, hd, key, pos)
            if cmf is _NO_ROOM:
                return False
        if cmf is None:
            exact = self._exact_cmf(g, g.point(pos), hd.theta)
            if exact is None:
                return False
        for _ in range(g.tries if tries is None else tries):
            if u0 is None:
                u = self.random()
            else:
                u, u0 = u0, None
            if exact is None:
                k = bisect.bisect_right(cmf, u, 1, hd.end)
                if cmf[k] > u + _TIE and cmf[k - 1] < u - _TIE:
                    at, qid = hd.cands[k]
                    at += pos
                else:
                    exact = self._exact_cmf(g, g.point(pos), hd.theta)
                    if exact is None:  # cannot happen: the shortcut's total is >= 2e-4
                        raise RuntimeError("pathfinder_gen: the turn table and the exact pmf disagree")
            if exact is not None:
                e_cmf, cy, cx, angles = exact
                i = int(e_cmf.searchsorted(u, "right"))
                i = 0 if i == len(e_cmf) else i
                at, orient, qid = int(cy[i]) * g.S + int(cx[i]), float(angles[i]), g.pid(float(_flip(angles[i])))
            key = g.qkey[at]
            if key and (g.band_hits.get(key | qid) if (key | qid) in g.band_hits else g.band_hit(key | qid)):
                continue
            if self.hot & g.hot_bits[qid] << at and self._collides(g, qid, at):
                continue
            self._keep(g, s.last)  # the previous paddle's mask joins one step late
            s.last = q = (at, qid)
            s.paddles.append(q)
            s.contrasts.append(contrast)
            s.pos = pos
            s.hd = (hd.nxt[k] or g.next_heading(hd, k)) if exact is None else g.heading(orient)
            return True
        return False

    def _near_cmf(self, g: _PairGeometry, hd: _Heading, key: int, pos: int):
        """The cumulative pmf where kept paddles reach relevant candidates: g is the band's (0 or 1 at each relevant
        candidate) maxed with the levels of the kept paddles near the pivot, so a term (1 - g) * w is the table's
        term (1 - band) * w times 1 - the level's value (bit for bit: w * 1.0 = w, and a band term is 0). Those
        levels decide it with the heading and the edge class ``key``: kept per heading."""
        corner, rows, side, S, zero, flat = g.near_corner, g.near_rows, g.near_side, g.S, g.reach_zero, hd.flat
        reads, near = hd.reads, []
        for at, pid in self.kept:
            d = at - pos + corner
            if 0 <= d < rows and d % S <= side:
                got = reads.get(pid << 24 | d)
                if got is None:  # paddle pid's levels at the candidates: its padded patch there
                    got = reads[pid << 24 | d] = bytes(map(g.reach[pid].__getitem__, map((zero - d).__add__, flat)))
                    g.read_count += 1
                near.append(got)
        levels = near[0] if len(near) == 1 else bytes(map(max, *near))
        seen = (key, levels)
        got = hd.near.get(seen, _MISSING)
        if got is _MISSING:
            got = hd.near[seen] = _cumulative(map(operator.mul, map(g.free_levels.__getitem__, levels), hd.terms[key]))
            g.near_count += 1
        return got

    def _collides(self, g: _PairGeometry, qid: int, at: int) -> bool:
        """The acceptance test for paddle qid at pos ``at`` against each kept paddle near it: the bit of their
        pos difference in ``pair`` (a difference of points on the canvas whose columns are more than 2R apart
        reads a column of the bitmask past 4R, which is clear)."""
        big, span, pairs = g.R, 2 * g.R, g.pairs
        corner, rows = span * g.S + span, (2 * span + 1) * g.S
        hy, hx = g.point(at)
        clipped = hy < big or hy + big >= g.h or hx < big or hx + big >= g.w
        for a, pid in reversed(self.kept):  # the newest paddles are the likeliest to meet it
            shift = a - at + corner
            if 0 <= shift < rows:
                bitmask = pairs.get(pid << 24 | qid)
                if bitmask is None:
                    bitmask = g.pair(pid, qid)
                if bitmask >> shift & 1:
                    if not clipped:
                        return True
                    y, x = g.point(a)
                    if g.hit_on_canvas(pid, qid, y - hy, x - hx, hy, hx):
                        return True
        return False

    def distractors(self, count, max_trial, length) -> None:
        """``many_snakes`` after ``target_pair``: the same random calls and image, each distractor grown from
        paddle lists (the mask is built for the seeds) and drawn once it is complete."""
        integers, cl, g = self.integers, self.p.snake_contrast_list, _pair_geometry(self.p, self.m)
        draws = len(cl) > 1 or _INTEGERS_0_1_DRAWS
        for _ in range(count):
            for _ in range(max_trial + 1):
                base, support, hot = len(self.kept), self.support, self.hot
                s = self._seed_distractor(g, cl[integers(0, len(cl))] if draws else cl[0])
                ok = s is not None and all(self._grow(g, s, cl[integers(0, len(cl))] if draws else cl[0])
                                           for _ in range(length - 1))
                if ok:
                    self._keep(g, s.last)
                    for (at, pid), c in zip(s.paddles, s.contrasts):
                        self._draw_listed(g, at, pid, c)
                    break
                del self.kept[base:]  # all or nothing, as many_snakes restores its copies
                self.support, self.hot = support, hot
                if self.synced > base:  # an exact step put this snake's paddles on the mask: rebuild it
                    self.buf.fill(0)
                    self.banded, self.synced = False, 0

    def _draw_listed(self, g: _PairGeometry, at: int, pid: int, contrast) -> None:
        """``draw`` of a listed paddle at pos ``at``: its contrast line patch maxed into the image, clipped to the
        canvas."""
        line, (h, w), size = _contrast_line(g.thetas[pid], *self.patch, contrast), self.hw, 2 * g.R + 1
        y, x = g.point(at)
        y0, x0 = y - g.R, x - g.R
        cy0, cy1, cx0, cx1 = max(y0, 0), min(y0 + size, h), max(x0, 0), min(x0 + size, w)
        if cy0 < cy1 and cx0 < cx1:
            window = self.img[cy0:cy1, cx0:cx1]
            np.maximum(window, line[cy0 - y0:cy1 - y0, cx0 - x0:cx1 - x0], out=window)

    def _seed_distractor(self, g: _PairGeometry, contrast):
        """``seed(lined, contrast, stop)`` on the synced mask, without drawing: same draws, same outcome."""
        p, integers, w = self.p, self.integers, g.w
        free_share = hit = None
        for _ in range(g.tries):
            rec = g.seed_angle(integers(-180, 180))
            if rec.kernel is None:  # cv2's border leaves this angle no pixel; seed's availability test returns the
                return None  # same None first where it fails, with no draw between
            if free_share is None:
                self._sync(g)
                free_share = np.count_nonzero(self.mask <= 0.3) / self.mask.size
            if free_share < p.stop_with_availability:
                return None
            if hit is None:  # many_snakes' lined mask (its border set to 1) > 0.3
                hit = self.mask > 0.3
                hit[0], hit[-1], hit[:, 0], hit[:, -1] = True, True, True, True
            free = np.flatnonzero(~_blocked_flat(hit, rec.kernel))  # row-major, as np.nonzero orders them
            if not len(free):
                return None
            ty, tx = divmod(int(free[integers(0, len(free))]), w)
            py, px = rec.pivot_y[ty], rec.pivot_x[tx]  # None where the head or the pivot leaves the canvas
            if py is not None and px is not None:
                return _Track((ty, tx), ty * g.S + tx, py * g.S + px, rec, contrast)
        return None

    def many_snakes(self, count, max_trial, length) -> None:
        """snakes2 ``make_many_snakes`` with allow_incomplete: each snake is all-or-nothing."""
        p, rng, cl = self.p, self.rng, self.p.snake_contrast_list
        for _ in range(count):
            for _ in range(max_trial + 1):
                saved = self.img.copy(), self.mask.copy()
                lined = self.mask.copy()
                lined[0], lined[-1], lined[:, 0], lined[:, -1] = 1, 1, 1, 1
                s = self.seed(lined, cl[rng.integers(0, len(cl))], stop=p.stop_with_availability)
                ok = s is not None and all(self.extend(s, cl[rng.integers(0, len(cl))]) for _ in range(length - 1))
                if ok:
                    self.keep_out(s.last)
                    break
                self.img[:], self.mask[:] = saved

    def marker(self, at) -> np.ndarray:
        aa, (h, w) = self.p.antialias_scale, self.hw
        y = np.arange(h * aa)[:, None] - at[0] * aa
        x = np.arange(w * aa)[None, :] - at[1] * aa
        return _shrink((x ** 2 + y ** 2 <= (self.p.marker_radius * aa) ** 2).astype(np.float64), self.hw)

    def marker_fast(self, at) -> np.ndarray:
        """``marker`` from a window around the disc (``_marker_window``)."""
        box, window = _marker_window(self.hw, self.p.antialias_scale, self.p.marker_radius, tuple(at))
        if window is None:
            return self.marker(at)
        out = np.zeros(self.hw, np.uint8)
        out[box[0]:box[1], box[2]:box[3]] = window
        return out


def _render(p: PathfinderParams, rng, debug: bool = False, reference: bool = False) \
        -> tuple[np.ndarray, int, int, dict]:
    """One image as snakes2 draws it: (uint8 image, label, paddle margin, info). info["markers"] = the two
    marker centres [(y, x), (y, x)]; with ``debug`` also the float layers before bytescale: "targets" (each
    target snake alone), "strokes" (all snakes), "marker_layer", and "marked" (the snake of the first marker)."""
    label = int(rng.integers(0, 2))
    margin = p.paddle_margin_list[rng.integers(0, len(p.paddle_margin_list))]
    scene = _Scene(p, rng, margin)
    snakes = scene.target_pair(reference)
    many = scene.many_snakes if reference else scene.distractors
    many(p.num_distractor_snakes, p.max_distractor_contour_retrial, p.distractor_length)
    if p.use_single_paddles:
        total = int(150 * (1. / ((7.5 + 13 * margin + 4 * margin * margin) / 123.5)))
        n_single = total - 2 * p.contour_length - p.num_distractor_snakes * p.distractor_length
        many(n_single, p.max_paddle_retrial, 1)
    if not reference:
        scene.settle()  # the paddle-list code's draws are spent: the generator takes over
    o = int(rng.integers(0, 2))
    ends = [snakes[o].origin, snakes[o if label else 1 - o].tip]
    marker = scene.marker if reference else scene.marker_fast
    markers = np.maximum(marker(ends[0]), marker(ends[1])).astype(np.float64) / 255
    info = {"markers": ends}
    if debug:
        info.update(targets=[s.layer(scene.hw) for s in snakes], strokes=scene.img.copy(), marker_layer=markers,
                    marked=o)
    return _bytescale(np.maximum(scene.img, markers)), label, margin, info


def render_sample(params: PathfinderParams, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """One Pathfinder image (uint8, ``params.window_size``) and its label (1 = the markers are connected)."""
    img, label, _, _ = _render(params, rng)
    return img, label


# ---------------------------------------------------------------- dataset on disk
def batch_rng(seed: int, k: int) -> np.random.Generator:
    """Batch k's stream: child k of SeedSequence(seed), so a batch never depends on workers or order."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(k,)))


def _write_batch(job) -> int:
    folder, params, seed, k, size = job
    folder, rng = Path(folder), batch_rng(seed, k)
    (folder / "imgs" / str(k)).mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(size):
        img, label, margin, _ = _render(params, rng)
        Image.fromarray(img, "L").save(folder / "imgs" / str(k) / f"sample_{i}.png")
        lines.append(params.metadata_line(k, i, label, margin) + "\n")
    final = folder / "metadata" / f"{k}.npy"
    tmp = final.with_name(f".{k}.npy.{os.getpid()}.tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, final)  # written last: a batch with metadata is complete
    return size


def generate(out_dir, resolution: int = 32, difficulty: str = "hard", n: int = 200_000, seed: int = 0,
             workers: int | None = None, batch_size: int = 1000, params: PathfinderParams | None = None,
             progress: bool = True) -> Path:
    """Write ``out_dir/pathfinder{resolution}/{folder}/{metadata/<k>.npy, imgs/<k>/sample_<i>.png}`` and
    return that folder. Resumable: batches whose metadata exists are skipped."""
    params = params or PathfinderParams.for_lra(resolution, difficulty)
    if tuple(params.window_size) != (resolution, resolution):
        raise ValueError(f"params.window_size {params.window_size} does not match resolution {resolution}")
    folder = Path(out_dir).expanduser() / f"pathfinder{resolution}" / DIFFICULTIES[difficulty]
    (folder / "metadata").mkdir(parents=True, exist_ok=True)
    manifest = {"generator": "lra.data.pathfinder_gen", "version": GENERATOR_VERSION, "seed": seed,
                "batch_size": batch_size, "params": asdict(params)}  # a folder never mixes versions
    mpath = folder / "pathfinder_gen.json"
    if mpath.exists() and json.loads(mpath.read_text()) != json.loads(json.dumps(manifest)):
        raise ValueError(f"{folder} was generated with other settings ({mpath}); use a new --out")
    mpath.write_text(json.dumps(manifest, indent=1))
    jobs = [(str(folder), params, seed, k, size) for k in range(math.ceil(n / batch_size))
            if not _batch_done(folder, k, size := min(batch_size, n - k * batch_size))]
    workers = workers or usable_cores()
    parallel = workers > 1 and len(jobs) > 1
    if progress and jobs and not pathfinder_jit.available():
        print("pathfinder_gen: numba is not installed, so target pairs are drawn in Python: the same images, "
              "slower (pip install 'lra[pathfinder]')")
    ctx = get_context("fork" if "fork" in get_all_start_methods() else "spawn")  # workers never touch torch
    # the pool forks before tqdm starts its monitor thread
    with (ctx.Pool(min(workers, len(jobs))) if parallel else contextlib.nullcontext()) as pool, \
            tqdm(total=n, initial=n - sum(j[-1] for j in jobs), unit="img", disable=not progress) as bar:
        for size in (pool.imap_unordered(_write_batch, jobs) if parallel else map(_write_batch, jobs)):
            bar.update(size)
    return folder


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one): ``generate``'s default workers."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _batch_done(folder: Path, k: int, size: int) -> bool:
    """A batch is done when its metadata (written last) lists all its images; a short last batch of an
    earlier, smaller ``n`` is regenerated (same seed, so its first images come out the same)."""
    meta = folder / "metadata" / f"{k}.npy"
    return meta.exists() and meta.read_text().count("\n") == size


def benchmark(resolution: int = 32, n: int = 200, difficulty: str = "hard", seed: int = 0) -> float:
    """Images per second on one core (render + PNG encode), printed and returned."""
    params, rng = PathfinderParams.for_lra(resolution, difficulty), batch_rng(seed, 0)
    _render(params, rng)  # warm the patch caches
    t = time.perf_counter()
    for _ in range(n):
        Image.fromarray(render_sample(params, rng)[0], "L").save(io.BytesIO(), format="PNG")
    rate = n / (time.perf_counter() - t)
    print(f"pathfinder{resolution} {difficulty}: {rate:.1f} images/s/core ({n} images)")
    return rate


TIMING_COLUMNS = ["task", "resolution", "difficulty", "generator", "version", "images", "warmup", "runs", "s_per_image",
                  "speedup", "minutes_200k_16_cores", "seed", "cpu", "python", "numpy", "pillow", "git_sha",
                  "timestamp", "workers", "minutes_200k_wall"]


def time_parallel(resolution: int = 128, difficulty: str = "hard", images: int = 8000, workers: int | None = None,
                  seed: int = 0, batch_size: int | None = None) -> dict:
    """Wall-clock seconds of ``generate`` writing ``images`` images (PNGs and metadata, into a temporary folder
    removed after) in ``workers`` processes (default: every core this process may use), in batches of
    ``batch_size`` (default: a quarter of an even share per worker, so that no worker idles long at the end).
    Returns a TIMING_COLUMNS row (less git_sha and timestamp): ``s_per_image`` the wall time per image at that
    parallelism, ``minutes_200k_wall`` LRA's 200,000 images at the same rate, measured rather than projected from
    one core (the pool's start, the disk and the cores' shared caches and clocks are in it)."""
    workers = workers or usable_cores()
    batch_size = batch_size or max(1, images // (4 * workers))
    with tempfile.TemporaryDirectory(prefix="pathfinder-timing-") as tmp:
        start = time.perf_counter()
        generate(tmp, resolution, difficulty, images, seed, workers, batch_size, progress=False)
        wall = time.perf_counter() - start
    per = wall / images
    row = {**_timing_row(resolution, difficulty, _generator_name(), images, seed), "warmup": 0, "runs": 1,
           "s_per_image": round(per, 5), "workers": workers, "minutes_200k_wall": round(per * 200_000 / 60, 1)}
    print(f"pathfinder{resolution} {difficulty}: {images} images in {wall:.1f} s on {workers} processes; "
          f"200,000 would take {row['minutes_200k_wall']} minutes")
    return row


def _timing_row(resolution: int, difficulty: str, generator: str, images: int, seed: int) -> dict:
    """What every timing row says of what was timed and where (TIMING_COLUMNS less the measurements)."""
    return {"task": "pathx" if resolution == 128 else f"pathfinder{resolution}", "resolution": resolution,
            "difficulty": difficulty, "generator": generator, "version": GENERATOR_VERSION, "images": images,
            "seed": seed, "cpu": _cpu_name(), "python": platform.python_version(), "numpy": np.__version__,
            "pillow": Image.__version__}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


GENERATORS = ("canvas", "paddle lists", "paddle lists + numba")  # the algorithms timing rows name


def _generator_name() -> str:
    """What ``_render`` runs by default here: paddle lists, their target-pair attempts compiled where numba is."""
    return GENERATORS[2] if _COMPILED else GENERATORS[1]


def _time_one(job) -> tuple[float, str]:
    """(CPU seconds, digest of images and labels) of ``images`` renders + PNG encodes of batch 0 of ``seed`` by one
    of GENERATORS, after ``warmup`` images of batch 1: run in a process of its own, so no algorithm's caches (nor
    the objects the cycle collector scans) weigh on another's."""
    global _COMPILED
    params, generator, images, warmup, seed = job
    reference, _COMPILED = generator == GENERATORS[0], generator == GENERATORS[2]
    rng = batch_rng(seed, 1)
    for _ in range(warmup):
        _render(params, rng, reference=reference)
    rng, digest, spent = batch_rng(seed, 0), hashlib.sha256(), 0.0
    for _ in range(images):
        t = time.process_time()
        img, label, _, _ = _render(params, rng, reference=reference)
        Image.fromarray(img, "L").save(io.BytesIO(), format="PNG")
        spent += time.process_time() - t
        digest.update(img.tobytes())
        digest.update(bytes([label]))
    return spent, digest.hexdigest()


def time_generators(resolution: int = 128, difficulty: str = "hard", images: int = 40, warmup: int = 200,
                    seed: int = 0, runs: int = 1) -> list[dict]:
    """CPU seconds per image (render + PNG encode, one process on one core) of each of GENERATORS this machine can
    run (the compiled one needs numba): the canvas algorithm (``_render(..., reference=True)``, the code before
    paddle lists), paddle lists in Python, and with their target-pair attempts compiled, on the same ``images``
    images (batch 0 of ``seed``) after ``warmup`` images of batch 1 (a tenth of them, at most 100, for the canvas
    algorithm, whose caches fill sooner), each in a fresh process, the fastest of ``runs`` alternating runs (the
    least disturbed by other load); all must draw the same images. Returns a row for each (TIMING_COLUMNS less
    git_sha and timestamp, which ``python -m lra.generate pathfinder --time`` adds as it appends them; ``speedup``
    over the canvas algorithm; ``minutes_200k_16_cores`` projects LRA's 200,000 images onto 16 such cores)."""
    params = PathfinderParams.for_lra(resolution, difficulty)
    generators = GENERATORS if pathfinder_jit.available() else GENERATORS[:2]
    warm = {name: max(1, min(warmup // 10, 100)) if name == GENERATORS[0] else warmup for name in generators}
    ctx = get_context("fork" if "fork" in get_all_start_methods() else "spawn")
    spent, digests = {name: [] for name in generators}, set()
    for _ in range(runs):
        for name in generators:
            with ctx.Pool(1) as pool:
                seconds, digest = pool.apply(_time_one, ((params, name, images, warm[name], seed),))
            spent[name].append(seconds)
            digests.add(digest)
    if len(digests) != 1:
        raise RuntimeError(f"pathfinder_gen: the algorithms drew different images (seed {seed}, batch 0)")
    spent = {name: min(seconds) for name, seconds in spent.items()}
    rows = []
    for name in generators:
        per = spent[name] / images
        rows.append({**_timing_row(resolution, difficulty, name, images, seed), "warmup": warm[name], "runs": runs,
                     "s_per_image": round(per, 5), "speedup": round(spent[GENERATORS[0]] / spent[name], 2),
                     "minutes_200k_16_cores": round(per * 200_000 / 16 / 60, 1)})
        print(f"pathfinder{resolution} {difficulty} {name}: {per * 1000:.1f} ms/image/core, x{rows[-1]['speedup']}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resolution", type=int, default=32, choices=sorted(_LRA))
    parser.add_argument("--difficulty", default="hard", choices=list(DIFFICULTIES))
    parser.add_argument("--n", type=int, default=200_000, help="images (LRA: 200,000)")
    parser.add_argument("--out", default="data/lra_release", help="root; writes <out>/pathfinder<res>/<folder>")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    parser.add_argument("--batch-size", type=int, default=1000, help="images per imgs/<k> folder")
    parser.add_argument("--no-progress", action="store_true")


def run_from_args(args) -> None:
    folder = generate(args.out, args.resolution, args.difficulty, args.n, args.seed, args.workers,
                      args.batch_size, progress=not args.no_progress)
    print(f"wrote {args.n} images under {folder}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Generate LRA Pathfinder / Path-X images (snakes2).")
    add_arguments(ap)
    ap.add_argument("--benchmark", action="store_true", help="print images/s/core instead of generating")
    a = ap.parse_args()
    benchmark(a.resolution, min(a.n, 200), a.difficulty, a.seed) if a.benchmark else run_from_args(a)
