"""cosFormer: linear attention with a ReLU kernel and a cosine re-weighting of distances (Qin, Sun, Deng, Li, Wei,
Lv, Yan, Kong, Zhong, 2022, "cosFormer: Rethinking Softmax in Attention", ICLR 2022,
https://arxiv.org/abs/2202.08791).

softmax(q . k) is replaced by a non-negative similarity that decays with distance: with positions i, j in
1..M,

    s_ij = relu(q_i) . relu(k_j) cos(pi/2 (i - j) / M),      out_i = sum_j s_ij v_j / max(sum_j s_ij, eps),

eps = 1e-6 (the official code's clamp). Since |i - j| < M the cosine is positive, so s_ij >= 0: the ReLU
kernel's non-negativity is kept and nearby tokens weigh more (the paper's locality bias). The cosine of a
difference splits, cos(a_i - a_j) = cos a_i cos a_j + sin a_i sin a_j with a_i = pi i / (2 M), so with

    q~_i = [relu(q_i) cos a_i, relu(q_i) sin a_i],   k~_j = [relu(k_j) cos a_j, relu(k_j) sin a_j]   (2 Dh each)

s_ij = q~_i . k~_j and the sums over keys factorise as in linear attention: one (2 Dh x (Dh + 1)) summary
sum_j k~_j [v_j, 1]^T (values and the normaliser in one matmul), then one matmul applies it to every query.

M, and padding. The official code takes M = the (padded) batch length, so appending padding changes every
real output. Here ``reweight_length: real`` (default) takes M per example as the position of its last real
token (its real length when padding is appended, as in LRA): appending padding changes nothing, an example
is re-weighted the same way whatever batch it is in, and an unpadded sequence gets the paper's M (its
length). ``reweight_length: max_len`` takes M = max_len for all: also exact under padding, and a fixed M is
what token-by-token decoding needs, but short sequences then see almost no decay (cos ~ 1). Padded keys
are zeroed in k~, so they never contribute; padded queries are zeroed in q~ and output exactly 0 (past M their
cosines would turn negative and the normaliser could approach 0).

Complexity: O(N Dh^2) time and O(N Dh) memory per head (the features are 2 Dh wide); nothing N x N.
Precision: features, angles, summaries and the normaliser run in fp32 even under bf16 autocast (a bf16 key
sum over thousands of tokens loses the normaliser's precision), as ``linear``.
Deviations from the official code (``OpenNLPLab/cosFormer``): M per example (above) and a padding mask (it
has none); the harness's projections have no bias. Attention dropout is not applied (no attention matrix;
the official code has none either). Only the bidirectional form is registered (the paper's causal form is a
prefix sum of the same summaries; decoding token by token would need M fixed in advance, e.g. max_len).

Eager speed: beside its two matmuls the method is elementwise work on (B, H, N, 2 Dh) fp32 features, and eagerly
each step is a kernel of its own that writes a full-size tensor and reads it back (the ReLU, the cos/sin product,
v's upcast and column of ones, the division by the normaliser, the cast back, and in the backward the gradient of
each, where the two slices of the (Dh + 1)-wide product are padded back with zeros and added), while Inductor
fuses each chain into one kernel beside the matmuls. The re-weighting table is only (B, N), so rebuilding it per
call costs nothing that matters; the mask is folded into it and each side's features are one broadcast product,
which keeps the eager chain short. Eagerly the layer computes the same values (to fp32 rounding), memory-bound and
slower than compiled, the backward most.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from .base import MultiHeadMixer, with_ones
from .registry import Taxonomy, register_model

EPS = 1e-6  # lower clamp of the normaliser, as the official code


def reweighting_angles(mask: torch.Tensor, length: torch.Tensor | int, dtype: torch.dtype) -> torch.Tensor:
    """a_i = pi/2 * i / M for positions i = 1..N: (B, N). ``length`` is M, an int or a (B,) tensor."""
    position = torch.arange(1, mask.shape[1] + 1, device=mask.device, dtype=dtype)  # (N,): 1-based, as the paper
    if isinstance(length, torch.Tensor):
        length = length.to(dtype)[:, None]  # (B, 1)
    return (math.pi / 2) * position[None, :] / length  # (B, N)


def cos_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, angle: torch.Tensor):
    """q, k, v (B, H, N, Dh), mask (B, N), angle (B, N) -> (B, H, N, Dh) in fp32 (fp64 stays fp64)."""
    # [cos a, sin a], 0 at padding: padded keys contribute nothing; padded queries (past M their cosines turn
    # negative, so their normaliser could cross 0) get exactly 0. The mask is folded into this (B, N) table, and
    # one broadcast product per side writes [relu(x) cos a, relu(x) sin a] (the concatenation, with the same
    # values): eagerly that is one kernel over (B, H, N, 2 Dh) instead of an upcast, a mask product, two
    # products and a cat. The ReLU runs in the input's dtype (exact), the product in fp32 at least.
    weights = torch.stack([angle.cos(), angle.sin()], dim=-1) * mask[..., None]  # (B, N, 2)
    weights = weights[:, None, :, :, None]  # (B, 1, N, 2, 1)

    def features(x: torch.Tensor) -> torch.Tensor:
        return (F.relu(x)[..., None, :] * weights).flatten(-2)  # (B, H, N, 2, Dh) -> (B, H, N, 2 Dh)

    fq, fk = features(q), features(k)  # (B, H, N, 2 Dh) each
    v1 = with_ones(v)  # (B, H, N, Dh + 1): [v, 1] gives the normaliser too
    summary = fk.transpose(-1, -2) @ v1  # (B, H, 2 Dh, Dh + 1): [sum k~ v^T | sum k~]
    o1 = fq @ summary  # (B, H, N, Dh + 1): [numerator | normaliser]
    return o1[..., :-1] / o1[..., -1:].clamp_min(EPS)  # (B, H, N, Dh)


@register_model
class CosFormer(MultiHeadMixer):
    taxonomy = Taxonomy("Qin et al. 2022, arXiv 2202.08791", "N", ("KR",), decode=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        dropout: float,
        max_len: int,
        *,
        reweight_length: Literal["real", "max_len"] = "real",
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if reweight_length not in ("real", "max_len"):
            raise ValueError(f"reweight_length must be 'real' or 'max_len', got {reweight_length!r}")
        self.reweight_length = reweight_length

    def reweight_m(self, mask: torch.Tensor) -> torch.Tensor | int:
        """M: the 1-based position of each example's last real token (B,), or max_len."""
        if self.reweight_length == "max_len":
            self.check_length(mask.shape[1])  # positions past M would get negative weights
            return self.max_len
        position = torch.arange(1, mask.shape[1] + 1, device=mask.device)  # (N,)
        return (position * mask).amax(-1).clamp_min(1)  # (B,): an all-padding row still gets a finite angle

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=q.device.type, enabled=False):
            dtype = torch.promote_types(q.dtype, torch.float32)  # upcast(q)'s dtype, without converting q
            angle = reweighting_angles(mask, self.reweight_m(mask), dtype)  # (B, N)
            return cos_attention(q, k, v, mask, angle).to(q.dtype)  # (B, H, N, Dh)
