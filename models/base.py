"""The skeleton most mixers share: per-head projections in, ``attend`` in the middle, one projection out.

A subclass implements ``attend(q, k, v, mask) -> (B, H, N, Dh)`` and, if it needs them, its own options
after the five backbone arguments.

Packed rows (several examples in one row, see ``lra.train.packing``): a mixer that sets ``supports_segments = True``
also takes ``segments``, a (B, N) integer tensor naming the example each position belongs to (0 = padding;
each example's positions are contiguous), and must compute every example's output from that example's
positions alone, exactly as if it had its own row. ``attend`` then receives ``segments=`` too. Position-indexed
mixers (a learned projection over positions, a fixed layout of blocks) cannot, and keep the default False.

Causal form: a mixer that sets ``supports_causal = True`` reads a ``causal`` attribute, which the caller may set on
an instance: True makes out_i depend on positions j <= i only (next-token pretraining, ``lra.train.pretrain``). It
changes no parameter, so weights trained one way load into the other.

Mixers that do not fit this shape (e.g. shared-QK Reformer, dense Synthesizer) subclass it anyway and override
``project`` or ``forward``.
"""
from __future__ import annotations

import functools
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

RECOMPILE_LIMIT = 128


@functools.cache
def compiled(fn, dynamic: bool | None = None):
    """``fn`` through ``torch.compile(fn, dynamic=dynamic)``, built once per (fn, dynamic) on first use.
    Mixers call it on CUDA only, to fuse the small kernels around their matmuls.

    Dynamo keeps at most ``recompile_limit`` (8) specialisations per function and runs it eagerly past
    that. One per layer instance and length is normal here (a 4-layer model benched at six lengths is 24),
    and eager FlexAttention materialises the N x N scores (a block-sparse model past the limit runs far slower than
    the transformer, in far more memory), so the limit is raised."""
    import torch._dynamo  # Dynamo (seconds to import) only where a mixer compiles

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=dynamic)


def runnable_backends(mixer) -> tuple[str, ...]:
    """The mixer's ``backends`` it may run now: under torch's deterministic mode (lra's ``trainer.deterministic``)
    those left after its ``nondeterministic_backends``, whose backward adds in no fixed order with no deterministic
    kernel to take its place; otherwise all."""
    if not torch.are_deterministic_algorithms_enabled():
        return tuple(mixer.backends)
    return tuple(b for b in mixer.backends if b not in getattr(mixer, "nondeterministic_backends", ()))


def checked_backend(mixer, value: str, label: str | None = None) -> str:
    """``value`` if it is one of the mixer's ``backends`` (how it runs, not what) that may run now
    (``runnable_backends``), else a ValueError that lists them, prefixed by ``label`` (default: the mixer's class
    name)."""
    label = label or type(mixer).__name__
    if value not in mixer.backends:
        raise ValueError(f"{label}: backend must be one of {', '.join(mixer.backends)}, got {value!r}")
    if value not in (allowed := runnable_backends(mixer)):
        raise ValueError(f"{label}: backend {value} sums its gradients in no fixed order, and torch's deterministic "
                         f"mode is on (trainer.deterministic): choose one of {', '.join(allowed)}")
    return value


def chosen_backend(mixer) -> str:
    """A mixer's ``backend`` attribute, checked against its class's ``backends``."""
    return checked_backend(mixer, mixer.backend)


class Count:
    """The values of a setting that counts (positions per chunk, ...): any integer >= 1, and None where ``none``
    says what None means. Tested with ``in``, as a tuple of values is."""

    def __init__(self, none: str | None = None):
        self.none = none

    def __contains__(self, value) -> bool:
        if value is None:
            return self.none is not None
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    def __str__(self) -> str:
        return "an integer >= 1" + (f", or null ({self.none})" if self.none is not None else "")


def settings(**allowed) -> MappingProxyType:
    """A mixer class's ``execution`` declaration: setting name -> its allowed values (a tuple, or a ``Count``), read
    only, as a class attribute shared by every instance must be."""
    return MappingProxyType(allowed)


def execution_settings(mixer) -> dict:
    """The attributes that choose how a mixer (an instance or its class) runs, never what it computes, each with
    its allowed values: ``backend`` (its ``backends``) where it has one, and those of its ``execution`` declaration
    (name -> a tuple of values or a ``Count``). The config hash leaves them out: a run sets them with
    ``trainer.mixer``, the benches with their variants, and each is checked by ``checked_setting``."""
    settings = {"backend": tuple(mixer.backends)} if hasattr(mixer, "backends") else {}
    return {**settings, **getattr(mixer, "execution", {})}


def _allowed_text(allowed) -> str:
    return ", ".join(map(repr, allowed)) if isinstance(allowed, tuple) else str(allowed)


def checked_setting(mixer, key: str, value, label: str | None = None):
    """``value`` if the mixer (an instance or its class) declares ``key`` among its ``execution_settings`` and
    ``value`` is one of its allowed values (a backend: as ``checked_backend`` checks it), else a ValueError naming
    them, prefixed by ``label`` (default: the class name)."""
    label = label or getattr(mixer, "__name__", type(mixer).__name__)
    settings = execution_settings(mixer)
    if key not in settings:
        known = ", ".join(settings) or "none: it runs one way"
        raise ValueError(f"{label}: {key} is not a setting of how it runs (its settings: {known})")
    if key == "backend":
        return checked_backend(mixer, value, label)
    allowed = settings[key]
    # a tuple's values compare by type too: 1 is not True, nor 0.0 the integer 0
    ok = any(value == a and type(value) is type(a) for a in allowed) if isinstance(allowed, tuple) else value in allowed
    if not ok:
        raise ValueError(f"{label}: {key} must be {_allowed_text(allowed)}, got {value!r}")
    return value


def takes_fused_path(mixer, fused: str, on_cuda: bool) -> bool:
    """Whether a mixer with two executions, ``backends = ("auto", fused, reference)``, takes its fused one: when its
    ``backend`` names it, or under "auto" on CUDA (``on_cuda``: the caller's condition, e.g. also no dropout) where
    it may run now (``runnable_backends``). The attribute is checked as ``chosen_backend`` checks it."""
    backend = chosen_backend(mixer)
    return backend == fused or (backend == "auto" and on_cuda and fused in runnable_backends(mixer))


def cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.cumsum(dim)``; for a floating CUDA tensor under torch's deterministic mode (``trainer.deterministic``),
    ``ordered_cumsum``: torch has no deterministic CUDA kernel for a floating cumsum (it raises in that mode), and
    the scan Inductor generates for a long one adds in an order set by the timing of its blocks."""
    if x.is_cuda and x.is_floating_point() and torch.are_deterministic_algorithms_enabled():
        return ordered_cumsum(x, dim)
    return x.cumsum(dim)


def ordered_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The inclusive cumulative sum along ``dim`` as ceil(log2 n) shifted additions (Hillis and Steele's scan): after
    the pass with shift s each entry holds the sum of the 2s entries ending at it. Elementwise work only, in one fixed
    order on any device, O(n log n) additions; its rounding is a pairwise sum's, not the sequential one's."""
    y = x.movedim(dim, -1)  # (..., n)
    n, shift = y.shape[-1], 1
    while shift < n:
        y = y + F.pad(y[..., : n - shift], (shift, 0))  # (..., n): entry i plus entry i - shift (0 before the start)
        shift *= 2
    return y.movedim(-1, dim)


def pad_head_dim(size: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(B, H, N, Dh) tensors zero-padded to head size ``size`` when ``Dh`` is smaller, for fused kernels that
    need a minimum or a multiple. Exact for attention: zero columns add nothing to q.k and give zero output
    columns, which the caller cuts off; the caller keeps the softmax scale of the true ``Dh``."""
    pad = size - tensors[0].shape[-1]
    return tuple(F.pad(t, (0, pad)) for t in tensors) if pad > 0 else tensors  # each (B, H, N, max(Dh, size))


def upcast(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 at least (fp64 stays, for tests)


def product_dtype(v: torch.Tensor) -> torch.dtype:
    """The operand dtype of a kernel mixer's products with values and gradients: bf16 when the values come in
    bf16 (as SDPA multiplies its probabilities by V in bf16), else fp32 or wider. fp16 gets fp32: sum_n fk_n v_n
    can pass fp16's 65504 at long N."""
    return torch.bfloat16 if v.dtype == torch.bfloat16 else upcast(v).dtype


def mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b with both operands in ``dtype`` (accumulated in fp32 by the matmul), returned in fp32 or wider."""
    return upcast(torch.matmul(a.to(dtype), b.to(dtype)))


def _dropped_softmax_values(scores: torch.Tensor, values: torch.Tensor, dropout_p: float, scale: float):
    logits = upcast(scores) if scale == 1.0 else upcast(scores) * scale  # eagerly, a multiply by 1 is a pass more
    p = F.dropout(torch.softmax(logits, -1), dropout_p)  # (..., S, L): fp32 at least
    return torch.matmul(p.to(values.dtype), values)  # (..., S, Dv)


def softmax_values(scores: torch.Tensor, values: torch.Tensor, dropout_p: float, scale: float = 1.0) -> torch.Tensor:
    """dropout(softmax(scores * scale)) @ values for explicitly formed scores (..., S, L) and values (..., L, Dv) ->
    (..., S, Dv) in the values' dtype; the scaling and the softmax in fp32 at least. The weights are recomputed in
    the backward (``torch.utils.checkpoint``), not stored: autograd, compiled or not, would keep the probabilities,
    the dropped ones and the dropout mask beside the scores, three (..., S, L) tensors more, where this keeps the
    scores alone (Transformer-XL's layer on a CPU, compiled: 43 -> 25 MB saved for the backward). The recomputation
    replays the RNG state, so its dropout mask is the forward's; the cost is one more softmax and product with the
    values."""
    return checkpoint(_dropped_softmax_values, scores, values, dropout_p, scale, use_reentrant=False)


def with_ones(v: torch.Tensor) -> torch.Tensor:
    """[v, 1] (..., Dh + 1), fp32 at least: one matmul against kernel features phi(K) then yields both
    sum phi(k) v^T and the normaliser sum phi(k) (linear's causal and recurrent forms, cosFormer)."""
    return F.pad(upcast(v), (0, 1), value=1.0)


class TiedDropout(nn.Dropout):
    """Dropout with one mask per example and channel, shared by every position of a (B, ..., D) input (S4's
    ``tie_dropout``; ``nn.Dropout1d`` on channels-first inputs): a dropped channel is gone along the whole
    sequence, so the next layer cannot read it back from a neighbouring position, which element dropout allows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = x.new_empty(x.shape[0], *[1] * (x.dim() - 2), x.shape[-1]).bernoulli_(1 - self.p)  # (B, 1.., D)
        return x * keep / (1 - self.p)


def make_dropout(p: float, tied: bool = False) -> nn.Dropout:
    """Element dropout, or with ``tied`` one mask per example and channel (:class:`TiedDropout`)."""
    return TiedDropout(p) if tied else nn.Dropout(p)


def same_segment(segments: torch.Tensor) -> torch.Tensor:
    """(B, N) segment ids -> (B, 1, N, N) bool: query i may see key j when both belong to one example (padding
    positions, id 0, see each other only, which keeps their softmax rows finite; their outputs are ignored)."""
    return segments[:, None, :, None] == segments[:, None, None, :]  # (B, 1, N, N)


def segment_onehot(segments: torch.Tensor) -> torch.Tensor:
    """(B, N) segment ids -> (B, S, N) one-hot over each row's own segments (S = the most segments in a row),
    in the order they appear; padding belongs to none. For mixers that sum over an example's positions."""
    real = segments != 0
    starts = real & (segments != F.pad(segments, (1, 0))[:, :-1])  # (B, N): first position of each segment
    local = torch.cumsum(starts, 1) - 1  # (B, N): 0, 1, ... per row; -1 before the first segment
    n_segments = max(int(starts.sum(1).max()), 1)
    onehot = local[:, None, :] == torch.arange(n_segments, device=segments.device)[None, :, None]  # (B, S, N)
    return onehot & real[:, None, :]


# What a mixer reads off a packed batch's segments tensor (a device read: a host synchronisation) is cached on that
# tensor: a forward's layers all receive the same one, so it is read once a forward, not once a layer.
once_per_batch = functools.lru_cache(maxsize=1)


@torch.compiler.disable  # S is read off the data: a compiled model breaks its graph here and goes on
@once_per_batch
def segment_members(segments: torch.Tensor) -> torch.Tensor:
    """(B, N) segment ids -> (B, 1, N, S) bool: n belongs to its row's s-th example. Padding joins the first (its
    keys are masked to zero, its outputs ignored), so every position has exactly one. With ``spread`` and
    ``pick``, kernel mixers sum keys per example in one matmul and each query reads its own example's sums."""
    onehot = segment_onehot(segments)  # (B, S, N)
    onehot[:, 0] |= segments == 0
    return onehot.transpose(1, 2)[:, None]  # (B, 1, N, S)


def own_segment(member: torch.Tensor | None) -> torch.Tensor | None:
    """(B, 1, N, S) membership -> (B, 1, N, 1) int64: the index s of each position's example."""
    return None if member is None else member.to(torch.uint8).argmax(-1, keepdim=True)


def spread(x: torch.Tensor, member: torch.Tensor | None) -> torch.Tensor:
    """(B, H, N, D) -> (B, H, N, S D): x_n in its own example's block of D columns, zeros in the others, so that
    (N x m)^T @ spread(x) sums each example apart. Unpacked: x itself."""
    if member is None:
        return x
    return (x.unsqueeze(-2) * member.unsqueeze(-1)).flatten(-2)  # (B, H, N, S, D) -> (B, H, N, S D)


def pick(y: torch.Tensor, index: torch.Tensor | None, d: int) -> torch.Tensor:
    """(B, H, N, S d) -> (B, H, N, d): each position's block of its own example. Unpacked: y itself."""
    if index is None:
        return y
    blocks = y.unflatten(-1, (-1, d))  # (B, H, N, S, d)
    return blocks.gather(3, index[..., None].expand(-1, y.shape[1], -1, 1, d)).squeeze(3)  # (B, H, N, d)


def key_summaries(fk: torch.Tensor, v: torch.Tensor, member: torch.Tensor | None, dtype: torch.dtype):
    """Kernel attention's key side: features fk (B, H, n, m), v (B, H, n, Dh) -> the summaries sum_n fk_n v_n^T
    (B, H, m, S Dh) and key sums sum_n fk_n (B, H, S, m) of these keys, per example."""
    kv = mm(fk.transpose(-1, -2), spread(v, member), dtype)  # (B, H, m, S Dh)
    ksum = fk.sum(-2, keepdim=True) if member is None else member.transpose(-1, -2).to(fk.dtype) @ fk  # (B, H, S, m)
    return kv, ksum


def read_out(fq: torch.Tensor, kv: torch.Tensor, ksum: torch.Tensor, index: torch.Tensor | None, d: int,
             dtype: torch.dtype, eps: float):
    """Kernel attention's query side: features fq (B, H, n, m) of some queries -> their output (B, H, n, Dh) and
    normaliser (B, H, n, 1), fp32 (the normaliser's matmul takes fp32 operands whatever ``dtype`` is)."""
    den = pick(torch.matmul(fq, ksum.transpose(-1, -2)), index, 1) + eps  # (B, H, n, 1)
    return pick(mm(fq, kv, dtype), index, d) / den, den


def kernel_attention(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, member: torch.Tensor | None,
                     eps: float) -> torch.Tensor:
    """Non-causal normalised kernel attention, out_i = fq_i . sum_j fk_j v_j^T / (fq_i . sum_j fk_j + eps), from
    positive fp32 (or fp64) features fq, fk (B, H, N, m) (padded keys' rows zero) and values v (B, H, N, Dh);
    returns (B, H, N, Dh) fp32. The two products with values take v's precision (``product_dtype``: bf16 under
    autocast, fp32 accumulation); the key sums and the normaliser stay fp32. Packed rows (``member``): one
    summary and key sum per example, each query reading its own."""
    dtype, index = product_dtype(v), own_segment(member)
    kv, ksum = key_summaries(fk, v, member, dtype)  # (B, H, m, S Dh), (B, H, S, m)
    return read_out(fq, kv, ksum, index, v.shape[-1], dtype, eps)[0]


class MultiHeadMixer(nn.Module):
    """Backbone arguments, fixed by the task: ``d_model`` (residual width), ``n_heads``, ``d_qkv`` (total
    width of queries/keys/values over all heads, as LRA's ``qkv_dim``), ``dropout`` (attention dropout,
    applied in training only) and ``max_len`` (the longest sequence the task feeds, CLS slot included)."""

    # True when ``forward`` takes mask=None for "no padding anywhere" and gains from it; the encoder gives the
    # others an all-true mask instead.
    accepts_no_mask = False
    # True when ``forward`` takes ``segments`` (several examples packed in one row) and keeps them apart exactly
    supports_segments = False
    # True when the mixer has a ``causal`` attribute (False unless set): True makes each position's output a
    # function of the positions at and before it only (next-token pretraining), with the same parameters
    supports_causal = False

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int):
        super().__init__()
        if d_qkv % n_heads:
            raise ValueError(f"d_qkv={d_qkv} is not divisible by n_heads={n_heads}")
        self.n_heads, self.d_head, self.max_len = n_heads, d_qkv // n_heads, max_len
        self.attn_dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_qkv, bias=False)
        self.out = nn.Linear(d_qkv, d_model, bias=False)

    @property
    def dropout_p(self) -> float:
        return self.attn_dropout if self.training else 0.0

    def check_length(self, n: int) -> None:
        if n > self.max_len:
            raise ValueError(f"{type(self).__name__} was built for at most {self.max_len} positions, got {n}")

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, N, _ = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.n_heads, self.d_head)  # (B, N, 3, H, Dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, N, Dh)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = self.project(x)
        if segments is None:
            o = self.attend(q, k, v, mask)  # (B, H, N, Dh)
        elif self.supports_segments:
            o = self.attend(q, k, v, mask, segments=segments)  # (B, H, N, Dh)
        else:
            raise ValueError(f"{type(self).__name__} cannot keep packed examples apart (supports_segments=False)")
        return self.out(o.transpose(1, 2).reshape(B, N, -1))  # (B, N, D)
