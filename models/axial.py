"""Axial attention: softmax attention along the rows of the pixel grid, then along its columns.

Ho, Kalchbrenner, Weissenborn, Salimans, 2019, "Axial Attention in Multidimensional Transformers"
(https://arxiv.org/abs/1912.12180). An axial attention layer attends along one axis of the image only: a pixel
sees the pixels of its own row (or column), so an H x W image costs H W (W + H) scores instead of (H W)^2.
Stacking a row layer and a column layer reaches every pixel: (r', c') reaches (r', c) along the row, which
reaches (r, c) along the column.

Composition: sequential, inside one mixer. ``rows`` (an ``AxialStep``) attends along the rows, and ``columns``,
with projections of its own, attends along the columns of the rows' output: ``columns(rows(x))``. Sequential
rather than heads split between the axes, because then every pixel hears from the whole image in every layer,
as two stacked axial layers of the paper do; split heads would give each pixel only its row and column (a
cross) per layer, and a full receptive field only after two. It is also the paper's layer, repeated, and
Axial-DeepLab's axial block (Wang et al. 2020, https://arxiv.org/abs/2003.07853: height-axis then width-axis
attention with no residual between them). The price: twice the transformer's attention parameters (two sets of
q, k, v and output projections) and two attention passes.

The CLS slot (``Grid.prefix``) is global in each step: it attends to every token, and every pixel attends to
it in the same softmax as its row (column). So the CLS gathers from all pixels twice per layer, and the column
step carries what the row step's CLS gathered to every pixel.

Complexity: O(N (H + W) d) time = O(N sqrt(N) d) on a square grid, and O(N (H + W)) memory for the scores
(the fused SDPA kernels hold less); the prefix queries add O(prefix * N). Each step is one
``F.scaled_dot_product_attention`` call over a batch of B * H rows (B * W columns), see ``models/_grid.py``.

Padding: masked pixels (LRA's ``pixel_zero_is_pad`` holes) are masked keys in both steps. The row step computes
an output at a masked pixel too (0 when its whole row and the prefix are masked); the column step masks that
pixel again, so it never reaches a real one. ``mask=None`` (no padding) runs both steps unmasked.

Deviations from the paper: bidirectional (the paper's decoder masks both axes causally and shifts the rows); no
layer norm, residual or MLP between the row and the column step, which the paper's stacked layers have: the
encoder's block owns those, once around the whole mixer (as in Axial-DeepLab's block). Attention dropout is
applied in each step, as in the transformer baseline. No CUDA-specific kernel: the same code runs there (fused
SDPA over the batch of rows), and a ``gpu`` test checks it against the CPU result.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ._grid import check_grid, grid_attend
from .base import MultiHeadMixer
from .registry import Grid, Taxonomy, register_model


def along_rows(t: torch.Tensor) -> torch.Tensor:
    return t  # (B, Hg, Wg, *C) is already (B, groups = rows, Wg keys per row, *C)


def along_columns(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # (B, Hg, Wg, *C) <-> (B, groups = columns, Hg, *C); its own inverse


class AxialStep(MultiHeadMixer):
    """Multi-head attention along one axis of the grid (``"rows"`` or ``"columns"``), plus the global prefix:
    one axial attention layer of the paper, bidirectional."""

    needs_grid = True
    accepts_no_mask = True

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *,
                 axis: Literal["rows", "columns"]):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if axis not in ("rows", "columns"):
            raise ValueError(f"axis must be 'rows' or 'columns', got {axis!r}")
        self.axis = axis

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, grid: Grid | None = None) -> torch.Tensor:
        B, N, _ = x.shape
        check_grid(self, N, grid)
        qkv = self.qkv(x).view(B, N, 3, self.n_heads, self.d_head)  # (B, N, 3, H, Dh)
        group = along_rows if self.axis == "rows" else along_columns
        o = grid_attend(qkv, mask, grid, queries=group, keys=group, ungroup=group,
                        dropout_p=self.dropout_p)  # (B, N, H, Dh)
        return self.out(o.reshape(B, N, -1))  # (B, N, D)


@register_model
class Axial(nn.Module):
    taxonomy = Taxonomy("Ho et al. 2019, arXiv 1912.12180", "N*sqrt(N)", ("FP",), decode=True)
    needs_grid = True
    accepts_no_mask = True  # mask=None: both steps run SDPA unmasked

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int):
        super().__init__()
        self.rows = AxialStep(d_model, n_heads, d_qkv, dropout, max_len, axis="rows")
        self.columns = AxialStep(d_model, n_heads, d_qkv, dropout, max_len, axis="columns")

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, grid: Grid | None = None) -> torch.Tensor:
        return self.columns(self.rows(x, mask, grid), mask, grid)  # (B, N, D)
