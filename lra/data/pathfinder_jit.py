"""Compiled target-pair attempts for ``pathfinder_gen``: its paddle-list inner loop under numba.

An image redraws its target pair hundreds of times (Path-X hard: ~380 attempts of ~5 growth steps for each of two
snakes), and ``_Scene._pairs`` decides each step in Python. ``attempts`` runs the same attempts compiled: the same
random words (lent by ``_words``'s tape and spent as numpy spends them: next_double, next_uint32 halves, Lemire's
bounded draw), the same tables (the geometry's caches copied into arrays, ``Mirror``), the same float64 arithmetic
in the same order (no fast-math, so every product and running sum rounds as Python's), so an attempt draws what
the Python attempt draws and ends the same way. Whatever the arrays cannot decide (a table, heading, band test or
seed angle not built yet, a pivot off the translating ones, a draw within _TIE of a boundary, a total too near
extend's threshold) hands the attempt back: the stream is rewound to the attempt's start and Python runs it,
building what was missing, which the geometry's journal lists for the mirror to copy.

Two tests decide as Python's do, from other data:
- a candidate's g: the levels of every kept paddle within reach of the pivot are read, and the band's table is
  used where they are all 0 (Python tests the occupancy bitmask first; a level is > 0 exactly where a paddle's g is);
- the acceptance test: each of Q's pixels >= _HOT (on the canvas where Q's patch is clipped) against the mask patch
  of each kept paddle near Q, where Python reads per-pair shift bitmasks built from the same float64 sums.

numba is optional (``pip install lra[pathfinder]``): without it ``available()`` is False and Python runs every
attempt, drawing the same images.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

try:
    import numba
except ImportError:  # the Python attempts run instead: same images, slower
    numba = None

OK, FAILED, PYTHON, WORDS, SPENT, UNAVAILABLE = 0, 1, 2, 3, 4, 5  # an attempt's end / why ``attempts`` returned
MISSING, NO_ROOM, UNDECIDED = -1, -2, -3  # a table slot: not built, extend gives up, too near the threshold
RESERVE = 512  # unspent words an attempt starts with (one takes ~25); running out rewinds it and asks for more
_SCALE = 1.0 / 9007199254740992.0  # 2**-53: next_double's (word >> 11) * 2**-53
_LOW32 = 0xFFFFFFFF


_failure = None  # numba's error where it could not compile the attempts: Python runs them from then on


def available() -> bool:
    return numba is not None and _failure is None


def _jit(fn):
    if numba is None:
        return fn
    try:  # compiled once, then loaded from numba's cache (beside this file, else in the user's cache folder)
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # no writable cache folder: compile in every process
        return numba.njit(nogil=True)(fn)


@_jit
def _next32(words, st):
    """next_uint32: the kept high half, else a word's low half (keeping its high half). st = [index, has, half,
    ran out]; past the words it flags st[3] and returns 0 (the attempt is then rewound)."""
    if st[1]:
        st[1] = 0
        return st[2]
    i = st[0]
    if i >= words.size:
        st[3] = 1
        return 0
    word = words[i]
    st[0] = i + 1
    st[1] = 1
    st[2] = np.int64(word >> np.uint64(32))
    return np.int64(word & np.uint64(_LOW32))


@_jit
def _integers(words, st, low, high):
    """Generator.integers(low, high) for a range below 2**32: Lemire's draw on 32-bit outputs (none for one value)."""
    n = high - low
    if n == 1:
        return low
    span = np.uint64(n)
    m = np.uint64(_next32(words, st)) * span
    if (m & np.uint64(_LOW32)) < span:
        floor = (np.uint64(0x100000000) - span) % span
        while (m & np.uint64(_LOW32)) < floor and st[3] == 0:
            m = np.uint64(_next32(words, st)) * span
    return np.int64(m >> np.uint64(32)) + low


@_jit
def _random(words, st):
    i = st[0]
    if i >= words.size:
        st[3] = 1
        return 0.5
    st[0] = i + 1
    return np.float64(words[i] >> np.uint64(11)) * _SCALE


@_jit
def _collides(qid, at, kept_at, kept_pid, nk, hot_y, hot_x, hot_v, hot_n, dense, geo):
    """Does paddle qid starting at pos ``at`` reach 1.8 with a kept paddle at some pixel (on the canvas where its
    patch is clipped)? Only pixels >= _HOT of both can: Q's listed ones against P's whole patch."""
    S, h, w, R, M, B = geo[0], geo[1], geo[2], geo[9], geo[10], geo[11]
    size = 2 * R + 1
    hy, hx = (at + B) // S - M, (at + B) % S - M
    clipped = hy < R or hy + R >= h or hx < R or hx + R >= w
    for q in range(nk - 1, -1, -1):
        py, px = (kept_at[q] + B) // S - M, (kept_at[q] + B) % S - M
        if abs(py - hy) > 2 * R or abs(px - hx) > 2 * R:
            continue
        pid = kept_pid[q]
        for i in range(hot_n[qid]):
            y, x = hy + hot_y[qid, i], hx + hot_x[qid, i]
            if clipped and (y < 0 or y >= h or x < 0 or x >= w):
                continue
            oy, ox = y - py + R, x - px + R
            if 0 <= oy < size and 0 <= ox < size and dense[pid, oy * size + ox] + hot_v[qid, i] >= 1.8:
                return True
    return False


@_jit
def _attempt(words, st, geo, tie, seeds, tails, tables, heads, paddles, free_levels, out):
    """One target-pair attempt (``_Scene._pairs``'s loop body on the quick path): OK, FAILED or PYTHON."""
    S, h, w, tries, steps, corner, rows, side, zero = (geo[0], geo[1], geo[2], geo[3], geo[4], geo[5], geo[6],
                                                      geo[7], geo[8])
    M, B, unstepped = geo[10], geo[11], geo[12]
    dead, seed_hid, seed_pid, free_n, free_at, free_y, free_x, piv_y, piv_x = seeds
    tail_r, tail_c = tails
    pivot_cls, qcls, band, tab, terms_at, cmf_pool, term_pool = tables
    hd_dpos, hd_ds, hd_dc, hd_n, hd_flat, hd_off, hd_qid, hd_nxt = heads
    reach, dense, hot_y, hot_x, hot_v, hot_n = paddles
    kept_at, kept_pid, tr_at, tr_pid, tr_len, tr_pos, tr_hid, tr_origin, counts, cmf_buf, levels = out
    hs = h * S
    deg = _integers(words, st, 0, 360)
    known = dead[deg]
    if known < 0:
        return PYTHON
    if known == 1:
        return FAILED
    deg -= 180
    for t in range(2):  # _seed_track: the first from free pixels (its first angle drawn above), the second off it
        placed = False
        for it in range(tries):
            if t == 1 or it > 0:
                deg = _integers(words, st, -180, 180)
            a = deg + 180
            if seed_hid[a] < 0:  # the seed angle is not built yet
                return PYTHON
            if t == 0:
                n = free_n[a]
                if n < 0:
                    return FAILED
                k = _integers(words, st, 0, n)
                ty, tx = free_y[free_at[a] + k], free_x[free_at[a] + k]
            else:
                j = _integers(words, st, 0, 360)
                ty, tx = tail_r[j, tr_origin[0, 0]], tail_c[j, tr_origin[0, 1]]
                if ty < 0 or ty >= h or tx < 0 or tx >= w:
                    return PYTHON
            py, px = piv_y[a, ty], piv_x[a, tx]
            if py >= 0 and px >= 0:
                tr_origin[t, 0], tr_origin[t, 1] = ty, tx
                tr_at[t, 0], tr_pid[t, 0], tr_len[t] = ty * S + tx, seed_pid[a], 1
                tr_pos[t], tr_hid[t] = py * S + px, seed_hid[a]
                placed = True
                break
        if not placed:
            return FAILED
    nk = 0
    for _ in range(steps):
        for t in range(2):
            hd = tr_hid[t]
            if hd_dpos[hd] == unstepped:  # _PairGeometry.next_pivot
                y, x = (tr_pos[t] + B) // S - M, (tr_pos[t] + B) % S - M
                pos = np.int64(math.ceil(y + hd_ds[hd])) * S + np.int64(math.ceil(x + hd_dc[hd]))
            else:
                pos = tr_pos[t] + hd_dpos[hd]
            if pos < 0 or pos >= hs or pivot_cls[pos] < 0:
                return PYTHON
            cls = pivot_cls[pos]
            slot = tab[hd, cls]
            if slot == MISSING:
                return PYTHON
            n = hd_n[hd]
            near = False
            for j in range(n):
                levels[j] = 0
            for q in range(nk):  # _near_cmf's levels: each kept paddle within reach of the pivot
                d = kept_at[q] - pos + corner
                if 0 <= d < rows and d % S <= side:
                    pid, at0 = kept_pid[q], zero - d
                    for j in range(n):
                        v = reach[pid, at0 + hd_flat[hd, j]]
                        if v > levels[j]:
                            levels[j] = v
                            near = True
            if near:  # _cumulative of the terms (1 - level's value) * table term
                first, acc = terms_at[hd, cls], 0.0
                for j in range(n):
                    acc += free_levels[levels[j]] * term_pool[first + j]
                    cmf_buf[j + 1] = acc
                if acc < 0.5e-4:
                    return FAILED
                if acc < 2e-4:
                    return PYTHON
                scale = 1.0 / acc
                for j in range(n):
                    cmf_buf[j + 1] *= scale
                cmf_buf[0], cmf_buf[n + 1] = -np.inf, -np.inf
                cmf, base = cmf_buf, 0
            elif slot == NO_ROOM:
                return FAILED
            elif slot == UNDECIDED:
                return PYTHON
            else:
                cmf, base = cmf_pool, slot
            end, grown = n + 1, False
            for _r in range(tries):
                u = _random(words, st)
                k = 1  # bisect_right(cmf, u, 1, end) on a non-decreasing table
                while k < end and cmf[base + k] <= u:
                    k += 1
                if not (cmf[base + k] > u + tie and cmf[base + k - 1] < u - tie):
                    return PYTHON
                at, qid = hd_off[hd, k] + pos, hd_qid[hd, k]
                if at < 0 or at >= hs:
                    return PYTHON
                qc = qcls[at]
                if qc > 0:
                    hit = band[qc, qid]
                    if hit < 0:
                        return PYTHON
                    if hit == 1:
                        continue
                if _collides(qid, at, kept_at, kept_pid, nk, hot_y, hot_x, hot_v, hot_n, dense, geo):
                    continue
                last = tr_len[t] - 1  # the previous paddle's mask joins one step late
                kept_at[nk], kept_pid[nk] = tr_at[t, last], tr_pid[t, last]
                nk += 1
                tr_at[t, last + 1], tr_pid[t, last + 1], tr_len[t] = at, qid, last + 2
                tr_pos[t] = pos
                if hd_nxt[hd, k] < 0:
                    return PYTHON
                tr_hid[t] = hd_nxt[hd, k]
                grown = True
                break
            if not grown:
                return FAILED
    counts[0] = nk
    return OK


@_jit
def _attempts(left, words, st, geo, tie, seeds, tails, tables, heads, paddles, free_levels, out):
    """Attempts until one fits (OK), ``left`` are spent (SPENT), one needs Python (PYTHON) or more words (WORDS);
    returns (why, attempts spent). After PYTHON / WORDS the stream st is at that attempt's start."""
    spent = 0
    while spent < left:
        i, has, half = st[0], st[1], st[2]
        if words.size - i < RESERVE:
            return WORDS, spent
        st[3] = 0
        end = _attempt(words, st, geo, tie, seeds, tails, tables, heads, paddles, free_levels, out)
        if st[3] or end == PYTHON:
            st[0], st[1], st[2] = i, has, half
            return (WORDS if st[3] else PYTHON), spent
        spent += 1
        if end == OK:
            return OK, spent
    return SPENT, spent


def _grown(a: np.ndarray, rows: int, fill=0) -> np.ndarray:
    """``a`` with at least ``rows`` rows (doubling its length), the new ones ``fill``."""
    if rows <= len(a):
        return a
    out = np.full((max(rows, 2 * len(a)), *a.shape[1:]), fill, a.dtype)
    out[:len(a)] = a
    return out


class Mirror:
    """A geometry's caches as arrays for ``_attempts``, kept up to date with ``sync`` (new paddle angles and headings
    by count, the rest from the geometry's journal). ``patch(pid)`` is paddle pid's float32 mask patch."""

    def __init__(self, g, patch, unstepped: int, no_room):
        self.g, self.patch, self.no_room = g, patch, no_room
        h, w, S, R, K = g.h, g.w, g.S, g.R, g.K
        self.geo = np.array([S, h, w, g.tries, g.p.contour_length - 1, g.near_corner, g.near_rows, g.near_side,
                             g.reach_zero, R, g.M, g.B, unstepped], np.int64)
        self.keys = {key: c for c, key in enumerate(sorted(set(g.pivots.values())))}  # a pivot's edge class
        self.pivot_cls = np.full(h * S, -1, np.int32)
        for pos, key in g.pivots.items():
            self.pivot_cls[pos] = self.keys[key]
        self.qkeys = {0: 0}  # a paddle start's band class (0: the band is out of its reach)
        for key in g.qkey:
            self.qkeys.setdefault(key, len(self.qkeys))
        self.qcls = np.array([self.qkeys[key] for key in g.qkey], np.int32)
        self.band = np.full((len(self.qkeys), 64), -1, np.int8)
        self.dead = np.full(360, -1, np.int8)
        self.seed_hid, self.seed_pid = np.full(360, -1, np.int64), np.full(360, -1, np.int64)  # -1: not built
        self.free_n, self.free_at = np.full(360, -1, np.int64), np.zeros(360, np.int64)
        self.free_y, self.free_x, self.free_used = np.zeros(0, np.int64), np.zeros(0, np.int64), 0
        self.piv_y, self.piv_x = np.full((360, h), -1, np.int64), np.full((360, w), -1, np.int64)
        self.tails = (np.array([rows for rows, _ in g.tail2], np.int64), np.array([cols for _, cols in g.tail2],
                                                                                   np.int64))
        nh, npid, size = 64, 64, (2 * R + 1) ** 2
        self.hd_dpos, self.hd_n = np.zeros(nh, np.int64), np.zeros(nh, np.int64)
        self.hd_ds, self.hd_dc = np.zeros(nh), np.zeros(nh)
        self.hd_flat, self.hd_off = np.zeros((nh, K), np.int64), np.zeros((nh, K + 1), np.int64)
        self.hd_qid, self.hd_nxt = np.zeros((nh, K + 1), np.int64), np.full((nh, K + 1), -1, np.int64)
        self.tab, self.terms_at = np.full((nh, len(self.keys)), MISSING, np.int64), np.zeros((nh, len(self.keys)),
                                                                                             np.int64)
        self.cmf_pool, self.term_pool, self.cmf_used, self.term_used = np.zeros(1024), np.zeros(1024), 0, 0
        self.reach = np.zeros((npid, (2 * g.H + 1) * S), np.uint8)  # _PairGeometry.reach's padded levels
        self.dense, self.hot_v = np.zeros((npid, size)), np.zeros((npid, size))
        self.hot_y, self.hot_x, self.hot_n = (np.zeros((npid, size), np.int64), np.zeros((npid, size), np.int64),
                                              np.zeros(npid, np.int64))
        self.free_levels = np.array(g.free_levels)
        cl = g.p.contour_length
        self.out = (np.zeros(2 * cl, np.int64), np.zeros(2 * cl, np.int64), np.zeros((2, cl), np.int64),
                    np.zeros((2, cl), np.int64), np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(2, np.int64),
                    np.zeros((2, 2), np.int64), np.zeros(1, np.int64), np.zeros(K + 2), np.zeros(K, np.int64))
        self.st = np.zeros(4, np.int64)
        self.npid = self.nh = self.read = 0
        self.sync()

    # ---- copying the geometry's caches
    def sync(self) -> None:
        g = self.g
        if len(g.thetas) > self.npid:
            self._paddles(len(g.thetas))
        if len(g.heading_list) > self.nh:
            self._headings(len(g.heading_list))
        journal = g.journal
        while self.read < len(journal):
            event = journal[self.read]
            self.read += 1
            kind = event[0]
            if kind == "nxt":
                self.hd_nxt[event[1], event[2]] = g.heading_list[event[1]].nxt[event[2]].id
            elif kind == "table":
                self._table(g.heading_list[event[1]], event[2])
            elif kind == "band":
                key = event[1]
                self.band[self.qkeys[key & ~0xFFFFFF], key & 0xFFFFFF] = g.band_hits[key]
            elif kind == "seed":
                self._seed(event[1])
            else:
                self.dead[event[1] + 180] = g.dead[event[1] + 180]

    def _paddles(self, count: int) -> None:
        g = self.g
        for name in ("reach", "dense", "hot_v", "hot_y", "hot_x", "hot_n"):
            setattr(self, name, _grown(getattr(self, name), count))
        self.band = _grown(self.band.T, count, -1).T.copy()  # per band class, per pid
        for pid in range(self.npid, count):
            self.reach[pid] = np.frombuffer(g.reach[pid], np.uint8)
            self.dense[pid] = self.patch(pid).astype(np.float64).reshape(-1)
            ys, xs, vals = g.hot[pid]
            self.hot_n[pid] = len(ys)
            self.hot_y[pid, :len(ys)], self.hot_x[pid, :len(ys)], self.hot_v[pid, :len(ys)] = ys, xs, vals
        self.npid = count

    def _headings(self, count: int) -> None:
        for name in ("hd_dpos", "hd_n", "hd_ds", "hd_dc", "hd_flat", "hd_off", "hd_qid", "terms_at"):
            setattr(self, name, _grown(getattr(self, name), count))
        self.hd_nxt, self.tab = _grown(self.hd_nxt, count, -1), _grown(self.tab, count, MISSING)
        for hid in range(self.nh, count):
            hd = self.g.heading_list[hid]
            n = len(hd.flat)
            self.hd_dpos[hid], self.hd_ds[hid], self.hd_dc[hid], self.hd_n[hid] = hd.dpos, hd.ds, hd.dc, n
            self.hd_flat[hid, :n] = hd.flat
            self.hd_off[hid, :n + 1] = [off for off, _ in hd.cands]
            self.hd_qid[hid, :n + 1] = [qid for _, qid in hd.cands]
            for k, nxt in enumerate(hd.nxt):
                if nxt is not None:
                    self.hd_nxt[hid, k] = nxt.id
            for key in hd.tables:
                self._table(hd, key)
        self.nh = count

    def _table(self, hd, key: int) -> None:
        cls = self.keys.get(key)
        if cls is None or self.tab[hd.id, cls] != MISSING:  # a key of no translating pivot / copied already
            return
        terms, table = hd.terms[key], hd.tables[key]
        self.term_pool, self.terms_at[hd.id, cls] = self._put(self.term_pool, self.term_used, terms)
        self.term_used += len(terms)
        if table is None:
            self.tab[hd.id, cls] = UNDECIDED
        elif table is self.no_room:
            self.tab[hd.id, cls] = NO_ROOM
        else:
            self.cmf_pool, self.tab[hd.id, cls] = self._put(self.cmf_pool, self.cmf_used, table)
            self.cmf_used += len(table)

    @staticmethod
    def _put(pool: np.ndarray, used: int, values) -> tuple[np.ndarray, int]:
        pool = _grown(pool, used + len(values))
        pool[used:used + len(values)] = values
        return pool, used

    def _seed(self, deg: int) -> None:
        rec, a = self.g.seeds[deg + 180], deg + 180
        self.seed_hid[a], self.seed_pid[a] = rec.hd.id, rec.pid
        if rec.free is not None:
            ys, xs = rec.free
            self.free_y, _ = self._put(self.free_y, self.free_used, ys)
            self.free_x, _ = self._put(self.free_x, self.free_used, xs)
            self.free_n[a], self.free_at[a] = len(ys), self.free_used
            self.free_used += len(ys)
        self.piv_y[a] = [-1 if c is None else c for c in rec.pivot_y]
        self.piv_x[a] = [-1 if c is None else c for c in rec.pivot_x]

    # ---- running attempts
    def attempts(self, left: int, tape, tie: float) -> tuple[int, int]:
        """Run up to ``left`` attempts on the tape's words, handing back draws within ``tie`` of a table's
        boundary: (why it stopped: OK, SPENT, PYTHON, or UNAVAILABLE where numba cannot compile them; attempts
        spent); the tape is left where the last attempt run here left it (at the start of one that needs Python)."""
        global _failure
        if not available():
            return UNAVAILABLE, 0
        self.sync()
        total, need, st = 0, RESERVE, self.st
        while True:
            words, index, has, half = tape.lend(need)
            st[0], st[1], st[2], st[3] = index, has, half, 0
            try:
                why, spent = _attempts(left - total, words, st, self.geo, tie, self._seeds(), self.tails,
                                       self._tables(), self._heads(), self._paddle_arrays(), self.free_levels,
                                       self.out)
            except numba.core.errors.NumbaError as error:  # compiling failed before any draw: the tape is as lent
                _failure = error
                warnings.warn(f"pathfinder_jit: numba {numba.__version__} cannot compile the target-pair attempts "
                              f"({type(error).__name__}); Python draws them (the same images, slower)", stacklevel=2)
                return UNAVAILABLE, total
            tape.spent(int(st[0]), int(st[1]), int(st[2]))
            total += spent
            if why != WORDS:
                return why, total
            need = 2 * max(need, len(words) - int(st[0]))  # an attempt ran out of words: lend it more

    def _seeds(self):
        return (self.dead, self.seed_hid, self.seed_pid, self.free_n, self.free_at, self.free_y, self.free_x,
                self.piv_y, self.piv_x)

    def _tables(self):
        return self.pivot_cls, self.qcls, self.band, self.tab, self.terms_at, self.cmf_pool, self.term_pool

    def _heads(self):
        return (self.hd_dpos, self.hd_ds, self.hd_dc, self.hd_n, self.hd_flat, self.hd_off, self.hd_qid,
                self.hd_nxt)

    def _paddle_arrays(self):
        return self.reach, self.dense, self.hot_y, self.hot_x, self.hot_v, self.hot_n

    def pair(self) -> tuple[list, list]:
        """The fitted pair of the last OK: (kept paddles in order, per track (origin, paddles, pos, heading id))."""
        kept_at, kept_pid, tr_at, tr_pid, tr_len, tr_pos, tr_hid, tr_origin, counts = self.out[:9]
        nk = int(counts[0])
        kept = list(zip(kept_at[:nk].tolist(), kept_pid[:nk].tolist()))
        tracks = []
        for t in range(2):
            n = int(tr_len[t])
            tracks.append(((int(tr_origin[t, 0]), int(tr_origin[t, 1])),
                           list(zip(tr_at[t, :n].tolist(), tr_pid[t, :n].tolist())), int(tr_pos[t]),
                           int(tr_hid[t])))
        return kept, tracks
