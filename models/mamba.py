"""Mamba, bidirectional, in its Mamba-2 (SSD) form: a selective state space model (Gu & Dao 2023, "Mamba:
Linear-Time Sequence Modeling with Selective State Spaces", https://arxiv.org/abs/2312.00752; Dao & Gu 2024,
"Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured State Space Duality",
https://arxiv.org/abs/2405.21060).

One projection of the input u gives the gate z, the SSM input x (d_inner = expand * d_model, split into heads
of ``headdim``), and per direction B, C (d_state each, one group shared by all heads) and the step size dt per
head. x, B, C go through a short depthwise causal convolution (``d_conv`` taps) and SiLU; then per head, with
a (d_state x headdim) state h and a scalar A < 0 per head (Mamba-2's SSD form):

    dt_t = softplus(dt_raw_t + dt_bias),   h_t = exp(A dt_t) h_{t-1} + B_t (dt_t x_t)^T,   y_t = C_t h_t + D x_t.

This is exactly a scalar-gated linear attention (``_scan``): q = C, k = B, v = x dt, log decay g = A dt and
scale 1 (not K^-0.5: C_t h_t carries no softmax-style temperature). Each direction's y is computed over the
sequence (the reversed pass on the flipped sequence, flipped back), the two are summed, gated and normalised
as Mamba-2 does, y = RMSNorm(y * silu(z)) (its gated RMSNorm with the norm after the gate, one group over
d_inner), then projected back to d_model.

Forms of the scan (``scan``): ``chunked`` (the default, every device), the chunked SSD form in plain
PyTorch, vectorised over chunks of ``chunk_size`` (Mamba-2's ``ssd_minimal``), which torch.compile fuses with the
layer around it; ``fla``, flash-linear-attention's Triton ``chunk_simple_gla`` (fla-core 0.6.0, ``pip install
lra[ssm]``, CUDA); ``auto``, fla on CUDA where its kernels are not refused (``_scan``), else chunked;
``recurrent``, the sequential recurrence, the readable reference. Why chunked by default: in the compiled layer it
is faster than fla's kernel at 4K and 16K and takes less memory, since feeding fla copies Mamba-2's one group of B
and C to every head in bf16 and its kernels split the compiled graph (results/layer_bench.csv, rows
``lra mamba(scan=chunked)`` and ``lra mamba(scan=fla)``). Mamba-1's selective scan (a diagonal A per state
dimension, a CUDA extension of its own) is not what runs: Mamba-2's scalar A per head is what the scan computes. The
convolution is K shifted products in PyTorch (``causal_conv``), which Inductor fuses with the SiLU and their
neighbours; fla's fused Triton convolution is slower in the compiled layer (results/layer_bench.csv: the
``lra mamba(conv=fla)`` rows time it).
``scan`` ("chunked", the default, | "fla" | "auto" | "recurrent") and ``chunk_size`` (an integer >= 1, default 64)
are attributes, not constructor options (``execution``, models/base.py's ``execution_settings``): how the layer
runs, never what it computes, so they stay out of a run's config hash; a run sets them with ``trainer.mixer``
(``+trainer.mixer.scan=fla``), the benches with their variants.

Bidirectional, as Vision Mamba (Zhu et al. 2024, arXiv 2401.09417, Alg. 1) and Caduceus's BiMamba (Schiff et
al. 2024, arXiv 2403.03234, which ties the in- and out-projections of its two directions): the in-projection of
x and z, the norm and the out-projection are shared; each direction has its own convolution, B / C / dt
projections, dt_bias, A and D (a few (2 d_state + H) x d_model weights more), since the forward pass reads the
past and the reversed pass the future. The two passes run as one batch of 2B sequences (the reversed rows
flipped in time, ``orient``), and their outputs are summed before the gate (Vim gates each and sums: the
same, y * silu(z) being linear in y). Parameters per layer: d_model (2 d_inner + 2 (2 d_state + H)) + d_inner
d_model + small ones, against the transformer's 4 d_model d_qkv (the encoder's MLP is kept, so a block here is
a Mamba-2 mixer plus that MLP, not Mamba's attention-free stack).

Complexity: O(N d_inner d_state) time, O(N) memory in N (chunked: O(N C (d_state + headdim) + (N/C)^2 d_state
headdim) per head, the second term a small product over chunk summaries).
Precision: the projections follow autocast; the convolution (K shifted products, since CPU's depthwise conv1d
backward would dominate a training step), dt, A dt and the norm run in fp32; the scan as ``_scan`` says (chunked:
fp32 decays, products following autocast; fla: bf16 q, k, v with fp32 states and decays).
Padding: padded steps are exact no-ops, wherever they sit: their inputs are zeroed before the convolution (so
no real position's convolution sees their content) and their dt is 0, so exp(A dt) = 1 and B dt x = 0 leave
the state unchanged. Flipping a right-padded row puts the padding first, where it is a no-op too, so both
passes over a padded row equal the passes over its real tokens alone (a hole inside a row reads as a zero input
to its neighbours' convolution taps). Padded positions get outputs the encoder ignores.
The mixer runs over whole chunks: a row of N steps gets padded steps at its end up to the next multiple of
``chunk_size`` (no-ops, as above), and its outputs are cut back to N. Why: at an odd length (Image's 1,025 with
the CLS token), Inductor's CUDA code for the scan's inputs (torch 2.11) gives dt_bias gradients up to 1e4 times
the eager ones, enough to make Mamba's Image and ListOps training collapse; at whole chunks (1,088) the compiled
gradients are the eager ones to 3e-6 (docs/gpu.md, compilation). At most chunk_size - 1 steps more.
Packed rows (``segments``, ``lra.train.packing``): two operations cross positions, and both keep the examples apart,
in each pass's own order (the reversed pass's first step of an example is its last position). The convolution's
taps read only positions of their own example (a tap on another example reads a zero, as before a row's start:
K - 1 comparisons and multiplies more); the scan's state resets at every example's first step (``_scan``'s
``reset``: chunked, the chunks' weights masked at the resets; fla, its variable-length mode; recurrent, a zero
decay). D x, the gate and the norm are per position. Every example gets exactly its own row's outputs.
Deviations: Mamba-2's defaults differ in d_state (128; here 64, Mamba-1 used 16) and headdim (64; here
d_inner / n_heads by default); ngroups 1; no dt clamp; d_inner follows d_model, as Mamba's expand, so
``d_qkv`` is unused, as are ``dropout`` and ``max_len`` (an SSM has neither attention weights nor a length
limit). A_log, dt_bias and D carry ``_optim = {"weight_decay": 0.0}``, as Mamba's ``_no_weight_decay``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import _scan
from ._scan import orient, upcast
from .base import Count, settings
from .registry import Taxonomy, register_model


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                segments: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal taps over time, one filter bank per direction: x (2, B, N, C), weight (2, C, K), bias
    (2, C) -> (2, B, N, C), y_t = b + sum_i w_i x_{t-K+1+i} (nn.Conv1d's cross-correlation, left-padded).
    ``segments`` (2, B, N) example ids in the same order: a tap reads zero off its own example, as before a row."""
    K, N = weight.shape[-1], x.shape[2]
    xp = F.pad(x, (0, 0, K - 1, 0))  # (2, B, N + K - 1, C): zeros before the start
    w = weight[:, None, None]  # (2, 1, 1, C, K)
    taps = [xp[:, :, i : i + N] for i in range(K)]  # tap i: x_{t-K+1+i}, each (2, B, N, C)
    if segments is not None:
        sp = F.pad(segments, (K - 1, 0), value=-1)  # (2, B, N + K - 1): -1 before the start, no example's id
        same = [(sp[:, :, i : i + N] == segments)[..., None] for i in range(K - 1)]  # (2, B, N, 1): own example
        taps = [tap * keep for tap, keep in zip(taps, same)] + taps[-1:]  # the last tap is x_t itself
    return sum(tap * w[..., i] for i, tap in enumerate(taps)) + bias[:, None, None]  # (2, B, N, C)


@register_model
class Mamba(nn.Module):
    taxonomy = Taxonomy("Gu & Dao 2023, arXiv 2312.00752; Dao & Gu 2024, arXiv 2405.21060", "N", ("SSM", "RC"),
                        decode=True)
    accepts_no_mask = True  # mask=None: no masking multiplies
    supports_segments = True  # packed rows: taps and states stay inside each example
    execution = settings(scan=_scan.SCANS, chunk_size=Count())  # how it runs (the module docstring)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        dropout: float,
        max_len: int,
        *,
        d_state: int = 64,
        expand: int = 2,
        d_conv: int = 4,
        headdim: int | None = None,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
    ):
        super().__init__()
        self.d_inner, self.d_state = expand * d_model, d_state
        self.scan: _scan.Scan = "chunked"  # the form of the scan (the module docstring)
        self.chunk_size = 64  # steps per chunk of the chunked form, and the multiple a row is padded to
        self.headdim = headdim or self.d_inner // n_heads
        if self.d_inner % self.headdim or d_conv < 1:
            raise ValueError(f"d_inner {self.d_inner} must split into heads of {self.headdim}; d_conv {d_conv} "
                             f"must be >= 1")
        self.n_heads = H = self.d_inner // self.headdim
        E, S = self.d_inner, d_state
        self.in_proj = nn.Linear(d_model, 2 * E + 2 * (2 * S + H), bias=False)  # z, x; per direction B, C, dt
        # Parameters with a leading axis of 2: the forward pass's, then the reversed pass's.
        bound = d_conv ** -0.5  # nn.Conv1d's default init for a depthwise filter (fan-in d_conv)
        self.conv_weight = nn.Parameter(torch.empty(2, E + 2 * S, d_conv).uniform_(-bound, bound))  # on x, B, C
        self.conv_bias = nn.Parameter(torch.empty(2, E + 2 * S).uniform_(-bound, bound))
        # Mamba's init: dt log-uniform in [dt_min, dt_max] (floor 1e-4), dt_bias its inverse softplus;
        # A uniform in [1, 16] (Mamba-2); D = 1.
        dt = torch.exp(torch.rand(2, H) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # (2, H)
        self.A_log = nn.Parameter(torch.empty(2, H).uniform_(1, 16).log())  # (2, H)
        self.D = nn.Parameter(torch.ones(2, H))  # (2, H)
        for p in (self.dt_bias, self.A_log, self.D):
            p._optim = {"weight_decay": 0.0}
        self.norm = nn.RMSNorm(E, eps=1e-5)
        self.out_proj = nn.Linear(E, d_model, bias=False)

    def project(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u (B, N, D) -> the gate z (B, N, E) and each direction's [x, B, C, dt] (2, B, N, E + 2S + H)."""
        E, S, H = self.d_inner, self.d_state, self.n_heads
        z, x, bcdt = self.in_proj(u).split([E, E, 2 * (2 * S + H)], -1)
        bcdt = bcdt.unflatten(-1, (2, 2 * S + H)).movedim(-2, 0)  # (2, B, N, 2S + H)
        return z, torch.cat([x.expand(2, *x.shape), bcdt], -1)  # (2, B, N, E + 2S + H): x shared

    def scan_inputs(self, xbcdt: torch.Tensor, keep: torch.Tensor | None, segments: torch.Tensor | None = None):
        """Both directions' SSM inputs, each causal over the order given: xbcdt (2, B, N, E + 2S + H), keep
        (2, B, N, 1) (1 = real) or None, segments (2, B, N) ids or None -> q, k (2B, 1, N, S), v (2B, H, N, P),
        g (2B, H, N, 1), x (2, B, N, H, P)."""
        _, B, N, _ = xbcdt.shape
        E, S, H, P = self.d_inner, self.d_state, self.n_heads, self.headdim
        xbc, dt = xbcdt.split([E + 2 * S, H], -1)  # (2, B, N, E + 2S), (2, B, N, H)
        if keep is not None:
            xbc = xbc * keep  # padding enters the convolution as zeros: no real position sees it
        xbc = F.silu(causal_conv(xbc, self.conv_weight, self.conv_bias, segments))  # (2, B, N, E + 2S)
        x, b, c = xbc.split([E, S, S], -1)  # (2, B, N, E), (2, B, N, S), (2, B, N, S)
        dt = F.softplus(upcast(dt) + self.dt_bias[:, None, None])  # (2, B, N, H)
        if keep is not None:
            dt = dt * keep  # padded steps: exp(A * 0) = 1 and a zero write, the state passes unchanged
        A = -torch.exp(upcast(self.A_log))[:, None, None]  # (2, 1, 1, H)
        x = upcast(x).view(2, B, N, H, P)  # (2, B, N, H, P)
        q = upcast(c).view(2 * B, 1, N, S)  # (2B, 1, N, S): one group, shared by the heads
        k = upcast(b).view(2 * B, 1, N, S)  # (2B, 1, N, S)
        v = (x * dt[..., None]).view(2 * B, N, H, P).transpose(1, 2)  # (2B, H, N, P)
        g = (dt * A).view(2 * B, N, H).transpose(1, 2)[..., None]  # (2B, H, N, 1): log decay per head and step
        return q, k, v, g, x

    def ssm(self, xbcdt: torch.Tensor, keep: torch.Tensor | None, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Both directions' y = SSM(x) + D x, each causal over the order given -> (2, B, N, E). ``segments``
        (2, B, N), packed rows' example ids in the same order: each example's taps and state stay its own."""
        q, k, v, g, x = self.scan_inputs(xbcdt, keep, segments)
        reset = None if segments is None else _scan.segment_starts(segments).flatten(0, 1)  # (2B, N)
        y = _scan.scan(q, k, v, g, mode=self.scan, chunk=self.chunk_size, reset=reset)  # (2B, H, N, P): both passes
        y = y.transpose(1, 2).view(x.shape) + x * upcast(self.D)[:, None, None, :, None]  # (2, B, N, H, P)
        return y.flatten(3)  # (2, B, N, E)

    def forward(self, u: torch.Tensor, mask: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        N = u.shape[1]
        if segments is not None and mask is None:  # (B, N) example ids, 0 for padding
            mask = segments != 0
        pad = -N % self.chunk_size
        if pad:  # whole chunks (the docstring says why): appended no-op steps, cut off at the end
            mask = torch.ones(u.shape[:2], dtype=torch.bool, device=u.device) if mask is None else mask
            u, mask = F.pad(u, (0, 0, 0, pad)), F.pad(mask, (0, pad))  # (B, N + pad, D), (B, N + pad)
            segments = None if segments is None else F.pad(segments, (0, pad))  # id 0: padding
        z, xbcdt = self.project(u)  # (B, N', E), (2, B, N', E + 2S + H), N' = N + pad
        if segments is not None:  # (2, B, N') example ids in each pass's order
            segments = orient(segments.expand(2, *segments.shape))
        # in the projections' dtype: 0 and 1 multiply exactly in any, and an fp32 mask would make (and keep for the
        # backward) an fp32 copy of the bf16 projections under autocast
        keep = None if mask is None else orient(mask[None, ..., None].to(xbcdt.dtype).expand(2, *mask.shape, 1))
        # The reversed pass runs the same causal code on the flipped rows, where right padding comes first:
        # no-op steps there too.
        y = orient(self.ssm(orient(xbcdt), keep, segments)).sum(0)  # (B, N', E): forward + reversed pass, in place
        y = self.norm(y * F.silu(upcast(z)))  # (B, N', E): Mamba-2's gated RMSNorm, norm after the gate
        return self.out_proj(y[:, :N])  # (B, N, D): the real steps; autocast casts y down, if on
