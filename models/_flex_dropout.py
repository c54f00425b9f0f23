"""Attention dropout for FlexAttention, which has none of its own: dropout on the softmax weights, as
``F.dropout(softmax(s)) @ v`` applies it, from two FlexAttention calls.

With Z = sum_j exp(s_ij) a row's normaliser and m_ij in {0, 1} each weight's keep draw (probability 1 - p),

    out_i = sum_j m_ij exp(s_ij) v_j / (Z (1 - p)) = o'_i Z' / (Z (1 - p)),

where o'_i = sum_j m_ij exp(s_ij) v_j / Z' is FlexAttention's output with the dropped scores set to -inf (a
``score_mod``) and Z' = sum_j m_ij exp(s_ij) its normaliser. Both calls return their log-normalisers
(``return_aux``), so out = o' exp(lse' - lse) / (1 - p), and gradients flow through outputs and log-normalisers
alike (FlexAttention differentiates its lse). A row whose kept weights are all dropped gets 0, as dropout gives it.

The keep draws are a counter-based hash of (seed, sample, head, query, key), computed inside the kernel, so
nothing N x N is drawn or stored and the backward sees the same draws as the forward. ``seed`` is drawn from
torch's generator on every call (reproducible under ``torch.manual_seed``). The hash (two rounds of a 32-bit
xor-shift-multiply finaliser, in int64 so that no signed product overflows) gives each weight 24 random bits; a
weight is kept when they are at or above p 2^24. The draws are not torch's Philox stream, so a run's masks differ
from SDPA's for the same seed; their distribution is the same (each weight kept with probability 1 - p,
independently up to the hash's quality, which ``tests/test_flex_dropout.py`` checks).

Cost: two FlexAttention calls, the second only for its normaliser (over zero values 16 wide, whatever v's width:
its output is 0), so up to twice one call's time; memory O(B H N) more for the two log-normalisers.
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

DROP_BITS = 24  # random bits per weight: p is resolved to 2^-24
MASK32 = 0xFFFFFFFF
LSE_VALUE_DIM = 16  # the normaliser's call takes values this wide (Triton's smallest dot), whatever v's width


def hash32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> well-mixed int64 values in [0, 2^32) (xor-shift-multiply; both multipliers odd
    and below 2^31, so that no int64 product overflows)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


def kept(seed, b, h, q_idx, kv_idx, heads, kv_len, threshold) -> torch.Tensor:
    """Whether the weight of (sample b, head h, query q_idx, key kv_idx) survives a call's dropout: elementwise on
    index tensors (the dense reference) or on a score_mod's scalars. ``seed`` an int64 tensor of one value; ``heads``,
    ``kv_len`` (the keys' count) and ``threshold`` (p 2^24) ints or int64 scalars."""
    row = hash32((seed + b.to(torch.int64) * heads + h) & MASK32)  # one stream per sample and head
    x = hash32(row ^ ((q_idx.to(torch.int64) * kv_len + kv_idx) & MASK32))
    return (x & ((1 << DROP_BITS) - 1)) >= threshold


def dense_draws(seed: torch.Tensor, p: float, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """A call's keep draws for every weight, densely (the reference the tests compare with): seed (1,) int64,
    shape (B, H, Nq, Nk) -> (B, H, Nq, Nk) bool on the seed's device."""
    b, h, i, j = (torch.arange(n, device=seed.device).view(*(-1 if d == axis else 1 for d in range(4)))
                  for axis, n in enumerate(shape))  # index grids, each along its own axis
    return kept(seed[0], b, h, i, j, shape[1], shape[3], round(p * 2**DROP_BITS))


def flex_attention_dropout(q, k, v, p: float, score_mod=None, block_mask=None, scale: float | None = None,
                           kernel_options=None, seed: torch.Tensor | None = None) -> torch.Tensor:
    """``flex_attention(q, k, v, score_mod, block_mask, scale)`` with dropout ``p`` on its softmax weights. q (B, H,
    Nq, Dh), k, v (B, H, Nk, Dh) -> (B, H, Nq, Dh). ``seed``: the draws' seed (an int64 tensor of one value; drawn
    from torch's generator when None, for tests to pass their own)."""
    if not 0 <= p <= 1:
        raise ValueError(f"attention dropout must be in [0, 1], got {p}")
    if p == 1:  # every weight dropped, as F.dropout(p=1) gives (and no division by 1 - p = 0)
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    if p == 0:
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                              kernel_options=kernel_options)
    if seed is None:
        seed = torch.randint(0, 2**31 - 1, (1,), device=q.device)
    # heads, keys and threshold reach the kernel in a tensor, not as Python ints: compiled with dynamic shapes (or
    # recompiled after p changed, which makes p dynamic) they are SymInts, and a SymInt among a score_mod's captured
    # values fails Inductor's FlexAttention lowering ("'ShapeAsConstantBuffer' object has no attribute 'dtype'")
    sizes = torch.tensor([q.shape[1], k.shape[2], round(p * 2**DROP_BITS)], dtype=torch.int64, device=q.device)

    def dropped(score, b, h, q_idx, kv_idx):
        s = score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)
        return torch.where(kept(seed[0], b, h, q_idx, kv_idx, sizes[0], sizes[1], sizes[2]), s, float("-inf"))

    lse_only = AuxRequest(lse=True)
    out, aux = flex_attention(q, k, v, score_mod=dropped, block_mask=block_mask, scale=scale,
                              kernel_options=kernel_options, return_aux=lse_only)  # (B, H, Nq, Dh)
    lse_kept = aux.lse  # (B, H, Nq): log Z'
    # the normaliser does not depend on the values: the narrowest the kernel takes, zeros (nothing to differentiate)
    values = v.new_zeros(*v.shape[:-1], LSE_VALUE_DIM)  # (B, H, Nk, 16)
    zeros, aux = flex_attention(q, k, values, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                kernel_options=kernel_options, return_aux=lse_only)  # (B, H, Nq, 16): exactly 0
    lse = aux.lse  # (B, H, Nq): log Z
    # a row with no key at all has lse = -inf, and then lse_kept = -inf too: exp(-inf - 0) = 0, no inf - inf.
    # The call's output (zeros) is added too: it changes nothing, in value or gradient (its values are 0), but an
    # output that no gradient reaches gives Inductor's FlexAttention backward a None grad_out, on which its lowering
    # fails (torch 2.11-2.13: "'NoneType' object has no attribute 'make_loader'").
    log_ratio = lse_kept - torch.where(torch.isinf(lse), 0.0, lse) + zeros[..., 0].float()  # (B, H, Nq)
    ratio = log_ratio.exp() / (1 - p)  # (B, H, Nq): Z' / (Z (1 - p))
    return (out.float() * ratio[..., None]).to(out.dtype)
