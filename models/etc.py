"""ETC: global-local attention, a sliding window over the long input plus a few global tokens.

Paper: Joshua Ainslie, Santiago Ontañón, Chris Alberti, Vaclav Cvicek, Zachary Fisher, Philip Pham, Anirudh Ravula,
Sumit Sanghai, Qifan Wang, Li Yang, "ETC: Encoding Long and Structured Inputs in Transformers", EMNLP 2020,
https://arxiv.org/abs/2004.08483.

ETC splits the input into a long sequence and a small global one. Global tokens attend to everything (g2g,
g2l); a long token attends to the long tokens within ``radius`` r on each side (l2l) and to every global token
(l2g); each query's two parts share one softmax (ETC's "fused" attention). Relative positions enter as in ETC
(Shaw et al.'s relative key embeddings): logit_ij = q_i . (k_j + a_{label(i,j)}) / sqrt(d), with one learned
vector per head and label. Long-to-long pairs get label clip(j - i, -k, k) with k = ``max_distance`` (ETC's
``relative_pos_max_distance``); every pair involving a global token gets one extra label, "global". In a long
token's row that label weighs the globals against the window; in a global token's row every key has it, so
it is a constant that the softmax cancels: global queries see plain content attention.

Global tokens here: the ``global_tokens`` leading positions of the input (the encoder's CLS slot at position 0,
ETC's global CLS for classification; without a CLS slot, the first token) and ``learned_globals`` learned vectors
of this layer. The learned ones are projected to keys and values by the layer's own projection and seen by
every query, as if prepended to the sequence; the mixer returns only its N input positions, so their outputs
(their own global-to-all attention) would be dropped, and are therefore not computed. They are memory slots
whose content is learned, not carried from layer to layer; content that does travel between layers goes through
the leading input positions, whose outputs stay in the encoder's residual stream.

Long-to-long attention runs blocked, as ETC's sparse implementation: the long sequence is cut into blocks of
b = r + 1 tokens rounded up to a multiple of 8, each block's queries score the keys of the previous, own and next
block (3b slots, views of one padded tensor, no copy), and a band mask |i - j| <= r keeps the exact per-token
window. (Any b >= r + 1 holds the window; a multiple of 8 lets the batched products take the aligned tensor-core
kernels, which blocks of 85 at r = 84 would not.) The relative term is q . a for each of the 2k + 2 labels,
computed once per query and looked up per slot.

Complexity: O(N * (3b + G) * d) time and O(N * (3b + G)) memory for long queries, O(g * N * d) for
the g global queries and O(N * (2k + 2) * d) for the relative terms: linear in N. No N x N tensor is built.

Padding: padded keys are masked (fill -1e9, finite, so a fully masked padded row averages instead of making
NaN). Blocks start at position g whatever the length, so appending padding only adds blocks after the last real
token; real rows, long or global, see the same real keys with the same labels. Outputs at real positions do not
change with appended padding or with what it holds (up to float rounding: the batched matmuls change shape).

Deviations: one set of q/k/v projections shared by all four attention pieces (ETC has separate ones by default;
its ``share_qkv_projections`` option matches this). No structure: ETC's hard g2l/l2g masks and segment labels
(one global per sentence) need segment boundaries, which LRA's flat sequences do not have; globals attend to all
long tokens (ETC's flat setting). No CPC pre-training loss. Learned globals as above. The softmax is explicit
(fp32) rather than a fused kernel by default. Defaults r = 84, k = 12 are ETC's base configuration.

Execution of the long queries (``backend``, an attribute: how it runs, not what it computes): ``explicit``
(``auto``) forms the blocks' logits in fp32, masks them and applies softmax and dropout as tensors; ``sdpa`` hands
each block's queries, its G + 3b keys and values, and the relative terms with the mask folded in (a float mask, -1e9
where a key is not seen) to one fused SDPA call, which stores neither the probabilities nor the dropout mask;
``recompute`` is explicit with the weights recomputed in the backward from the stored scores
(``base.softmax_values``; the values of each block's G + 3b keys are gathered into one tensor for it).
``auto`` = explicit: in the compiled layer it is the fastest of the three at 4K and 16K; ``sdpa`` is slower and
takes more memory (its float mask), ``recompute`` takes less memory for more time (results/layer_bench.csv, rows
``lra etc`` and ``lra etc(backend=...)``). The labels (2k + 2 = 26) are padded to 32 and the global columns to a
multiple of 8 (exact: zero embeddings, never-seen columns), so that cuBLAS takes its aligned kernels.

``flex`` (asked for by name) runs the whole layer, global and long queries, as one FlexAttention call over the
keys in order [learned globals, input positions] (the queries likewise, with zero queries in the learned globals'
rows, whose outputs are dropped): a BlockMask of the band's diagonal tiles plus the globals' first row and column of
tiles, padding-only key tiles skipped, and a ``score_mod`` that adds q . a[label] read from the (B, H, G + N, 2k +
2) fp32 table of every query's relative terms (under torch.compile padded to the longest length,
``patterns.score_table``, so that its gradient's size is an int whatever the batch's length). Nothing of size
(3b + G) per query is stored: O(N (2k + 2)) for the table, the kernel's O(N) statistics. Attention dropout, which
FlexAttention lacks, comes from ``_flex_dropout`` (a second call for the normaliser; the draws are a hash, not
torch's Philox stream). It takes about SDPA's memory, about half of explicit's, but runs slower than explicit,
and slower still with dropout (results/layer_bench.csv, rows ``lra etc(backend=flex)``): at r = 84 a 128-query
tile's window spans three 128-key tiles plus the globals' tile, 512 keys scored per query against explicit's
3b + G = 265, each through the table's lookup. ``auto`` is explicit.

Eager speed: eagerly each step over the (B, H, N/b, b, Gp + 3b) scores is a kernel of its own that reads and writes
the whole tensor, seven such passes in the forward (the window's sum with its relative terms, the concatenation
with the global columns, the fp32 upcast, the scale, the mask, the softmax, the downcast) and six in the backward,
most of them in fp32. torch.compile fuses each direction's chain into about one kernel between the batched matmuls,
which are the same cuBLAS calls in both, so the eager step moves several times the bytes and holds more of its
intermediates at once (a higher memory peak). Debugging eagerly, expect the same outputs up to rounding and the
same linear growth in N, a constant factor slower; ``auto`` is explicit in both, so FlexAttention (which off CUDA
runs eagerly as its reference and forms the full score matrix; on CUDA it is compiled even in an eager model) runs
only when asked for.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import MultiHeadMixer, chosen_backend, softmax_values
from .patterns import (
    FLEX_BLOCK,
    flex_attend,
    flex_call,
    realized,
    row_starts,
    score_table,
    tile_block_mask,
)
from .registry import Taxonomy, register_model

MASKED = -1e9  # finite: a row with no visible key (a padded query with no global) averages instead of NaN
BACKENDS = ("auto", "explicit", "flex", "recompute", "sdpa")  # auto = explicit (the module docstring says why)


def band_tiles(n: int, globals_: int, radius: int, device) -> torch.Tensor:
    """(nt, nt) bool: the FlexAttention tiles of an n x n score matrix that hold a pair ETC may see: |i - j| <= radius
    (tiles a, c apart hold pairs (|a - c| - 1) * FLEX_BLOCK + 1 apart at the least), or i or j < ``globals_``."""
    nt = -(-n // FLEX_BLOCK)
    tile = torch.arange(nt, device=device)
    gap = ((tile[:, None] - tile[None, :]).abs() - 1).clamp(min=0) * FLEX_BLOCK + 1  # (nt, nt): nearest pair
    near = (tile[:, None] == tile[None, :]) | (gap <= radius)  # (nt, nt)
    holds_global = tile * FLEX_BLOCK < globals_  # (nt,)
    return near | holds_global[:, None] | holds_global[None, :]


def _flex_attend(mixer: ETC, q, k, v, real, G: int) -> torch.Tensor:
    """Every query's attention as one FlexAttention call. q (B, H, S, Dh) with zero rows for the learned globals,
    k, v (B, H, S, Dh) and real (B, S) over [learned globals, input positions], the first G of them global -> (B, H,
    S, Dh)."""
    B, H, S, Dh = q.shape
    r, kmax, global_label = mixer.radius, mixer.max_distance, mixer.global_label
    V = 2 * kmax + 2
    with torch.autocast(device_type=q.device.type, enabled=False):  # fp32: the backward sums by atomic adds
        table = torch.einsum("bhsd,hvd->bhsv", q.float(), mixer.rel.float()) * Dh**-0.5  # (B, H, S, V)
    # (B H Sb V,): 1-D, as an index computed from scalars is FlexAttention's fast lookup; Sb = S, or under
    # torch.compile the longest S (patterns.score_table: a gradient's size must be an int)
    table = score_table(table, {2: mixer.max_len + mixer.learned_globals}, flat=True)
    rows = table.shape[0] // (B * H * V)  # Sb
    real_flat = realized(real.flatten())  # (B S,): a buffer of its own for the mask_mod (patterns.realized)
    # where each sample's keys and each (sample, head)'s table rows start: S is the input's length plus CLS
    row_start = row_starts(B, S, q.device)  # (B,)
    table_start = row_starts(B * H, rows * V, q.device)  # (B H,)

    def mask_mod(b, h, q_idx, kv_idx):
        return ((q_idx < G) | (kv_idx < G) | ((q_idx - kv_idx).abs() <= r)) & real_flat[row_start[b] + kv_idx]

    def score_mod(score, b, h, q_idx, kv_idx):  # score: q . k / sqrt(Dh), fp32
        label = torch.where(kv_idx < G, global_label, (kv_idx - q_idx).clamp(-kmax, kmax) + kmax)
        relative = table[table_start[b * H + h] + q_idx * V + label]
        return score + torch.where(q_idx < G, 0.0, relative)  # a global query's row: one label, cancelled

    padded = -(-S // FLEX_BLOCK) * FLEX_BLOCK
    key_tiles = F.pad(real, (0, padded - S)).view(B, -1, FLEX_BLOCK).any(-1)  # (B, nt): a real key in the tile
    partial = (band_tiles(S, G, r, q.device)[None] & key_tiles[:, None, :])[:, None]  # (B, 1, nt, nt)
    block_mask = tile_block_mask(partial, torch.zeros_like(partial), S, mask_mod)
    return flex_attend(q, k, v, block_mask, small_tiles=True, score_mod=score_mod, dropout_p=mixer.dropout_p)


@register_model
class ETC(MultiHeadMixer):
    taxonomy = Taxonomy("Ainslie et al. 2020, arXiv 2004.08483", "N", ("FP", "M"), decode=False)
    backends = BACKENDS  # the values of ``backend`` (how it runs, not what it computes)
    # FlexAttention sums the gradient of the table its score_mod reads by atomic adds (no fixed order), and torch's
    # deterministic mode neither checks nor replaces them: under it ``auto`` keeps off flex and asking for it is refused
    nondeterministic_backends = ("flex",)

    def __init__(
        self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *, radius: int = 84,
        max_distance: int | None = 12, global_tokens: int = 1, learned_globals: int = 0,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        max_distance = radius if max_distance is None else max_distance
        for name, value in (("radius", radius), ("max_distance", max_distance), ("global_tokens", global_tokens),
                            ("learned_globals", learned_globals)):
            if value < 0:
                raise ValueError(f"etc: {name} must be >= 0, got {value}")
        self.radius, self.max_distance = radius, max_distance
        self.backend = "auto"  # "explicit" | "flex" | "recompute" | "sdpa" (the attention); how, not what
        self.global_tokens, self.learned_globals = global_tokens, learned_globals
        # a window of +-r lies within the previous, own and next block of any size >= r + 1; a multiple of 8 for
        # the aligned kernels of the batched products
        self.block = -(-(radius + 1) // 8) * 8
        self.global_label = 2 * max_distance + 1  # labels 0..2k: clipped distance + k; 2k + 1: "global"
        # ETC's relative key embeddings a_label, per head (initializer_range 0.02 as ETC)
        self.rel = nn.Parameter(torch.randn(n_heads, 2 * max_distance + 2, self.d_head) * 0.02)  # (H, V, Dh)
        if learned_globals:
            # in the residual stream's scale: the encoder feeds the mixer layer-normed tokens
            self.globals = nn.Parameter(torch.randn(learned_globals, d_model))  # (Gl, D)

    def global_keys(self, k, v, mask, g):
        """Keys, values (B, H, G, Dh) and key mask (B, G) of all global tokens: learned ones, then input ones."""
        B, H, _, Dh = k.shape
        gk, gv, real = k[:, :, :g], v[:, :, :g], mask[:, :g]
        if self.learned_globals:
            G = self.learned_globals
            lk, lv = self.qkv(self.globals).view(G, 3, H, Dh).permute(1, 2, 0, 3)[1:]  # each (H, Gl, Dh)
            gk = torch.cat([lk.expand(B, -1, -1, -1).to(k.dtype), gk], dim=2)  # (B, H, G, Dh)
            gv = torch.cat([lv.expand(B, -1, -1, -1).to(v.dtype), gv], dim=2)  # (B, H, G, Dh)
            real = torch.cat([mask.new_ones(B, G), real], dim=1)  # (B, G): learned globals are always there
        return gk, gv, real

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        self.check_length(N)
        # not min(): with a dynamic length (trimmed batches) min() is a SymInt, which the flex path's mods would
        # close over; the comparison is a guard, and g stays an int
        g = self.global_tokens if self.global_tokens <= N else N
        q, k, v = self.project(x)  # each (B, H, N, Dh)
        gk, gv, g_real = self.global_keys(k, v, mask, g)  # (B, H, G, Dh) x 2, (B, G)
        flex = chosen_backend(self) == "flex"
        if flex or g:  # every key in order [globals, long tokens]: the flex call's, or the global queries'
            keys, values = torch.cat([gk, k[:, :, g:]], dim=2), torch.cat([gv, v[:, :, g:]], dim=2)  # (B, H, G+L, Dh)
            real = torch.cat([g_real, mask[:, g:]], dim=1)  # (B, G+L)
        if flex:
            Gl = self.learned_globals
            queries = F.pad(q, (0, 0, Gl, 0))  # (B, H, G+L, Dh): zero queries in the learned globals' rows
            o = flex_call(_flex_attend, x.is_cuda, self, queries, keys, values, real, Gl + g)  # (B, H, G+L, Dh)
            o = o[:, :, Gl:]  # (B, H, N, Dh): the learned globals' rows dropped
            return self.out(o.transpose(1, 2).reshape(B, N, -1))  # (B, N, D)
        parts = []
        if g:  # global queries: every key, global and long (the label term is constant over the row: omitted)
            bias = torch.zeros_like(real, dtype=q.dtype).masked_fill(~real, MASKED)[:, None, None]  # (B, 1, 1, G+L)
            parts.append(F.scaled_dot_product_attention(q[:, :, :g], keys, values, attn_mask=bias,
                                                        dropout_p=self.dropout_p))  # (B, H, g, Dh)
        if g < N:
            parts.append(self.long_attention(q[:, :, g:], k[:, :, g:], v[:, :, g:], mask[:, g:], gk, gv, g_real))
        o = torch.cat(parts, dim=2)  # (B, H, N, Dh)
        return self.out(o.transpose(1, 2).reshape(B, N, -1))  # (B, N, D)

    def long_attention(self, q, k, v, real, gk, gv, g_real) -> torch.Tensor:
        """Long queries (B, H, L, Dh): blocked window of +-radius over the long keys, plus every global key."""
        B, H, L, Dh = q.shape
        b, G = self.block, gk.shape[2]
        NB = math.ceil(L / b)
        pad = NB * b - L
        qb = F.pad(q, (0, 0, 0, pad)).view(B, H, NB, b, Dh)  # (B, H, NB, b, Dh)
        # One empty block before the first and after the last: block j's window is padded blocks j .. j+2.
        kw = F.pad(k, (0, 0, b, b + pad)).unfold(2, 3 * b, b).transpose(-1, -2)  # (B, H, NB, 3b, Dh), a view
        vw = F.pad(v, (0, 0, b, b + pad)).unfold(2, 3 * b, b).transpose(-1, -2)  # (B, H, NB, 3b, Dh), a view
        w_real = F.pad(real, (b, b + pad), value=False).unfold(1, 3 * b, b)  # (B, NB, 3b)

        # Query s of a block and window slot t are t - b - s positions apart, in every block alike.
        dist = torch.arange(3 * b, device=q.device)[None, :] - b - torch.arange(b, device=q.device)[:, None]  # (b, 3b)
        band = dist.abs() <= self.radius  # (b, 3b)
        label = dist.clamp(-self.max_distance, self.max_distance) + self.max_distance  # (b, 3b)

        # the labels padded with zero embeddings to a multiple of 8, so that the products over them run cuBLAS's
        # aligned kernels: with 2k + 2 = 26 they would take the unaligned (align-1) ones, which take a large share of
        # the layer's device time
        V = -(-self.rel.shape[1] // 8) * 8
        rel = F.pad(self.rel, (0, 0, 0, V - self.rel.shape[1]))  # (H, V, Dh)
        q_rel = torch.einsum("bhnsd,hvd->bhnsv", qb, rel.to(qb.dtype))  # (B, H, NB, b, V): q . a_label
        # q_rel looked up at each slot's label, as a product with the labels' one-hot (b, V, 3b), not a gather: a
        # gather's backward scatters, and with up to 3b - 2k - 1 slots of a row on the two clipped labels its atomic
        # adds contend (the gather would take most of the layer's device time); the product's backward is one
        # more product. Exact: each output sums a single nonzero term
        one_hot = F.one_hot(label, V).transpose(-1, -2).to(q_rel.dtype)  # (b, V, 3b)
        win_rel = torch.einsum("bhnsv,svt->bhnst", q_rel, one_hot)  # (B, H, NB, b, 3b)
        see = torch.cat([g_real[:, None, None, :].expand(B, NB, b, G),
                         band & w_real[:, :, None, :]], dim=-1)  # (B, NB, b, G+3b)
        backend = chosen_backend(self)
        if backend in ("sdpa", "recompute"):  # one value tensor per block: the globals', then its window's
            values = torch.cat([gv[:, :, None].expand(B, H, NB, G, Dh), vw], dim=3)  # (B, H, NB, G+3b, Dh)
        if backend == "sdpa":  # relative terms as SDPA's float mask; heads, blocks one batch dim
            rel = torch.cat([q_rel[..., self.global_label, None].expand(B, H, NB, b, G), win_rel], dim=-1)
            bias = (rel * Dh**-0.5).masked_fill(~see[:, None], MASKED)  # (B, H, NB, b, G+3b)
            keys = torch.cat([gk[:, :, None].expand(B, H, NB, G, Dh), kw], dim=3)  # (B, H, NB, G+3b, Dh)
            o = F.scaled_dot_product_attention(qb.flatten(1, 2), keys.flatten(1, 2), values.flatten(1, 2),
                                               attn_mask=bias.flatten(1, 2).to(qb.dtype),
                                               dropout_p=self.dropout_p)  # (B, H NB, b, Dh)
        else:
            win = torch.einsum("bhnsd,bhntd->bhnst", qb, kw) + win_rel  # (B, H, NB, b, 3b)
            glob = torch.einsum("bhnsd,bhgd->bhnsg", qb, gk) + q_rel[..., self.global_label, None]  # (B, H, NB, b, G)
            if backend == "recompute":  # the weights recomputed in the backward, not stored (base.softmax_values)
                scores = torch.cat([glob, win], dim=-1).masked_fill(~see[:, None], MASKED)  # (B, H, NB, b, G+3b)
                o = softmax_values(scores, values, self.dropout_p, Dh**-0.5)  # (B, H, NB, b, Dh)
            else:
                # Gp - G never-seen columns after the globals', so that the window's weights start at a multiple of 8
                # of rows of Gp + 3b: sliced from rows of G + 3b = 265 they would feed cuBLAS's align-1 kernels
                Gp = -(-G // 8) * 8
                seen = torch.cat([see[..., :G], see.new_zeros(B, NB, b, Gp - G), see[..., G:]], dim=-1)  # Gp+3b
                with torch.autocast(device_type=q.device.type, enabled=False):
                    logits = torch.cat([F.pad(glob, (0, Gp - G)), win], dim=-1).float() * Dh**-0.5  # (.., b, Gp+3b)
                    # where, not masked_fill: one pass each way, where masked_fill copies, then fills (eagerly)
                    p = torch.softmax(torch.where(seen[:, None], logits, MASKED), dim=-1)  # (B, H, NB, b, Gp+3b)
                p = F.dropout(p.to(v.dtype), self.dropout_p, training=self.training)
                # split, not two slices: eagerly its backward is one cat, where each slice's fills a zero tensor of
                # p's size and the two are then added
                p_glob, _, p_win = p.split([G, Gp - G, 3 * b], dim=-1)
                o = (torch.einsum("bhnsg,bhgd->bhnsd", p_glob, gv)
                     + torch.einsum("bhnst,bhntd->bhnsd", p_win, vw))  # (B, H, NB, b, Dh)
        return o.reshape(B, H, NB * b, Dh)[:, :, :L]  # (B, H, L, Dh)
