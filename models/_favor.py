"""The FAVOR+ kernels under ``performer`` (models/performer.py states the method, its stabilisers, precision and
packing): the feature maps, the normalised forward, its hand-written backward, the per-example stabiliser of
packed rows (the packing helpers ``spread`` and ``pick`` are models/base.py's, shared with ``linear``), the
autograd Function that CUDA runs, and LRA's relu variant.

Chunking (``chunk_size`` C): unchunked, the softmax kernel forms whole (B, H, N, m) fp32 feature maps, several
alive at once (the key exponents / features and the query features in the forward; both features, d_fq,
d_qdash and d_kdash in the backward), each B H N m x 4 bytes: 537 MB at N 4096, batch 32, 4 heads, m 256. With
C the sequence is walked in ceil(N / C) chunks of C positions and each chunk's maps are computed, used and
dropped, so the feature-map transients are O(B H C m) instead of O(B H N m). Only small sums cross chunks: the
(B, H, S, m) key stabiliser and key sums, the (B, H, m, S Dh) summaries and their gradients.

* forward: pass 1 takes the stabiliser c (per feature, the maximum over each example's real keys) chunk by
  chunk over the keys, since no key feature can be formed before every key is seen; pass 2 sums kv and ksum
  over key chunks; pass 3 gives each query chunk its features, output and normaliser. c is returned, and kept
  for the backward (a (B, H, S, m) tensor), so the backward recomputes nothing more than unchunked.
* backward: over query chunks, dq and the sums d_kv, d_ksum; then over key chunks, dk and dv.

Cost: the key exponents' matmul (N x Dh x m) runs twice in the forward (pass 1, pass 2); the sums over chunks
add in another order (chunked equals unchunked to rounding, not bit for bit); more, smaller kernels. ``None`` or
C >= N runs the unchunked code, bit for bit. Under torch.compile the chunk loop unrolls (its count comes from
the shape). The autograd path (``favor_attention``) runs the same chunked forward, but autograd keeps every
chunk's features for its backward: only ``FavorAttention`` (the hand-written, recomputing backward) saves the
memory.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import (
    compiled,
    kernel_attention,
    key_summaries,
    mm,
    own_segment,
    pick,
    product_dtype,
    read_out,
    spread,
    upcast,
)

EPS = 1e-6  # normaliser floor (LRA's numerical_stabilizer)
RELU_EPS = 1e-3  # LRA's kernel_epsilon for the deterministic relu features


# ------------------------------------------------------------------------------------------------ packing


def rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """(B, H, S, m) -> (B, H, N, m): each position's example's row. Unpacked: the (B, H, 1, m) x, broadcasting."""
    return x if index is None else x.gather(2, index.expand(-1, x.shape[1], -1, x.shape[3]))  # (B, H, N, m)


def key_maxima(kdash: torch.Tensor, member: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor:
    """(B, H, N, m) key exponents (-inf at padding) -> (B, H, S, m): the per-feature maximum over each
    example's real keys (unpacked: S = 1, the row's), finite even with no real key."""
    if member is None:
        return kdash.amax(2, keepdim=True).clamp_min(-1e30)  # (B, H, 1, m)
    B, H, N, m = kdash.shape
    c = kdash.new_full((B, H, member.shape[-1], m), -math.inf)  # (B, H, S, m)
    return c.scatter_reduce_(2, index.expand(B, H, N, m), kdash, "amax").clamp_min(-1e30)


# ------------------------------------------------------------------------------------------------ chunks


def chunk_spans(n: int, chunk_size: int | None) -> list[slice]:
    """The position slices that walk a length-n sequence in chunks of ``chunk_size`` (None or >= n: one, all)."""
    if chunk_size is None or chunk_size >= n:
        return [slice(0, n)]
    return [slice(start, min(start + chunk_size, n)) for start in range(0, n, chunk_size)]


def at(x: torch.Tensor | None, span: slice) -> torch.Tensor | None:
    """x (B, ., N, .) -> (B, ., n, .): the positions of one chunk (positions are dim 2 everywhere); None stays."""
    return None if x is None else x[:, :, span]


# ----------------------------------------------------------------------------------------------- features


def key_exponents(k: torch.Tensor, keep: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """k (B, H, N, Dh), keep (B, 1, N, 1), w (m, Dh) pre-scaled by Dh^-1/4 -> (B, H, N, m) fp32: the key
    exponents w . k' - |k'|^2 / 2, -inf at padded keys (exp(-inf) = 0)."""
    B, H, N, D = k.shape
    kf = upcast(k)
    # -|k'|^2 / 2 enters as the matmul's bias; -inf there removes padded keys
    bias = torch.where(keep, kf.square().sum(-1, keepdim=True) * (-0.5 / math.sqrt(D)), -math.inf)  # (B, H, N, 1)
    return torch.addmm(bias.reshape(-1, 1), kf.reshape(-1, D), w.t()).view(B, H, N, w.shape[0])  # (B, H, N, m)


def query_features(q: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """q (B, H, N, Dh), c (B, H, 1, m) or (B, H, N, m) packed -> fq (B, H, N, m) fp32: the softmax over features
    of w . q' + c (the key stabiliser carried back, the query's own factors cancelled)."""
    B, H, N, D = q.shape
    m = w.shape[0]
    w_t = w.t().expand(B * H, D, m)  # (B H, Dh, m), a view
    qdash = torch.baddbmm(c.reshape(B * H, -1, m), upcast(q).reshape(B * H, N, D), w_t)  # (B H, N, m): w . q' + c
    return torch.softmax(qdash, dim=-1).view(B, H, N, m)  # (B, H, N, m)


def favor_features(q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor, w: torch.Tensor,
                   member: torch.Tensor | None = None):
    """q, k (B, H, N, Dh), keep (B, 1, N, 1), w (m, Dh) pre-scaled by Dh^-1/4 -> fq, fk (B, H, N, m) fp32 and the
    key stabiliser c (B, H, S, m). ``member`` (B, 1, N, S): the examples of packed rows (see ``segment_members``),
    None for unpacked rows.

    Key features are exp(w . k' - |k'|^2/2 - c) with c the per-feature maximum over real keys (packed: of the
    key's example), so every feature's key sum is >= 1; the query features carry their example's exp(+c) back
    and are normalised to sum 1 per query (a softmax: exp(-|q'|^2/2) / sqrt(m) and any per-query factor cancel
    in the ratio). Hence the normaliser sum_j fq_j (sum_n fk_nj) is >= 1: no overflow, no 0/0. c is a constant
    for the gradient. One key matmul serves the stabiliser and the features (the unchunked path).
    """
    index = own_segment(member)  # (B, 1, N, 1) or None
    kdash = key_exponents(k, keep, w)  # (B, H, N, m)
    c = key_maxima(kdash.detach(), member, index)  # (B, H, S, m)
    c_rows = rows(c, index)  # (B, H, 1, m), packed (B, H, N, m)
    fk = kdash.sub_(c_rows).exp_()  # (B, H, N, m), max 1 per feature and example
    return query_features(q, w, c_rows), fk, c


def key_features(k: torch.Tensor, keep: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """One chunk's key features exp(exponents - c), c the stabiliser's rows for it -> (B, H, n, m) fp32."""
    return key_exponents(k, keep, w).sub_(c).exp_()  # (B, H, n, m)


def chunked_stabiliser(k: torch.Tensor, keep: torch.Tensor, w: torch.Tensor, member: torch.Tensor | None,
                       index: torch.Tensor | None, spans: list[slice]) -> torch.Tensor:
    """Pass 1: ``key_maxima`` over all keys, one chunk's exponents at a time -> c (B, H, S, m), a constant."""
    c = None
    for s in spans:
        part = key_maxima(key_exponents(k[:, :, s].detach(), keep[:, :, s], w), at(member, s), at(index, s))
        c = part if c is None else torch.maximum(c, part)  # (B, H, S, m)
    return c


# ------------------------------------------------------------------------------------------------ forward


def favor_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, w: torch.Tensor,
                  member: torch.Tensor | None = None, chunk_size: int | None = None):
    """Normalised FAVOR+ attention, (B, H, N, Dh) x 3 -> out (B, H, N, Dh) fp32 (or fp64), plus what the
    backward needs: the (B, H, m, S Dh) summaries sum_n fk_n v_n^T, the (B, H, S, m) key sums (one per example
    of a packed row, S = 1 unpacked), the (B, H, N, 1) normaliser and the (B, H, S, m) key stabiliser. Features,
    key sums and normaliser are fp32; the two products with v take v's precision. ``chunk_size``: the three
    passes of the module docstring."""
    D, dtype = v.shape[-1], product_dtype(v)
    index = own_segment(member)  # (B, 1, N, 1) or None
    spans = chunk_spans(k.shape[2], chunk_size)
    if len(spans) == 1:
        fq, fk, c = favor_features(q, k, keep, w, member)  # (B, H, N, m) x 2, (B, H, S, m)
        kv, ksum = key_summaries(fk, v, member, dtype)
        out, den = read_out(fq, kv, ksum, index, D, dtype, EPS)
        return out, kv, ksum, den, c
    c = chunked_stabiliser(k, keep, w, member, index, spans)  # pass 1: (B, H, S, m)
    kv = ksum = 0
    for s in spans:  # pass 2: the summaries, one chunk of keys at a time
        fk = key_features(k[:, :, s], keep[:, :, s], w, rows(c, at(index, s)))  # (B, H, n, m)
        kv_s, ksum_s = key_summaries(fk, v[:, :, s], at(member, s), dtype)
        kv, ksum = kv + kv_s, ksum + ksum_s  # (B, H, m, S Dh), (B, H, S, m)
    parts = []
    for s in spans:  # pass 3: one chunk of queries at a time
        fq = query_features(q[:, :, s], w, rows(c, at(index, s)))  # (B, H, n, m)
        parts.append(read_out(fq, kv, ksum, at(index, s), D, dtype, EPS))
    out, den = (torch.cat(p, 2) for p in zip(*parts))  # (B, H, N, Dh), (B, H, N, 1)
    return out, kv, ksum, den, c


def favor_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, w: torch.Tensor,
                    member: torch.Tensor | None = None, chunk_size: int | None = None):
    """favor_forward differentiated by autograd: the reference the hand-written backward is tested against."""
    return favor_forward(q, k, v, keep, w, member, chunk_size)[0]


# ----------------------------------------------------------------------------------------------- backward


def query_grads(fq, g, g_den, kv, ksum, w, member, index, dtype):
    """Some queries' features fq (B, H, n, m) and output gradients g (B, H, n, Dh) (of the numerator), g_den
    (B, H, n, 1) (of the normaliser) -> their dq (B, H, n, Dh) and their terms of d_kv (B, H, m, S Dh) and
    d_ksum (B, H, S, m)."""
    g_spread = spread(g, member)  # (B, H, n, S Dh)
    d_kv = mm(fq.transpose(-1, -2), g_spread, dtype)  # (B, H, m, S Dh)
    d_ksum = torch.matmul(spread(g_den, member).transpose(-1, -2), fq)  # (B, H, S, m)
    d_fq = mm(g_spread, kv.transpose(-1, -2), dtype) + g_den * rows(ksum, index)  # (B, H, n, m)
    d_qdash = fq * (d_fq - (d_fq * fq).sum(-1, keepdim=True))  # (B, H, n, m): through the query softmax
    return mm(d_qdash, w, dtype), d_kv, d_ksum  # dq (B, H, n, Dh)


def key_grads(fk, k, v, d_kv, d_ksum, w, member, index, dtype):
    """Some keys' features fk (B, H, n, m), keys and values (B, H, n, Dh) -> their dk, dv (B, H, n, Dh)."""
    dv = pick(mm(fk, d_kv, dtype), index, v.shape[-1])  # (B, H, n, Dh)
    d_kdash = (mm(spread(v, member), d_kv.transpose(-1, -2), dtype) + rows(d_ksum, index)) * fk  # (B, H, n, m)
    # the key exponent is w . k' - |k'|^2 / 2, so d/dk adds -(sum_r d_kdash_r) k / sqrt(Dh)
    dk = mm(d_kdash, w, dtype) - d_kdash.sum(-1, keepdim=True) * upcast(k) / math.sqrt(k.shape[-1])
    return dk, dv


def favor_backward(grad, q, k, v, keep, w, kv, ksum, out, den, c, member=None, chunk_size=None):
    """Gradients of favor_forward's out w.r.t. q, k, v, recomputing the two (N x m) feature maps (chunked: one
    chunk's at a time, with the forward's stabiliser c). The products with values and gradients take v's
    precision, as in the forward; features and sums stay fp32. Packed rows: the summaries' gradients are per
    example (``spread``), and each position reads its own example's."""
    dtype = product_dtype(v)
    index = own_segment(member)  # (B, 1, N, 1) or None
    g = upcast(grad) / den  # (B, H, N, Dh): d loss / d numerator
    g_den = -(g * out).sum(-1, keepdim=True)  # (B, H, N, 1): d loss / d normaliser
    spans = chunk_spans(k.shape[2], chunk_size)
    if len(spans) == 1:
        fq, fk, _ = favor_features(q, k, keep, w, member)  # (B, H, N, m) each
        dq, d_kv, d_ksum = query_grads(fq, g, g_den, kv, ksum, w, member, index, dtype)
        dk, dv = key_grads(fk, k, v, d_kv, d_ksum, w, member, index, dtype)
        return dq, dk, dv
    dq, d_kv, d_ksum = [], 0, 0
    for s in spans:  # queries: dq, and the summaries' gradients summed
        fq = query_features(q[:, :, s], w, rows(c, at(index, s)))  # (B, H, n, m)
        dq_s, d_kv_s, d_ksum_s = query_grads(fq, g[:, :, s], g_den[:, :, s], kv, ksum, w, at(member, s),
                                             at(index, s), dtype)
        dq.append(dq_s)
        d_kv, d_ksum = d_kv + d_kv_s, d_ksum + d_ksum_s  # (B, H, m, S Dh), (B, H, S, m)
    dk, dv = [], []
    for s in spans:  # keys: dk, dv
        fk = key_features(k[:, :, s], keep[:, :, s], w, rows(c, at(index, s)))  # (B, H, n, m)
        dk_s, dv_s = key_grads(fk, k[:, :, s], v[:, :, s], d_kv, d_ksum, w, at(member, s), at(index, s), dtype)
        dk.append(dk_s)
        dv.append(dv_s)
    return torch.cat(dq, 2), torch.cat(dk, 2), torch.cat(dv, 2)  # (B, H, N, Dh) each


class FavorAttention(torch.autograd.Function):
    """favor_forward with a hand-written backward that recomputes the features: saves q, k, v, out and the
    small summary instead of two (B, H, N, m) fp32 feature maps (at N 4096, batch 32, 4 heads, m 256: 0.5
    instead of 1.6 GB per layer). ``fused``: forward and backward bodies run compiled, each separately, so
    the compiler cannot move the feature maps back into the saved set. ``chunk_size``: both walk the sequence
    in chunks (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, keep, w, fused: bool, member=None, chunk_size: int | None = None):
        with torch.autocast(device_type=q.device.type, enabled=False):
            out, kv, ksum, den, c = (compiled(favor_forward) if fused else favor_forward)(
                q, k, v, keep, w, member, chunk_size
            )
        ctx.fused, ctx.chunk_size = fused, chunk_size
        # c only serves the chunked backward (unchunked, it is recomputed with the features)
        ctx.save_for_backward(q, k, v, keep, w, kv, ksum, out, den, None if chunk_size is None else c, member)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, keep, w, kv, ksum, out, den, c, member = ctx.saved_tensors
        with torch.autocast(device_type=q.device.type, enabled=False):
            dq, dk, dv = (compiled(favor_backward) if ctx.fused else favor_backward)(
                grad, q, k, v, keep, w, kv, ksum, out, den, c, member, ctx.chunk_size
            )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def relu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                   member: torch.Tensor | None = None) -> torch.Tensor:
    """LRA's "generalized" attention: phi(x) = relu(x) + 1e-3 on the raw q, k; (B, H, N, Dh) -> (B, H, N, Dh).
    Packed rows (``member``): one summary and key sum per example, each query reading its own. Its transients are
    (N x Dh): it takes no chunks."""
    fq = F.relu(upcast(q)) + RELU_EPS  # (B, H, N, Dh)
    fk = (F.relu(upcast(k)) + RELU_EPS) * keep  # (B, H, N, Dh): padded keys give nothing
    return kernel_attention(fq, fk, v, member, EPS)  # (B, H, N, Dh)
