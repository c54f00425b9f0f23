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

``strided: true`` is LRA's code instead: a block holds the positions congruent modulo G = N/block (positions r,
r + G, r + 2G, ...; on a 32 x 32 image with block 64, two columns of pixels), which it reaches by one transpose of
the sequence before the same block attention and one after. N counts the internal length (a multiple of 128), so
the groups depend on the length: appending padding changes them (``padding_invariant`` is False, and
``trainer.trim`` is then not applied). LRA chunks its padding mask contiguously while grouping by stride, which
masks the wrong keys wherever there is padding; here the mask follows the positions. The ``experiment=lra``
presets of the pixel tasks (Image, Pathfinder), which have no padding, set it: there LRA's grouping is exactly this.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .patterns import BlockSparseMixer, padded_length
from .registry import Taxonomy, register_model


@register_model
class Local(BlockSparseMixer):
    taxonomy = Taxonomy("Parmar et al. 2018 (block-local attention), arXiv 1802.05751", "N", ("FP",), decode=True)

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *, block: int = 128,
                 strided: bool = False):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len, block=block)
        self.strided = bool(strided)
        self.padding_invariant = not self.strided  # strided groups depend on the length

    def pattern(self, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q == k  # grid: (1, nb, nb), the diagonal blocks

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if not self.strided:
            return super().attend(q, k, v, mask)
        self.check_length(q.shape[2])
        B, N = q.shape[0], q.shape[2]
        Np = padded_length(N, self.block)
        if mask is None and Np > N:  # the internal padding is spread over the groups: mask it by position
            mask = (torch.arange(Np, device=q.device) < N).expand(B, Np)  # (B, Np)
        elif mask is not None:
            mask = F.pad(mask, (0, Np - N), value=False)  # (B, Np)

        def by_group(x: torch.Tensor) -> torch.Tensor:  # (..., Np, *) position j G + r -> r block + j
            return x.unflatten(2, (self.block, -1)).transpose(2, 3).flatten(2, 3)

        q, k, v = (by_group(F.pad(t, (0, 0, 0, Np - N))) for t in (q, k, v))  # (B, H, Np, Dh)
        keep = None if mask is None else by_group(mask[:, None])[:, 0]  # (B, Np)
        o = self.attend_blocks(q, k, v, keep)  # (B, H, Np, Dh): block r = the positions r (mod G)
        return o.unflatten(2, (-1, self.block)).transpose(2, 3).flatten(2, 3)[:, :, :N]  # (B, H, N, Dh)
