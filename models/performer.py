"""Performer: FAVOR+ attention (Choromanski, Likhosherstov, Dohan, Song, Gane, Sarlos, Hawkins, Davis,
Mohiuddin, Kaiser, Belanger, Colwell, Weller, 2021, "Rethinking Attention with Performers", ICLR 2021,
https://arxiv.org/abs/2009.14794).

softmax attention exp(q . k / sqrt(Dh)) is estimated without bias by positive orthogonal random features:
with q' = q Dh^-1/4, k' = k Dh^-1/4 and m rows w_r (blocks of orthonormal directions, chi(Dh) lengths, so each
row is marginally N(0, I)),

    phi(x) = exp(W x - |x|^2 / 2) / sqrt(m),   exp(q' . k') = E[phi(q')^T phi(k')],
    out_i  = phi(q_i)^T (sum_j phi(k_j) [v_j, 1]^T)  ->  numerator / (denominator + 1e-6).

Stabilisers (exact, they cancel in the ratio): key features are divided by their per-feature maximum over
the real keys, the query features multiplied back by it and then normalised to sum 1 per query (which also
absorbs exp(-|q'|^2/2) / sqrt(m)). Every feature's key sum is then >= 1, so the normaliser is >= 1: no
overflow, no 0/0. The maxima are constants for the gradient.

Precision under bf16 autocast: the feature maps (their exponents come from fp32 matmuls with the random
matrix), stabilisers, key sums and the normaliser are fp32 (fp16/bf16 exponentials overflow:
facebookresearch/xformers#96). The products of the [0, 1] feature maps with values and gradients
(sum_n fk_n v_n^T, fq times that, and their backward) take bf16 operands with fp32 accumulation, as SDPA
multiplies its probabilities by V: these are 8 of the 12 N x m x Dh matmuls of a training step, and fp32
matmuls run at half of bf16's rate at best and move twice the bytes (on the GPU they are TF32, since the
runner and bench set matmul precision "high"; the exponents' matmuls too). Tested against fp64: 0.5%
relative error, most of it from rounding q, k, v themselves to bf16.

On CUDA the backward is written by hand and recomputes the two (N x m) feature maps instead of keeping them
(``recompute``): two extra matmuls, but 2 x B H N m fp32 fewer saved per layer (the CPU path keeps them,
3x faster there). Forward and backward bodies run through torch.compile (``compile_core``), fusing the
elementwise passes over the feature maps around the cuBLAS matmuls: recomputation trades about 1.6x the
layer's time for a third of its saved memory, and compilation cuts the eager time by a third or more
(measurements: ``results/layer_bench.csv`` and ``results/bench.csv``).

Features come from a torch.Generator seeded with ``seed`` (draw j uses a seed derived from (seed, j)), so a
layer's features are reproducible and survive a checkpoint (the matrix is a buffer; seed and counters are
extra state). ``seed: null`` takes each layer's seed from torch's RNG at construction, so layers differ but
follow the run seed. In training the features are redrawn every ``redraw_every`` training forward calls
(0 = never); in eval they are frozen, so evaluation is deterministic. The heads of a layer share the matrix
(as in the paper's code).

``kernel: relu`` is LRA's default Performer ("generalized" attention with deterministic features):
phi(x) = relu(x) + 1e-3 on the raw q, k, no random features, no stabiliser; ``n_features``/``redraw_every``
are then unused (LRA ignored ``nb_features`` as well).

Complexity: softmax kernel O(N m Dh) time, O(N m) transient memory per head (O(N Dh) kept for backward);
relu kernel O(N Dh^2) time, O(N Dh) memory. Nothing N x N is ever formed.
Packed rows (``segments``): each example has its own key stabiliser (the maximum over its own keys, so its
normaliser is >= 1 as when alone, however far its exponents lie below another example's) and its own
summaries, which its queries read. One matmul per product serves the S examples of a row (S = the most in any
row): values and gradients are spread into S blocks of Dh columns, zero outside their example's (``spread``),
and each position picks its example's block of the result (``pick``); the relu kernel does the same with its
[summary | key sum]. So the products with values or gradients (2 forward, 4 backward) and the normaliser cost
S-fold FLOPs per row, with (B, H, N, S Dh) transients and S summaries kept; the (N x m) feature maps are
computed once. Unpacked rows skip all of it (the helpers return their input).
Padding: padded keys get features exactly 0 (their exponent is -inf) and are excluded from the key
stabiliser, so padding never contributes; padded queries get an output the encoder ignores.
Deviations from LRA: LRA's Performer used no padding mask; its ListOps run used FAVOR+ with 2 features
redrawn every call from a seed of ceil(1e7 * sum q) (here: a declared seed and schedule); the key stabiliser
there was a max over the whole batch and the gradient flowed through both maxima; attention dropout is not
applied (LRA ignored it too).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from .base import MultiHeadMixer, compiled, segment_onehot
from .registry import Taxonomy, register_model

EPS = 1e-6  # normaliser floor (LRA's numerical_stabilizer)
RELU_EPS = 1e-3  # LRA's kernel_epsilon for the deterministic relu features


def upcast(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 at least (fp64 stays, for tests)


def orthogonal_gaussian(m: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """(m, d) rows: blocks of d orthonormal directions with chi(d) lengths (paper's ORF, 'scaling 0')."""
    blocks = torch.randn(-(-m // d), d, d, generator=generator)  # (n_blocks, d, d)
    q, r = torch.linalg.qr(blocks)  # q (n_blocks, d, d), orthonormal columns
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # sign fix: Haar-distributed
    rows = q.transpose(-1, -2).reshape(-1, d)[:m]  # (m, d)
    lengths = torch.randn(m, d, generator=generator).norm(dim=-1)  # (m,): chi(d), as |N(0, I)|
    return rows * lengths[:, None]  # (m, d)


def segment_members(segments: torch.Tensor) -> torch.Tensor:
    """(B, N) segment ids -> (B, 1, N, S) bool: n belongs to its row's s-th example. Padding joins the first (its
    keys are masked to zero, its outputs ignored), so every position has exactly one."""
    onehot = segment_onehot(segments)  # (B, S, N)
    onehot[:, 0] |= segments == 0
    return onehot.transpose(1, 2)[:, None]  # (B, 1, N, S)


def own_segment(member: torch.Tensor | None) -> torch.Tensor | None:
    """(B, 1, N, S) membership -> (B, 1, N, 1) int64: the index s of each position's example."""
    return None if member is None else member.to(torch.uint8).argmax(-1, keepdim=True)


def spread(x: torch.Tensor, member: torch.Tensor | None) -> torch.Tensor:
    """(B, H, N, D) -> (B, H, N, S D): x_n in its own example's block of D columns, zeros in the others, so that
    (N x m)^T @ spread(x) sums each example apart. Unpacked: x itself."""
    if member is None:
        return x
    return (x.unsqueeze(-2) * member.unsqueeze(-1)).flatten(-2)  # (B, H, N, S, D) -> (B, H, N, S D)


def pick(y: torch.Tensor, index: torch.Tensor | None, d: int) -> torch.Tensor:
    """(B, H, N, S d) -> (B, H, N, d): each position's block of its own example. Unpacked: y itself."""
    if index is None:
        return y
    blocks = y.unflatten(-1, (-1, d))  # (B, H, N, S, d)
    return blocks.gather(3, index[..., None].expand(-1, y.shape[1], -1, 1, d)).squeeze(3)  # (B, H, N, d)


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


def favor_features(q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor, w: torch.Tensor,
                   member: torch.Tensor | None = None):
    """q, k (B, H, N, Dh), keep (B, 1, N, 1), w (m, Dh) pre-scaled by Dh^-1/4 -> fq, fk (B, H, N, m) fp32.
    ``member`` (B, 1, N, S): the examples of packed rows (see ``segment_members``), None for unpacked rows.

    Key features are exp(w . k' - |k'|^2/2 - c) with c the per-feature maximum over real keys (packed: of the
    key's example), so every feature's key sum is >= 1; the query features carry their example's exp(+c) back
    and are normalised to sum 1 per query (a softmax: exp(-|q'|^2/2) / sqrt(m) and any per-query factor cancel
    in the ratio). Hence the normaliser sum_j fq_j (sum_n fk_nj) is >= 1: no overflow, no 0/0. c is a constant
    for the gradient.
    """
    B, H, N, D = k.shape
    m = w.shape[0]
    kf = upcast(k)
    # -|k'|^2 / 2 enters as the matmul's bias; -inf there removes padded keys (exp(-inf) = 0)
    bias = torch.where(keep, kf.square().sum(-1, keepdim=True) * (-0.5 / math.sqrt(D)), -math.inf)  # (B, H, N, 1)
    kdash = torch.addmm(bias.reshape(-1, 1), kf.reshape(-1, D), w.t()).view(B, H, N, m)  # (B, H, N, m)
    index = own_segment(member)  # (B, 1, N, 1) or None
    c = rows(key_maxima(kdash.detach(), member, index), index)  # (B, H, 1, m), packed (B, H, N, m)
    fk = kdash.sub_(c).exp_()  # (B, H, N, m), max 1 per feature and example
    w_t = w.t().expand(B * H, D, m)  # (B H, Dh, m), a view
    qdash = torch.baddbmm(c.reshape(B * H, -1, m), upcast(q).reshape(B * H, N, D), w_t)  # (B H, N, m): w . q' + c
    fq = torch.softmax(qdash, dim=-1).view(B, H, N, m)  # (B, H, N, m)
    return fq, fk


def product_dtype(v: torch.Tensor) -> torch.dtype:
    """The operand dtype of the products with values and gradients: bf16 when the values come in bf16 (as SDPA
    multiplies its probabilities by V in bf16), else fp32 or wider. fp16 gets fp32: sum_n fk_n v_n can pass
    fp16's 65504 at long N."""
    return torch.bfloat16 if v.dtype == torch.bfloat16 else upcast(v).dtype


def mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b with both operands in ``dtype`` (accumulated in fp32 by the matmul), returned in fp32 or wider."""
    return upcast(torch.matmul(a.to(dtype), b.to(dtype)))


def favor_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, w: torch.Tensor,
                  member: torch.Tensor | None = None):
    """Normalised FAVOR+ attention, (B, H, N, Dh) x 3 -> out (B, H, N, Dh) fp32 (or fp64), plus what the
    backward needs: the (B, H, m, S Dh) summaries sum_n fk_n v_n^T, the (B, H, S, m) key sums (one per example
    of a packed row, S = 1 unpacked) and the (B, H, N, 1) normaliser. Features, key sums and normaliser are
    fp32; the two products with v take v's precision."""
    D = v.shape[-1]
    index = own_segment(member)  # (B, 1, N, 1) or None
    fq, fk = favor_features(q, k, keep, w, member)  # (B, H, N, m) each
    dtype = product_dtype(v)
    kv = mm(fk.transpose(-1, -2), spread(v, member), dtype)  # (B, H, m, S Dh)
    ksum = fk.sum(-2, keepdim=True) if member is None else member.transpose(-1, -2).to(fk.dtype) @ fk  # (B, H, S, m)
    den = pick(torch.matmul(fq, ksum.transpose(-1, -2)), index, 1) + EPS  # (B, H, N, 1), >= 1 + EPS
    return pick(mm(fq, kv, dtype), index, D) / den, kv, ksum, den


def favor_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, w: torch.Tensor,
                    member: torch.Tensor | None = None):
    """favor_forward differentiated by autograd: the reference the hand-written backward is tested against."""
    return favor_forward(q, k, v, keep, w, member)[0]


def favor_backward(grad, q, k, v, keep, w, kv, ksum, out, den, member=None):
    """Gradients of favor_forward's out w.r.t. q, k, v, recomputing the two (N x m) feature maps. The products
    with values and gradients take v's precision, as in the forward; features and sums stay fp32. Packed rows:
    the summaries' gradients are per example (``spread``), and each position reads its own example's."""
    dtype = product_dtype(v)
    D = v.shape[-1]
    index = own_segment(member)  # (B, 1, N, 1) or None
    g = upcast(grad) / den  # (B, H, N, Dh): d loss / d numerator
    g_den = -(g * out).sum(-1, keepdim=True)  # (B, H, N, 1): d loss / d normaliser
    fq, fk = favor_features(q, k, keep, w, member)  # (B, H, N, m) each
    g_spread = spread(g, member)  # (B, H, N, S Dh)
    d_kv = mm(fq.transpose(-1, -2), g_spread, dtype)  # (B, H, m, S Dh)
    d_ksum = torch.matmul(spread(g_den, member).transpose(-1, -2), fq)  # (B, H, S, m)
    d_fq = mm(g_spread, kv.transpose(-1, -2), dtype) + g_den * rows(ksum, index)  # (B, H, N, m)
    d_qdash = fq * (d_fq - (d_fq * fq).sum(-1, keepdim=True))  # (B, H, N, m): through the query softmax
    dq = mm(d_qdash, w, dtype)  # (B, H, N, Dh)
    dv = pick(mm(fk, d_kv, dtype), index, D)  # (B, H, N, Dh)
    d_kdash = (mm(spread(v, member), d_kv.transpose(-1, -2), dtype) + rows(d_ksum, index)) * fk  # (B, H, N, m)
    # the key exponent is w . k' - |k'|^2 / 2, so d/dk adds -(sum_r d_kdash_r) k / sqrt(Dh)
    dk = mm(d_kdash, w, dtype) - d_kdash.sum(-1, keepdim=True) * upcast(k) / math.sqrt(k.shape[-1])
    return dq, dk, dv


def relu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                   member: torch.Tensor | None = None) -> torch.Tensor:
    """LRA's "generalized" attention: phi(x) = relu(x) + 1e-3 on the raw q, k; (B, H, N, Dh) -> (B, H, N, Dh).
    Packed rows (``member``): one [summary | key sum] per example, each query reading its own."""
    fq = F.relu(upcast(q)) + RELU_EPS  # (B, H, N, Dh)
    fk = (F.relu(upcast(k)) + RELU_EPS) * keep  # (B, H, N, Dh): padded keys give nothing
    v1 = F.pad(upcast(v), (0, 1), value=1.0)  # (B, H, N, Dh + 1)
    summary = torch.matmul(fk.transpose(-1, -2), spread(v1, member))  # (B, H, Dh, S (Dh + 1))
    o1 = pick(torch.matmul(fq, summary), own_segment(member), v1.shape[-1])  # (B, H, N, Dh + 1): [num | den]
    return o1[..., :-1] / (o1[..., -1:] + EPS)  # (B, H, N, Dh)


class FavorAttention(torch.autograd.Function):
    """favor_forward with a hand-written backward that recomputes the features: saves q, k, v, out and the
    small summary instead of two (B, H, N, m) fp32 feature maps (at N 4096, batch 32, 4 heads, m 256: 0.5
    instead of 1.6 GB per layer). ``fused``: forward and backward bodies run compiled, each separately, so
    the compiler cannot move the feature maps back into the saved set."""

    @staticmethod
    def forward(ctx, q, k, v, keep, w, fused: bool, member=None):
        with torch.autocast(device_type=q.device.type, enabled=False):
            out, kv, ksum, den = (compiled(favor_forward) if fused else favor_forward)(q, k, v, keep, w, member)
        ctx.fused = fused
        ctx.save_for_backward(q, k, v, keep, w, kv, ksum, out, den, member)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, keep, w, kv, ksum, out, den, member = ctx.saved_tensors
        with torch.autocast(device_type=q.device.type, enabled=False):
            dq, dk, dv = (compiled(favor_backward) if ctx.fused else favor_backward)(
                grad, q, k, v, keep, w, kv, ksum, out, den, member
            )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


@register_model
class Performer(MultiHeadMixer):
    taxonomy = Taxonomy("Choromanski et al. 2021, arXiv 2009.14794", "N", ("KR",), decode=True)
    supports_segments = True

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        dropout: float,
        max_len: int,
        *,
        n_features: int = 256,
        kernel: Literal["softmax", "relu"] = "softmax",
        redraw_every: int = 1000,
        seed: int | None = None,
        recompute: bool = True,
        compile_core: bool = True,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if kernel not in ("softmax", "relu"):
            raise ValueError(f"kernel must be 'softmax' (FAVOR+) or 'relu' (LRA's generalized), got {kernel!r}")
        if n_features < 1:
            raise ValueError(f"n_features must be >= 1, got {n_features}")
        if redraw_every < 0:
            raise ValueError(f"redraw_every must be >= 0 (0 = never), got {redraw_every}")
        self.kernel, self.n_features, self.redraw_every = kernel, int(n_features), int(redraw_every)
        # null: a per-layer seed from torch's RNG (so layers differ, reproducibly under the run seed)
        self.seed = int(torch.randint(2**31, ())) if seed is None else int(seed)
        self.recompute, self.compile_core = bool(recompute), bool(compile_core)
        self.train_calls = 0  # training forward calls seen; drives the redraw schedule
        self.draws = 0  # index of the current feature draw
        self.register_buffer("features", self.draw(0) if kernel == "softmax" else None)  # (m, Dh) fp32

    def draw(self, index: int) -> torch.Tensor:
        # the CPU generator keeps 32 seed bits: mix (seed, index) into them with two odd multipliers
        generator = torch.Generator().manual_seed((self.seed * 0x9E3779B1 + index * 0x85EBCA77) & 0xFFFFFFFF)
        return orthogonal_gaussian(self.n_features, self.d_head, generator)  # (m, Dh), drawn on the CPU

    @torch.compiler.disable  # host-side bookkeeping; keeps a compiled graph free of Python-int guards
    def advance_schedule(self) -> None:
        if not (self.training and self.features is not None and self.redraw_every):
            return
        if self.train_calls and self.train_calls % self.redraw_every == 0:
            self.draws += 1
            # a new tensor, not copy_(): graphs still awaiting backward keep the features they used
            self.features = self.draw(self.draws).to(self.features)
        self.train_calls += 1

    def get_extra_state(self) -> dict:
        return {"seed": self.seed, "train_calls": self.train_calls, "draws": self.draws}

    def set_extra_state(self, state: dict) -> None:
        self.seed, self.train_calls, self.draws = (int(state[k]) for k in ("seed", "train_calls", "draws"))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        keep = mask[:, None, :, None]  # (B, 1, N, 1)
        member = None if segments is None else segment_members(segments)  # (B, 1, N, S)
        fused = self.compile_core and q.is_cuda
        if self.kernel == "relu":
            with torch.autocast(device_type=q.device.type, enabled=False):
                return (compiled(relu_attention) if fused else relu_attention)(q, k, v, keep, member).to(q.dtype)
        self.advance_schedule()
        w = upcast(self.features).to(upcast(q).dtype) * self.d_head**-0.25  # (m, Dh): folds in q' = q Dh^-1/4
        if self.recompute and q.is_cuda:  # hand-written backward, features recomputed: lean GPU memory
            return FavorAttention.apply(q, k, v, keep, w, fused, member).to(q.dtype)  # (B, H, N, Dh)
        with torch.autocast(device_type=q.device.type, enabled=False):  # autograd keeps both feature maps
            return (compiled(favor_attention) if fused else favor_attention)(q, k, v, keep, w, member).to(q.dtype)
