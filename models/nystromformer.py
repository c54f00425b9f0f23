"""Nystromformer: softmax attention through the Nystrom method (Xiong, Zeng, Chakraborty, Tan, Fung, Li, Singh,
2021, "Nystromformer: A Nystrom-Based Algorithm for Approximating Self-Attention", AAAI 2021,
https://arxiv.org/abs/2102.03902).

The N x N matrix S = softmax(Q K^T / sqrt(Dh)) is approximated from m landmarks: the landmark queries Q~ and
keys K~ are segment means of Q and K (m contiguous segments), and

    F = softmax(Q K~^T),   A = softmax(Q~ K~^T),   B = softmax(Q~ K^T)   (each scaled by 1 / sqrt(Dh)),
    out = F A^+ (B V)  [+ conv(V), the paper's depthwise-convolution skip on the values],

evaluated right to left (B V, then A^+ (B V), then F times that), so nothing N x N is formed. A^+ is the
Moore-Penrose pseudo-inverse by the paper's iteration (Razavi et al. 2014), from Z_0 = A^T / (|A|_1 |A|_inf):

    Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4,   ``pinv_iterations`` times (paper: 6).

The norms are taken per matrix (per example and head): the public code's default divides by one maximum
over the whole batch, which couples examples and converges more slowly (its "exact" option is
per-matrix, as here). The skip is a convolution over the sequence with one kernel per head, shared by the
head's Dh value channels (the public code's Conv2d with groups = heads and a (kernel, 1) window), zero-padded
at the ends, and computed as a sum of shifted copies of the values, which torch.compile fuses.

Complexity: O(N m Dh + m^2 Dh + iterations m^3) time and O(N m) memory per head (F and B), plus the
(N x m) segment-mean matrix shared by the heads; O(N Dh kernel) for the convolution.
Precision (``backend``, an attribute: how it runs, not what it computes): ``fp32`` runs everything
after the projections (landmarks, the three softmaxes, the pinv iteration and the products) in fp32 even under
bf16 autocast. ``mixed`` runs the N-sized products (landmark means, F's and B's logits, B V, F W) with bf16
operands when the projections come in bf16 (``auto``), as the public package runs all of its products, keeping the
softmaxes and the m-sized core (A, its pseudo-inverse and W = Z (B V)) in fp32: the iteration's Z can have
large entries that cancel in W, which bf16 cannot carry. With fp32 inputs the two are one computation. The
convolution follows autocast. ``auto`` = mixed: one compiled layer replayed as CUDA graphs (torch.compile's
``reduce-overhead`` mode, which leaves the device's own time) is faster with it than with fp32 at 4K x 32 and
16K x 8 (results/layer_bench.csv, rows ``lra nystromformer`` and ``lra nystromformer(backend=mixed)`` whose
compile_mode is ``reduce-overhead``). Launched kernel by kernel (torch.compile's default mode) the layer is bound by
the host's launches, and its time varies more from one machine to another than between the two backends.
Padding (exact, and never NaN): segments are laid over each example's REAL tokens (token i is the r-th real
one; it belongs to segment floor(r m' / L) of L real tokens, m' = min(m, L)), so appending padding moves no
segment boundary and padded tokens enter no landmark mean. An example with fewer real tokens than m gets one
landmark per token; its m - L empty landmarks are masked out of F (their columns are exactly 0) and given
identity rows in A, which keeps A block-diagonal, its real block's pseudo-inverse unchanged, and the
iteration finite. Padded keys are masked out of B, padded values are zeroed before the convolution (its
zero padding then looks the same at a real end and at a padded one). Masking uses the dtype's most negative
finite value, not -inf, so even a row with nothing real gives finite (ignored) outputs, never 0/0.
Limit case: with m >= L every real token is its own landmark, F = A = B over the real tokens and
F A^+ B = S: exact softmax attention once the iteration has converged (tested).

Deviations from the paper's code (``mlpen/Nystromformer``): segments need not divide N (lengths differ by at
most one; the public LRA code requires N divisible by m and averages zeroed padding into the landmarks,
diluting them; xformers' port gives NaN on key padding, facebookresearch/xformers#360); per-matrix pinv
init (above); no separate exact path when m = N (the same result, by the limit case above). Attention
dropout is not applied (there is no attention matrix; the public code applies none to the Nystrom path
either). The paper's LRA runs used 64 landmarks and a kernel of 35 (``LRA/code/lra_config.py``; 33 is its
BERT pre-training setting).

Eager speed: most of the eager layer's kernels and memory traffic are the convolution skip. Its K shifted copies
are K multiplies and K additions over the (B, H, N, Dh) values forward; in the backward each copy's slice is
scattered into a zero-filled padded gradient and accumulated (cast back to bf16 first under autocast), with a
multiply and a reduction more for its tap: a few hundred full-size elementwise kernels, which Inductor fuses into
one stencil kernel each way. The rest are separate passes and launches that compiling fuses: the upcast, scale,
mask, softmax and downcast around F's and B's (N x m) logits, and the pseudo-inverse iteration's small elementwise
steps, one kernel each eagerly; expect the eager layer, on a CPU or a GPU, several times slower than compiled.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import MultiHeadMixer, chosen_backend, product_dtype, upcast
from .registry import Taxonomy, register_model

BACKENDS = ("auto", "fp32", "mixed")  # auto = mixed (the module docstring says why)


def segment_means(mask: torch.Tensor, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """mask (B, N) -> the (B, m, N) matrix whose row s averages segment s of each example's real tokens, and
    the (B, m) flags of non-empty segments (the first min(m, L) of an example with L real tokens)."""
    length = mask.sum(-1, keepdim=True)  # (B, 1): real tokens per example
    rank = mask.cumsum(-1) - 1  # (B, N): the r-th real token has rank r (padding repeats its neighbour's)
    segment = rank * length.clamp(max=m) // length.clamp_min(1)  # (B, N), in [0, min(m, L))
    member = (segment[:, None, :] == torch.arange(m, device=mask.device)[None, :, None]) & mask[:, None, :]
    count = member.sum(-1, keepdim=True)  # (B, m, 1): tokens per segment, 0 for the empty ones
    return member.to(dtype) / count.clamp_min(1).to(dtype), count.squeeze(-1) > 0  # (B, m, N), (B, m)


def landmark_means(means: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """means (B, m, N), x (B, H, N, Dh) -> the segment means (B, H, m, Dh), as one (B, m, N) @ (B, N, H Dh) product
    for all heads: broadcasting means over the heads instead would copy it H times."""
    B, H, N, Dh = x.shape
    per_token = x.transpose(1, 2).reshape(B, N, H * Dh)  # (B, N, H Dh): a view of the projections' layout
    return (means @ per_token).view(B, -1, H, Dh).transpose(1, 2)  # (B, m, H Dh) -> (B, H, m, Dh)


def depthwise_skip(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The paper's skip: v (B, H, N, Dh) convolved over the sequence with each head's kernel, weight (H, 1, K, 1)
    (a grouped Conv2d's, zero padding), shared by the head's Dh channels; summed in fp32 at least, returned in v's
    dtype. Written as K shifted copies of v, which torch.compile fuses into one stencil kernel each way: the grouped
    convolution with one channel per group is many times slower, forward and backward, compiled on a CPU."""
    K, N = weight.shape[2], v.shape[2]
    padded = F.pad(v, (0, 0, K // 2, K // 2))  # (B, H, N + K - 1, Dh): zeros beyond both ends
    taps = weight[:, 0, :, 0].to(torch.promote_types(v.dtype, torch.float32))  # (H, K)
    out = sum(taps[None, :, j, None, None] * padded[:, :, j: j + N] for j in range(K))  # (B, H, N, Dh)
    return out.to(v.dtype)


def iterative_pinv(a: torch.Tensor, iterations: int) -> torch.Tensor:
    """(..., m, m) -> the Moore-Penrose pseudo-inverse by the paper's iteration, initialised per matrix."""
    norm_1 = a.abs().sum(-2).amax(-1)  # (...): max column sum
    norm_inf = a.abs().sum(-1).amax(-1)  # (...): max row sum (1 for a softmax; computed, not assumed)
    z = a.transpose(-1, -2) / (norm_1 * norm_inf)[..., None, None]  # (..., m, m): the paper's Z_0
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)  # (m, m)
    eye_7, eye_15, eye_13 = 7 * eye, 15 * eye, 13 * eye  # (m, m) each: built once, not once an iteration (eager)
    for _ in range(iterations):
        az = a @ z  # (..., m, m)
        z = 0.25 * z @ (eye_13 - az @ (eye_15 - az @ (eye_7 - az)))  # (..., m, m)
    return z


def masked_softmax(products: torch.Tensor, scale: float, masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax(products * scale) over the last dim in fp32 at least, ``masked`` entries at the most negative finite
    value (exp gives exactly 0 beside any real logit, and a row with nothing real no 0/0), returned in ``dtype``."""
    logits = upcast(products) * scale
    return logits.masked_fill(masked, torch.finfo(logits.dtype).min).softmax(-1).to(dtype)


def nystrom_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, n_landmarks: int, iterations: int,
    mixed: bool = False,
) -> torch.Tensor:
    """q, k, v (B, H, N, Dh), mask (B, N) -> F A^+ (B V), (B, H, N, Dh) in fp32 (fp64 stays fp64); ``mixed``: the
    N-sized products in the dtype of ``product_dtype(v)`` (bf16 for bf16 inputs) and the result in it too."""
    work = upcast(q).dtype  # the softmaxes and the m-sized core
    low = product_dtype(v) if mixed else work  # the N-sized products' operands
    q, k, v = q.to(low), k.to(low), v.to(low)
    scale = q.shape[-1] ** -0.5
    means, landmark = segment_means(mask, n_landmarks, low)  # (B, m, N), (B, m)
    q_land = landmark_means(means, q)  # (B, H, m, Dh): segment means over real tokens only
    k_land = landmark_means(means, k)  # (B, H, m, Dh)
    empty = ~landmark[:, None, None, :]  # (B, 1, 1, m)
    f = masked_softmax(q @ k_land.transpose(-1, -2), scale, empty, low)  # (B, H, N, m)
    q_core, k_core = q_land.to(work), k_land.to(work)  # (B, H, m, Dh)
    a = masked_softmax(q_core @ k_core.transpose(-1, -2), scale, empty, work)  # (B, H, m, m)
    eye = torch.eye(n_landmarks, dtype=work, device=q.device)  # (m, m)
    a = torch.where(landmark[:, None, :, None], a, eye)  # (B, H, m, m): an empty landmark's row is e_s
    padded_key = ~mask[:, None, None, :]  # (B, 1, 1, N)
    b = masked_softmax(q_land @ k.transpose(-1, -2), scale, padded_key, low)  # (B, H, m, N)
    w = iterative_pinv(a, iterations) @ (b @ v).to(work)  # (B, H, m, Dh): Z (B V), its cancellations in fp32
    return f @ w.to(low)  # (B, H, N, Dh): right to left, never N x N


@register_model
class Nystromformer(MultiHeadMixer):
    taxonomy = Taxonomy("Xiong et al. 2021, arXiv 2102.03902", "N", ("LR",), decode=False)
    backends = BACKENDS  # the values of ``backend`` (how it runs, not what it computes)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        dropout: float,
        max_len: int,
        *,
        n_landmarks: int = 64,
        pinv_iterations: int = 6,
        conv_kernel: int = 35,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if n_landmarks < 1:
            raise ValueError(f"n_landmarks must be >= 1, got {n_landmarks}")
        if pinv_iterations < 1:
            raise ValueError(f"pinv_iterations must be >= 1, got {pinv_iterations}")
        if conv_kernel < 0 or (conv_kernel and conv_kernel % 2 == 0):
            raise ValueError(f"conv_kernel must be 0 (no skip) or odd (centred window), got {conv_kernel}")
        self.n_landmarks, self.pinv_iterations = int(n_landmarks), int(pinv_iterations)
        self.backend = "auto"  # "fp32" | "mixed" (the N-sized products' operands); how it runs, not what
        # one kernel per head over the sequence, shared by the head's Dh channels (the public code's layout and
        # initialisation); the module holds the weight, ``depthwise_skip`` applies it
        self.conv = None if conv_kernel == 0 else nn.Conv2d(
            n_heads, n_heads, (conv_kernel, 1), padding=(conv_kernel // 2, 0), groups=n_heads, bias=False
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=q.device.type, enabled=False):
            o = nystrom_attention(q, k, v, mask, self.n_landmarks, self.pinv_iterations,
                                  mixed=chosen_backend(self) != "fp32").to(q.dtype)
        if self.conv is not None:  # padded values are zeroed first
            o = o + depthwise_skip(v * mask[:, None, :, None].to(v.dtype), self.conv.weight)  # (B, H, N, Dh)
        return o  # (B, H, N, Dh)
