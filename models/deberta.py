"""DeBERTa: disentangled attention over content and relative position (He, Liu, Gao, Chen, 2021, "DeBERTa:
Decoding-enhanced BERT with Disentangled Attention", https://arxiv.org/abs/2006.03654), in the form of
DeBERTa-v2/v3 (log-bucketed distances, relative embeddings projected by the layer's own W_q and W_k).

Each pair (i, j) scores content against content and each content against the other's relative position
(paper eq. 4-5). With Q = H W_q, K = H W_k, V = H W_v the content projections, P the (2k, d) relative
embedding table (layer-normed, as v2/v3), Q_r = P W_q and K_r = P W_k its projections, and delta(i, j) the row
of P for the distance i - j:

    A_ij = Q_i . K_j  (c2c)  +  Q_i . K_r[delta(i, j)]  (c2p)  +  K_j . Q_r[delta(j, i)]  (p2c),
    out  = softmax(A / sqrt(3 Dh)) V        (3 = the number of terms, the v2 code's scale_factor).

Two executions of the same score (``backend``, an attribute: how it runs, never what it computes):

* **dense** (the reference; CPU, and CUDA while attention dropout is active): c2p and p2c are computed as the
  paper's Algorithm 1 does, without an N x N x d tensor: Q K_r^T (N x 2k) and Q_r K^T (2k x N) are small
  tables, and one (N x N) index delta gathers from them, along the rows for c2p[i, j] = (Q K_r^T)[i, delta(i, j)]
  and down the columns for p2c[i, j] = (Q_r K^T)[delta(j, i), j]. The scale is applied to Q_r and K_r, and padded
  keys are masked in the p2c table, both before anything is N x N. On CUDA the gathers' backward sums runs of
  equal distance bucket from prefix sums (``RelativeGather``), not by ``scatter_add``'s atomics. The sum of the
  two terms is the float mask of ``scaled_dot_product_attention`` (a (B, H, N, N) bias: 4 GB a layer at N = 4096,
  batch 32). delta and the runs' bounds depend on N only: built once per (N, device) and shared by the layers
  (``cached_index``), or, under torch.compile, built inside the graph, where Inductor fuses them.
* **flex** (CUDA's default where no gradient is taken, i.e. evaluation; ``backend = "flex"`` forces it, with
  gradients too): FlexAttention with a ``score_mod`` that adds c2p[b, h, i, delta(i, j)] + p2c[b, h, delta(j,
  i), j] to each score, read from the same two tables (fp32, captured: their gradients come from the kernel's
  backward) with delta computed elementwise from q_idx - kv_idx (``position_rows``, the ops that build the dense
  index; a GPU test checks that Triton's log and division bucket every distance alike). Padded keys are masked by
  a BlockMask (tiles of only padding skipped). Nothing N x N is stored: O(N k) memory for the tables instead of
  O(N^2) for bias and index, fused forward and backward.
  FlexAttention has no dropout of its own (a score_mod acts before the softmax, dropout after it): "flex" applies
  it through ``_flex_dropout`` (a second call for the normaliser, the draws hashed in the kernel), and with
  attention dropout active "auto" takes the dense path.
  "auto" also keeps training steps on the dense path, which is the faster: one layer's compiled forward + backward
  (batch 32, d 256, 4 heads of 64, bf16) is several times slower with flex than dense at N = 1024 and 4096, in
  less peak memory (results/layer_bench.csv, rows ``lra deberta`` and ``lra deberta(backend=flex)``): the kernel
  reads two fp32 tables per score and sums their gradients by atomic adds. Its tiles are the smaller ones
  (``TABLE_BACKWARD``) that a multiprocessor's shared memory holds.
  On the CPU it runs eagerly, forward only (torch refuses its CPU backward; the tests lift that check to compare
  gradients with the dense path's).

delta: v2's ``make_log_bucket_position`` then ``clamp(. + k, 0, 2k - 1)``, k = ``position_buckets``:
distances |d| <= k / 2 keep their own bucket; beyond, bucket sign(d) (k/2 + ceil(log(|d| / (k/2)) /
log((m - 1) / (k/2)) (k/2 - 1))) with m = ``max_relative_positions``, so |d| = m - 1 lands on k - 1 and
farther ones share the last rows of P. ``position_buckets: 0`` is DeBERTa v1: k = m, distances clipped at +-k.

Complexity: O(N^2 d) time on both paths, O(N k d) for the two tables. Memory: dense, O(N^2) (the N x N bias and
index, the scores on CPU, and on CUDA the backward's fp32 N x N prefix sum); flex, O(N k). It is exact attention
with relative terms: the N^2 member of the relative-position family.
Padding: dense, padded keys get the dtype's finite minimum (in the p2c table; adding c2p, many orders of
magnitude smaller, leaves it there), so their weight is exactly 0 and a row of only padding stays finite
(uniform); flex, the BlockMask leaves them out (weight exactly 0; a row of only padding gives 0). The terms depend
on i - j only, so appending padding leaves real outputs unchanged. Padded queries get an output the encoder
ignores.

Deviations:
* p2c index: the paper's eq. 4 uses delta(j, i). The released code indexes p2c with delta(i, j), c2p's index
  (microsoft/DeBERTa reuses c2p's index down the columns; HuggingFace gathers with -delta and transposes, to
  the same effect; discussed in microsoft/DeBERTa#162). Both are learned tables; this file follows the paper.
* P belongs to each layer: DeBERTa shares one table (and its LayerNorm) across layers, which a mixer built
  per layer cannot (2k x d parameters per layer more, 512 d at the defaults).
* The projections have no bias (the harness's shared W_qkv); DeBERTa's have, so its P W_q carries one.
* DeBERTa's released models add no absolute positions at the input (``position_biased_input: false``) and use
  them in the enhanced mask decoder, a pretraining head; both belong to the harness here (its ``positions``).
* No position-to-position term, as the paper (with relative positions it adds little).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import MultiHeadMixer, cumsum, pad_head_dim, takes_fused_path
from .patterns import flex_attend, flex_call, padding_block_mask, score_table
from .registry import Taxonomy, register_model


def log_bucket(distance: torch.Tensor, buckets: int, max_distance: int) -> torch.Tensor:
    """DeBERTa-v2's ``make_log_bucket_position``: integer distances -> signed buckets, exact for
    |d| <= buckets // 2, log-spaced beyond (|d| = max_distance - 1 -> buckets - 1). fp32 logs, as the original,
    so the bucket edges match it. Elementwise (also on the scalars of a score_mod) and odd: the bucket of -d is
    exactly minus that of d (all arithmetic is on |d|)."""
    mid = buckets // 2
    far = distance.abs().clamp_min(mid).float()  # the log branch only matters where |d| > mid
    log_pos = mid + torch.ceil(torch.log(far / mid) / math.log((max_distance - 1) / mid) * (mid - 1))
    return torch.where(distance.abs() <= mid, distance, (torch.sign(distance) * log_pos).to(distance.dtype))


def position_rows(distance: torch.Tensor, buckets: int, max_relative: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distances d = i - j (an integer tensor of any shape, the scalar q_idx - kv_idx in a score_mod) ->
    (delta(i, j), delta(j, i)), the rows of P for d and -d, elementwise. One bucket serves both (it is odd)."""
    span = buckets or max_relative
    bucket = log_bucket(distance, buckets, max_relative) if buckets else distance
    return (bucket + span).clamp(0, 2 * span - 1), (span - bucket).clamp(0, 2 * span - 1)


def relative_index(n: int, device: torch.device, buckets: int, max_relative: int) -> torch.Tensor:
    """delta(i, j) for i, j < n: the row of P for distance i - j. -> (n, n) long."""
    rows = position_rows(torch.arange(1 - n, n, device=device), buckets, max_relative)[0]  # (2n - 1,): each i - j
    i = torch.arange(n, device=device)
    return rows[i[:, None] - i[None, :] + n - 1]  # (n, n)


class RelativeGather(torch.autograd.Function):
    """``torch.gather(table, dim, index)`` for an index that never increases along ``dim`` (a relative-position
    index: delta(i, j) falls as j rises), with a backward that sums each run of equal indices from a prefix sum
    instead of scattering. Gather's own backward is ``scatter_add``: on CUDA, atomics that thousands of entries
    aim at one table cell (every distance past the last bucket), in bf16, and in no fixed order. Here each cell's
    gradient is ``S[end] - S[start]`` of the fp32 prefix sum S of the output's gradient along ``dim``: no
    contention and deterministic.

    table: (B, H, T, n) gathered along dim -2 with index (n, n), or (B, H, n, T) along -1; ``starts``, ``ends``:
    (n, T) each, where each run of one table entry starts and ends along a row of the index (``run_bounds``)."""

    @staticmethod
    def forward(ctx, table, index, starts, ends, dim):
        ctx.save_for_backward(starts, ends)
        ctx.dim, ctx.table_dtype = dim, table.dtype
        return torch.gather(table, dim, index.expand(*table.shape[:2], *index.shape))

    @staticmethod
    def backward(ctx, grad):
        starts, ends = ctx.saved_tensors
        dim = ctx.dim
        if dim == -2:  # (B, H, n, n) -> runs down the columns: the bounds' rows become columns
            starts, ends = starts.t(), ends.t()  # (T, n)
        # The leading 0 goes in before the prefix sum (S[k] = sum of the first k, n + 1 of them), not after: the
        # sum of the n alone, padded, does not compile for CUDA in fp32 at n = 1,025 (Inductor's split-scan codegen
        # fails), while this form compiles with the eager gradients (docs/gpu.md).
        grad = grad.to(torch.promote_types(grad.dtype, torch.float32))  # >= fp32
        prefix = cumsum(F.pad(grad, (1, 0) if dim == -1 else (0, 0, 1, 0)), dim)  # (B, H, n + 1, n) or (B, H, n, n + 1)
        lead = grad.shape[:2]
        total = prefix.gather(dim, ends.expand(*lead, -1, -1)) - prefix.gather(dim, starts.expand(*lead, -1, -1))
        return total.to(ctx.table_dtype), None, None, None, None


def relative_gather(table: torch.Tensor, delta: torch.Tensor, dim: int,
                    bounds: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """A relative-position table gathered by delta: along the rows (dim -1, index delta) or down the columns
    (dim -2, index delta^T). With ``bounds`` (``run_bounds(delta, ...)``, given on CUDA) through
    :class:`RelativeGather`, whose backward has no atomics; without, by ``torch.gather``, whose own backward is
    the faster on the CPU (a plain loop)."""
    index = delta if dim == -1 else delta.t().contiguous()  # contiguous: gathers about twice as fast on CPU
    if bounds is not None:
        return RelativeGather.apply(table, index, *bounds, dim)
    return torch.gather(table, dim, index.expand(*table.shape[:2], *index.shape))


def run_bounds(index: torch.Tensor, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, n) index, non-increasing along each row -> (starts, ends), (n, entries) each: row i holds entry r at
    positions starts[i, r] <= j < ends[i, r] (an empty run where r is absent)."""
    rising = (-index).contiguous()  # (n, n): non-decreasing rows, as searchsorted needs
    entry = -torch.arange(entries, device=index.device).repeat(index.shape[0], 1)  # (n, entries), negated as well
    return torch.searchsorted(rising, entry), torch.searchsorted(rising, entry, right=True)


def build_index(n: int, device: torch.device, buckets: int, max_relative: int):
    """The dense path's delta (n, n) and, on CUDA, its ``run_bounds`` ((n, 2k) each; None elsewhere)."""
    with torch.inference_mode(False):  # cached tensors that autograd may save later
        delta = relative_index(n, device, buckets, max_relative)
        bounds = run_bounds(delta, 2 * (buckets or max_relative)) if device.type == "cuda" else None
        return delta, bounds


# Eager: one delta per (n, device, buckets) for every layer and step; a few lengths kept (8 n^2 bytes each, 2 GB at
# n = 16K). Compiled code does not read it (see ``DeBERTa.index``).
cached_index = functools.lru_cache(maxsize=4)(build_index)


# Triton stages each tile of the two fp32 tables through shared memory, once per pipeline stage. At the bench's
# shape (heads of 64, bf16) Inductor's defaults ask for 442,368 bytes, 3 stages x 2 tables x 64 KiB + 48 KiB of q, k
# and v: its 128 x 128 forward tiles, or its backward's two loops of 64 x 128 and 128 x 64 tiles (32 KiB each) if
# their buffers add up, more than any current GPU's multiprocessor holds. The forward takes 64 x 64 tiles
# (patterns.SMALL_FORWARD_TILES) and the backward one stage: within the 232,448 bytes of a compute capability 9.0
# multiprocessor either way.
TABLE_BACKWARD = {"bwd_num_stages": 1}


def _flex_attend(mixer: DeBERTa, q, k, v, mask):
    """The layer's attention as FlexAttention: q, k, v (B, H, N, Dh), mask (B, N) or None -> (B, H, N, Dh)."""
    d_head = q.shape[-1]
    scale = mixer.score_scale(d_head)
    # tables in fp32 (at least): the kernel adds them to fp32 scores, and its backward sums their gradients by atomic
    # adds, up to thousands per entry (every distance past the last bucket), which bf16 would round away
    dtype = torch.promote_types(q.dtype, torch.float32)  # at least fp32
    c2p, p2c = (t.to(dtype) for t in mixer.position_tables(q, k, scale))  # (B, H, N, 2k), (B, H, 2k, N)
    # N padded to its bound and each a buffer of its own under torch.compile (patterns.score_table)
    c2p, p2c = score_table(c2p, {2: mixer.max_len}), score_table(p2c, {3: mixer.max_len})
    buckets, max_relative = mixer.buckets, mixer.max_relative

    def score_mod(score, b, h, q_idx, kv_idx):  # score: q_i . k_j * scale, fp32
        row, col = position_rows(q_idx - kv_idx, buckets, max_relative)  # delta(i, j), delta(j, i)
        return score + (c2p[b, h, q_idx, row] + p2c[b, h, col, kv_idx])

    block_mask = None if mask is None else padding_block_mask(mask)
    # (B, H, N, Dh); head sizes under the kernel's 16 are zero-padded and cut in flex_attend. Tiles whose loads of
    # the two fp32 tables fit shared memory (TABLE_BACKWARD)
    return flex_attend(q, k, v, block_mask, small_tiles=True, score_mod=score_mod, scale=scale,
                       dropout_p=mixer.dropout_p, kernel_options=TABLE_BACKWARD)


@register_model
class DeBERTa(MultiHeadMixer):
    taxonomy = Taxonomy("He et al. 2021, arXiv 2006.03654", "N^2", (), decode=False)
    backends = ("auto", "flex", "dense")  # the values of ``backend`` (how it runs, not what it computes)
    # FlexAttention sums the gradient of the table its score_mod reads by atomic adds (no fixed order), and torch's
    # deterministic mode neither checks nor replaces them: under it ``auto`` keeps off flex and asking for it is refused
    nondeterministic_backends = ("flex",)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        dropout: float,
        max_len: int,
        *,
        position_buckets: int = 256,
        max_relative_positions: int = 512,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if max_relative_positions < 1:
            raise ValueError(f"max_relative_positions must be >= 1, got {max_relative_positions}")
        if position_buckets < 0 or position_buckets == 1:
            raise ValueError(f"position_buckets must be >= 2 (log buckets) or 0 (clip), got {position_buckets}")
        if position_buckets and max_relative_positions <= position_buckets // 2 + 1:
            raise ValueError(f"max_relative_positions={max_relative_positions} must exceed position_buckets // 2 + 1 "
                             f"= {position_buckets // 2 + 1}: the log buckets start there")
        self.buckets, self.max_relative = int(position_buckets), int(max_relative_positions)
        self.span = self.buckets or self.max_relative  # k: P has 2k rows, relative positions -k ... k - 1
        # P: N(0, 0.02) as DeBERTa's initializer_range, then LayerNorm (v2/v3's norm_rel_ebd)
        self.rel_embeddings = nn.Parameter(torch.randn(2 * self.span, d_model) * 0.02)
        self.rel_norm = nn.LayerNorm(d_model)
        # "auto" (flex on CUDA in evaluation, else dense), "flex" or "dense"; how it runs, not what (module
        # docstring)
        self.backend = "auto"

    def relative_index(self, n: int, device: torch.device) -> torch.Tensor:
        """delta(i, j) for i, j < n: the row of P for distance i - j. -> (n, n) long, built anew."""
        return relative_index(n, device, self.buckets, self.max_relative)

    def index(self, n: int, device: torch.device):
        """The dense path's delta (n, n) and its run bounds (CUDA; else None): in eager from ``cached_index``, built
        once per (n, device, buckets) for all layers and steps; under torch.compile built inside the graph (a pure
        function of n: no guard on a cache that eager code may fill, no graph break, no tensor copied into CUDA
        graphs; Inductor fuses the index arithmetic into the gathers)."""
        build = build_index if torch.compiler.is_compiling() else cached_index
        return build(n, device, self.buckets, self.max_relative)

    def relative_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Q_r = P W_q and K_r = P W_k: one table P for both terms, through the layer's own projections.
        -> (H, 2k, Dh) each."""
        d_qkv = self.n_heads * self.d_head
        p = self.rel_norm(self.rel_embeddings)  # (2k, D)
        qk_r = F.linear(p, self.qkv.weight[: 2 * d_qkv]).view(-1, 2, self.n_heads, self.d_head)  # (2k, 2, H, Dh)
        q_r, k_r = qk_r.permute(1, 2, 0, 3)  # each (H, 2k, Dh)
        return q_r, k_r

    @staticmethod
    def score_scale(d_head: int) -> float:
        return (3 * d_head) ** -0.5  # 3 terms: the v2 code's scale_factor

    def position_tables(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The two small tables both paths read the position terms from, times ``scale``: q, k (B, H, N, Dh) ->
        Q K_r^T (B, H, N, 2k) (c2p's: q_i . K_r[r]) and Q_r K^T (B, H, 2k, N) (p2c's: Q_r[r] . k_j)."""
        q_r, k_r = (t * scale for t in self.relative_projections())  # (H, 2k, Dh): scaled while still small
        return q @ k_r.transpose(-1, -2), q_r @ k.transpose(-1, -2)

    def c2p_p2c(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0):
        """The two position terms gathered from (N x 2k) tables: q, k (B, H, N, Dh) -> (B, H, N, N) each,
        c2p[i, j] = q_i . K_r[delta(i, j)] and p2c[i, j] = k_j . Q_r[delta(j, i)], times ``scale``. With a
        ``mask`` (B, N), p2c is the dtype's minimum at padded keys j (masked in its 2k x N table, not N x N)."""
        N = q.shape[2]
        rows, table = self.position_tables(q, k, scale)  # (B, H, N, 2k), (B, H, 2k, N): one column per key
        # delta (N, N): delta(i, j), non-increasing along each row; on CUDA, where each row of delta holds each
        # table entry ((N, 2k) each): one computation for both gathers (column j of p2c's index is row j of delta)
        delta, bounds = self.index(N, q.device)
        c2p = relative_gather(rows, delta, -1, bounds)  # (B, H, N, N)
        if mask is not None:
            table = table.masked_fill(~mask[:, None, None, :], torch.finfo(table.dtype).min)
        # down the columns: out[i, j] = table[delta(j, i), j], laid out (i, j) already (no transposed N x N copy)
        p2c = relative_gather(table, delta, -2, bounds)  # (B, H, N, N)
        return c2p, p2c

    def flex_runs(self, on_cuda: bool, needs_grad: bool = False) -> bool:
        """Whether FlexAttention runs (``backend``): asked for, or on CUDA where no gradient is taken (evaluation;
        module docstring: why not in training) and no attention dropout is active."""
        return takes_fused_path(self, "flex", on_cuda and self.dropout_p == 0 and not needs_grad)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.flex_runs(q.is_cuda, torch.is_grad_enabled() and q.requires_grad):
            return flex_call(_flex_attend, q.is_cuda, self, q, k, v, mask)  # compiled on CUDA (patterns.flex_call)
        d_head = q.shape[-1]
        scale = self.score_scale(d_head)
        c2p, p2c = self.c2p_p2c(q, k, mask, scale)  # (B, H, N, N) each, scaled; p2c carries the padding mask
        # in place on the gather's fresh output (its backward needs only the index): one N x N bias. At padded
        # keys it is min + c2p, which rounds back to about min (c2p is far below min's rounding step), so
        # padding gets weight exactly 0, and a row of only padding stays finite (uniform)
        bias = c2p.add_(p2c)  # (B, H, N, N)
        # head sizes off a multiple of 8 are zero-padded for the fused CUDA kernels (see models/transformer.py)
        q, k, v = pad_head_dim(-(-d_head // 8) * 8, q, k, v)  # (B, H, N, multiple of 8)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=self.dropout_p, scale=scale)
        return o[..., :d_head]  # (B, H, N, Dh)
