"""Linear Transformer: kernelised attention with phi(x) = elu(x) + 1 (Katharopoulos, Vyas, Pappas, Fleuret,
2020, "Transformers are RNNs: Fast Autoregressive Transformers with Linear Attention",
https://arxiv.org/abs/2006.16236).

softmax(q . k) is replaced by the positive kernel phi(q) . phi(k), so the sum over keys factorises:

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps),   eps = 1e-6 (as LRA).

Non-causal: one matmul forms the (Dh x Dh) key-value summary, one more applies it to every query; the Dh-vector
key sum and each query's normaliser are two reductions beside them (``models.base.kernel_attention``, shared
with Performer). Unpacked rows take ``LinearAttentionFn``, the same computation with a hand-written backward that
keeps only q, k, v and the small summaries (autograd would keep fp32 N x Dh maps): one layer takes less peak
memory than autograd's form and than linear-attention-transformer's, in about that package's time from 1K to 16K
(results/layer_bench.csv, rows ``lra linear`` and ``linear-attention-transformer 0.19.1``; docs/performance.md).
Causal (``causal: true``, paper Sec. 3.2): out_i uses only the prefix j <= i. ``attend`` computes it in
parallel (chunked prefix sums: exact C x C causal products inside each chunk of ``chunk_size`` tokens plus an
exclusive cumulative sum of per-chunk summaries across chunks, so no (N x Dh x Dh) prefix tensor is stored;
``chunk_size = 1`` is the plain per-token cumsum); ``recurrent_step`` / ``step`` are the paper's RNN form for
token-by-token inference with an O(Dh^2) state.

On CUDA the function runs through torch.compile (``compile_core``), which fuses the elementwise passes around
the matmuls: faster than eager, in less peak memory.
``chunk_size`` (an integer >= 1, default 64) and ``compile_core`` (True | False, default True) are attributes, not
constructor options (``execution``, models/base.py's ``execution_settings``): how the layer runs, never what it
computes (a chunk changes only the order of the causal form's additions), so they stay out of a run's config
hash; a run sets them with ``trainer.mixer``, the benches with their variants.

Complexity: O(N Dh^2) time and O(N Dh) memory per head (causal: O(N (C + Dh) Dh) time, O(N Dh + N C) memory).
Precision: the feature maps, key sums and normaliser run in fp32 even under bf16 autocast (a bf16 key sum over
thousands of tokens loses the normaliser's precision). The non-causal form's two products with values (and their
backward) take bf16 operands under autocast with fp32 accumulation, as SDPA multiplies its probabilities by V:
faster than fp32 products at 4K and 16K (docs/performance.md), for 0.35% relative error against fp64 (0.2% of it
from rounding q, k, v to bf16; tested).
The causal form keeps fp32 products (its in-chunk scores and prefix sums are the accumulation).
Padding: phi(k) is zeroed at padded keys, so padding never contributes to any output; padded queries get an
output, which the encoder ignores. The mask is honoured exactly in both forms.
Packed rows (``segments``, non-causal form): one summary per example of the row in one matmul (values spread
into S blocks of columns, models/base.py's ``spread``), each query reading its own example's (``pick``); S
examples in a row cost S-fold products, still O(N Dh^2) per example. On CUDA this is compiled like the unpacked
form; the membership is read off the data outside the graph, so S is one more size of the compiled function.
Deviations from LRA's code (``linear_attention``): LRA applies no padding mask (pads leak into the key sums),
and offers only the non-causal form. Attention dropout is not applied (there is no attention matrix; LRA
ignores its dropout rate here too).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import (
    Count,
    MultiHeadMixer,
    compiled,
    cumsum,
    kernel_attention,
    key_summaries,
    mm,
    product_dtype,
    read_out,
    segment_members,
    settings,
    upcast,
    with_ones,
)
from .registry import Taxonomy, register_model

EPS = 1e-6  # added to the normaliser, as in the paper's code and LRA


def feature_map(x: torch.Tensor) -> torch.Tensor:
    return F.elu(upcast(x)) + 1.0  # positive, and ~x for large x, so no exponent to overflow


def normalise(o1: torch.Tensor) -> torch.Tensor:
    return o1[..., :-1] / (o1[..., -1:] + EPS)  # (..., Dh): numerator over denominator column


def causal_prefix_attention(fq: torch.Tensor, fk: torch.Tensor, v1: torch.Tensor, chunk: int) -> torch.Tensor:
    """sum_{j <= i} (fq_i . fk_j) v1_j for every i, vectorised over chunks of ``chunk`` tokens.

    fq, fk: (B, H, N, Dh); v1: (B, H, N, E). Returns (B, H, N, E)."""
    B, H, N, D = fq.shape
    E = v1.shape[-1]
    pad = -N % chunk
    if pad:  # zero fk / v1 rows add nothing to any prefix; the padded queries are cut below
        fq, fk, v1 = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v1))
    n = (N + pad) // chunk
    fq = fq.view(B, H, n, chunk, D)  # (B, H, n, C, Dh)
    fk = fk.view(B, H, n, chunk, D)  # (B, H, n, C, Dh)
    v1 = v1.view(B, H, n, chunk, E)  # (B, H, n, C, E)
    # inside a chunk: exact causal products (C x C, never N x N)
    scores = torch.matmul(fq, fk.transpose(-1, -2)).tril_()  # (B, H, n, C, C)
    out = torch.matmul(scores, v1)  # (B, H, n, C, E)
    # across chunks: every query sees the summaries of all earlier chunks (exclusive prefix sum)
    summary = torch.matmul(fk.transpose(-1, -2), v1)  # (B, H, n, Dh, E)
    before = F.pad(cumsum(summary, 2)[:, :, :-1], (0, 0, 0, 0, 1, 0))  # (B, H, n, Dh, E): chunk c sees < c
    out = out + torch.matmul(fq, before)  # (B, H, n, C, E)
    return out.view(B, H, n * chunk, E)[:, :, :N]  # (B, H, N, E)


def elu1_grad(x: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, 1.0, phi)  # d(elu(x) + 1)/dx: 1 above 0, exp(x) = phi(x) at or below


class LinearAttentionFn(torch.autograd.Function):
    """The unpacked non-causal form, ``kernel_attention``'s computation with a hand-written backward (as FAVOR+'s
    ``FavorAttention``): it keeps q, k, v, the (Dh x Dh) summary, the key sum and the (N x 1) normaliser and
    recomputes the feature maps, where autograd keeps fp32 (N x Dh) maps for the normaliser's and the division's
    backward (4x the bytes of q, k, v in bf16). Its backward takes four products, as autograd's does. Same
    precision as ``kernel_attention``."""

    @staticmethod
    def forward(ctx, q, k, v, keep):  # (B, H, N, Dh) x 3, keep (B, 1, N, 1) float
        dtype = product_dtype(v)
        fq, fk = feature_map(q), feature_map(k) * keep  # (B, H, N, Dh) fp32
        kv, ksum = key_summaries(fk, v, None, dtype)  # (B, H, Dh, Dh), (B, H, 1, Dh)
        out, den = read_out(fq, kv, ksum, None, v.shape[-1], dtype, EPS)  # (B, H, N, Dh), (B, H, N, 1)
        ctx.save_for_backward(q, k, v, keep, kv, ksum, den)
        return out.to(q.dtype)  # (B, H, N, Dh)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, keep, kv, ksum, den = ctx.saved_tensors
        dtype = product_dtype(v)
        phi_q, phi_k = feature_map(q), feature_map(k)  # (B, H, N, Dh), recomputed
        g_num = upcast(grad) / den  # (B, H, N, Dh): the numerator's gradient
        g_fq = mm(g_num, kv.transpose(-1, -2), dtype)  # (B, H, N, Dh): through the numerator
        # the normaliser's gradient, -g_num . (phi_q kv) / den, read off the same product as phi_q . (g_num kv^T):
        # the output is never recomputed
        g_den = -(phi_q * g_fq).sum(-1, keepdim=True) / den  # (B, H, N, 1)
        d_kv = mm(phi_q.transpose(-1, -2), g_num, dtype)  # (B, H, Dh, Dh)
        d_fq = g_fq + g_den * ksum  # (B, H, N, Dh)
        d_fk = (mm(v, d_kv.transpose(-1, -2), dtype) + (g_den * phi_q).sum(-2, keepdim=True)) * keep  # (B, H, N, Dh)
        d_v = mm(phi_k * keep, d_kv, dtype)  # (B, H, N, Dh)
        dq, dk = d_fq * elu1_grad(q, phi_q), d_fk * elu1_grad(k, phi_k)
        return dq.to(q.dtype), dk.to(k.dtype), d_v.to(v.dtype), None


def linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, causal: bool, chunk: int,
    member: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k, v (B, H, N, Dh), mask (B, N) -> (B, H, N, Dh) in q's dtype; feature maps, key sums and normaliser in
    fp32 (or fp64); the non-causal form's products with values in v's precision (``kernel_attention``).
    ``member`` (B, 1, N, S): the examples of packed rows (``segment_members``; non-causal form only)."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        if not causal and member is None:
            return LinearAttentionFn.apply(q, k, v, mask[:, None, :, None].to(upcast(q).dtype))  # (B, H, N, Dh)
        fq = feature_map(q)  # (B, H, N, Dh)
        fk = feature_map(k) * mask[:, None, :, None]  # (B, H, N, Dh): padded keys contribute nothing
        if causal:
            o1 = causal_prefix_attention(fq, fk, with_ones(v), chunk)  # (B, H, N, Dh + 1): [num | den]
            return normalise(o1).to(q.dtype)  # (B, H, N, Dh)
        # packed rows: one summary per example, each query reading its own
        return kernel_attention(fq, fk, v, member, EPS).to(q.dtype)  # (B, H, N, Dh)


@register_model
class LinearAttention(MultiHeadMixer):
    taxonomy = Taxonomy("Katharopoulos et al. 2020, arXiv 2006.16236", "N", ("KR",), decode=True)
    supports_causal = True  # ``causal``: the constructor's option, or set on an instance (it changes no parameter)
    execution = settings(chunk_size=Count(), compile_core=(True, False))  # how it runs (the module docstring)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        dropout: float,
        max_len: int,
        *,
        causal: bool = False,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        self.causal = bool(causal)
        self.chunk_size = 64  # the causal form: tokens per chunk of its parallel prefix sums
        self.compile_core = True  # CUDA: the core through torch.compile

    @property
    def supports_segments(self) -> bool:
        """Packed rows in the non-causal form only: a causal prefix would run on into the next example."""
        return not self.causal

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        member = None if segments is None else segment_members(segments)  # (B, 1, N, S), S read off the data
        core = compiled(linear_attention) if (self.compile_core and q.is_cuda) else linear_attention
        return core(q, k, v, mask, self.causal, self.chunk_size, member)  # (B, H, N, Dh)

    def recurrent_step(
        self,
        state: torch.Tensor | None,
        q_t: torch.Tensor,
        k_t: torch.Tensor,
        v_t: torch.Tensor,
        mask_t: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of causal attention as an RNN (paper eq. 16-20). q_t, k_t, v_t: (B, H, Dh); mask_t:
        optional (B,) bool, False = padded token (it updates nothing). ``state`` is None at the start, then
        the (B, H, Dh, Dh + 1) fp32 running [sum phi(k) v^T | sum phi(k)]. Returns (out_t (B, H, Dh), state)."""
        if not self.causal:
            raise ValueError("recurrent_step is the causal form; build the model with causal=True")
        with torch.autocast(device_type=q_t.device.type, enabled=False):
            fk = feature_map(k_t)  # (B, H, Dh)
            if mask_t is not None:
                fk = fk * mask_t[:, None, None]
            update = fk.unsqueeze(-1) * with_ones(v_t).unsqueeze(-2)  # (B, H, Dh, Dh + 1)
            state = update if state is None else state + update
            o1 = torch.matmul(feature_map(q_t).unsqueeze(-2), state).squeeze(-2)  # (B, H, Dh + 1)
            return normalise(o1).to(q_t.dtype), state

    def step(
        self, x_t: torch.Tensor, state: torch.Tensor | None = None, mask_t: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole mixer for one token, for autoregressive inference: x_t (B, D) -> ((B, D), state)."""
        B = x_t.shape[0]
        q, k, v = self.qkv(x_t).view(B, 3, self.n_heads, self.d_head).unbind(1)  # each (B, H, Dh)
        o, state = self.recurrent_step(state, q, k, v, mask_t)  # (B, H, Dh)
        return self.out(o.reshape(B, -1)), state  # (B, D)
