"""Transformer: exact softmax attention (Vaswani et al., 2017, "Attention Is All You Need",
https://arxiv.org/abs/1706.03762), the baseline every other mixer in this package is read against.

softmax(Q K^T / sqrt(d)) V through ``torch.nn.functional.scaled_dot_product_attention``, which picks a
fused kernel (cuDNN / FlashAttention / memory-efficient) on CUDA and a fused CPU kernel otherwise.
Padded keys are masked out; padded queries still compute an output, which the encoder ignores.

Packed rows (``segments``, ``lra/train/packing.py``): each example's queries see its own keys only. On CUDA the
row's runs of one segment (each example, and the padding after the last one) become the sequences of a
jagged nested tensor, for which SDPA runs the variable-length fused kernels, attention dropout included: a
dense block-diagonal mask would leave SDPA only its memory-efficient kernel, with which packed training under
LRA's attention dropout is slower than unpacked training. ``backend = "varlen"`` calls that same
variable-length flash kernel directly (fp16/bf16 on CUDA, the default there; the jagged path otherwise), without
the nested tensor, whose Python dispatch takes about half of a packed step's host time: through varlen, packed
ListOps trains faster than unpacked, through the nested tensor slower (docs/performance.md, packing). Elsewhere (or
``backend = "dense"``) the (B, 1, N, N) block-diagonal mask, the reference the tests hold both to.

Small heads (``backend = "small_head"``, unpacked rows): ``models/_small_head.py``, Triton kernels of the same exact
attention for head sizes up to 32. SDPA's fused kernels take head sizes in multiples of 8, so a head of 4 (LRA's
Pathfinder: 4 heads over d_qkv 16) is padded to 8, and FlashAttention's smallest kernel computes with 32 columns:
most of its reads, products and (backward) dQ accumulation carry zeros. The small-head kernels pad to 16 in
registers only (the least depth of a tensor-core product), sum dQ over its real columns only (by atomic adds
from the dK/dV kernel; under torch's deterministic mode from a kernel of its own), and fold the scale into the
exponent. Their attention dropout departs from FlashAttention's Philox: each
score's keep decision is a counter-based integer hash of (seed, batch-head, query, key), a few integer operations
per score, statistically equivalent (each score kept independently with probability 1 - p), the seed drawn from
torch's RNG each call. "auto" takes them on CUDA for 16-bit inputs (bf16/fp16, as autocast gives) with heads
off a multiple of 8, which SDPA would pad: at Pathfinder's shape (4 heads of 4, N 1,024, batch 512) a layer runs
faster and in less memory than through SDPA, with attention dropout and without (results/layer_bench.csv, width
32x4x16). Elsewhere "auto" keeps SDPA; on the CPU the kernels run only under Triton's interpreter, for the tests.

Causal form (``causal = True``, set on an instance: next-token pretraining, ``lra.train.pretrain``): query i
attends to keys j <= i, through SDPA on unpacked rows (``is_causal`` without padding, else the padding mask and the
lower triangle as one (B, 1, N, N) mask).

Complexity: O(N^2 d) time; O(N) extra memory with the fused kernels (the N x N scores are never stored); the
small-head kernels keep O(N) per head for the backward (the output and one log-sum-exp per query).
Deviation from LRA: none in the mechanism (LRA also masks padded queries, which only changes outputs at
padded positions).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .base import MultiHeadMixer, chosen_backend, once_per_batch, pad_head_dim, same_segment
from .registry import Taxonomy, register_model

try:  # Triton comes with CUDA builds of torch; without it the small-head kernels are not available
    from ._small_head import MAX_HEAD, small_head_attention
except ImportError:
    small_head_attention, MAX_HEAD = None, 0



@register_model
class Transformer(MultiHeadMixer):
    taxonomy = Taxonomy("Vaswani et al. 2017, arXiv 1706.03762", "N^2", (), decode=True)
    # the values of ``backend`` (how it runs, not what it computes)
    backends = ("auto", "varlen", "jagged", "dense", "small_head")
    accepts_no_mask = True  # mask=None (no padding anywhere): SDPA's unmasked kernels, faster than its masked ones
    supports_segments = True
    supports_causal = True  # ``causal``: query i attends to keys j <= i (unpacked rows, SDPA)

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        # packed rows: "varlen", "jagged" or "dense"; unpacked: "small_head" (models/_small_head.py) or SDPA; how it
        # runs, not what it computes
        self.backend = "auto"
        self.causal = False  # True: the causal form (models/base.py), for next-token pretraining

    def takes_small_head(self, q: torch.Tensor, segments: torch.Tensor | None) -> bool:
        """Whether the small-head kernels run: when ``backend`` names them (unpacked rows, head size <= 32, CUDA or
        Triton's interpreter), and under "auto" where ``small_heads_suit`` the rows."""
        backend = chosen_backend(self)
        if backend == "auto":
            return segments is None and small_heads_suit(q)
        if backend == "small_head":
            if segments is not None:
                raise ValueError("backend='small_head' takes unpacked rows only; packed rows (segments) run SDPA's "
                                 "paths: set backend='auto', 'varlen', 'jagged' or 'dense'")
            if small_head_attention is None:
                raise ModuleNotFoundError("backend='small_head' needs the triton package (it comes with CUDA builds of "
                                          "torch): pip install triton, or set backend='auto'")
            if q.shape[-1] > MAX_HEAD:
                raise ValueError(f"backend='small_head' takes head sizes up to {MAX_HEAD}, got {q.shape[-1]}")
            if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError("backend='small_head' runs on CUDA, or on the CPU under Triton's interpreter "
                                 "(TRITON_INTERPRET=1 before triton is imported); here set backend='auto'")
            return True
        return False

    def packed_path(self, q: torch.Tensor) -> str:
        """The path of packed rows: the one ``backend`` names; under "auto", "varlen" where flash runs (fp16/bf16
        on CUDA), "jagged" elsewhere on CUDA (its twin, for fp32), "dense" off CUDA."""
        backend = chosen_backend(self)
        if backend == "dense" or (backend == "auto" and not q.is_cuda):
            return "dense"
        flash = cuda_16_bit(q)
        return "varlen" if backend != "jagged" and flash else "jagged"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        d_head = q.shape[-1]
        if self.causal:
            return self.attend_causal(q, k, v, mask, segments)
        if self.takes_small_head(q, segments):  # no padding, no N x N scores, the cheap dropout hash
            return small_head_attention(q, k, v, mask, self.dropout_p)  # (B, H, N, d_head), a view of (B, N, H, d)
        # The fused CUDA kernels take head sizes in multiples of 8; off that SDPA falls back to the math kernel,
        # which stores the N x N scores and is far slower (Pathfinder's head size is 4).
        q, k, v = pad_head_dim(-(-d_head // 8) * 8, q, k, v)  # (B, H, N, multiple of 8)
        path = "dense" if segments is None else self.packed_path(q)
        if path != "dense":
            attention = varlen_attention if path == "varlen" else jagged_attention
            o = attention(q, k, v, segments, self.dropout_p, d_head ** -0.5)
        else:
            if segments is not None:
                key_mask = same_segment(segments)  # (B, 1, N, N): each example's queries see its own keys
            else:
                key_mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, N): the real keys
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=self.dropout_p,
                                               scale=d_head ** -0.5)
        return o[..., :d_head]  # (B, H, N, d_head)

    def attend_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      segments: torch.Tensor | None) -> torch.Tensor:
        """The causal form through SDPA: query i sees the real keys j <= i. Padding follows an example's real
        tokens, so every real query keeps at least its own key (no row of the mask is empty)."""
        if segments is not None or chosen_backend(self) == "small_head":
            raise ValueError("the causal form runs unpacked rows through SDPA: leave backend at auto, dense or "
                             "varlen, and pack nothing")
        d_head = q.shape[-1]
        q, k, v = pad_head_dim(-(-d_head // 8) * 8, q, k, v)  # (B, H, N, multiple of 8), as ``attend``
        if mask is None:  # SDPA's own causal kernels
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p, is_causal=True, scale=d_head ** -0.5)
        else:
            N = q.shape[-2]
            past = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()  # (N, N): key j <= query i
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :] & past,
                                               dropout_p=self.dropout_p, scale=d_head ** -0.5)  # mask (B, 1, N, N)
        return o[..., :d_head]  # (B, H, N, d_head)


def cuda_16_bit(q: torch.Tensor) -> bool:
    """Rows the fused 16-bit kernels take: on CUDA, in fp16 or bf16 (as autocast gives)."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def small_heads_suit(q: torch.Tensor) -> bool:
    """"auto"'s choice of the small-head kernels for q (B, H, N, Dh): ``cuda_16_bit`` rows whose Dh is off a
    multiple of 8 (which SDPA pads) and at most MAX_HEAD (0 without triton)."""
    return cuda_16_bit(q) and q.shape[-1] % 8 != 0 and q.shape[-1] <= MAX_HEAD


@once_per_batch
def run_starts(segments: torch.Tensor) -> torch.Tensor:
    """(R, M) segment ids -> (S + 1,) int64 offsets into the R * M flattened positions: where each run of one
    segment starts (a change of id, or a new row), then R * M. The padding after a row's last example is a run
    of its own: its queries see only padding, as in ``same_segment``, and its outputs are ignored."""
    R, M = segments.shape
    start = F.pad(segments[:, 1:] != segments[:, :-1], (1, 0), value=True)  # (R, M): True where a run begins
    return F.pad(start.flatten().nonzero().squeeze(1), (0, 1), value=R * M)  # (S + 1,)


@torch.compiler.disable  # the number of runs is read off the data: SDPA's jagged call runs outside the graph
def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, dropout_p: float,
                     scale: float) -> torch.Tensor:
    """Packed rows q, k, v (R, H, M, Dh) -> (R, H, M, Dh): softmax attention within each run of one segment,
    as SDPA over a jagged nested tensor (one sequence per run; CUDA: the variable-length fused kernels)."""
    R, H, M, Dh = q.shape
    offsets = run_starts(segments)  # (S + 1,)

    def jagged(x: torch.Tensor) -> torch.Tensor:  # (R, H, M, Dh) -> (S, H, j, Dh), j = each run's length
        flat = x.transpose(1, 2).reshape(R * M, H, Dh).contiguous()  # (R M, H, Dh): positions in row order
        # bounds, not the exact lengths: SDPA would read those off the device (a synchronisation per call)
        return torch.nested.nested_tensor_from_jagged(flat, offsets, min_seqlen=1, max_seqlen=M).transpose(1, 2)

    o = F.scaled_dot_product_attention(jagged(q), jagged(k), jagged(v), dropout_p=dropout_p, scale=scale)
    return o.transpose(1, 2).values().view(R, M, H, Dh).transpose(1, 2)  # (R, H, M, Dh)


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_len: int,
                 dropout_p: float, scale: float) -> torch.Tensor:
    """Flash attention's variable-length kernel (the one SDPA runs for a jagged nested tensor; differentiable,
    dropout included): q, k, v (T, H, Dh) fp16/bf16 on CUDA, sequences at ``offsets`` (S + 1,) int32 -> (T, H, Dh)."""
    return torch.ops.aten._flash_attention_forward(q, k, v, offsets, offsets, max_len, max_len, dropout_p, False,
                                                   False, scale=scale)[0]


@torch.compiler.disable  # as jagged_attention: the number of runs is read off the data
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, dropout_p: float,
                     scale: float) -> torch.Tensor:
    """``jagged_attention`` without the nested tensor: packed rows q, k, v (R, H, M, Dh) -> (R, H, M, Dh), the
    rows' positions end to end and the runs' offsets handed to the kernel as they are."""
    R, H, M, Dh = q.shape
    offsets = run_starts(segments).to(torch.int32)  # (S + 1,)
    # M bounds every run's length: the kernel sizes its grid by it, and blocks past a run's end return at once
    flat = [x.transpose(1, 2).reshape(R * M, H, Dh) for x in (q, k, v)]  # each (R M, H, Dh): positions in row order
    o = flash_varlen(*flat, offsets, M, dropout_p, scale)  # (R M, H, Dh)
    return o.view(R, M, H, Dh).transpose(1, 2)  # (R, H, M, Dh)
