"""Reformer: shared-QK attention restricted by locality-sensitive hashing (LSH).

Paper: Nikita Kitaev, Lukasz Kaiser, Anselm Levskaya, "Reformer: The Efficient Transformer", 2020,
https://arxiv.org/abs/2001.04451.

One projection gives the shared query/key vector x (keys are x / |x|, queries x, logits scaled by
1/sqrt(d)). Each of ``n_hashes`` rounds hashes x with a random rotation R into ``n_buckets`` buckets
(bucket = argmax over [xR, -xR]), sorts positions by (bucket, position), cuts the sorted sequence into
chunks of ``chunk`` positions, and lets every query attend to its own chunk and the previous one. A
token attends to itself only when no other key is visible (its logit is -5e4 rather than -inf);
padded keys are masked out. Outputs are unsorted, and the rounds are combined with weights
softmax_r(logsumexp of round r's logits), i.e. attention over the union of the rounds' windows.
With one round (LRA's setting) the chunk attention is one fused kernel (self masked, a query left with no key
takes its own value): on CUDA without attention dropout (evaluation, and the bench, which runs every mixer
without it) FlexAttention over the sorted sequence, whose band of two chunks per query is a block mask of
partial 128 x 128 tiles, so no chunk is copied into a window (without a padding mask the band depends on the length
alone, and its tile lists are made once per length); otherwise ``scaled_dot_product_attention`` with
chunks as heads and (chunk, 2 chunks) windows, since FlexAttention has no dropout. Both compute the same
attention (tested); ``backend`` ("auto" | "flex" | "sdpa", an attribute: how it runs, never what) names one. With
several rounds it is computed explicitly in fp32, because the combination needs each
round's logsumexp.

Chunking: with ``bucket_size`` (default) the chunk is ``bucket_size`` positions and n_buckets =
ceil(max_len / bucket_size) (rounded up to even); with ``n_buckets`` given, the chunk is
ceil(max_len / n_buckets) -- ``n_buckets: 10`` reproduces LRA's 10 chunks at N = max_len. Both are fixed
at construction, so hashes and chunk boundaries never depend on the batch's padded length.
``n_buckets: 1`` is exact shared-QK attention (one chunk covers the sequence; quadratic, for tests).

Complexity: O(N * chunk * d * n_hashes) time and O(N * chunk * n_hashes) memory for the chunked logits,
plus O(N log N) for the sort and O(N d n_buckets) for hashing. No N x N tensor is ever built.

Deviations. From the paper/trax: rotations are drawn once from ``torch.Generator().manual_seed(seed)``
(per hash round and head) and stay fixed, like LRA's fixed PRNGKey(0) (trax redraws every call), so
evaluation is deterministic; every layer built with the same seed shares them, as in LRA. Chunk 0 does
not wrap around to look back at the last chunk (trax does), so that padding, which sorts last, can
never become visible to a real query. Keys in a query's two chunks are attended whatever their
bucket (no same-bucket mask), and a key seen in two rounds counts twice (no duplicate correction). From LRA's
code: we divide logits by sqrt(d) (LRA multiplies), use d_qkv (LRA ignores qkv_dim), mask self-attention and
padding (LRA does neither).

``mask=None`` (no padding in the batch) with N a multiple of the chunk: no padding bucket, and FlexAttention's
mask reads no tensor (one tile layout serves every sample). Otherwise the internal padding to whole chunks is
masked as any padding.

Padding: padded positions are hashed into an extra bucket after all real ones, so real tokens keep
the same sorted order and chunks whatever padding follows, and padded keys are masked. Appending
padding leaves outputs at real positions exactly unchanged; so does changing the content of padded
tokens.

Eager speed: with one round on CUDA without attention dropout the attention is FlexAttention, compiled even in an
eager model (``flex_call``), so eagerly only the code around it runs differently: the fp32 copy of x for hashing,
the sort, the gathers of x and v into sorted order, the keys' normalisation and the gather back each write a full
(B, H, N, Dh) tensor, and in the backward every gather becomes a zero-filled tensor plus a scatter-add and the
normalisation's gradient a chain of about ten elementwise kernels. Compiled, Inductor fuses the gathers into the
normalisation, the unsorting into the output's transpose and the normalisation's backward into one kernel. Eagerly
(and on the CPU, where the round runs as SDPA over windows that ``roll`` and ``cat`` copy) the layer computes the
same attention, slower than compiled, its extra cost memory traffic rather than arithmetic.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import MultiHeadMixer, takes_fused_path
from .patterns import FLEX_BLOCK, block_mask_of, flex_attend, flex_call, kept_tile_lists, realized, tile_block_mask
from .registry import Taxonomy, register_model

SELF_LOGIT = -5e4  # a token sees itself only if nothing else is visible
PAD_LOGIT = -1e9  # below SELF_LOGIT, finite so all-padding windows give no NaN


@register_model
class Reformer(MultiHeadMixer):
    taxonomy = Taxonomy("Kitaev et al. 2020, arXiv 2001.04451", "N*log(N)", ("LP",), decode=True)
    backends = ("auto", "flex", "sdpa")  # the values of ``backend`` (how it runs, not what it computes)
    accepts_no_mask = True  # mask=None, whole chunks: nothing to mask

    def __init__(
        self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *, n_hashes: int = 1,
        bucket_size: int = 64, n_buckets: int | None = None, seed: int = 0,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if n_hashes < 1:
            raise ValueError(f"reformer: n_hashes must be >= 1, got {n_hashes}")
        if n_buckets is None:
            if bucket_size < 1:
                raise ValueError(f"reformer: bucket_size must be >= 1, got {bucket_size}")
            self.chunk = min(bucket_size, max_len)
            n_buckets = math.ceil(max_len / self.chunk)
            n_buckets += n_buckets % 2 if n_buckets > 1 else 0  # argmax over [xR, -xR] gives an even count
        else:
            if n_buckets < 1 or (n_buckets > 1 and n_buckets % 2):
                raise ValueError(f"reformer: n_buckets must be 1 or even (buckets come from [xR, -xR]), "
                                 f"got {n_buckets}")
            self.chunk = math.ceil(max_len / n_buckets)
        self.n_hashes, self.n_buckets = n_hashes, n_buckets
        # Shared QK: one projection for queries/keys, one for values (the base's 3-way qkv would leave
        # the key third without gradient).
        self.qkv = nn.Linear(d_model, 2 * d_qkv, bias=False)
        gen = torch.Generator().manual_seed(seed)
        rot = torch.randn(n_hashes, n_heads, self.d_head, max(n_buckets // 2, 1), generator=gen)
        self.register_buffer("rotations", rot)  # (R, H, Dh, n_buckets/2)
        self.backend = "auto"  # one round: "flex" (CUDA, no attention dropout) or "sdpa"; how it runs, not what
        self._band_tiles: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}  # FlexAttention's, per N

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, N, _ = x.shape
        qk, v = self.qkv(x).view(B, N, 2, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)  # each (B, H, N, Dh)
        return qk, qk, v

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, N, _ = x.shape
        self.check_length(N)
        pad = -N % self.chunk
        if pad:  # padded rows hash to the extra bucket and sort after every real token
            mask = x.new_ones(B, N, dtype=torch.bool) if mask is None else mask
            x = F.pad(x, (0, 0, 0, pad))  # (B, Np, D)
            mask = F.pad(mask, (0, pad), value=False)  # (B, Np)
        qk, _, v = self.project(x)
        o = self.attend(qk, qk, v, mask)[:, :, :N]  # (B, H, N, Dh)
        return self.out(o.transpose(1, 2).reshape(B, N, -1))  # (B, N, D)

    def hash(self, qk: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """(B, H, N, Dh) -> bucket ids (B, H, R, N); padding gets the extra bucket ``n_buckets``."""
        B, H, N, _ = qk.shape
        if self.n_buckets == 1:
            buckets = qk.new_zeros(B, H, self.n_hashes, N, dtype=torch.long)
        else:
            with torch.autocast(device_type=qk.device.type, enabled=False):
                rot = torch.einsum("bhnd,rhdc->bhrnc", qk.float(), self.rotations.float())  # (B, H, R, N, nb/2)
                # argmax over [xR, -xR] without building it: the largest entry of xR, or the most negative one
                # (ties go to xR's, the first half, as argmax takes the first)
                top, low = rot.max(dim=-1), rot.min(dim=-1)  # values and indices, (B, H, R, N) each
                buckets = torch.where(top.values >= -low.values, top.indices, low.indices + rot.shape[-1])
        return buckets if mask is None else buckets.masked_fill(~mask[:, None, None, :], self.n_buckets)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        qk = q  # shared QK: k is q
        B, H, N, Dh = qk.shape
        R, L = self.n_hashes, self.chunk
        C = N // L  # forward padded N to a multiple of the chunk

        # Sort positions by (bucket, position) in each round.
        pos = torch.arange(N, device=qk.device)
        buckets = self.hash(qk, mask)  # (B, H, R, N)
        order = (buckets * N + pos).argsort(dim=-1)  # (B, H, R, N): sorted slot -> position
        flat = order.reshape(B, H, R * N, 1)  # (B, H, R*N, 1)
        s_qk = qk.gather(2, flat.expand(-1, -1, -1, Dh)).view(B, H, R, C, L, Dh)  # (B, H, R, C, L, Dh)
        s_v = v.gather(2, flat.expand(-1, -1, -1, Dh)).view(B, H, R, C, L, Dh)  # (B, H, R, C, L, Dh)
        inv = torch.empty_like(order).scatter_(-1, order, pos.expand_as(order))  # (B, H, R, N): position -> slot
        if R == 1 and self.flex_round_runs(qk.is_cuda):
            s_qk, s_v = s_qk.view(B, H, N, Dh), s_v.view(B, H, N, Dh)
            # (B,): padding hashes to the last bucket, so real keys are a prefix of the order; None: all real
            n_real = None if mask is None else mask.sum(-1)
            keys = F.normalize(s_qk, dim=-1)  # (B, H, N, Dh): unit length
            o = flex_call(_flex_round, qk.is_cuda, self, s_qk, keys, s_v, n_real)  # (B, H, N, Dh), sorted order
            return o.gather(2, inv.view(B, H, N, 1).expand(-1, -1, -1, Dh))  # (B, H, N, Dh)
        if mask is None:
            mask = qk.new_ones(B, N, dtype=torch.bool)  # (B, N)
        s_real = mask[:, None, None, :].expand(B, H, R, N).gather(-1, order).view(B, H, R, C, L)  # (B, H, R, C, L)

        # Keys: own chunk + previous chunk (none for chunk 0 or a single chunk).
        s_k = F.normalize(s_qk, dim=-1)  # (B, H, R, C, L, Dh): paper's unit-length keys
        if C > 1:
            k_win = torch.cat([s_k, s_k.roll(1, dims=3)], dim=4)  # (B, H, R, C, 2L, Dh)
            v_win = torch.cat([s_v, s_v.roll(1, dims=3)], dim=4)  # (B, H, R, C, 2L, Dh)
            prev_real = s_real.roll(1, dims=3)  # (B, H, R, C, L)
            prev_real[:, :, :, 0] = False  # chunk 0 does not wrap around
            real_win = torch.cat([s_real, prev_real], dim=4)  # (B, H, R, C, 2L)
        else:
            k_win, v_win, real_win = s_k, s_v, s_real

        self_key = torch.eye(L, k_win.shape[4], dtype=torch.bool, device=qk.device)  # (L, W): own key, diagonal
        if R == 1:
            o, lse = self.one_round(s_qk, k_win, v_win, s_v, real_win, self_key), None
        else:
            o, lse = self.rounds_with_mass(s_qk, k_win, v_win, real_win, self_key)

        # Unsort: gather each position's row back through the inverse permutation.
        o = o.view(B, H, R, N, Dh).gather(3, inv.unsqueeze(-1).expand(-1, -1, -1, -1, Dh))  # (B, H, R, N, Dh)
        if R == 1:
            return o.squeeze(2)  # (B, H, N, Dh)
        with torch.autocast(device_type=qk.device.type, enabled=False):
            lse = lse.reshape(B, H, R, N).gather(-1, inv)  # (B, H, R, N)
            w = torch.softmax(lse, dim=2).unsqueeze(-1)  # (B, H, R, N, 1): each round's share of the mass
            return (o.float() * w).sum(dim=2).to(o.dtype)  # (B, H, N, Dh)

    def flex_round_runs(self, on_cuda: bool) -> bool:
        """Whether one round runs as FlexAttention: asked for, or on CUDA where no attention dropout is active."""
        return takes_fused_path(self, "flex", on_cuda and self.dropout_p == 0)

    def one_round(self, q, k, v, v_self, real, self_key):
        """Chunked attention for a single hash round through fused SDPA, with chunks as heads. Self is
        masked out; a query that then sees no key takes its own value (the -5e4 self logit's limit)."""
        B, H, R, C, L, Dh = q.shape
        W = k.shape[4]
        see = real[..., None, :] & ~self_key  # (B, H, 1, C, L, W)
        o = F.scaled_dot_product_attention(
            q.view(B * H, C, L, Dh), k.view(B * H, C, W, Dh), v.view(B * H, C, W, Dh),
            attn_mask=see.view(B * H, C, L, W), dropout_p=self.dropout_p,
        )  # (B*H, C, L, Dh); rows with no visible key come back as 0
        lone = ~see.any(dim=-1, keepdim=True)  # (B, H, 1, C, L, 1)
        return torch.where(lone, v_self, o.view(B, H, R, C, L, Dh))  # (B, H, 1, C, L, Dh)

    def rounds_with_mass(self, q, k, v, real, self_key):
        """Chunked attention for several rounds, explicitly, returning each row's logsumexp as well (the
        rounds' combination weights, which SDPA does not expose)."""
        dots = torch.einsum("bhrcld,bhrcmd->bhrclm", q, k)  # (B, H, R, C, L, W)
        with torch.autocast(device_type=q.device.type, enabled=False):
            dots = dots.float() * q.shape[-1] ** -0.5  # a fresh fp32 tensor, so the fills may be in place
            dots.masked_fill_(self_key, SELF_LOGIT)
            dots.masked_fill_(~real[..., None, :], PAD_LOGIT)
            # softmax rather than exp(dots - lse): at PAD_LOGIT fp32 cannot hold lse's log(count)
            p = torch.softmax(dots, dim=-1)  # (B, H, R, C, L, W)
            lse = dots.logsumexp(dim=-1)  # (B, H, R, C, L): this round's mass
        p = F.dropout(p.to(v.dtype), self.dropout_p, training=self.training)
        return torch.einsum("bhrclm,bhrcmd->bhrcld", p, v), lse  # (B, H, R, C, L, Dh), (B, H, R, C, L)


def _flex_round(mixer: Reformer, q, k, v, n_real):
    """One hash round as FlexAttention over the sorted sequence (B, H, N, Dh): query slot i sees the keys of its
    own chunk and of the previous one (chunk 0 does not wrap), not itself, and only real keys (slots below
    ``n_real[b]``; None: every slot, one layout for all samples and a mask that reads no tensor). Tiles outside
    the band or wholly past the real keys are skipped; every other tile is partial (the diagonal and the chunk
    edges cut through it). A query left with no key takes its own value."""
    N, L, device = q.shape[2], mixer.chunk, q.device
    nt = -(-N // FLEX_BLOCK)
    first = torch.arange(nt, device=device) * FLEX_BLOCK  # (nt,): each tile's first slot
    last = (first + FLEX_BLOCK).clamp(max=N) - 1  # (nt,)

    def near(q_idx, kv_idx):
        q_chunk, kv_chunk = q_idx // L, kv_idx // L
        return ((kv_chunk == q_chunk) | (kv_chunk == q_chunk - 1)) & (q_idx != kv_idx)

    def band():  # (nt q, nt kv): the tiles the two-chunk band touches
        lo = ((first // L - 1).clamp(min=0) * L)[:, None]  # (nt, 1): lowest key a query of the tile may see
        hi = (((last // L + 1) * L).clamp(max=N) - 1)[:, None]  # (nt, 1): highest
        return (last[None, :] >= lo) & (first[None, :] <= hi)

    if n_real is None:  # the tiles depend on the length alone: listed once per length and device
        def band_tiles():  # partial (the band) and full (none), (1, 1, nt, nt) each
            return band()[None, None], torch.zeros(1, 1, nt, nt, dtype=torch.bool, device=device)

        lists = kept_tile_lists(mixer._band_tiles, (N, device), band_tiles)
        block_mask = block_mask_of(lists, N, lambda b, h, q_idx, kv_idx: near(q_idx, kv_idx))
    else:
        tiles = band()[None] & (first[None, None, :] < n_real[:, None, None])  # (B, nt, nt): some real key inside
        limit = realized(n_real)  # (B,), read by the mask_mod: a buffer of its own

        def mask_mod(b, h, q_idx, kv_idx):
            return near(q_idx, kv_idx) & (kv_idx < limit[b])

        block_mask = tile_block_mask(tiles[:, None], torch.zeros_like(tiles[:, None]), N, mask_mod)
    o = flex_attend(q, k, v, block_mask, small_tiles=True)  # (B, H, N, Dh); a row with no key gives 0
    # the real keys a query sees but itself: slots in [start, end) below n_real, less one when the query is real
    slot = torch.arange(N, device=device)
    start, end = (slot // L - 1).clamp(min=0) * L, (slot // L + 1) * L  # (N,)
    if n_real is None:
        seen = end.clamp(max=N) - start - 1  # (N,)
    else:
        seen = (torch.minimum(end, n_real[:, None]) - start).clamp(min=0) - (slot < n_real[:, None]).long()  # (B, N)
    return torch.where((seen == 0).view(-1, 1, N, 1), v, o)  # (B, H, N, Dh)
