"""Longformer: sliding-window attention plus a few global tokens.

Beltagy, Peters, Cohan, 2020, "Longformer: The Long-Document Transformer", https://arxiv.org/abs/2004.05150.
Every token attends to a window around itself; the ``global_tokens`` leading positions attend to every
token and every token attends to them (the paper makes the classification token global).

Here the window is counted in blocks: a query in block i sees blocks i - window .. i + window, so with
the defaults (block 128, window 2) every token sees at least 256 tokens on each side and at most 383,
which covers LRA's window of 512 (256 left including itself, 256 right). Global tokens are exact, at
token granularity.

Complexity: O(N * (2*window + 1) * block * d) time for the window plus O(N * global_tokens * d) for the global
rows and columns on the FlexAttention path; with one global token, every query row computes one extra tile.
The CPU dense-mask path is O(N^2) (see ``models/patterns.py``).

Deviations: block-aligned window instead of a per-token band (FlexAttention skips work only in whole
128 x 128 tiles, and a block-aligned window fills them exactly). Global tokens: LRA's configs pass no global
mask, i.e. none, and so does the default here; ``global_tokens: 1`` makes position 0 (the encoder's CLS slot)
global as in the paper. Each global token costs more than its share on the GPU: its row and column cut
through tiles, which then become partial (mask_mod evaluated in every one of them). No dilation (the paper
uses it only in autoregressive language modelling), one pattern for all heads and layers, no separate
projections for global attention (the paper has them), no attention dropout (FlexAttention has none).

Padding: padded keys are masked; the pattern depends only on absolute positions, so appending padding
leaves real positions unchanged. For a task without a CLS slot (MEAN pooling) the first real token is the
global one.
"""
from __future__ import annotations

import torch

from .patterns import BlockSparseMixer
from .registry import Taxonomy, register_model


@register_model
class Longformer(BlockSparseMixer):
    taxonomy = Taxonomy("Beltagy et al. 2020, arXiv 2004.05150", "N", ("FP", "M"), decode=False)

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *,
                 block: int = 128, window: int = 2, global_tokens: int = 0):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len, block=block, global_tokens=global_tokens)
        if window < 0:
            raise ValueError(f"window={window} must be >= 0 blocks on each side")
        self.window = window

    def pattern(self, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q - k).abs() <= self.window  # grid: (1, nb, nb), a band of 2 * window + 1 blocks
