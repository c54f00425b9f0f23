"""Linformer: low-rank attention by projecting keys and values along the sequence.

Paper: Sinong Wang, Belinda Z. Li, Madian Khabsa, Han Fang, Hao Ma, "Linformer: Self-Attention with Linear
Complexity", 2020, https://arxiv.org/abs/2006.04768.

softmax(Q (E^T K)^T / sqrt(d)) (F^T V), with E, F of shape (max_len, k) sliced to the first N rows, so the
N keys and values are replaced by k "projected" keys and values (mixtures of all positions). With
``share_kv`` (the LRA setting) F = E; otherwise F is the parameter ``E_v``. One E per layer, shared by
all heads (the paper's "layerwise" sharing is one E for the whole network; LRA and we use one per
layer). The k-slot attention is a plain dense (N x k) attention through fused
``scaled_dot_product_attention``.

Complexity: O(N k d) time and O(N k) memory per layer (+ O(N d) for the projections); parameters
O(max_len k).

Deviations from LRA's code: LRA applies no padding mask at all (pad embeddings leak into E^T K); we zero
K and V at padded positions *before* the length projection. E is initialised N(0, 1/max_len) (LRA:
lecun-normal over the (max_len, k) kernel, the same scale), so E^T K keeps the scale of one key when
N = max_len.

Padding, precisely. Because padded rows of K and V are zero, E^T K = sum over *real* positions n of
E[n] K[n], and the same for V: the projected keys/values, hence the outputs at real positions, depend
only on the (position, content) of real tokens. Appending padding (making N longer) therefore leaves the
outputs at real positions exactly unchanged (up to float summation order), and so does changing the
content of padded tokens. What does NOT hold: the attention is over k mixtures, not over tokens, so
there is nothing to "mask" -- each projected slot is a position-weighted sum whose size grows with the
number of real tokens, so the same text at a different real length gives different outputs (a property
of the method, not of padding); left padding or any shift of real positions changes which rows of E
they meet. Outputs at padded query positions are computed but meaningless (the encoder ignores them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import MultiHeadMixer
from .registry import Taxonomy, register_model


@register_model
class Linformer(MultiHeadMixer):
    taxonomy = Taxonomy("Wang et al. 2020, arXiv 2006.04768", "N", ("LR",), decode=False)

    def __init__(
        self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *, k: int = 16,
        share_kv: bool = True,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if k < 1:
            raise ValueError(f"linformer: k (low-rank features) must be >= 1, got {k}")
        self.k, self.share_kv = k, share_kv
        # Rows are sequence positions: a shorter input uses the first N rows.
        self.E = nn.Parameter(torch.randn(max_len, k) * max_len**-0.5)
        self.E_v = None if share_kv else nn.Parameter(torch.randn(max_len, k) * max_len**-0.5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        self.check_length(N)
        H, Dh = self.n_heads, self.d_head
        q, kv = self.qkv(x).split([H * Dh, 2 * H * Dh], dim=-1)  # (B, N, H*Dh), (B, N, 2*H*Dh)
        # Zero padded keys/values so the length projection sums over real positions only.
        kv = kv * mask.unsqueeze(-1).to(kv.dtype)  # (B, N, 2*H*Dh)
        E = self.E[:N].t()  # (k, N)
        if self.share_kv:
            kv = torch.matmul(E, kv)  # (B, k, 2*H*Dh): one GEMM projects keys and values together
            k_low, v_low = kv.chunk(2, dim=-1)  # each (B, k, H*Dh)
        else:
            k_low = torch.matmul(E, kv[..., : H * Dh])  # (B, k, H*Dh)
            v_low = torch.matmul(self.E_v[:N].t(), kv[..., H * Dh :])  # (B, k, H*Dh)
        q = q.view(B, N, H, Dh).transpose(1, 2)  # (B, H, N, Dh)
        k_low = k_low.reshape(B, self.k, H, Dh).transpose(1, 2)  # (B, H, k, Dh)
        v_low = v_low.reshape(B, self.k, H, Dh).transpose(1, 2)  # (B, H, k, Dh)
        o = F.scaled_dot_product_attention(q, k_low, v_low, dropout_p=self.dropout_p)  # (B, H, N, Dh)
        return self.out(o.transpose(1, 2).reshape(B, N, H * Dh))  # (B, N, D)
