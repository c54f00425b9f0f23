"""BigBird: block-sparse attention = sliding window + global blocks + random blocks.

Zaheer, Guruganesh, Dubey, Ainslie, Alberti, Ontanon, Pham, Ravula, Wang, Yang, Ahmed, 2020, "Big Bird:
Transformers for Longer Sequences", https://arxiv.org/abs/2007.14062. ITC form, as LRA configures it: the
sequence is cut into blocks of ``block`` tokens; query block i attends to blocks i - window .. i + window, to
the ``global_blocks`` first and last blocks (which in turn attend to everything), and to ``n_random``
random blocks.

The random plan is fixed per layer and reproducible: a (blocks x blocks) table of uniform scores, drawn at
construction and stored as a buffer (so it travels with checkpoints); for each query block the
``n_random`` best-scored candidate blocks are taken, candidates being the sample's real blocks outside the
window and the global blocks. ``seed: null`` draws the table from torch's global generator, so every layer
gets its own plan and the run's seed fixes them all (LRA seeds each layer's plan with its index); an integer
seed gives every layer that same plan.

Complexity: O(N * (2*window + 1 + n_random + 2*global_blocks) * block * d) time on the FlexAttention path,
plus the global rows, i.e. O(N) for fixed settings; the CPU dense-mask path is O(N^2) (``models/patterns.py``).
With block 64 each 128-wide FlexAttention tile holds two query blocks and computes the union of their key
blocks, up to twice the work of an exact 64-block kernel; ``block: 128`` fills the tiles exactly.

Deviations from the paper and LRA: (1) the "last" global blocks and the random candidates are taken per
sample from its real length (one past its last real token), not from the padded length: LRA's inputs are
padded to the task's maximum, so its last global block was usually padding; here the plan never depends on
how much padding follows, which makes outputs at real positions invariant to appended padding. (2) Random
blocks are drawn once per layer (LRA: same; the paper's code can also redraw per step). (3) No attention
dropout (FlexAttention has none). Short sequences with few blocks get fewer (or no) random blocks, and the
pattern is full attention once (2*window + 1 + n_random + 2*global_blocks) blocks cover the sequence.

Padding: padded keys are masked; a padded query whose allowed keys are all padding returns 0.
"""
from __future__ import annotations

import torch

from .patterns import BlockSparseMixer, padded_length
from .registry import register_model


@register_model
class BigBird(BlockSparseMixer):
    static_pattern = False  # global and random blocks depend on each sample's real length

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *,
                 block: int = 64, window: int = 1, n_random: int = 3, global_blocks: int = 1, seed: int | None = None):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len, block=block)
        if window < 0 or n_random < 0 or global_blocks < 0:
            raise ValueError(f"window={window}, n_random={n_random}, global_blocks={global_blocks} must be >= 0")
        self.window, self.n_random, self.global_blocks = window, n_random, global_blocks
        nb = padded_length(max_len, block) // block  # the most blocks `attend` will ever lay out
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.register_buffer("plan", torch.rand(nb, nb, generator=generator))  # (nb, nb) scores in [0, 1)

    def pattern(self, q: torch.Tensor, k: torch.Tensor, n_blocks: torch.Tensor) -> torch.Tensor:
        g, nb = self.global_blocks, q.shape[1]
        window = (q - k).abs() <= self.window  # (1, nb, nb)
        k_global = (k < g) | ((k >= n_blocks - g) & (k < n_blocks))  # (B, 1, nb)
        q_global = (q < g) | ((q >= n_blocks - g) & (q < n_blocks))  # (B, nb, 1)
        allowed = window | k_global | q_global  # (B, nb, nb)
        if self.n_random == 0:
            return allowed
        candidate = ~window & ~k_global & (k < n_blocks)  # (B, nb, nb)
        scores = torch.where(candidate, self.plan[:nb, :nb], -1.0)  # (B, nb, nb); -1 = not a candidate
        best = scores.topk(min(self.n_random, nb), dim=-1)  # values, indices: (B, nb, r)
        chosen = torch.zeros_like(allowed).scatter_(-1, best.indices, best.values >= 0)  # (B, nb, nb)
        return allowed | chosen
