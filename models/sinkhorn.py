"""Sparse Sinkhorn Attention: local block attention plus attention to a learned, softly sorted block.

Paper: Yi Tay, Dara Bahri, Liu Yang, Donald Metzler, Da-Cheng Juan, "Sparse Sinkhorn Attention", 2020,
https://arxiv.org/abs/2002.11296.

The (padded) sequence is cut into NB = ceil(N / b) blocks of ``block_size`` b. Per head, a sort network
(one Linear, Dh -> NB_max logits, shared across heads as in LRA) reads each block's summary (the masked
mean of its keys) and emits row i of an NB x NB logit matrix: where block i wants to draw from. Optional
Gumbel noise (training only), division by ``temperature`` and ``sinkhorn_iters`` rounds of log-space
row/column normalisation (in fp32; on CUDA through ``torch.compile`` unless the attribute ``compile_sinkhorn``
is False, since the eager loop's tiny kernels would dominate the layer) make it a soft permutation P
(approximately doubly stochastic). ``compile_sinkhorn`` (True | False, default True) is how the layer runs, never
what it computes (``execution``, models/base.py's ``execution_settings``): not a constructor option, out of a run's
config hash; a run sets it with ``trainer.mixer``, the benches with their variants.
Sorted keys and values are P applied over blocks: K_sorted[i] = sum_j P[i, j] K[j]. Each query block
then attends to its own block and, separately, to its sorted block, and the two outputs are summed
(the paper's local + Sinkhorn mixture, and LRA's ``x + sorted_x``). Both are batched
``scaled_dot_product_attention`` calls over blocks (fused kernels on GPU).

Complexity: attention O(N b d); the sort logits and Sinkhorn O(NB^2) = O((N/b)^2) memory and
O((N/b)^2 * iters) time; applying the soft P costs O(N * N/b * d) FLOPs (a dense NB x NB matmul over
the keys/values, cheap GEMMs next to the attention for LRA sizes) and O(N d) memory. No N x N tensor.

Deviations from LRA's code: LRA's sorting einsum sums over both block indices, so every "sorted" block
is the sum of all blocks and the sort net gets no gradient; here P is applied per block row and the sort
net is trained (tested). LRA uses a plain softmax as "sort activation" (no Sinkhorn iterations), sums
key blocks (we take the masked mean, which does not change with padding), reshapes blocks with a
stride (we use contiguous blocks), and needs N to be a multiple of the block (we pad internally).
From the paper: the sort net is LRA's single Linear on per-head key summaries (the paper allows a
deeper net on block summaries); no causal variant, no SortCut.

``mask=None`` (no padding in the batch) with N a multiple of the block: nothing is masked, and both
attentions run SDPA unmasked (its flash kernel, not the memory-efficient one a mask leaves it). Otherwise
the internal padding to whole blocks is masked as any padding.

Padding: K and V are zeroed at padded positions before summaries and sorting, padded keys are masked
in the local attention, and the sort logits between a real block and an all-padding block are masked,
so Sinkhorn balances the real blocks among themselves (the all-padding blocks among themselves). A
sorted key position is masked when less than half of its mixture comes from real tokens (only the
last, partly filled real block can contribute padding). Appending padding therefore leaves outputs at
real positions unchanged (in training up to the random draws of dropout and Gumbel noise, which
depend on the padded size); changing padded content never changes them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import MultiHeadMixer, compiled, settings
from .registry import Taxonomy, register_model

MASKED_LOGIT = -1e9  # finite: each row keeps its own diagonal entry, so no row is all masked


def sinkhorn(log_alpha: torch.Tensor, n_iters: int) -> torch.Tensor:
    """Log-space Sinkhorn normalisation of (..., n, n) logits in fp32 (call it with autocast off).
    Returns exp, doubly stochastic up to the convergence of ``n_iters`` row-then-column rounds (the
    columns exactly)."""
    x = log_alpha.float()
    for _ in range(n_iters):
        for dim in (-1, -2):  # rows, then columns, sum to 1
            # Any shift is exact in a logsumexp; detached, the max adds no backward work.
            x = x - x.detach().amax(dim=dim, keepdim=True)
            x = x - x.exp().sum(dim=dim, keepdim=True).log()
    return x.exp()


def fused_sinkhorn(log_alpha: torch.Tensor, n_iters: int) -> torch.Tensor:
    """``sinkhorn`` through ``torch.compile`` (built on first use). In eager mode each iteration is some
    25 tiny kernels forward and backward, which dominate the layer's GPU time; compiled, a few."""
    return compiled(sinkhorn, dynamic=True)(log_alpha, n_iters)


@register_model
class Sinkhorn(MultiHeadMixer):
    taxonomy = Taxonomy("Tay et al. 2020, arXiv 2002.11296", "N", ("LP",), decode=True)
    accepts_no_mask = True  # mask=None, whole blocks: both attentions unmasked
    execution = settings(compile_sinkhorn=(True, False))  # how it runs (the module docstring)

    def __init__(
        self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *, block_size: int = 64,
        sinkhorn_iters: int = 8, temperature: float = 0.75, gumbel_noise: bool = False,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if block_size < 1:
            raise ValueError(f"sinkhorn: block_size must be >= 1, got {block_size}")
        if sinkhorn_iters < 1 or temperature <= 0:
            raise ValueError(f"sinkhorn: need sinkhorn_iters >= 1 and temperature > 0, got {sinkhorn_iters}, "
                             f"{temperature}")
        self.block, self.iters, self.temperature, self.gumbel = block_size, sinkhorn_iters, temperature, gumbel_noise
        self.compile_sinkhorn = True  # CUDA: the normalisation loop through torch.compile
        self.max_blocks = math.ceil(max_len / block_size)
        self.sort_net = nn.Linear(self.d_head, self.max_blocks)  # block summary -> logits over source blocks

    def sort_matrix(self, k: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """Zeroed keys (B, NB, b, H, Dh) and the real-token mask (B, NB, b), None if every token is real ->
        soft permutation P (B, H, NB, NB), P[.., i, j] = share of source block j in sorted block i."""
        NB = k.shape[1]
        if real is None:
            summary = k.mean(2)  # (B, NB, H, Dh)
        else:
            count = real.sum(-1).clamp_min(1)  # (B, NB)
            summary = k.sum(2) / count[:, :, None, None].to(k.dtype)  # (B, NB, H, Dh): mean over real tokens
        logits = F.linear(summary, self.sort_net.weight[:NB], self.sort_net.bias[:NB])  # (B, NB, H, NB)
        with torch.autocast(device_type=k.device.type, enabled=False):
            logits = logits.float().transpose(1, 2)  # (B, H, NB, NB)
            if self.gumbel and self.training:
                u = torch.rand_like(logits).clamp_(1e-6, 1 - 1e-6)
                logits = logits - torch.log(-torch.log(u))  # Gumbel-Sinkhorn
            logits = logits / self.temperature
            if real is not None:
                block_real = real.any(-1)  # (B, NB)
                cross = block_real[:, :, None] != block_real[:, None, :]  # (B, NB, NB): real <-> all-padding
                logits = logits.masked_fill(cross[:, None], MASKED_LOGIT)
            fused = self.compile_sinkhorn and logits.is_cuda and not torch.compiler.is_compiling()
            return (fused_sinkhorn if fused else sinkhorn)(logits, self.iters)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, N, _ = x.shape
        self.check_length(N)
        H, Dh, b = self.n_heads, self.d_head, self.block
        pad = -N % b
        if pad:
            mask = x.new_ones(B, N, dtype=torch.bool) if mask is None else mask  # the blocks' padding is masked
            x = F.pad(x, (0, 0, 0, pad))  # (B, Np, D)
            mask = F.pad(mask, (0, pad), value=False)  # (B, Np)
        NB = x.shape[1] // b
        real = None if mask is None else mask.view(B, NB, b)  # (B, NB, b)
        qkv = self.qkv(x).view(B, NB, b, 3, H, Dh)  # (B, NB, b, 3, H, Dh)
        q = qkv[:, :, :, 0]  # (B, NB, b, H, Dh)
        kv = qkv[:, :, :, 1:]  # (B, NB, b, 2, H, Dh)
        if real is not None:  # zero padded keys/values: they must not leak into summaries or sorted mixtures
            kv = kv * real[:, :, :, None, None, None].to(qkv.dtype)
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]  # each (B, NB, b, H, Dh)

        P = self.sort_matrix(k, real)  # (B, H, NB, NB)
        sorted_kv = torch.einsum("bhij,bjtshd->bishtd", P.to(kv.dtype), kv)  # (B, NB, 2, H, b, Dh)
        sorted_mask = None  # mask=None, whole blocks: every sorted key is real
        if real is not None:
            sorted_real = torch.einsum("bhij,bjt->bhit", P.detach(), real.to(P.dtype)) > 0.5  # (B, H, NB, b)
            sorted_mask = sorted_real.transpose(1, 2).reshape(B * NB, H, 1, b)  # (B*NB, H, 1, b)

        # Blocks become the batch: (B*NB, H, b, Dh) views for q, k, v (merging B and NB needs no copy).
        qb = q.reshape(B * NB, b, H, Dh).transpose(1, 2)  # (B*NB, H, b, Dh)
        kb = k.reshape(B * NB, b, H, Dh).transpose(1, 2)  # (B*NB, H, b, Dh)
        vb = v.reshape(B * NB, b, H, Dh).transpose(1, 2)  # (B*NB, H, b, Dh)
        local_mask = None if real is None else real.reshape(B * NB, 1, 1, b)  # (B*NB, 1, 1, b)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=local_mask, dropout_p=self.dropout_p)

        sk = sorted_kv[:, :, 0].reshape(B * NB, H, b, Dh)  # (B*NB, H, b, Dh)
        sv = sorted_kv[:, :, 1].reshape(B * NB, H, b, Dh)  # (B*NB, H, b, Dh)
        o = o + F.scaled_dot_product_attention(qb, sk, sv, attn_mask=sorted_mask, dropout_p=self.dropout_p)

        o = o.transpose(1, 2).reshape(B, NB * b, H * Dh)[:, :N]  # (B, N, H*Dh)
        return self.out(o)  # (B, N, D)
