"""Image Transformer local 2-D attention: each block of pixels attends to its neighbourhood on the image grid.

Parmar, Vaswani, Uszkoreit, Kaiser, Shazeer, Ku, Tran, 2018, "Image Transformer" (https://arxiv.org/abs/1802.05751),
Section 3.2, "Local Self-Attention", 2-D case. The grid is cut into non-overlapping rectangular *query blocks*
of ``query_height`` x ``query_width`` pixels; each query block attends to its *memory block*: the query block
extended by ``memory_flange`` pixels on every side, so that every pixel sees the pixels around it, whichever
side of its block they lie on (``1d`` local attention over the row-major sequence, the ``local`` model, sees only
the pixels before and after it in raster order: a pixel's neighbours one row up or down are ``width`` positions
away and usually fall in another block). Inside a block the attention is exact softmax.

Mechanism (``models/_grid.py`` does the call): the key grid is padded by the flange on every side, the memory
blocks are cut out of it with ``Tensor.unfold`` (overlapping windows of (qh + 2f) x (qw + 2f) at stride
(qh, qw)), and all blocks go through one ``F.scaled_dot_product_attention`` call as a batch. The flange padding
and the padding of a grid not divisible by the block are masked, like any padded pixel.

The CLS slot (``Grid.prefix``) is global: it attends to every pixel (and itself), and every pixel attends to it
in the same softmax as its memory block. With mean pooling (no prefix) the model is purely local and information
travels ``memory_flange`` pixels (plus the block) per layer.

Complexity: O(N * M * d) time and O(N * M) memory for the scores per head, M = (qh + 2f)(qw + 2f) + prefix the
keys of a query (257 with the defaults and a CLS slot, against 1025 for full attention at 32 x 32 and 16385 at
Path-X's 128 x 128). The gathered keys and values take M / (qh * qw) (here 4) times the memory of k and v. The
prefix queries add O(prefix * N).

Defaults: 8 x 8 query blocks with a flange of 4, i.e. 16 x 16 memory blocks. Square, because classification is
bidirectional and images (Pathfinder's curved paths especially) have no preferred direction, unlike the paper's
raster-order decoder; 256 keys, because at 32 x 32 larger memory blocks cover most of the image (tensor2tensor's
hparams for the paper, ``image_transformer_2d.py``: 16 x 16 query blocks with flange (16, 32) by default, 8 x 16
with (0, 32) for its big CIFAR-10 model, 8 x 64 with (4, 32) at 64 x 64: at 32 x 32 the first two reach the
whole width), while at 128 x 128 it is 64x fewer keys per query than full attention.
Information crosses the flange (4 pixels) past a block's edge in the first layer and a whole block more (8) in
each further one, so through Pathfinder's 4 layers (mean pooling: no CLS) it travels 4 + 3 * 8 = 28 >= 32 - 8
pixels past a block in every direction: every pixel hears from the whole 32 x 32 image. The sizes are multiples
of 8 (64 queries, 256 keys), which the fused kernels tile without waste.

Padding: masked pixels (LRA's ``pixel_zero_is_pad`` holes) are masked keys in every memory block, so they never
contribute; the output at a masked pixel is computed anyway (and ignored by the encoder), 0 where its whole memory
block and the prefix are masked.

Two executions (``backend``, an attribute: how it runs, never what it computes):
* **dense** (the reference, and ``auto``): the gather + SDPA call above. The gathered keys and values are what
  holds its memory above exact attention's. ``auto``: in the compiled layer flex is faster at 1K but slower at 4K
  and 16K (results/layer_bench.csv, rows ``lra image_local`` and ``lra image_local(backend=flex)``), and LRA's
  pixel protocols train with attention dropout, which this flex path does not apply.
* **flex** (``backend = "flex"``; CUDA only in training, where torch has its backward; no attention dropout, no
  key mask, as in the bench and the pixel tasks' evaluation): FlexAttention over the row-major sequence itself, with a
  ``mask_mod`` that allows a pair when the key lies in the query's memory block (or either is a prefix token).
  Nothing is gathered: O(N) memory beside q, k, v. It computes whole 128 x 128 tiles wherever a tile holds an
  allowed pair: a 128-pixel run of a row meets (qh + 2f) rows of keys, so at width W each query computes about
  128 (qh + 2f) max(1, W / 128) / max(1, 128 / W) keys instead of its (qh + 2f)(qw + 2f) (about 1,100 at 64 x 64
  and 2,050 at 128 x 128 for 256), still a fixed number per query. The tiles depend on the grid alone: made once
  per (length, grid, device) and kept. FlexAttention has no dropout of its own and this path does not add
  ``_flex_dropout``'s (hence dense in training under LRA's attention dropout); forcing ``flex`` with dropout active
  or a key mask is an error.

Deviations from the paper: the memory block extends the query block on all four sides (the paper's decoder
extends it up, left and right only, to stay causal; we classify). One flange for all sides, where
tensor2tensor's ``memory_flange`` is (height, width); the query block's height and width are separate options.
Attention dropout is applied, as in the transformer baseline (on the dense path). ``gpu`` tests check the dense
path on CUDA against the CPU result and the flex path against the dense one, forward and backward.

Eager speed: the dense path's attention is one SDPA call, the same kernel eager or compiled; the difference is the
data movement around it. Eagerly the query blocks are a copy, and the key and the value memory blocks each a
zero-padded copy of the grid plus the copy that cuts the overlapping windows out of it ((qh + 2f)(qw + 2f) / (qh qw)
times k's size), whose backward folds the windows back in two ``unfold_backward`` passes and copies the padding's
inside out; Inductor makes each of these one gather from the projections (the padding a predicate, not a tensor)
and one accumulation back. FlexAttention runs only with ``backend = "flex"``, and eagerly only off CUDA, where
torch's unfused form builds every (query, key) score: a path for tests. Expect the eager layer to be slower than
compiled and to hold more memory, with the same outputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._grid import check_grid, grid_attend
from .base import MultiHeadMixer, chosen_backend
from .patterns import FLEX_BLOCK, block_mask_of, flex_attend, flex_call, kept_tile_lists
from .registry import Grid, Taxonomy, register_model

BACKENDS = ("auto", "dense", "flex")


def memory_rule(P: int, width: int, qh: int, qw: int, f: int):
    """The pattern as a function of sequence indices (prefix P, then the grid row-major): key j is in query i's
    memory block (i's query block grown by f on every side), or either is a prefix token."""
    def allowed(q_idx, kv_idx):
        p, c = q_idx - P, kv_idx - P  # pixel indices (negative for the prefix)
        top, left = p // width // qh * qh, p % width // qw * qw  # the query block's first row and column
        row, col = c // width, c % width
        local = (row >= top - f) & (row < top + qh + f) & (col >= left - f) & (col < left + qw + f)
        return local | (q_idx < P) | (kv_idx < P)
    return allowed


def memory_tiles(rule, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, 1, nt, nt) partial and full 128 x 128 tiles of ``rule`` over a length-``n`` sequence: one (n, n)
    evaluation, made once per length and grid (positions past n are absent: they make no tile partial)."""
    nt = -(-n // FLEX_BLOCK)
    idx = torch.arange(nt * FLEX_BLOCK, device=device)  # (Np,)
    inside = idx < n  # (Np,)
    pairs = rule(idx[:, None], idx[None, :])  # (Np, Np)
    some = (pairs & inside[:, None] & inside[None, :]).view(nt, FLEX_BLOCK, nt, FLEX_BLOCK).any(3).any(1)
    every = (pairs | ~inside[:, None] | ~inside[None, :]).view(nt, FLEX_BLOCK, nt, FLEX_BLOCK).all(3).all(1)
    full = some & every  # (nt, nt): computed without the mask_mod
    return (some & ~full)[None, None], full[None, None]


def pad_grid(t: torch.Tensor, top: int, bottom: int, left: int, right: int) -> torch.Tensor:
    """(B, Hg, Wg, *C) -> (B, top + Hg + bottom, left + Wg + right, *C), zeros around; t itself when nothing is
    added. ``F.pad`` rather than zeros and a slice assignment: its backward is one copy of the gradient's slice,
    the assignment's two."""
    if not (top or bottom or left or right):
        return t
    return F.pad(t, (0, 0) * (t.dim() - 3) + (left, right, top, bottom))


def _flex_attend(mixer: ImageLocal, qkv: torch.Tensor, grid: Grid) -> torch.Tensor:
    """qkv (B, N, 3, H, Dh) -> (B, N, H, Dh) through FlexAttention with the memory-block BlockMask."""
    N = qkv.shape[1]
    rule = memory_rule(grid.prefix, grid.width, mixer.query_height, mixer.query_width, mixer.memory_flange)
    key = (N, grid.height, grid.width, grid.prefix, qkv.device)
    lists = kept_tile_lists(mixer.kept_tiles, key, lambda: memory_tiles(rule, N, qkv.device))
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, N, Dh)
    o = flex_attend(q, k, v, block_mask_of(lists, N, lambda b, h, q_idx, kv_idx: rule(q_idx, kv_idx)))
    return o.transpose(1, 2)  # (B, N, H, Dh)


@register_model
class ImageLocal(MultiHeadMixer):
    taxonomy = Taxonomy("Parmar et al. 2018 (2-D local attention), arXiv 1802.05751", "N", ("FP",), decode=True)
    backends = BACKENDS  # the values of ``backend`` (how it runs, not what it computes)
    needs_grid = True
    accepts_no_mask = True  # mask=None: only the internal padding (flange, ragged edge) is masked

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *,
                 query_height: int = 8, query_width: int = 8, memory_flange: int = 4):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if query_height < 1 or query_width < 1 or memory_flange < 0:
            raise ValueError(f"query block {query_height}x{query_width} must be at least 1x1 and memory_flange="
                             f"{memory_flange} at least 0")
        self.query_height, self.query_width, self.memory_flange = query_height, query_width, memory_flange
        self.backend = "auto"  # "flex" | "dense" (auto = dense: the module docstring says why)
        self.kept_tiles: dict = {}  # the flex path's tile lists by (length, grid, device)

    def flex_runs(self, key_mask: bool) -> bool:
        """Whether FlexAttention runs (``backend``): only when asked for (``auto`` = dense, module docstring)."""
        if chosen_backend(self) == "flex" and (self.dropout_p > 0 or key_mask):
            raise ValueError(f"image_local: backend='flex' takes no attention dropout (dropout_p={self.dropout_p}) "
                             f"and no key mask (given: {key_mask}); use 'auto' or 'dense'")
        return self.backend == "flex"

    def block_counts(self, grid: Grid) -> tuple[int, int]:
        """Query blocks down and across the grid, the last ones reaching past its edge when it is not divisible."""
        return -(-grid.height // self.query_height), -(-grid.width // self.query_width)

    def query_blocks(self, t: torch.Tensor, grid: Grid) -> torch.Tensor:
        """(B, Hg, Wg, *C) pixels -> (B, nh * nw, qh * qw, *C): the query blocks, row-major, each row-major."""
        (nh, nw), qh, qw = self.block_counts(grid), self.query_height, self.query_width
        B, Hg, Wg, *C = t.shape
        padded = pad_grid(t, 0, nh * qh - Hg, 0, nw * qw - Wg)  # (B, Hp, Wp, *C): the ragged edge is padding
        blocks = padded.view(B, nh, qh, nw, qw, *C).transpose(2, 3)  # (B, nh, nw, qh, qw, *C)
        return blocks.reshape(B, nh * nw, qh * qw, *C)

    def memory_blocks(self, t: torch.Tensor, grid: Grid) -> torch.Tensor:
        """(B, Hg, Wg, *C) pixels -> (B, nh * nw, mh * mw, *C): each query block's memory block, the query block
        grown by the flange f on every side (mh = qh + 2f, mw = qw + 2f); outside the grid it holds zeros."""
        (nh, nw), qh, qw, f = self.block_counts(grid), self.query_height, self.query_width, self.memory_flange
        B, Hg, Wg, *C = t.shape
        padded = pad_grid(t, f, nh * qh - Hg + f, f, nw * qw - Wg + f)  # (B, Hp + 2f, Wp + 2f, *C)
        windows = padded.unfold(1, qh + 2 * f, qh).unfold(2, qw + 2 * f, qw)  # (B, nh, nw, *C, mh, mw): a view
        windows = windows.movedim((-2, -1), (3, 4))  # (B, nh, nw, mh, mw, *C)
        return windows.reshape(B, nh * nw, (qh + 2 * f) * (qw + 2 * f), *C)  # the copy that overlaps the windows

    def ungroup(self, o: torch.Tensor, grid: Grid) -> torch.Tensor:
        """The inverse of ``query_blocks``: (B, nh * nw, qh * qw, *C) -> (B, Hg, Wg, *C)."""
        (nh, nw), qh, qw = self.block_counts(grid), self.query_height, self.query_width
        B, _, _, *C = o.shape
        o = o.view(B, nh, nw, qh, qw, *C).transpose(2, 3)  # (B, nh, qh, nw, qw, *C)
        return o.reshape(B, nh * qh, nw * qw, *C)[:, :grid.height, :grid.width]  # (B, Hg, Wg, *C)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, grid: Grid | None = None) -> torch.Tensor:
        B, N, _ = x.shape
        check_grid(self, N, grid)
        qkv = self.qkv(x).view(B, N, 3, self.n_heads, self.d_head)  # (B, N, 3, H, Dh)
        if self.flex_runs(key_mask=mask is not None):  # a key mask: there may be padding
            return self.out(flex_call(_flex_attend, x.is_cuda, self, qkv, grid).reshape(B, N, -1))  # (B, N, D)
        # Padding is internal whenever the flange reaches past the grid or the blocks do not divide it.
        pads = (self.memory_flange > 0 or grid.height % self.query_height > 0
                or grid.width % self.query_width > 0)
        o = grid_attend(qkv, mask, grid, queries=lambda t: self.query_blocks(t, grid),
                        keys=lambda t: self.memory_blocks(t, grid), ungroup=lambda t: self.ungroup(t, grid),
                        dropout_p=self.dropout_p, pads=pads)  # (B, N, H, Dh)
        return self.out(o.reshape(B, N, -1))  # (B, N, D)
