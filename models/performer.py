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

from .base import MultiHeadMixer, compiled
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


def favor_features(q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor, w: torch.Tensor):
    """q, k (B, H, N, Dh), keep (B, 1, N, 1), w (m, Dh) pre-scaled by Dh^-1/4 -> fq, fk (B, H, N, m) fp32.

    Key features are exp(w . k' - |k'|^2/2 - c) with c the per-feature maximum over real keys (so every
    feature's key sum is >= 1); the query features carry exp(+c) back and are normalised to sum 1 per query
    (a softmax: exp(-|q'|^2/2) / sqrt(m) and any per-query factor cancel in the ratio). Hence the
    normaliser sum_j fq_j (sum_n fk_nj) is >= 1: no overflow, no 0/0. c is a constant for the gradient.
    """
    B, H, N, D = k.shape
    m = w.shape[0]
    kf = upcast(k)
    # -|k'|^2 / 2 enters as the matmul's bias; -inf there removes padded keys (exp(-inf) = 0)
    bias = torch.where(keep, kf.square().sum(-1, keepdim=True) * (-0.5 / math.sqrt(D)), -math.inf)  # (B, H, N, 1)
    kdash = torch.addmm(bias.reshape(-1, 1), kf.reshape(-1, D), w.t()).view(B, H, N, m)  # (B, H, N, m)
    c = kdash.detach().amax(2, keepdim=True).clamp_min(-1e30)  # (B, H, 1, m); finite even with no real key
    fk = kdash.sub_(c).exp_()  # (B, H, N, m), max 1 per feature
    w_t = w.t().expand(B * H, D, m)  # (B H, Dh, m), a view
    qdash = torch.baddbmm(c.view(B * H, 1, m), upcast(q).reshape(B * H, N, D), w_t)  # (B H, N, m): w . q' + c
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


def favor_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, w: torch.Tensor):
    """Normalised FAVOR+ attention, (B, H, N, Dh) x 3 -> out (B, H, N, Dh) fp32 (or fp64), plus what the
    backward needs: the (B, H, m, Dh) summary sum_n fk_n v_n^T, the (B, H, 1, m) key sums and the (B, H, N, 1)
    normaliser. Features, key sums and normaliser are fp32; the two products with v take v's precision."""
    fq, fk = favor_features(q, k, keep, w)  # (B, H, N, m) each
    dtype = product_dtype(v)
    kv = mm(fk.transpose(-1, -2), v, dtype)  # (B, H, m, Dh)
    ksum = fk.sum(-2, keepdim=True)  # (B, H, 1, m)
    den = torch.matmul(fq, ksum.transpose(-1, -2)) + EPS  # (B, H, N, 1), >= 1 + EPS (see favor_features)
    return mm(fq, kv, dtype) / den, kv, ksum, den


def favor_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, w: torch.Tensor):
    """favor_forward differentiated by autograd: the reference the hand-written backward is tested against."""
    return favor_forward(q, k, v, keep, w)[0]


def favor_backward(grad, q, k, v, keep, w, kv, ksum, out, den):
    """Gradients of favor_forward's out w.r.t. q, k, v, recomputing the two (N x m) feature maps. The products
    with values and gradients take v's precision, as in the forward; features and sums stay fp32."""
    dtype = product_dtype(v)
    g = upcast(grad) / den  # (B, H, N, Dh): d loss / d numerator
    g_den = -(g * out).sum(-1, keepdim=True)  # (B, H, N, 1): d loss / d normaliser
    fq, fk = favor_features(q, k, keep, w)  # (B, H, N, m) each
    d_kv = mm(fq.transpose(-1, -2), g, dtype)  # (B, H, m, Dh)
    d_ksum = torch.matmul(g_den.transpose(-1, -2), fq)  # (B, H, 1, m)
    d_fq = mm(g, kv.transpose(-1, -2), dtype) + g_den * ksum  # (B, H, N, m)
    d_qdash = fq * (d_fq - (d_fq * fq).sum(-1, keepdim=True))  # (B, H, N, m): through the query softmax
    dq = mm(d_qdash, w, dtype)  # (B, H, N, Dh)
    dv = mm(fk, d_kv, dtype)  # (B, H, N, Dh)
    d_kdash = (mm(v, d_kv.transpose(-1, -2), dtype) + d_ksum) * fk  # (B, H, N, m)
    # the key exponent is w . k' - |k'|^2 / 2, so d/dk adds -(sum_r d_kdash_r) k / sqrt(Dh)
    dk = mm(d_kdash, w, dtype) - d_kdash.sum(-1, keepdim=True) * upcast(k) / math.sqrt(k.shape[-1])
    return dq, dk, dv


def relu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """LRA's "generalized" attention: phi(x) = relu(x) + 1e-3 on the raw q, k; (B, H, N, Dh) -> (B, H, N, Dh)."""
    fq = F.relu(upcast(q)) + RELU_EPS  # (B, H, N, Dh)
    fk = (F.relu(upcast(k)) + RELU_EPS) * keep  # (B, H, N, Dh): padded keys give nothing
    summary = torch.matmul(fk.transpose(-1, -2), F.pad(upcast(v), (0, 1), value=1.0))  # (B, H, Dh, Dh + 1)
    o1 = torch.matmul(fq, summary)  # (B, H, N, Dh + 1): [numerator | normaliser]
    return o1[..., :-1] / (o1[..., -1:] + EPS)  # (B, H, N, Dh)


class FavorAttention(torch.autograd.Function):
    """favor_forward with a hand-written backward that recomputes the features: saves q, k, v, out and the
    small summary instead of two (B, H, N, m) fp32 feature maps (at N 4096, batch 32, 4 heads, m 256: 0.5
    instead of 1.6 GB per layer). ``fused``: forward and backward bodies run compiled, each separately, so
    the compiler cannot move the feature maps back into the saved set."""

    @staticmethod
    def forward(ctx, q, k, v, keep, w, fused: bool):
        with torch.autocast(device_type=q.device.type, enabled=False):
            out, kv, ksum, den = (compiled(favor_forward) if fused else favor_forward)(q, k, v, keep, w)
        ctx.fused = fused
        ctx.save_for_backward(q, k, v, keep, w, kv, ksum, out, den)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, keep, w, kv, ksum, out, den = ctx.saved_tensors
        with torch.autocast(device_type=q.device.type, enabled=False):
            dq, dk, dv = (compiled(favor_backward) if ctx.fused else favor_backward)(
                grad, q, k, v, keep, w, kv, ksum, out, den
            )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


@register_model
class Performer(MultiHeadMixer):
    taxonomy = Taxonomy("Choromanski et al. 2021, arXiv 2009.14794", "N", ("KR",), decode=True)

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

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = mask[:, None, :, None]  # (B, 1, N, 1)
        fused = self.compile_core and q.is_cuda
        if self.kernel == "relu":
            with torch.autocast(device_type=q.device.type, enabled=False):
                return (compiled(relu_attention) if fused else relu_attention)(q, k, v, keep).to(q.dtype)
        self.advance_schedule()
        w = upcast(self.features).to(upcast(q).dtype) * self.d_head**-0.25  # (m, Dh): folds in q' = q Dh^-1/4
        if self.recompute and q.is_cuda:  # hand-written backward, features recomputed: lean GPU memory
            return FavorAttention.apply(q, k, v, keep, w, fused).to(q.dtype)  # (B, H, N, Dh)
        with torch.autocast(device_type=q.device.type, enabled=False):  # autograd keeps both feature maps
            return (compiled(favor_attention) if fused else favor_attention)(q, k, v, keep, w).to(q.dtype)
