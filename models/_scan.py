"""The gated linear recurrence under ``mamba`` (Mamba-2's SSD) and ``gla`` (Gated Linear Attention), in three
interchangeable forms. Per head, with a (K x V) state S and S_0 = 0:

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,      o_t = scale * q_t S_t,      g_t <= 0 (log-space decay).

``g`` is (B, H, N, 1), one decay per head and step (Mamba-2: g = A dt), or (B, H, N, K), one per key dimension
(GLA: g = log alpha). A step with g_t = 0 and k_t = 0 leaves S unchanged: that is how both models make padding
an exact no-op, in either direction, wherever the padding sits.

* ``recurrent``: the definition, one Python step per position (the readable reference; slow).
* ``chunked``: the same sums in chunks of C steps, vectorised over all chunks (the layout of Mamba-2's
  ``ssd_minimal``). Inside a chunk, C x C scores q_i . k_j weighted by the decay between the steps,
  exp(G_i - G_j), G the cumulative log decay from the chunk's start: one per head, a C x C weight; per key
  dim, factorised as (q_i exp(G_i)) . (k_j exp(-G_j)) (the GLA paper's chunkwise form) while every
  chunk's total log decay stays under ``FACTOR_LIMIT``, else the exact C x C x K weights (what the paper's
  secondary chunking does in log space), so nothing overflows however fast a gate forgets. Across chunks,
  the chunk summaries are combined by decay-weighted products from segment sums (no exp of a positive number),
  per key dimension in two levels (``chunk_ends``: within groups of sqrt(N/C) chunks, then across groups), per
  head in one (an (N/C)^2 weight per head). O(N C (K + V) + (N/C)^1.5 K V) time per head (per head decays:
  (N/C)^2 K V). The default off CUDA (the per-key branch test reads one number off the device).
* ``fla``: flash-linear-attention's Triton kernels (``pip install lra[ssm]``, fla-core 0.6.0): ``chunk_simple_gla``
  for the scalar decay, ``chunk_gla`` for the per-key one. Layout (B, N, H, K); ``g`` is the same log decay;
  ``scale`` is passed explicitly (its default is K^-0.5). Head sizes are zero-padded to a multiple of 16 first
  (Triton's tl.dot needs >= 16 and bf16 tiles need even sizes): zero q, k columns add nothing to q S, a zero g
  column keeps a zero state row at zero, zero v columns give zero outputs, which are cut off. Padding needs no
  ``cu_seqlens`` (variable-length mode): padded steps are no-ops wherever they sit; packed rows use it (below).
  CUDA only.

Packed rows (several examples in one row, ``lra.train.packing``): ``reset`` (B, N) bool marks each example's first step
in scan order (``segment_starts``; for a reversed pass, the example's last position). There the state forgets
everything before it, S_t = k_t^T v_t, as if that step carried a log decay of -inf, so every example gets exactly
the outputs it would have alone in its own row (padding between examples is a no-op as above):

* ``recurrent``: the step's decay is exp(``RESET``) = 0 exactly (a finite log decay, so no inf reaches anything).
* ``chunked``: no large number enters the cumulative sums: differences of sums through -1e4 would lose the small
  decays' precision (fp32 spacing at 1e4 is 1e-3), and -inf would give inf - inf. Instead each chunk is cut into
  parts at its resets, and every weight that would carry the state over a reset is masked to exactly 0: the
  C x C scores between parts, the entering state for steps after the chunk's first reset, the steps before the
  chunk's last reset in its summary, and the chunk's whole decay (``RESET`` in the across-chunk segment sums,
  which only add, so it stays finite and its exp is 0). The factorised branch sees the same bounded G as
  without packing. Cost: a (C x C) mask per chunk and row, and a few masked products.
* ``fla``: fla's own variable-length mode, which fits the (B, N) layout: the rows are laid end to end as one
  sequence of B N steps (a view, no copy) and ``cu_seqlens`` starts a new sequence at each row's start and at
  each reset; fla runs every sequence from a zero state, so each example (with any padding after it, no-ops)
  is computed as alone by construction, in the kernels' own arithmetic. Cost: one device sync to build
  ``cu_seqlens`` (fla syncs for its chunk indices anyway), and each sequence starts a fresh chunk of 64.

Precision: the fla kernels take bf16 q, k, v under autocast and keep their states in fp32. The chunked form's
decays (the cumulative log sums and their exps) and elementwise weights are fp32 at least; its products (the
C x C scores, their product with v, the chunk summaries, their combination across chunks and the entering
states' product with q) follow autocast as every matmul does: under bf16 autocast (a GPU's training and bench
steps) bf16 operands accumulated in fp32 with bf16 results, about fla's precision (its dots take bf16 operands
too; it keeps the running state in fp32, where this rounds each chunk's combined state once); without autocast
(CPU, the tests) fp32, and fp64 stays fp64. The recurrent form is elementwise, fp32 at least.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from .base import cumsum, pad_head_dim, upcast

Scan = Literal["auto", "fla", "chunked", "recurrent"]
SCANS = get_args(Scan)  # the values of a mixer's ``scan`` attribute (gla, mamba): how it runs, not what
# Per-key decays inside a chunk are factorised, exp(G_i - G_j) = exp(G_i) * exp(-G_j), while a chunk's total log
# decay stays within this bound: exp(40) = 2e17 leaves fp32 ample room for the products and their gradients.
FACTOR_LIMIT = 40.0
# The log decay of a reset (an example's first step in a packed row): exp(-1e4) is exactly 0 in fp32 and fp64,
# and the value only ever enters sums (never differences), which stay finite.
RESET = -1e4


def orient(t: torch.Tensor) -> torch.Tensor:
    """(2, B, N, ...), a forward and a reversed pass stacked: the second's rows flipped in time, so both passes
    run the same causal scan (and their outputs come back in place). Its own inverse."""
    return torch.stack((t[0], t[1].flip(1)))


def segment_starts(segments: torch.Tensor) -> torch.Tensor:
    """(..., N) example ids in scan order (0 = padding) -> (..., N) bool ``reset``: True at each example's first
    step, where the scan forgets its state."""
    return (segments != 0) & (segments != F.pad(segments, (1, 0))[..., :-1])  # (..., N)


def recurrent(q, k, v, g, scale: float = 1.0, state: torch.Tensor | None = None, reset: torch.Tensor | None = None):
    """q, k (B, H | 1, N, K); v (B, H, N, V); g (B, H, N, 1 | K); reset (B, N) bool or None -> (o (B, H, N, V),
    final state (B, H, K, V))."""
    q, k, v, g = map(upcast, (q, k, v, g))
    B, H, N, V = v.shape
    if reset is not None:
        g = g.masked_fill(reset[:, None, :, None], RESET)  # (B, H, N, 1 | K): exp(RESET) = 0, the state forgotten
    S = v.new_zeros(B, H, k.shape[-1], V) if state is None else state  # (B, H, K, V)
    out = []
    for t in range(N):
        S = g[:, :, t, :, None].exp() * S + k[:, :, t, :, None] * v[:, :, t, None, :]  # (B, H, K, V)
        out.append(scale * (q[:, :, t, :, None] * S).sum(-2))  # (B, H, V)
    return torch.stack(out, 2), S  # (B, H, N, V)


def segsum(x: torch.Tensor) -> torch.Tensor:
    """x (..., T) -> (..., T, T): entry [i, j] = x_{j+1} + ... + x_i for i >= j, -inf above the diagonal
    (Mamba-2's ``segsum``: masked cumulative sums, no difference of two long cumulative sums)."""
    T = x.shape[-1]
    ones = torch.ones(T, T, dtype=torch.bool, device=x.device)
    x = x[..., :, None].expand(*x.shape, T).masked_fill(~ones.tril(-1), 0.0)  # (..., T, T): [i, j] = x_i, i > j
    s = cumsum(x, -2)  # (..., T, T): [i, j] = sum_{j < m <= i} x_m
    return s.masked_fill(~ones.tril(), float("-inf"))


def entering(ends: torch.Tensor) -> torch.Tensor:
    """(B, H, n, K, V) states at the ends of n consecutive pieces (chunks, or groups of them) -> the state entering
    each: the previous piece's end, zero for the first."""
    return F.pad(ends[:, :, :-1], (0, 0, 0, 0, 1, 0))  # (B, H, n, K, V)


def chunk_ends(total: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
    """The state at each chunk's end, ends_c = sum over c' <= c of exp(total_{c'+1} + ... + total_c) summary_{c'}:
    total (B, H, n, 1 | K) each chunk's log decay, summary (B, H, n, K, V) each chunk's own end state -> (B, H, n,
    K, V). One decay per head (Mamba-2): in one level, through an n x n weight per head (there a second level
    would only add (B, H, n, K, V) temporaries, making the layer slower and larger). Per key dimension (GLA): in two
    levels, so that no (B, H, K, n, n) weight is formed (at 16K it would be most of GLA's layer memory): within
    groups of m = ceil(sqrt(n)) chunks, then across the n / m groups, with the group's own decay carried to each
    chunk inside it: O(n m + (n / m)^2) weights instead of n^2. Only sums of log decays, never differences (as
    ``segsum``): a reset's ``RESET`` stays finite and its exp is 0."""
    n = summary.shape[2]
    if total.shape[-1] == 1:  # one decay per head: an n x n weight per head, small beside the states
        across = segsum(total.transpose(-1, -2)).exp()  # (B, H, 1, n, n): decay from chunk c' 's end to chunk c's
        return torch.einsum("bhkcd,bhdkv->bhckv", across, summary)  # (B, H, n, K, V)
    m = math.isqrt(n - 1) + 1  # ceil(sqrt(n)) for n >= 1
    pad = -n % m
    if pad:  # trailing chunks that decay nothing and hold nothing
        total, summary = F.pad(total, (0, 0, 0, pad)), F.pad(summary, (0, 0, 0, 0, 0, pad))
    groups = (n + pad) // m
    t = total.unflatten(2, (groups, m)).movedim(-1, 2)  # (B, H, 1 | K, groups, m)
    s = summary.unflatten(2, (groups, m))  # (B, H, groups, m, K, V)
    local = torch.einsum("bhkgij,bhgjkv->bhgikv", segsum(t).exp(), s)  # (B, H, groups, m, K, V): from its group
    group_end = local[:, :, :, -1]  # (B, H, groups, K, V): each group's own state at its end
    across = segsum(t.sum(-1)).exp()  # (B, H, 1 | K, groups, groups): decay from group f's end to group g's
    ends = torch.einsum("bhkgf,bhfkv->bhgkv", across, group_end)  # (B, H, groups, K, V): state at each group's end
    into = cumsum(t, -1).exp().permute(0, 1, 3, 4, 2)[..., None]  # (B, H, groups, m, 1 | K, 1): start to chunk i
    return (local + into * entering(ends)[:, :, :, None]).flatten(2, 3)[:, :, :n]  # (B, H, n, K, V)


def chunked(q, k, v, g, chunk: int, scale: float = 1.0, reset: torch.Tensor | None = None) -> torch.Tensor:
    """The recurrence's outputs, vectorised over chunks of ``chunk`` steps. Shapes as ``recurrent``."""
    q, k, v, g = map(upcast, (q, k, v, g))
    B, N = v.shape[0], v.shape[2]
    pad = -N % chunk
    if pad:  # trailing steps with g = 0, k = 0 leave the state unchanged; their outputs are cut below
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
    n, C = (N + pad) // chunk, chunk
    q, k, v, g = (t.unflatten(2, (n, C)) for t in (q, k, v, g))  # (B, H, n, C, .)
    q = q * scale
    G = cumsum(g, 3)  # (B, H, n, C, 1 | K): log decay from the chunk's start through step i (inclusive), <= 0
    same = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # (C, C): j <= i
    if reset is not None:  # cut each chunk into parts at its resets; no weight crosses from one part to the next
        cut = F.pad(reset, (0, pad)).reshape(B, 1, n, C)  # (B, 1, n, C): an example begins at step i
        part = cut.cumsum(3)  # (B, 1, n, C): 0 = continuing the chunk before, 1, 2, ... after each reset
        same = same & (part[..., :, None] == part[..., None, :])  # (B, 1, n, C, C): j <= i, no reset in (j, i]
        part = part[..., None]  # (B, 1, n, C, 1)
    if g.shape[-1] == 1:  # one decay per head: weight the C x C scores by exp(G_i - G_j)
        L = (G - G.transpose(-1, -2)).masked_fill(~same, float("-inf")).exp()  # (B, H, n, C, C)
        scores = (q @ k.transpose(-1, -2)) * L  # (B, H, n, C, C)
    elif -G[:, :, :, -1].min() <= FACTOR_LIMIT:  # per key dim: exp(G_i - G_j) = exp(G_i) exp(-G_j), both finite
        scores = ((q * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)).masked_fill(~same, 0.0)  # (B, H, n, C, C)
    else:  # a chunk forgets too fast to factorise: the exact per-key weights, C x C x K
        L = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~same[..., None], float("-inf")).exp()
        scores = (q[..., :, None, :] * k[..., None, :, :] * L).sum(-1)  # (B, H, n, C, C); L (B, H, n, C, C, K)
    out = scores @ v  # (B, H, n, C, V): contributions from inside the chunk
    to_end = (G[:, :, :, -1:] - G).exp()  # (B, H, n, C, 1 | K): decay from step j to the chunk's end, <= 1
    total = G[:, :, :, -1]  # (B, H, n, 1 | K): each chunk's whole log decay
    from_start = G.exp()  # (B, H, n, C, 1 | K): decay from the chunk's start to step i, <= 1
    if reset is not None:
        to_end = to_end * (part == part[:, :, :, -1:])  # steps before the chunk's last reset: forgotten by its end
        total = total.masked_fill(cut.any(3)[..., None], RESET)  # a chunk with a reset passes nothing on
        from_start = from_start * (part == 0)  # steps after a reset do not see the state entering the chunk
    summary = (k * to_end).transpose(-1, -2) @ v  # (B, H, n, K, V): the chunk's own state at its end
    ends = chunk_ends(total, summary)  # (B, H, n, K, V): state at each chunk's end
    starts = entering(ends)  # (B, H, n, K, V): state entering each chunk
    out = out + (q * from_start) @ starts  # (B, H, n, C, V): the entering state, decayed to step i
    return out.flatten(2, 3)[:, :, :N]  # (B, H, N, V)


@functools.cache
def warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


FLA_OPS: tuple | None = None  # fla_ops's result, once imported


def fla_ops():
    """(chunk_simple_gla, chunk_gla), imported on first CUDA use; a clear error when fla-core is missing. Kept in
    a module global, not by functools.cache: Dynamo warns at each trace that calls a cached function."""
    global FLA_OPS
    if FLA_OPS is None:
        try:
            from fla.ops.gla import chunk_gla  # optional: the [ssm] extra, on CUDA only
            from fla.ops.simple_gla import chunk_simple_gla
        except ImportError as e:
            raise ImportError(
                "scan=fla or auto (trainer.mixer.scan) runs the scan on CUDA through flash-linear-attention's Triton "
                "kernels: `pip install lra[ssm]` (fla-core 0.6.0), or set scan=chunked for the pure-PyTorch form. "
                f"Import failed: {e}"
            ) from e
        FLA_OPS = chunk_simple_gla, chunk_gla
    return FLA_OPS


def cu_seqlens(reset: torch.Tensor) -> torch.Tensor:
    """(B, N) bool, True at each example's first step -> fla's variable-length boundaries (sequences + 1,) int64:
    the rows laid end to end as one sequence of B N steps, a new sequence at each row's start and at each reset."""
    B, N = reset.shape
    first = reset | (torch.arange(N, device=reset.device) == 0)  # (B, N): where a sequence begins
    return F.pad(first.flatten().nonzero()[:, 0], (0, 1), value=B * N)  # (sequences + 1,)


def fla(q, k, v, g, scale: float = 1.0, reset: torch.Tensor | None = None) -> torch.Tensor:
    """The recurrence's outputs from fla's chunked Triton kernels. Shapes as ``recurrent``."""
    chunk_simple_gla, chunk_gla = fla_ops()
    B, H, N, V = v.shape
    lowp = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.float32
    size_k, size_v = (-(-d // 16) * 16 for d in (q.shape[-1], V))  # multiples of 16, >= 16
    q, k = (t.expand(B, H, N, t.shape[-1]) for t in (q, k))  # (B, H, N, K): heads sharing q, k (Mamba-2)
    q, k, v = (t.transpose(1, 2).to(lowp) for t in (q, k, v))  # each (B, N, H, .)
    q, k = (t.contiguous() for t in pad_head_dim(size_k, q, k))  # each (B, N, H, size_k)
    v = pad_head_dim(size_v, v)[0].contiguous()  # (B, N, H, size_v)
    g = upcast(g).transpose(1, 2)  # (B, N, H, 1 | K)
    scalar = g.shape[-1] == 1
    g = (g[..., 0] if scalar else pad_head_dim(size_k, g)[0]).contiguous()  # (B, N, H) | (B, N, H, size_k)
    varlen = {}
    if reset is not None:  # variable-length mode: the rows end to end, a sequence from each row start and reset
        varlen["cu_seqlens"] = cu_seqlens(reset)  # (sequences + 1,)
        q, k, v, g = (t.flatten(0, 1)[None] for t in (q, k, v, g))  # each (1, B N, H, .): a view, no copy
    kernel = chunk_simple_gla if scalar else chunk_gla
    o, _ = kernel(q, k, v, g=g, scale=scale, **varlen)  # (B, N, H, size_v), or (1, B N, H, size_v)
    return o.reshape(B, N, H, size_v)[..., :V].transpose(1, 2).float()  # (B, H, N, V)


@functools.cache
def fla_refused(device_index: int) -> str | None:
    """Why fla's gated kernels cannot run on this GPU (None when they can). fla 0.6 refuses its gated backward on
    Hopper GPUs (compute capability 9) with Triton from 3.4.0 up to, not including, 3.7.1, which computes it wrongly
    there; the chunked form runs instead, said once, since no extra package fixes it short of another Triton."""
    import triton  # optional: CUDA builds of torch bring it

    major = torch.cuda.get_device_capability(device_index)[0]
    version = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3])
    if major == 9 and (3, 4, 0) <= version < (3, 7, 1):
        return (f"flash-linear-attention's gated kernels give wrong gradients on Hopper GPUs with Triton "
                f"{triton.__version__} (3.7.1 or later is needed)")
    return None


@torch.compiler.assume_constant_result
def fla_refusal(device_index: int, fall_back: bool = True) -> str | None:
    """``fla_refused``, and a constant to torch.compile: it runs eagerly at trace time, so a compiled model neither
    traces the cached check (Dynamo warns at each trace where it does) nor repeats the warning. ``fall_back``: the
    caller runs the chunked form instead, which is said once."""
    reason = fla_refused(device_index)
    if reason is not None and fall_back:
        warn_once(f"{reason}: running the scan in its chunked PyTorch form (scan=chunked)")
    return reason


def scan(q, k, v, g, *, mode: str, chunk: int, scale: float = 1.0, reset: torch.Tensor | None = None) -> torch.Tensor:
    """``mode`` "auto": fla on CUDA (the chunked form where fla's kernels are known to be wrong, and under torch's
    deterministic mode), ``chunked`` elsewhere; "fla": fla's kernels or an error saying why they cannot run here;
    "chunked" / "recurrent": that form anywhere. ``reset`` (B, N) bool: packed rows' example starts."""
    if mode not in SCANS:
        raise ValueError(f"scan must be one of {', '.join(SCANS)}, got {mode!r}")
    # fla's Triton kernels are outside what torch's deterministic mode (trainer.deterministic) checks or replaces
    deterministic = torch.are_deterministic_algorithms_enabled()
    if mode == "fla" and deterministic:
        raise ValueError("scan=fla (trainer.mixer.scan) runs flash-linear-attention's Triton kernels, which torch's "
                         "deterministic mode (trainer.deterministic=true) does not cover: set scan=chunked")
    if mode == "fla":
        if not q.is_cuda:
            raise ValueError("scan=fla (trainer.mixer.scan) runs flash-linear-attention's Triton kernels, on CUDA "
                             "only: here set scan=auto or chunked")
        reason = fla_refusal(q.device.index or 0, fall_back=False)
        if reason is not None:
            raise RuntimeError(f"scan=fla (trainer.mixer.scan): {reason}; scan=auto runs the chunked form instead")
        return fla(q, k, v, g, scale, reset)
    if mode == "auto" and q.is_cuda and not deterministic and fla_refusal(q.device.index or 0) is None:
        return fla(q, k, v, g, scale, reset)
    if mode == "recurrent":
        return recurrent(q, k, v, g, scale, reset=reset)[0]
    return chunked(q, k, v, g, chunk, scale, reset)
