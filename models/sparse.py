"""Sparse Transformer: factorized "fixed" or "strided" attention patterns, here at block granularity.

Child, Gray, Radford, Sutskever, 2019, "Generating Long Sequences with Sparse Transformers",
https://arxiv.org/abs/1904.10509. With stride l, the paper's two patterns are the unions
- fixed:   key in the query's own length-l segment, or key among the last c "summary" positions of any segment;
- strided: key within l positions of the query, or at a distance that is a multiple of l.
Here positions are blocks of ``block`` tokens, ``stride`` counts blocks (l = stride * block tokens) and
``summary`` counts summary blocks per segment. As in LRA, both halves are merged into one mask shared by
all heads (the paper also splits them across heads or layers).

Complexity: per query, fixed sees stride + summary * N/(stride*block) blocks, strided 2*stride - 1 +
N/(stride*block) blocks, so O(N^2/l + N*l) time, O(N^1.5) for l ~ sqrt(N) as in the paper, O(N^2) at a fixed l
(as the paper's and LRA's fixed settings also are). Defaults (block 128, stride 4, summary 1) compute 44 % of
the tiles at N = 2048 and 34 % at N = 4096 on the FlexAttention path; the CPU dense-mask path is O(N^2).

Deviations from the paper and LRA: (1) block granularity: an element-level stride (every l-th column) has
0 % tile sparsity in FlexAttention and runs slower than dense attention, so strides and
summaries are whole blocks; LRA used block 50 with 10 summary columns per block (key mod 50 in {0} or
[40, 49]), i.e. 1/5 of the columns, the defaults here make 1/4 of the columns summaries. (2) Bidirectional:
LRA also made both patterns causal (key <= query, with the CLS row and column open); a classifier has no
reason to, so no causal mask is applied. (3) No attention dropout (FlexAttention has none).

Padding: padded keys are masked; the pattern depends only on absolute block indices, so appending padding
leaves real positions unchanged. A padded query whose allowed keys are all padding returns 0.
"""
from __future__ import annotations

from typing import Literal

import torch

from .patterns import BlockSparseMixer
from .registry import Taxonomy, register_model


@register_model
class Sparse(BlockSparseMixer):
    taxonomy = Taxonomy("Child et al. 2019, arXiv 1904.10509", "N*sqrt(N)", ("FP",), decode=True)

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *,
                 pattern: Literal["fixed", "strided"] = "fixed", block: int = 128, stride: int = 4, summary: int = 1):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len, block=block)
        if pattern not in ("fixed", "strided"):
            raise ValueError(f"pattern={pattern!r}: choose 'fixed' or 'strided'")
        if stride < 1:
            raise ValueError(f"stride={stride} must be >= 1 block")
        if pattern == "fixed" and not 0 <= summary <= stride:
            raise ValueError(f"summary={summary} must be between 0 and stride={stride} blocks")
        self.kind, self.stride, self.summary = pattern, stride, summary

    def pattern(self, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        s = self.stride
        if self.kind == "fixed":
            same_segment = q // s == k // s
            summary = k % s >= s - self.summary  # the last `summary` blocks of every segment
            return same_segment | summary  # grid: (1, nb, nb)
        distance = (q - k).abs()
        return (distance < s) | (distance % s == 0)  # grid: (1, nb, nb)
