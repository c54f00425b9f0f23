"""Transformer-XL: segment-level recurrence with relative positional attention (Dai, Yang, Yang, Carbonell, Le,
Salakhutdinov, 2019, "Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context",
https://arxiv.org/abs/1901.02860).

The sequence is cut into segments of ``segment`` tokens (S). Segment t attends to itself and to the cached
states of the ``memory`` segments before it (M), the memory being this layer's *inputs* of those segments under
a stop-gradient, as the paper's SG(h^{n-1}_{tau}) (the harness's pre-LayerNorm blocks hand the mixer LN(x), the
original code's ``pre_lnorm`` form). Keys and values of the window [memory, segment] (L = (M + 1) S positions)
come from the same W_k, W_v; queries only from the segment. Positions are relative (paper Sec. 3.3): with q_i,
k_j the content projections, R the sinusoid table, W_r its projection and u, v two learned per-head vectors,

    A_ij = q_i . k_j  (a)  +  q_i . W_r R_{i-j}  (b)  +  u . k_j  (c)  +  v . W_r R_{i-j}  (d)
         = (q_i + u) . k_j  +  (q_i + v) . W_r R_{i-j},        out_i = softmax_j(A_ij / sqrt(Dh)) v_j.

(b) + (d) are computed once per distance, (q + v) against the P = L + S - 1 projected sinusoids of every
distance a window holds (L - 1 down to -(S - 1)), and moved onto the (query, key) grid by ``rel_shift``
(the paper's trick: row i of the (S, P) table is read from offset S - 1 - i, a strided view, no gather).

All segments are computed at once, batched as an extra dimension: because a segment depends on earlier ones
only through the stop-gradient memory, this equals the paper's recurrence run segment after segment (within
one parameter update). Stacked layers widen the context as in the paper: layer l's memory already saw its own
predecessors, so a token reaches about l x M x S tokens back. Never forward: a CLS token in front (LRA's
``pooling: cls``) reads its own segment alone, at any depth (on Image's one layer, the top 127 pixels); mean
pooling reads every segment.

Complexity: O(N (M + 1) S d) time and O(N (M + 1) S) memory per layer (scores per segment over its window;
"N" in S and M fixed). N is padded up to a multiple of S; a sequence no longer than ``segment`` is one segment
of its own length (no memory), which is exactly full relative attention.
Execution (``backend``, an attribute: how it runs, not what it computes): ``explicit`` (``auto``) forms each
window's scores, softmax and dropout as tensors, keeping only the scores for the backward, which recomputes the
weights (``base.softmax_values``); ``sdpa`` hands (q + u), the keys and the values to fused SDPA with
the position term (b) + (d) as its float mask, so that of the (B, H, n, S, L) tensors only that bias is stored,
not the scores, the probabilities and the dropout mask. ``auto`` = explicit: in the compiled layer it is faster
than ``sdpa`` at every length, since SDPA reads its float mask from memory for every score, and with the weights
recomputed it takes less memory too (results/layer_bench.csv, rows ``lra transformer_xl`` and
``lra transformer_xl(backend=sdpa)``).
Padding: padded keys are masked in every window (memory included) and the window before the first segment is
masked too, so appending padding leaves real outputs unchanged (segments are counted from the start). Padded
queries get an output the encoder ignores. Masking fills the finite dtype minimum, not -inf, so a padded query
with no visible key (a window of only padding) averages finite values instead of producing NaN.

Deviations from the paper:
* Bidirectional within the window: the paper's language model masks keys j > i (causal). Classification
  reads the whole sequence at once, so a token sees its whole segment, later tokens included; the recurrence
  itself stays one-directional (a segment never sees later segments), which is what makes it Transformer-XL.
  Distances then run from -(S - 1) to L - 1, negative ones in the same sinusoid table, as XLNet's
  bidirectional form of this encoding (Yang et al. 2019, https://arxiv.org/abs/1906.08237) does.
* Memory counted in segments (``memory`` x ``segment`` tokens = the paper's mem_len); the paper's training
  runs used mem_len = tgt_len, i.e. ``memory: 1``.
* u and v belong to each layer (the original code's ``untie_r``); its default shares them across layers,
  which a per-layer mixer cannot. No ``clamp_len`` (sinusoids cover any distance; the original code's
  ``clamp_len`` is an evaluation-time knob).
* Training differs from the paper's only in what a step covers: the paper updates the weights between
  segments, so its memory is produced by older weights; here one step sees every segment of an example.

Eager speed: the layer launches few kernels; what eager PyTorch adds is memory traffic over the scores, (S, L)
per segment and head. Eagerly the position table (over P distances), its scaling, the key mask, the content scores
plus that bias, the fp32 upcast, the softmax and the downcast each write a scores-sized tensor, and the backward
(with the checkpoint's recomputation) writes about a dozen more, among them ``rel_shift``'s slices scattered into
zero-filled copies of the table and the softmax gradient in fp32. Compiled, Inductor reads the table through
``rel_shift`` inside one kernel that scales, masks, adds and takes the softmax, and fuses the backward likewise, so
only the matmuls' outputs and a few fused results reach memory. Debugging eagerly, on a CPU or a GPU, expect it
several times slower than compiled and its peak memory higher, from those intermediates.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import MultiHeadMixer, chosen_backend, softmax_values
from .registry import Taxonomy, register_model

BACKENDS = ("auto", "explicit", "sdpa")  # auto = explicit (the module docstring says why)


def sinusoid(distances: torch.Tensor, d: int) -> torch.Tensor:
    """The paper's table R: [sin(p w), cos(p w)] with w_k = 10000^(-2k/d), concatenated halves (its code's
    ``PositionalEmbedding``). distances (P,) float -> (P, d)."""
    inv_freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32, device=distances.device) * (-math.log(1e4) / d))
    angles = distances.float()[:, None] * inv_freq[None, :]  # (P, ceil(d / 2))
    return torch.cat([angles.sin(), angles.cos()], dim=-1)[:, :d]  # (P, d)


def rel_shift(table: torch.Tensor, length: int) -> torch.Tensor:
    """(..., S, P) scores per (query, distance), distances L - 1 down to -(S - 1) (P = L + S - 1), for queries
    at the last S of L window positions -> (..., S, L) scores per (query i, key j), distance L - S + i - j.

    Column S - 1 - i + j of row i: in the flattened (S P) rows that is offset (S - 1) + i (P - 1) + j, so
    dropping the first S - 1 entries and reading rows of P - 1 gives it at (i, j). Views only."""
    S, P = table.shape[-2:]
    flat = table.flatten(-2)[..., S - 1: S - 1 + S * (P - 1)]  # (..., S (P - 1))
    return flat.unflatten(-1, (S, P - 1))[..., :length]  # (..., S, L)


def earlier(t: torch.Tensor, m: int, dim: int) -> torch.Tensor:
    """t with its segments (along ``dim``) moved m later: slot s holds segment s - m, the first m slots zero
    (False for a mask), i.e. what lies m segments before each segment."""
    n = t.shape[dim]
    m = min(m, n)
    zeros = t.new_zeros(t.shape[:dim] + (m,) + t.shape[dim + 1:])
    return torch.cat([zeros, t.narrow(dim, 0, n - m)], dim)


@register_model
class TransformerXL(MultiHeadMixer):
    taxonomy = Taxonomy("Dai et al. 2019, arXiv 1901.02860", "N", ("RC",), decode=True)
    backends = BACKENDS  # the values of ``backend`` (how it runs, not what it computes)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        dropout: float,
        max_len: int,
        *,
        segment: int = 128,
        memory: int = 1,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if segment < 1:
            raise ValueError(f"segment must be >= 1, got {segment}")
        if memory < 0:
            raise ValueError(f"memory must be >= 0 segments, got {memory}")
        self.segment, self.memory, self.d_model = int(segment), int(memory), d_model
        self.backend = "auto"  # "explicit" | "sdpa" (the window attention); how it runs, not what
        self.r_net = nn.Linear(d_model, d_qkv, bias=False)  # W_r: sinusoid -> per-head relative keys
        # u, v: the global content and position biases; N(0, 0.02) as the original code's init_std
        self.u = nn.Parameter(torch.randn(n_heads, self.d_head) * 0.02)
        self.v = nn.Parameter(torch.randn(n_heads, self.d_head) * 0.02)

    def project_kv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of states h (B, T, D) through this layer's W_k, W_v -> (B, H, T, Dh) each."""
        B, T, _ = h.shape
        d_qkv = self.n_heads * self.d_head
        kv = F.linear(h, self.qkv.weight[d_qkv:]).view(B, T, 2, self.n_heads, self.d_head)  # (B, T, 2, H, Dh)
        k, v = kv.permute(2, 0, 3, 1, 4)  # each (B, H, T, Dh)
        return k, v

    def windows(self, x: torch.Tensor, mask: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: int):
        """Each segment's keys, values (B, H, n, L, Dh) and key mask (B, n, L) over [memory, segment], oldest
        first. x (B, n S, D) and mask (B, n S) are the padded inputs, k, v (B, H, n S, Dh) their projections."""
        B, H, T, Dh = k.shape
        n = T // S
        k_mem, v_mem = self.project_kv(x.detach())  # the memory: stop-gradient states, live W_k, W_v
        k, v, k_mem, v_mem = (t.view(B, H, n, S, Dh) for t in (k, v, k_mem, v_mem))  # (B, H, n, S, Dh)
        keep = mask.view(B, n, S)  # (B, n, S)
        back = range(self.memory, 0, -1)  # M segments back ... 1 segment back
        keys = torch.cat([earlier(k_mem, m, 2) for m in back] + [k], dim=3)  # (B, H, n, L, Dh)
        values = torch.cat([earlier(v_mem, m, 2) for m in back] + [v], dim=3)  # (B, H, n, L, Dh)
        keep = torch.cat([earlier(keep, m, 1) for m in back] + [keep], dim=2)  # (B, n, L)
        return keys, values, keep

    def relative_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor):
        """q (B, H, n, S, Dh) at the last S positions of each window; keys, values (B, H, n, L, Dh); keep
        (B, n, L) -> (B, H, n, S, Dh)."""
        S, L, H, Dh = q.shape[3], keys.shape[3], self.n_heads, self.d_head
        distances = torch.arange(L - 1, -S, -1, device=q.device)  # (P,): L - 1 down to -(S - 1)
        r = self.r_net(sinusoid(distances, self.d_model).to(q.dtype))  # (P, H Dh): W_r R
        r = r.view(-1, H, Dh).permute(1, 2, 0)  # (H, Dh, P)
        # an einsum, not a broadcast matmul, which would keep r expanded over batch and segments for its backward
        table = torch.einsum("bhnsd,hdp->bhnsp", q + self.v[:, None, None, :], r)  # (B, H, n, S, P)
        position = rel_shift(table, L) * Dh**-0.5  # (B, H, n, S, L): (b) + (d)
        bias = position.masked_fill(~keep[:, None, :, None, :], torch.finfo(position.dtype).min)  # (B, H, n, S, L)
        content_q = q + self.u[:, None, None, :]  # (B, H, n, S, Dh): (a) + (c) = (q + u) . k
        if chosen_backend(self) == "sdpa":  # heads and segments as one batch dimension: (B, H n, ., .)
            o = F.scaled_dot_product_attention(content_q.flatten(1, 2), keys.flatten(1, 2), values.flatten(1, 2),
                                               attn_mask=bias.flatten(1, 2), dropout_p=self.dropout_p)
            return o.unflatten(1, (H, -1))  # (B, H n, S, Dh) -> (B, H, n, S, Dh)
        # bias + scale (q + u) k^T: one elementwise kernel eagerly (and one rounding), as in the compiled layer
        scores = torch.add(bias, content_q @ keys.transpose(-1, -2), alpha=Dh**-0.5)  # (B, H, n, S, L)
        return softmax_values(scores, values, self.dropout_p)  # (B, H, n, S, Dh): weights recomputed, not kept

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        S = min(self.segment, N)  # a short sequence is one segment: padding it to S would change nothing
        n = -(-N // S)
        x = F.pad(x, (0, 0, 0, n * S - N))  # (B, n S, D)
        mask = F.pad(mask, (0, n * S - N), value=False)  # (B, n S)
        q, k, v = self.project(x)  # each (B, H, n S, Dh)
        keys, values, keep = self.windows(x, mask, k, v, S)  # (B, H, n, L, Dh) x 2, (B, n, L)
        q = q.view(B, self.n_heads, n, S, self.d_head)  # (B, H, n, S, Dh)
        o = self.relative_attention(q, keys, values, keep)  # (B, H, n, S, Dh)
        o = o.reshape(B, self.n_heads, n * S, self.d_head)[:, :, :N]  # (B, H, N, Dh)
        return self.out(o.transpose(1, 2).reshape(B, N, -1))  # (B, N, D)
