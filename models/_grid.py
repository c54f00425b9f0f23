"""Grouped attention over a pixel grid, shared by the 2-D mixers ``image_local`` and ``axial``.

A 2-D mixer cuts the pixels into *groups*: each group is a set of queries with its own set of keys (a query block
and its memory block; a row; a column). The mixer says how, with two functions on channels-last pixel tensors
``(B, height, width, *C)``: ``queries`` -> ``(B, G, Lq, *C)`` and ``keys`` -> ``(B, G, Lk, *C)``, plus
``ungroup``, the inverse of ``queries``. ``grid_attend`` does the rest, so that both models treat the
prefix, the mask and the kernel call the same way:

* The prefix tokens (the CLS slot, ``Grid.prefix``) are global: every pixel query also sees the prefix keys, in
  the same softmax as its group's keys, and the prefix queries see every token (O(prefix * N)).
* Masked keys never contribute, pixels and prefix alike. ``keys`` is also applied to the (B, height, width) key
  mask, so a model that pads the grid internally (``pads=True``) fills the padding with ``False`` and gets it
  masked like any padded pixel.
* Each group is one ``F.scaled_dot_product_attention`` call over a (B * G) batch: fused kernels on CUDA and CPU,
  and the scores held are O(B * H * G * Lq * Lk) = O(N * Lk) per head, never N x N.
* A group with no real key (only masked queries have one: a real pixel is always a key of its own group) gives
  0, as SDPA's CPU kernels do for a fully masked row; it is made explicit here so that no backend can turn it
  into NaN, which would leak into real positions through the next layer's zero attention weights (0 * NaN).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .base import pad_head_dim
from .registry import Grid

Grouping = Callable[[torch.Tensor], torch.Tensor]


def check_grid(mixer, n: int, grid: Grid | None) -> None:
    if grid is None:
        raise ValueError(f"{type(mixer).__name__} is a 2-D mixer: call it with grid=Grid(height, width, prefix)")
    if n != grid.length:
        raise ValueError(f"{type(mixer).__name__} got {n} tokens, but grid {grid.height}x{grid.width} with "
                         f"{grid.prefix} prefix token(s) holds {grid.length}")
    mixer.check_length(n)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
              dropout_p: float, may_be_empty: bool = True) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh)) v over the real keys: q (G, H, Lq, Dh), k, v (G, H, Lk, Dh), keep (G, Lk) bool
    or None (every key real) -> (G, H, Lq, Dh). ``may_be_empty`` False: every group is known to hold a real key
    (no padding mask, only the grouping's own padding), so no group is checked or zeroed."""
    empty = None
    if keep is not None:
        if may_be_empty:
            empty = ~keep.any(-1)  # (G,): no real key at all
            keep = keep | empty[:, None]  # such a group attends to its junk, zeroed below
        keep = keep[:, None, None, :]  # (G, 1, 1, Lk)
    d_head = q.shape[-1]
    # The fused CUDA kernels take head sizes in multiples of 8 (see models/transformer.py); zero columns are exact.
    q, k, v = pad_head_dim(-(-d_head // 8) * 8, q, k, v)  # (G, H, L, multiple of 8)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=d_head**-0.5)
    o = o[..., :d_head]  # (G, H, Lq, Dh)
    return o if empty is None else o.masked_fill(empty[:, None, None, None], 0.0)


def grid_attend(qkv: torch.Tensor, mask: torch.Tensor | None, grid: Grid, queries: Grouping, keys: Grouping,
                ungroup: Grouping, dropout_p: float, pads: bool = False) -> torch.Tensor:
    """qkv (B, N, 3, H, Dh) projections of the N = prefix + height * width tokens, mask (B, N) bool (True = real)
    or None (no padding) -> (B, N, H, Dh) attention outputs. ``pads``: ``keys`` adds padding of its own, which
    then needs a key mask even when ``mask`` is None."""
    B, _, _, H, Dh = qkv.shape
    P, Hg, Wg = grid.prefix, grid.height, grid.width
    pixels = qkv[:, P:].unflatten(1, (Hg, Wg))  # (B, Hg, Wg, 3, H, Dh)
    # unbind, not three selects: the backward stacks the three gradients into one tensor, where a select's
    # backward writes each into a zero-filled copy of the whole (B, Hg, Wg, 3, H, Dh) tensor and adds those up
    pixel_q, pixel_k, pixel_v = pixels.unbind(3)  # each (B, Hg, Wg, H, Dh)
    q = queries(pixel_q)  # (B, G, Lq, H, Dh)
    k, v = keys(pixel_k), keys(pixel_v)  # each (B, G, Lk, H, Dh)
    G = q.shape[1]
    keep = None
    if mask is not None or pads:
        real = mask[:, P:] if mask is not None else qkv.new_ones(1, Hg * Wg, dtype=torch.bool)  # (B or 1, Hg * Wg)
        keep = keys(real.unflatten(1, (Hg, Wg)))  # (B or 1, G, Lk)
    if P:  # the prefix keys join every group
        k = torch.cat([qkv[:, None, :P, 1].expand(B, G, P, H, Dh), k], 2)  # (B, G, P + Lk, H, Dh)
        v = torch.cat([qkv[:, None, :P, 2].expand(B, G, P, H, Dh), v], 2)  # (B, G, P + Lk, H, Dh)
        if keep is not None:
            prefix_keep = mask[:, None, :P] if mask is not None else keep.new_ones(1, 1, P)  # (B or 1, 1, P)
            keep = torch.cat([prefix_keep.expand(keep.shape[0], G, P), keep], 2)  # (B or 1, G, P + Lk)
    if keep is not None:
        keep = keep.expand(B, G, -1).flatten(0, 1)  # (B * G, P + Lk)
    q, k, v = (t.transpose(2, 3).flatten(0, 1) for t in (q, k, v))  # each (B * G, H, L, Dh)
    # without a mask every pixel is real, and a pixel is a key of its own group: no group can be empty
    o = attention(q, k, v, keep, dropout_p, may_be_empty=mask is not None)  # (B * G, H, Lq, Dh)
    o = ungroup(o.unflatten(0, (B, G)).transpose(2, 3))  # (B, G, Lq, H, Dh) -> (B, Hg, Wg, H, Dh)
    o = o.reshape(B, Hg * Wg, H, Dh)  # (B, Hg * Wg, H, Dh), pixels row-major
    if not P:
        return o
    # The prefix queries attend to every token, pixels and prefix.
    q_all, k_all, v_all = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, N, Dh)
    o_prefix = attention(q_all[:, :, :P], k_all, v_all, mask, dropout_p)  # (B, H, P, Dh)
    return torch.cat([o_prefix.transpose(1, 2), o], 1)  # (B, N, H, Dh)
