"""Gated Linear Attention, bidirectional (Yang, Wang, Shen, Panda, Kim 2024, "Gated Linear Attention
Transformers with Hardware-Efficient Training", ICML 2024, https://arxiv.org/abs/2312.06635).

Linear attention with a data-dependent forget gate per key dimension. Per head, with a (Dk x Dv) state S:

    alpha_t = sigmoid(x_t W_1 W_2 + b)^(1/tau),      log alpha_t = logsigmoid(x_t W_1 W_2 + b) / tau <= 0,
    S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,          o_t = q_t S_t / sqrt(Dk),

with a rank-``gate_low_rank`` (16) gate projection and tau = ``gate_logit_normalizer`` (16), which keeps
alpha near 1 (slow forgetting) at initialisation. The layer output is y = (RMSNorm(o) * swish(x W_r)) W_o, the
norm per head, as the paper's GLA layer (the paper writes a LayerNorm and a bias in the output gate; the
authors' code in flash-linear-attention uses RMSNorm and no bias; this follows the code). Widths as the
paper: queries and keys ``expand_k`` = 0.5 of the backbone's d_qkv, values and the output gate ``expand_v`` = 1.

Forms of the scan (``scan``, from ``_scan``): ``chunked`` (the default, every device), the chunked form in plain
PyTorch, vectorised over chunks of ``chunk_size``: the paper's chunkwise form, (q_i exp(G_i)) . (k_j exp(-G_j))
with G the cumulative log gate inside a chunk, while no chunk's total log decay exceeds ``_scan.FACTOR_LIMIT``
(40), else the exact C x C x Dk decays in log space (the paper's secondary chunking does this on the GPU), so no
gate, however small, overflows it; ``fla``, fla-core's Triton ``chunk_gla`` (``pip install lra[ssm]``, CUDA);
``auto``, fla on CUDA where its kernels are not refused (``_scan``), else chunked; ``recurrent``, the definition
step by step (the reference). Why chunked by default: in the compiled layer it is faster than fla's kernel at 4K
and 16K, as for ``mamba``; at 1K, where the layer is bound by the host, fla's kernel is the faster, since the
chunked form's choice of scores above breaks the graph (results/layer_bench.csv, rows ``lra gla(scan=chunked)``
and ``lra gla(scan=fla)``, and the ``lra gla`` rows timed with them).
``scan`` ("chunked", the default, | "fla" | "auto" | "recurrent") and ``chunk_size`` (an integer >= 1, default 64)
are attributes, not constructor options (``execution``, models/base.py's ``execution_settings``): how the layer
runs, never what it computes, so they stay out of a run's config hash; a run sets them with ``trainer.mixer``
(``+trainer.mixer.scan=fla``), the benches with their variants.

Bidirectional: a forward pass and a reversed pass (the same causal scan over the flipped sequence, flipped
back), summed before the norm. Each direction has its own q, k and forget gate (what reads from and writes
to its state), the value, output gate, norm and output projection are shared: the split Vision Mamba (Zhu
et al. 2024, arXiv 2401.09417) makes for its SSM, as ``mamba`` here. With expand_k = 0.5 the mixer holds
5 d_model d_qkv weights (+ the low-rank gates) against the transformer's 4 (one direction alone: 4).

Complexity: O(N Dk Dv) time and O(N (Dk + Dv)) memory per head (chunked: O(N C (Dk + Dv)) more inside the
chunks, C = chunk_size, and (N/C)^1.5 Dk Dv over the chunk summaries).
Precision: projections follow autocast; gates and the norm run in fp32; the scan as ``_scan`` says (fla: bf16 q,
k, v with fp32 states and gates; chunked: fp32 decays, products following autocast).
Padding: padded steps are exact no-ops wherever they sit: their keys and log gates are zeroed, so alpha = 1
and the write k^T v = 0 leave the state unchanged. Flipping a right-padded row puts the padding first, where
it is a no-op too, so both passes equal the passes over the real tokens alone. Padded positions get outputs
the encoder ignores.
Packed rows (``segments``, ``lra.train.packing``): each pass's state is reset at every example's first step in its own
order (the reversed pass: the example's last position), ``_scan``'s ``reset``: chunked, the chunks' weights are
masked at the resets; fla, its variable-length mode; recurrent, a zero decay. Nothing else here crosses positions
(the norm and the gates are per position), so every example gets exactly its own row's outputs. Cost: the
chunked form's (C x C) masks; fla's, one device sync and a fresh chunk per example.
Deviations: the paper's GLA is causal (a language model); the bidirectional sum is ours. Default PyTorch
initialisation (the authors' code uses Xavier with gain 2^-2.5); ``dropout`` and ``max_len`` are unused (no
attention weights, no length limit).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _scan
from ._scan import orient, upcast
from .base import Count, settings
from .registry import Taxonomy, register_model


@register_model
class GLA(nn.Module):
    taxonomy = Taxonomy("Yang et al. 2024, arXiv 2312.06635", "N", ("RC", "KR"), decode=True)
    accepts_no_mask = True  # mask=None: no masking multiplies
    supports_segments = True  # packed rows: each pass's state resets at every example's start
    execution = settings(scan=_scan.SCANS, chunk_size=Count())  # how it runs (the module docstring)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        dropout: float,
        max_len: int,
        *,
        expand_k: float = 0.5,
        expand_v: float = 1.0,
        gate_low_rank: int = 16,
        gate_logit_normalizer: float = 16.0,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        d_k, d_v = int(d_qkv * expand_k), int(d_qkv * expand_v)
        if d_k % n_heads or d_v % n_heads or d_k == 0:
            raise ValueError(f"key width {d_k} and value width {d_v} must be positive multiples of n_heads "
                             f"{n_heads}")
        self.n_heads, self.d_hk, self.d_hv = n_heads, d_k // n_heads, d_v // n_heads
        self.tau = gate_logit_normalizer
        self.scan: _scan.Scan = "chunked"  # the form of the scan (the module docstring)
        self.chunk_size = 64  # steps per chunk of the chunked form
        self.qk = nn.Linear(d_model, 4 * d_k, bias=False)  # q, k of the forward pass, then of the reversed one
        self.forget = nn.ModuleList(  # low-rank gate logits, one per direction
            nn.Sequential(nn.Linear(d_model, gate_low_rank, bias=False), nn.Linear(gate_low_rank, d_k))
            for _ in range(2)
        )
        self.v = nn.Linear(d_model, d_v, bias=False)
        self.gate = nn.Linear(d_model, d_v, bias=False)  # output gate r = swish(x W_r)
        self.norm = nn.RMSNorm(self.d_hv, eps=norm_eps)  # per head, weights shared by the heads (as fla)
        self.out = nn.Linear(d_v, d_model, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        B, N, _ = x.shape
        reset = None
        if segments is not None:  # (B, N) example ids: each pass forgets its state where an example begins
            mask = segments != 0 if mask is None else mask
            reset = _scan.segment_starts(orient(segments.expand(2, B, N))).flatten(0, 1)  # (2B, N), passes' order
        H, Dk, Dv = self.n_heads, self.d_hk, self.d_hv
        q, k = self.qk(x).unflatten(-1, (2, 2, H, Dk)).movedim(2, 0).unbind(3)  # each (2, B, N, H, Dk)
        logit = torch.stack([f(x) for f in self.forget]).unflatten(-1, (H, Dk))  # (2, B, N, H, Dk)
        v = self.v(x).unflatten(-1, (H, Dv)).expand(2, B, N, H, Dv)  # (2, B, N, H, Dv): shared by the passes
        # The reversed pass runs the same causal scan on the flipped rows, where right padding comes first.
        q, k, logit, v = map(orient, (q, k, logit, v))  # each (2, B, N, H, .)
        g = F.logsigmoid(upcast(logit)) / self.tau  # (2, B, N, H, Dk): log alpha <= 0
        if mask is not None:
            keep = orient(mask[None, :, :, None, None].expand(2, B, N, 1, 1)).to(g.dtype)  # (2, B, N, 1, 1)
            k, g = k * keep, g * keep  # padded steps: alpha = 1 and no write, the state passes unchanged
        q, k, v, g = (upcast(t).flatten(0, 1).transpose(1, 2) for t in (q, k, v, g))  # each (2B, H, N, .)
        o = _scan.scan(q, k, v, g, mode=self.scan, chunk=self.chunk_size, scale=Dk ** -0.5,
                       reset=reset)  # (2B, H, N, Dv)
        o = orient(o.transpose(1, 2).unflatten(0, (2, B))).sum(0)  # (B, N, H, Dv): forward + reversed pass
        r = F.silu(upcast(self.gate(x))).unflatten(-1, (H, Dv))  # (B, N, H, Dv): output gate
        return self.out((self.norm(o) * r).flatten(2))  # (B, N, D)
