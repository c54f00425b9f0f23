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

Cost: a growth step is O(candidates * |margin disk|) with patches, placed paddles, candidate sets and their turn
weights cached (an image redraws its target pair hundreds of times over the same few); a distractor seed
attempt is one H*W dilation by the seed kernel. snakes2 redraws failed target pairs, so an image costs hundreds
of attempts (32 px hard ~300, 128 px hard ~350). A 128 px image costs many 32 px ones; both are generated far
faster than by a literal cv2 port of snakes2, thanks to the caches. Memory O(H*W) plus caches (< 100 MB).

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
import contextlib
import functools
import io
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

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


class _Scene:
    def __init__(self, p: PathfinderParams, rng, margin: int):
        self.p, self.rng, self.m = p, rng, margin
        self.hw = tuple(p.window_size)
        self.img = np.zeros(self.hw)  # float64 like snakes2's np.zeros; the pasted patches are float32
        self.buf = np.zeros((self.hw[0] + 2 * margin, self.hw[1] + 2 * margin))  # zero rim: dilation gathers
        self.mask = self.buf[margin:margin + self.hw[0], margin:margin + self.hw[1]]  # (H, W) view
        self.flat = self.buf.reshape(-1)  # ((H + 2m) * (W + 2m),) view for gathers
        self.patch = (p.paddle_length, p.paddle_thickness, margin, p.antialias_scale)  # a paddle's key, less theta

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


def _render(p: PathfinderParams, rng, debug: bool = False) -> tuple[np.ndarray, int, int, dict]:
    """One image as snakes2 draws it: (uint8 image, label, paddle margin, info). info["markers"] = the two
    marker centres [(y, x), (y, x)]; with ``debug`` also the float layers before bytescale: "targets" (each
    target snake alone), "strokes" (all snakes), "marker_layer", and "marked" (the snake of the first marker)."""
    label = int(rng.integers(0, 2))
    margin = p.paddle_margin_list[rng.integers(0, len(p.paddle_margin_list))]
    scene = _Scene(p, rng, margin)
    for _ in range(p.max_target_pair_attempts):
        snakes = scene.targets()
        if snakes is not None:
            break
        scene.clear()
    else:
        raise RuntimeError(f"no target pair fits after {p.max_target_pair_attempts} attempts: check {p}")
    scene.many_snakes(p.num_distractor_snakes, p.max_distractor_contour_retrial, p.distractor_length)
    if p.use_single_paddles:
        total = int(150 * (1. / ((7.5 + 13 * margin + 4 * margin * margin) / 123.5)))
        n_single = total - 2 * p.contour_length - p.num_distractor_snakes * p.distractor_length
        scene.many_snakes(n_single, p.max_paddle_retrial, 1)
    o = int(rng.integers(0, 2))
    ends = [snakes[o].origin, snakes[o if label else 1 - o].tip]
    markers = np.maximum(scene.marker(ends[0]), scene.marker(ends[1])).astype(np.float64) / 255
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
    workers = workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    parallel = workers > 1 and len(jobs) > 1
    ctx = get_context("fork" if "fork" in get_all_start_methods() else "spawn")  # workers never touch torch
    # the pool forks before tqdm starts its monitor thread
    with (ctx.Pool(min(workers, len(jobs))) if parallel else contextlib.nullcontext()) as pool, \
            tqdm(total=n, initial=n - sum(j[-1] for j in jobs), unit="img", disable=not progress) as bar:
        for size in (pool.imap_unordered(_write_batch, jobs) if parallel else map(_write_batch, jobs)):
            bar.update(size)
    return folder


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
