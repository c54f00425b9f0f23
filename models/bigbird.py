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

Block size: LRA's 64 (``block: 64``) reproduces its pattern, but on the GPU it is slow: a 128-wide
FlexAttention tile then holds two query and two key blocks whose pairs differ, so nearly every computed tile
is partial (10.4 of 11.4 per query row at N = 4K) and evaluates the pattern per position, several times the
cost of a full tile. The default is therefore 128, with LRA's block counts (3-block window, first and last
block global, 3 random blocks), so every tile is full and the kernel skips the mask entirely; each query sees
twice LRA's 512 tokens. ``results/bench.csv`` has both (the ``bigbird(block=64)`` rows).

Deviations from the paper and LRA: (0) block 128 instead of 64 by default (above); (1) the "last" global
blocks and the random candidates are taken per sample from its real length (one past its last real token),
not from the padded length: LRA's inputs are padded to the task's maximum, so its last global block is
usually padding; here the plan never depends on how much padding follows, which makes outputs at real
positions invariant to appended padding. (2) Random
blocks are drawn once per layer (LRA: same; the paper's code can also redraw per step). (3) No attention
dropout (FlexAttention has none). Short sequences with few blocks get fewer (or no) random blocks, and the
pattern is full attention once (2*window + 1 + n_random + 2*global_blocks) blocks cover the sequence.

Padding: padded keys are masked; a padded query whose allowed keys are all padding returns 0.
"""
from __future__ import annotations

import torch

from .patterns import BlockSparseMixer, padded_length, real_blocks
from .registry import Taxonomy, register_model


@register_model
class BigBird(BlockSparseMixer):
    taxonomy = Taxonomy("Zaheer et al. 2020, arXiv 2007.14062", "N", ("FP", "M"), decode=False)
    static_pattern = False  # global and random blocks depend on each sample's real length

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *,
                 block: int = 128, window: int = 1, n_random: int = 3, global_blocks: int = 1, seed: int | None = None):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len, block=block)
        if window < 0 or n_random < 0 or global_blocks < 0:
            raise ValueError(f"window={window}, n_random={n_random}, global_blocks={global_blocks} must be >= 0")
        self.window, self.n_random, self.global_blocks = window, n_random, global_blocks
        nb = padded_length(max_len, block) // block  # the most blocks `attend` will ever lay out
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.register_buffer("plan", torch.rand(nb, nb, generator=generator))  # (nb, nb) scores in [0, 1)

    def is_global(self, i: torch.Tensor, n_blocks: torch.Tensor) -> torch.Tensor:
        g = self.global_blocks
        return (i < g) | ((i >= n_blocks - g) & (i < n_blocks))  # the first and last g real blocks

    def context(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's real block count (B,) and random key blocks (B, nb, n_random), -1 where a row has
        fewer candidates than n_random: the best-scored real blocks outside the window and global blocks."""
        n_blocks, nb = real_blocks(keep, self.block), keep.shape[1] // self.block
        blocks = torch.arange(nb, device=keep.device)
        q, k, n = blocks[None, :, None], blocks[None, None, :], n_blocks[:, None, None]
        candidate = ((q - k).abs() > self.window) & ~self.is_global(k, n) & (k < n)  # (B, nb, nb)
        scores = torch.where(candidate, self.plan[:nb, :nb], -1.0)  # (B, nb, nb); -1 = not a candidate
        best = scores.topk(min(self.n_random, nb), dim=-1)  # values, indices: (B, nb, r)
        return n_blocks, torch.where(best.values >= 0, best.indices, -1)

    def pattern(self, b, q, k, n_blocks: torch.Tensor, random: torch.Tensor) -> torch.Tensor:
        n = n_blocks[b]  # grid: (B, 1, 1)
        allowed = ((q - k).abs() <= self.window) | self.is_global(q, n) | self.is_global(k, n)  # grid: (B, nb, nb)
        nb, r = random.shape[1:]
        flat = random.reshape(-1)  # 1-D lookups keep FlexAttention's partial tiles cheap
        for slot in range(r):  # the n_random slots of the query block's row, not a loop over blocks
            allowed = allowed | (k == flat[(b * nb + q) * r + slot])
        return allowed
