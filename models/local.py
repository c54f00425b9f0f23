"""Local attention: each token attends only to the tokens of its own fixed block.

The "Local Attention" baseline of Long Range Arena (Tay et al., 2021, "Long Range Arena: A Benchmark for
Efficient Transformers", https://arxiv.org/abs/2011.04006), after the block-local attention of the Image
Transformer (Parmar, Vaswani, Uszkoreit, Kaiser, Shazeer, Ku, Tran, 2018, https://arxiv.org/abs/1802.05751):
the sequence is cut into non-overlapping blocks of ``block`` tokens and softmax attention runs inside each.

Complexity: O(N * block * d) time and O(N * block) memory on the FlexAttention path (only the diagonal
tiles are computed); the CPU dense-mask path is O(N^2) (see ``models/patterns.py``).

Deviations from LRA: block 128 by default instead of 50 (Image/Pathfinder: 64), because FlexAttention skips
work only in whole 128 x 128 tiles, so any block below 128 costs at least as much as 128 (more: the diagonal
tile is then partial, with its mask evaluated per position); ``block: 64`` is the closest to LRA that still
nests in the tiles. Blocks are contiguous, as in the paper: LRA's reshape
(code-read) groups positions congruent modulo N/block instead, a strided pattern. No attention dropout
(FlexAttention has none; see ``models/patterns.py``).

Padding: padded keys are masked inside each block, so appending padding leaves real positions unchanged.
Padded queries in blocks made only of padding attend to nothing and return 0.
"""
from __future__ import annotations

import torch

from .patterns import BlockSparseMixer
from .registry import Taxonomy, register_model


@register_model
class Local(BlockSparseMixer):
    taxonomy = Taxonomy("Parmar et al. 2018 (block-local attention), arXiv 1802.05751", "N", ("FP",), decode=True)

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *, block: int = 128):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len, block=block)

    def pattern(self, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q == k  # grid: (1, nb, nb), the diagonal blocks
