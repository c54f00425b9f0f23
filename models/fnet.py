"""FNet: token mixing by the 2-D Fourier transform, no parameters (Lee-Thorp, Ainslie, Eckstein, Ontanon, 2022,
"FNet: Mixing Tokens with Fourier Transforms", NAACL 2022, https://arxiv.org/abs/2105.03824).

The mixer is the real part of the 2-D DFT of the (L x D) block of token vectors, over the hidden dimension
and over the sequence:

    out[k, c] = Re sum_{n < L} sum_{d < D} x[n, d] exp(-2 pi i (n k / L + d c / D)).

Nothing is learned: the backbone arguments (d_model, n_heads, d_qkv, dropout, max_len) are accepted for the
mixer contract and unused (the width D is read off the input).

Padding, exactly. L is each example's OWN length, the position of its last real token + 1 (its real
length when padding is appended): a DFT over the padded length would mix in other frequencies, so appending
padding would change every real output. Padded tokens are zeroed first (a hole inside the window is a zero
token) and padded positions output 0. A batch of different lengths cannot share one FFT of one size, so
the sequence DFT of each example is computed by Bluestein's chirp-z algorithm: with c_n = exp(-i pi n^2 / L),
nk = (n^2 + k^2 - (k - n)^2) / 2 turns the length-L DFT into a convolution,

    X_k = c_k sum_n (x_n c_n) conj(c_{k - n}),

done with FFTs of ONE size P >= 2N - 1 for the whole batch (L enters only through the chirps), so the batch
stays one computation with fixed shapes: no Python loop over lengths (the one host synchronisation is the
check for the all-full case below). n^2 is reduced modulo 2L in integers before the angle is formed, so the
chirps stay exact at large n.
Cost: when every row is full length (or ``mask=None``) it is one plain ``fft2``; otherwise the sequence
transform takes two FFTs of size P (the smallest 2^a 3^b 5^c >= 2N - 1) over the D channels plus one
over the (B x P) chirp filter: about 4-5x the FLOPs and 4x the transient memory (complex, 2N long) of the
plain transform, still O(N log N). The alternative, grouping the batch by length, costs one FFT call (and
one cuFFT plan) per distinct length, up to B per layer, with shapes that change from batch to batch.

Complexity: O(N D (log N + log D)) time and O(N D) memory per example; no parameters.
Precision: the transform runs in fp32 (complex64) even under bf16 autocast; chirps are computed in fp64.
Scale: ``norm: none`` (default) is the paper's unscaled transform (xformers' ``fourier_mix``, benchmarked in its
LRA suite, is unscaled too). Its output has std ~ sqrt(L D / 2) from unit inputs (~500 at ListOps'
length and width), which in pre-LN blocks dominates the residual stream over the MLP updates (the paper's
own encoder is post-LN and renormalises right after the residual sum); ``norm: ortho`` scales by
1 / sqrt(L D), the unitary DFT, keeping the output on its input's scale. Which trains better here is untested.
Deviations from the paper: the length per example (above); the paper computes short sequences by DFT matrix
multiplication on TPU (the same result).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from .registry import Taxonomy, register_model


def fast_size(n: int) -> int:
    """The smallest 2^a 3^b 5^c >= n: FFT sizes that pocketfft and cuFFT run fastest."""
    while True:
        rest = n
        for p in (2, 3, 5):
            while rest % p == 0:
                rest //= p
        if rest == 1:
            return n
        n += 1


def dft_per_length(y: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Bluestein: y (B, N, D) complex, zero at positions >= length (B,) -> X (B, N, D) with
    X[b, k] = sum_{n < L_b} y[b, n] exp(-2 pi i n k / L_b) for k < L_b (rows k >= L_b are left for the caller)."""
    B, N, _ = y.shape
    n = torch.arange(N, device=y.device)  # (N,)
    two_l = 2 * length[:, None]  # (B, 1)
    angle = math.pi * ((n * n)[None, :] % two_l).double() / length[:, None].double()  # (B, N): pi n^2 / L mod 2 pi
    chirp = torch.polar(torch.ones_like(angle), -angle).to(y.dtype)  # (B, N): c_n = exp(-i pi n^2 / L)
    size = fast_size(2 * N - 1)  # every shift k - n in (-N, N) gets its own slot: no circular wrap-around
    # the filter conj(c_m) for m in (-N, N), laid out circularly: m >= 0 at m, m < 0 at size + m (c is even in m)
    gap = torch.zeros(B, size - 2 * N + 1, dtype=y.dtype, device=y.device)  # (B, size - 2N + 1)
    kernel = torch.cat([chirp.conj(), gap, chirp.conj()[:, 1:].flip(-1)], dim=1)  # (B, size)
    spectrum = torch.fft.fft(y * chirp[..., None], n=size, dim=1)  # (B, size, D)
    conv = torch.fft.ifft(spectrum * torch.fft.fft(kernel, dim=1)[..., None], dim=1)[:, :N]  # (B, N, D)
    return conv * chirp[..., None]  # (B, N, D)


def fourier_mix(x: torch.Tensor, mask: torch.Tensor | None, norm: str) -> torch.Tensor:
    """x (B, N, D) real, mask (B, N) or None -> Re(2-D DFT over each example's length) (B, N, D), 0 at padding."""
    _, N, D = x.shape
    if mask is None:
        out = torch.fft.fft2(x, dim=(1, 2)).real  # (B, N, D)
        return out / math.sqrt(N * D) if norm == "ortho" else out
    position = torch.arange(1, N + 1, device=x.device)  # (N,)
    length = (position * mask).amax(-1).clamp_min(1)  # (B,): last real position + 1 (0-based)
    keep = mask[..., None].to(x.dtype)  # (B, N, 1)
    y = torch.fft.fft(x * keep, dim=-1)  # (B, N, D) complex: over the hidden dimension, padded tokens zero
    # every row spans the batch: the plain FFT is exact. Eager only: the check is a host sync, and a compiled model
    # would break its graph on it in every layer; Bluestein's transform is exact at any length
    if not torch.compiler.is_compiling() and bool((length == N).all()):
        y = torch.fft.fft(y, dim=1)  # (B, N, D)
    else:
        y = dft_per_length(y, length)  # (B, N, D)
    out = y.real * keep  # (B, N, D): padded positions (and what lies past each L) output 0
    return out / (length[:, None, None] * D).to(x.dtype).sqrt() if norm == "ortho" else out


@register_model
class FNet(nn.Module):
    taxonomy = Taxonomy("Lee-Thorp et al. 2022, arXiv 2105.03824", "N*log(N)", ("FT",), decode=False)
    accepts_no_mask = True  # mask=None: one fft2, no length bookkeeping

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        dropout: float,
        max_len: int,
        *,
        norm: Literal["none", "ortho"] = "none",
    ):
        super().__init__()  # the backbone arguments are unused: nothing to project, nothing to learn
        if norm not in ("none", "ortho"):
            raise ValueError(f"norm must be 'none' (the paper's) or 'ortho' (1 / sqrt(L D)), got {norm!r}")
        self.norm = norm

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 at least (fp64 stays, for tests)
            return fourier_mix(xf, mask, self.norm).to(x.dtype)  # (B, N, D)
