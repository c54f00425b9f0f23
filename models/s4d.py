"""S4D: a diagonal state space model as the token mixer (Gu, Gupta, Goel, Ré, 2022, "On the Parameterization and
Initialization of Diagonal State Space Models", https://arxiv.org/abs/2206.11893).

Each of the H = d_model channels is its own linear time-invariant system with a diagonal complex state matrix:

    x_k = Ab x_{k-1} + Bb u_k,   y_k = 2 Re(C x_k) + D u_k,     A = -exp(log_A_real) + i A_imag (Re A < 0),

with N = ``d_state`` real state dimensions held as N/2 complex modes: the other half are the complex conjugates,
which contribute the conjugate, hence ``2 Re`` (as the S4D code). dt = exp(log_dt), log_dt ~ U[log dt_min,
log dt_max]. Discretisation (``discretization``): ``zoh`` Ab = exp(dt A), Bb = (exp(dt A) - 1) / A * B (default);
``bilinear`` Ab = (1 + dt A/2) / (1 - dt A/2), Bb = dt B / (1 - dt A/2). The recurrence unrolls to a convolution
with the kernel K_k = 2 Re(sum_n C_n Bb_n Ab_n^k), k = 0..L-1, a Vandermonde product, applied by FFT.

Initialisation of A (``init``), C ~ complex N(0, 1), D ~ N(0, 1):
* ``legs`` (default; the published S4D-LegS LRA numbers): the eigenvalues of the normal part of HiPPO-LegS,
  S = A_LegS + P P^T with P_n = sqrt(n + 1/2), which is -1/2 I plus a skew-symmetric matrix: A_n = -1/2 + i w_n,
  the N/2 eigenvalues with w_n > 0. B is HiPPO-derived, B = V^* B_LegS (V the unit eigenvectors, B_LegS_n =
  sqrt(2n + 1)) with its imaginary part clipped to [-2, 2] (``b_clip``, default ``HIPPO_B_CLIP``), as S4 v4's
  diagonal mode does with ``init: legs``; v3 (the S4D paper's code) left it unclipped (``b_clip: null``).
* ``lin`` (S4D-Lin): A_n = -1/2 + i pi n; B = 1.        * ``inv`` (S4D-Inv): A_n = -1/2 + i (N/pi)(N/(2n+1) - 1); B = 1.
``c_times_b: true`` starts C as CN(0, 1) times B, as S4 v3's diagonal mode (the S4D paper's code) did, whose kernel
multiplies by B again: C B^2 at init, where S4 v4 and the default keep C random (C B).

The layer, as S4's: SSM (with the D skip) -> GELU -> dropout -> output projection, ``glu: true`` = Linear(H, 2H)
+ GLU (S4's default), else Linear(H, H). The backbone's ``dropout`` (the attention-dropout slot) is this dropout;
``tie_dropout: true`` draws its mask once per example and channel for all positions (S4's ``tie_dropout``, which
its v3 Image recipe sets), else per element.
``n_heads``, ``d_qkv`` and ``max_len`` have no meaning here and are unused (the kernel is built at each length).
Bidirectional (``bidirectional: true``, S4's ``bidirectional=True``): a second C gives a second kernel K' that
convolves the future, y_t = sum_{s<=t} K_{t-s} u_s + sum_{s>t} K'_{s-t-1} u_s + D u_t, both in one FFT (K' is
reversed into the second half of the length-2L kernel). ``step`` decodes token by token with the recurrence
(``bidirectional: false``). SSM parameters (log_dt, log_A_real, A_imag, B; not C, not D) carry ``_optim = {"lr":
ssm_lr, "weight_decay": 0}`` (S4's convention); ``ssm_lr: null`` sets no ``_optim``. ``dt_lr: base`` trains log_dt
at the optimiser's own lr instead, still without weight decay (S4's configs with ``lr.dt: null``). ``n_ssm``:
copies of A and B, channel h using copy h mod n_ssm (S4's ``n_ssm``; null = one per channel, S4D's default).

Complexity: O(H L log L) time for the FFT convolution plus O(H N L) for the kernel, O(H L) memory for the
convolution; the Vandermonde product is factored (k = q R + r, R ~ sqrt L: Ab^k = Ab^(qR) Ab^r) into batched
matmuls, so the kernel needs O(H N sqrt L) memory, not the (H, N/2, L) powers of the naive form.
Speed: torch.compile generates no code for complex operations (each runs as a kernel of its own, a conjugate as a
copy), so the Vandermonde product and the convolution's spectral products are written in real arithmetic, which
it fuses; and the FFT convolution has a written backward (``CircularConv``: the adjoint convolution for the
input, the correlation for the kernel, two real FFTs each way), where autograd's backward of rfft/irfft runs a
complex FFT over a zero-filled (B, H, 2L) buffer and several slice-and-scatter copies of it.
Eager speed: the FFTs are the same cuFFT calls eager or compiled; what compiling removes is the rest, which
eagerly runs one kernel per operation: around the FFTs each step over a (B, H, L)-sized tensor (the padding copy,
the D skip's product and sum, GELU, the cast for the projection, the transposes' copies, their gradients) is a
pass of its own where Inductor fuses the chain, and the kernel's factored Vandermonde product with its discretisation
is about a hundred and fifty small kernels forward and backward (exp, cos, sin, products, sums), independent of the
batch, which Inductor fuses into far fewer. Eagerly the spectral products are torch's complex product (``complex_mul``),
one kernel each (a copy more for a conjugate) instead of the real form's seven. Debugging eagerly, expect the same
outputs up to rounding, a constant factor slower at long lengths and, at short lengths or small batches, a step
bounded by launching those small kernels.
Precision: the kernel (complex64 at least) and the FFT convolution run in fp32 even under bf16 autocast (powers
Ab^k over thousands of steps and FFT sums lose everything in bf16); the GELU and output projection follow autocast.
Padding: padded inputs are zeroed before the convolution, so they reach no output; the FFT has length 2L, so
nothing wraps around, and each K_k depends on k only, so appending padding leaves real outputs unchanged.
Deviations from the S4D code: no kernel caching and no CUDA/keops Vandermonde kernel (the factored matmul
instead); dt is parameterised by exp (S4D's default; the S4 repository's default is softplus); Linear instead of the
equivalent Conv1d(kernel_size=1).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .base import make_dropout, upcast
from .registry import Taxonomy, register_model


def legs_normal_part(N: int) -> torch.Tensor:
    """The normal part of HiPPO-LegS, A + P P^T (float64, (N, N)): -1/2 on the diagonal, -sqrt((2n+1)(2k+1))/2
    below it and the negation above it (A_nk = -sqrt((2n+1)(2k+1)) for n > k, -(n+1) on the diagonal)."""
    r = torch.sqrt(2 * torch.arange(N, dtype=torch.float64) + 1)
    lower = torch.tril(r[:, None] * r[None, :], -1) / 2  # (N, N)
    return lower.T - lower - 0.5 * torch.eye(N, dtype=torch.float64)


# S4 v4's clip of S4D-LegS's B (hippo.nplr's B_clip, which its diagonal mode uses with ``init: legs``; v3 had none):
# the imaginary part of V^* B_LegS, in eigh's phases, to [-2, 2]. Unclipped, |B| grows with the mode's frequency to
# 40.75 at N = 64, and the fastest modes, aliased where dt w > pi, start as long pseudo-random filters carrying 16% of
# the kernels' energy (0.9% clipped); B trains at ssm_lr without weight decay, so it keeps that scale.
HIPPO_B_CLIP = 2.0


def legs_diagonal(N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """S4D-LegS's unclipped modes as S4's hippo.nplr forms them: (w, B), float64 (N/2,) and complex128 (N/2,), the
    normal part S of HiPPO-LegS having eigenvalues -1/2 + i w with w < 0 (ascending), B = V^* B_LegS with V their
    unit eigenvectors in eigh's phases and B_LegS_n = sqrt(2n + 1)."""
    S = legs_normal_part(N)
    # S + I/2 is real skew-symmetric, so -i (S + I/2) is Hermitian: eigh gives its real spectrum w and unitary V;
    # S v = (-1/2 + i w) v. S4 keeps the w < 0 half (the other half are their conjugates).
    w, V = torch.linalg.eigh(-1j * (S + 0.5 * torch.eye(N, dtype=torch.float64)))  # (N,), (N, N): w ascending
    w, V = w[: N // 2], V[:, : N // 2]  # (N/2,), (N, N/2)
    return w, V.conj().T @ torch.sqrt(2 * torch.arange(N, dtype=torch.float64) + 1).to(V.dtype)  # V^* B_LegS


def init_diagonal(init: str, N: int, b_clip: float | None = HIPPO_B_CLIP) -> tuple[torch.Tensor, torch.Tensor]:
    """The N/2 kept modes: (A, B), each complex128 (N/2,), Re A = -1/2 and Im A > 0 (or 0 for Lin's n = 0);
    LegS's B with its imaginary part clipped to [-b_clip, b_clip] (None: unclipped)."""
    n = torch.arange(N // 2, dtype=torch.float64)
    B = torch.ones(N // 2, dtype=torch.complex128)
    if init == "lin":
        imag = math.pi * n
    elif init == "inv":
        imag = (N / math.pi) * (N / (2 * n + 1) - 1)
    elif init == "legs":
        w, B = legs_diagonal(N)
        if b_clip is not None:
            B = torch.complex(B.real, B.imag.clamp(-b_clip, b_clip))  # (N/2,): S4 v4's clip
        # the conjugate modes, Im A > 0 as the other inits: with C ~ CN(0, 1) (as likely as its conjugate) the
        # kernel 2 Re(C B exp(k dt A)) has the same distribution
        imag, B = -w.flip(0), B.flip(0).conj()  # ascending Im A
    else:
        raise ValueError(f"init must be legs, lin or inv, got {init!r}")
    return torch.complex(torch.full_like(imag, -0.5), imag), B


def vandermonde(log_z: torch.Tensor, CB: torch.Tensor, L: int) -> torch.Tensor:
    """Re(sum_n CB[c, h, n] z[h, n]^k) for k < L, with z = exp(log_z): (c, H, L) real (the kernel needs no more).

    Factored as z^(qR + r) = z^(qR) z^r with R ~ sqrt(L): per (c, h) a (Q x n) @ (n x R) complex product, whose
    real part is two real matmuls, and O(H n sqrt L) memory instead of the (H, n, L) table of powers. Written in
    real arithmetic (z^t = e^(t a) (cos t b + i sin t b) for log z = a + i b), so torch.compile fuses it; it runs
    complex operations one kernel each."""
    R = math.isqrt(L - 1) + 1  # ceil(sqrt(L))
    Q = -(-L // R)
    a, b = log_z.real, log_z.imag  # (H, n) each

    def powers(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # z^t for each t: (H, n, T) re, im
        magnitude, angle = torch.exp(a[..., None] * t), b[..., None] * t
        return magnitude * torch.cos(angle), magnitude * torch.sin(angle)

    inner_re, inner_im = powers(torch.arange(R, device=a.device, dtype=a.dtype))  # (H, n, R): z^r
    outer_re, outer_im = powers(torch.arange(Q, device=a.device, dtype=a.dtype) * R)  # (H, n, Q): z^(qR)
    cb_re, cb_im = CB.real[..., None], CB.imag[..., None]  # (c, H, n, 1)
    left_re = (cb_re * outer_re - cb_im * outer_im).transpose(-1, -2)  # (c, H, Q, n): Re(CB z^(qR))
    left_im = (cb_re * outer_im + cb_im * outer_re).transpose(-1, -2)  # (c, H, Q, n): Im(CB z^(qR))
    return (left_re @ inner_re - left_im @ inner_im).flatten(-2)[..., :L]  # (c, H, Q * R) -> (c, H, L)


def complex_mul(a: torch.Tensor, b: torch.Tensor, conj_b: bool = False) -> torch.Tensor:
    """a * b (a * conj(b) with ``conj_b``) for complex tensors, written in real arithmetic on their (re, im) views:
    torch.compile cannot generate code for complex operations and would run each as its own kernel (a conjugate
    is a copy of its own), where this fuses into one. Eagerly the real form would be seven kernels (four products,
    a difference, a sum and the stack of the parts), so there it is torch's complex product, one kernel (and a
    copy for the conjugate): the same arithmetic, equal up to rounding."""
    if not torch.compiler.is_compiling():
        return a * (b.conj() if conj_b else b)
    (ar, ai), (br, bi) = torch.view_as_real(a).unbind(-1), torch.view_as_real(b).unbind(-1)
    if conj_b:
        bi = -bi
    return torch.view_as_complex(torch.stack((ar * br - ai * bi, ar * bi + ai * br), dim=-1))


class CircularConv(torch.autograd.Function):
    """y = (kernel circularly convolved with u zero-padded to 2L)[..., :L], by FFT: u (B, H, L), kernel (H, 2L).

    The backward is written out: the adjoint of a circular convolution is the convolution with the conjugate
    spectrum (the reversed kernel), so the inputs' gradient is this same operation on the output's gradient,
    and the kernel's gradient is the circular correlation of the padded gradient with the padded input, summed
    over the batch. Autograd's backward of rfft(n=2L) and irfft instead runs a complex 2L-point FFT over a
    zero-filled (B, H, 2L) complex buffer and a few slice-and-scatter copies of it. Run eagerly it saves the input,
    not its spectrum (half the bytes), and transforms it again; compiled, the partitioner may keep the forward's
    spectrum instead."""

    @staticmethod
    def forward(ctx, u: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        n = kernel.shape[-1]
        # the inverse FFT's 1/n goes into the kernel's (H, n/2 + 1) spectrum, not over the (B, H, n) product: the
        # inverse transforms then scale nothing (norm="forward"), which spares a pass over (B, H, n) each
        kernel_f = torch.fft.rfft(kernel, norm="forward")  # (H, n/2 + 1): the spectrum / n
        ctx.save_for_backward(u, kernel_f)
        y = torch.fft.irfft(complex_mul(torch.fft.rfft(u, n=n), kernel_f), n=n, norm="forward")  # (B, H, n)
        return y[..., : u.shape[-1]]  # (B, H, L)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        u, kernel_f = ctx.saved_tensors
        n, L = 2 * (kernel_f.shape[-1] - 1), u.shape[-1]
        grad_f = torch.fft.rfft(grad_y, n=n)  # (B, H, n/2 + 1): the gradient zero-padded as u was
        grad_u = grad_kernel = None
        if ctx.needs_input_grad[0]:
            grad_u = torch.fft.irfft(complex_mul(grad_f, kernel_f, conj_b=True), n=n, norm="forward")[..., :L]
        if ctx.needs_input_grad[1]:
            u_f = torch.fft.rfft(u, n=n)  # (B, H, n/2 + 1)
            grad_kernel = torch.fft.irfft(complex_mul(grad_f, u_f, conj_b=True).sum(0), n=n)  # (H, n)
        return grad_u, grad_kernel


def fft_conv(u: torch.Tensor, k: torch.Tensor, k_future: torch.Tensor | None) -> torch.Tensor:
    """y_t = sum_{s<=t} k_{t-s} u_s (+ sum_{s>t} k_future_{s-t-1} u_s). u (B, H, L), k and k_future (H, L)."""
    L = u.shape[-1]
    kernel = F.pad(k, (0, L))  # (H, 2L): causal taps at lags 0..L-1, zeros after, so nothing wraps around
    if k_future is not None:  # lag -(j+1) sits at index 2L - 1 - j of the circular convolution
        kernel = kernel + F.pad(k_future.flip(-1), (L, 0))  # (H, 2L)
    return CircularConv.apply(u, kernel)  # (B, H, L)


@register_model
class S4D(nn.Module):
    taxonomy = Taxonomy("Gu et al. 2022, arXiv 2206.11893", "N*log(N)", ("SSM",), decode=True)
    accepts_no_mask = True  # mask=None: nothing to zero

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        dropout: float,
        max_len: int,
        *,
        d_state: int = 64,
        init: Literal["legs", "lin", "inv"] = "legs",
        discretization: Literal["zoh", "bilinear"] = "zoh",
        bidirectional: bool = True,
        glu: bool = True,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        ssm_lr: float | None = 0.001,
        dt_lr: Literal["ssm", "base"] = "ssm",
        n_ssm: int | None = None,
        tie_dropout: bool = False,
        c_times_b: bool = False,
        b_clip: float | None = HIPPO_B_CLIP,
    ):
        super().__init__()
        if d_state < 2 or d_state % 2:
            raise ValueError(f"d_state must be even and >= 2 (N/2 complex conjugate pairs), got {d_state}")
        if discretization not in ("zoh", "bilinear"):
            raise ValueError(f"discretization must be zoh or bilinear, got {discretization!r}")
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max, got {dt_min}, {dt_max}")
        if b_clip is not None and not b_clip > 0:
            raise ValueError(f"b_clip must be > 0 (init legs: B's imaginary part to [-b_clip, b_clip]) or null "
                             f"(unclipped), got {b_clip}")
        if dt_lr not in ("ssm", "base"):
            raise ValueError(f"dt_lr must be ssm (ssm_lr, as A and B) or base (the optimiser's lr), got {dt_lr!r}")
        n_ssm = d_model if n_ssm is None else int(n_ssm)
        if n_ssm < 1 or d_model % n_ssm:
            raise ValueError(f"n_ssm must divide d_model={d_model} (copies of A and B shared over channels), "
                             f"got {n_ssm}")
        H, n = d_model, d_state // 2
        self.discretization, self.bidirectional, self.glu = discretization, bool(bidirectional), bool(glu)
        A, B = init_diagonal(init, d_state, b_clip)  # (n,), (n,)
        self.log_dt = nn.Parameter(torch.rand(H) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        # n_ssm copies of A and B (H: one per channel); channel h uses copy h mod n_ssm, as S4's repeat
        self.log_A_real = nn.Parameter(torch.log(-A.real).float().repeat(n_ssm, 1))  # (n_ssm, n)
        self.A_imag = nn.Parameter(A.imag.float().repeat(n_ssm, 1))  # (n_ssm, n)
        self.B = nn.Parameter(torch.view_as_real(B.to(torch.complex64)).repeat(n_ssm, 1, 1))  # (n_ssm, n, 2): re, im
        channels = 2 if self.bidirectional else 1  # past (and future) kernels share A, B, dt; each has its C
        C = torch.randn(channels, H, n, dtype=torch.complex64)  # (c, H, n)
        self.C = nn.Parameter(torch.view_as_real(C * B.to(C.dtype) if c_times_b else C))  # (c, H, n, 2): re, im
        self.D = nn.Parameter(torch.randn(H))
        if ssm_lr is not None:
            for p in (self.log_A_real, self.A_imag, self.B) + ((self.log_dt,) if dt_lr == "ssm" else ()):
                p._optim = {"lr": float(ssm_lr), "weight_decay": 0.0}
        if dt_lr == "base":  # S4's `lr.dt: null`: the optimiser's own lr and schedule, still no weight decay
            self.log_dt._optim = {"weight_decay": 0.0}
        self.dropout = make_dropout(dropout, tie_dropout)  # tied: one mask per example and channel
        self.out = nn.Linear(H, 2 * H if self.glu else H)

    def discretize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log Ab, Bb, C): (H, n), (H, n), (c, H, n) complex (complex64 at least)."""
        dt = torch.exp(upcast(self.log_dt))[:, None]  # (H, 1)
        copies = dt.shape[0] // self.B.shape[0]  # H / n_ssm
        A = torch.complex(-torch.exp(upcast(self.log_A_real)), upcast(self.A_imag)).repeat(copies, 1)  # (H, n)
        B = torch.view_as_complex(upcast(self.B)).repeat(copies, 1)  # (n_ssm, n) -> (H, n)
        C = torch.view_as_complex(upcast(self.C))  # (c, H, n)
        dtA = dt * A  # (H, n)
        if self.discretization == "zoh":
            return dtA, B * torch.expm1(dtA) / A, C
        return torch.log((1 + dtA / 2) / (1 - dtA / 2)), B * dt / (1 - dtA / 2), C

    def kernel(self, L: int) -> torch.Tensor:
        """K (c, H, L), real: K[c, h, k] = 2 Re(sum_n C[c, h, n] Bb[h, n] Ab[h, n]^k); c = 1, or 2 (past, future)."""
        with torch.autocast(device_type=self.D.device.type, enabled=False):
            log_Ab, Bb, C = self.discretize()
            return 2 * vandermonde(log_Ab, complex_mul(C, Bb), L)  # (c, H, L)

    def ssm(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The SSM with the D skip, (B, L, H) -> (B, L, H) in fp32 (fp64 stays), autocast off."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            u = upcast(x)
            if mask is not None:
                u = u * mask[..., None]  # padded inputs are zero: they reach no output, in either direction
            u = u.transpose(1, 2)  # (B, H, L)
            k = self.kernel(u.shape[-1]).to(u.dtype)  # (c, H, L)
            y = fft_conv(u, k[0], k[1] if self.bidirectional else None) + u * upcast(self.D)[:, None]  # (B, H, L)
            return y.transpose(1, 2)  # (B, L, H)

    def output(self, y: torch.Tensor) -> torch.Tensor:
        y = self.out(self.dropout(F.gelu(y)))  # (B, ..., H or 2H)
        return F.glu(y, dim=-1) if self.glu else y  # (B, ..., H)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.output(self.ssm(x, mask))  # (B, L, D)

    def step(self, x_t: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of the causal layer as the recurrence, for decoding: x_t (B, D) -> ((B, D), state), with
        state (B, H, n) complex, None at the start. Equals ``forward`` position by position (bidirectional=False)."""
        if self.bidirectional:
            raise ValueError("step is the causal recurrence; build the model with bidirectional=False")
        with torch.autocast(device_type=x_t.device.type, enabled=False):
            log_Ab, Bb, C = self.discretize()  # (H, n), (H, n), (1, H, n)
            u = upcast(x_t)  # (B, H)
            update = Bb * u[..., None]  # (B, H, n)
            state = update if state is None else torch.exp(log_Ab) * state + update
            y = 2 * (C[0] * state).sum(-1).real + u * upcast(self.D)  # (B, H)
        return self.output(y), state
