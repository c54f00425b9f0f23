"""Transformer: exact softmax attention (Vaswani et al., 2017, "Attention Is All You Need",
https://arxiv.org/abs/1706.03762), the baseline every other mixer in this package is read against.

softmax(Q K^T / sqrt(d)) V through ``torch.nn.functional.scaled_dot_product_attention``, which picks a
fused kernel (cuDNN / FlashAttention / memory-efficient) on CUDA and a fused CPU kernel otherwise.
Padded keys are masked out; padded queries still compute an output, which the encoder ignores. Packed rows
(``segments``): a block-diagonal mask keeps each example's queries on its own keys.

Complexity: O(N^2 d) time; O(N) extra memory with the fused kernels (the N x N scores are never stored).
Deviation from LRA: none in the mechanism (LRA also masks padded queries, which only changes outputs at
padded positions).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import MultiHeadMixer, pad_head_dim, same_segment
from .registry import Taxonomy, register_model


@register_model
class Transformer(MultiHeadMixer):
    taxonomy = Taxonomy("Vaswani et al. 2017, arXiv 1706.03762", "N^2", (), decode=True)
    accepts_no_mask = True  # mask=None (no padding anywhere): SDPA's unmasked kernels, 30% faster
    supports_segments = True

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        if segments is not None:
            key_mask = same_segment(segments)  # (B, 1, N, N): each example's queries see its own keys
        else:
            key_mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, N): queries see the real keys
        d_head = q.shape[-1]
        # The fused CUDA kernels take head sizes in multiples of 8; off that SDPA falls back to the math kernel,
        # which stores the N x N scores (Pathfinder's head size 4: 10x slower, 30 GB at batch 512).
        q, k, v = pad_head_dim(-(-d_head // 8) * 8, q, k, v)  # (B, H, N, multiple of 8)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=self.dropout_p,
                                           scale=d_head ** -0.5)
        return o[..., :d_head]  # (B, H, N, d_head)
