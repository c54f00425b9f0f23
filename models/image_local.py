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

Deviations from the paper: the memory block extends the query block on all four sides (the paper's decoder
extends it up, left and right only, to stay causal; we classify). One flange for all sides, where
tensor2tensor's ``memory_flange`` is (height, width); the query block's height and width are separate options.
Attention dropout is applied, as in the transformer baseline. No CUDA-specific kernel: the gather + SDPA path
above runs the same on CUDA (fused SDPA kernels on the batch of blocks), and a ``gpu`` test checks it against
the CPU result.
"""
from __future__ import annotations

import torch

from ._grid import check_grid, grid_attend
from .base import MultiHeadMixer
from .registry import Grid, Taxonomy, register_model


@register_model
class ImageLocal(MultiHeadMixer):
    taxonomy = Taxonomy("Parmar et al. 2018 (2-D local attention), arXiv 1802.05751", "N", ("FP",), decode=True)
    needs_grid = True
    accepts_no_mask = True  # mask=None: only the internal padding (flange, ragged edge) is masked

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *,
                 query_height: int = 8, query_width: int = 8, memory_flange: int = 4):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if query_height < 1 or query_width < 1 or memory_flange < 0:
            raise ValueError(f"query block {query_height}x{query_width} must be at least 1x1 and memory_flange="
                             f"{memory_flange} at least 0")
        self.query_height, self.query_width, self.memory_flange = query_height, query_width, memory_flange

    def block_counts(self, grid: Grid) -> tuple[int, int]:
        """Query blocks down and across the grid, the last ones reaching past its edge when it is not divisible."""
        return -(-grid.height // self.query_height), -(-grid.width // self.query_width)

    def query_blocks(self, t: torch.Tensor, grid: Grid) -> torch.Tensor:
        """(B, Hg, Wg, *C) pixels -> (B, nh * nw, qh * qw, *C): the query blocks, row-major, each row-major."""
        (nh, nw), qh, qw = self.block_counts(grid), self.query_height, self.query_width
        B, Hg, Wg, *C = t.shape
        padded = t.new_zeros(B, nh * qh, nw * qw, *C)  # (B, Hp, Wp, *C): the ragged edge is padding
        padded[:, :Hg, :Wg] = t
        blocks = padded.view(B, nh, qh, nw, qw, *C).transpose(2, 3)  # (B, nh, nw, qh, qw, *C)
        return blocks.reshape(B, nh * nw, qh * qw, *C)

    def memory_blocks(self, t: torch.Tensor, grid: Grid) -> torch.Tensor:
        """(B, Hg, Wg, *C) pixels -> (B, nh * nw, mh * mw, *C): each query block's memory block, the query block
        grown by the flange f on every side (mh = qh + 2f, mw = qw + 2f); outside the grid it holds zeros."""
        (nh, nw), qh, qw, f = self.block_counts(grid), self.query_height, self.query_width, self.memory_flange
        B, Hg, Wg, *C = t.shape
        padded = t.new_zeros(B, nh * qh + 2 * f, nw * qw + 2 * f, *C)  # (B, Hp + 2f, Wp + 2f, *C)
        padded[:, f:f + Hg, f:f + Wg] = t
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
        # Padding is internal whenever the flange reaches past the grid or the blocks do not divide it.
        pads = (self.memory_flange > 0 or grid.height % self.query_height > 0
                or grid.width % self.query_width > 0)
        o = grid_attend(qkv, mask, grid, queries=lambda t: self.query_blocks(t, grid),
                        keys=lambda t: self.memory_blocks(t, grid), ungroup=lambda t: self.ungroup(t, grid),
                        dropout_p=self.dropout_p, pads=pads)  # (B, N, H, Dh)
        return self.out(o.reshape(B, N, -1))  # (B, N, D)
