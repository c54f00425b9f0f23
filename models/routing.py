"""Routing Transformer: attention within clusters of an online k-means over shared queries/keys.

Paper: Aurko Roy, Mohammad Saffar, Ashish Vaswani, David Grangier, "Efficient Content-Based Sparse Attention
with Routing Transformers", TACL 2021, https://arxiv.org/abs/2003.05997.

One projection gives each head a shared query/key vector, layer-normalised without gain or bias (as the
paper's code), so every routing vector r has norm sqrt(d) and its direction u = r / |r| lies on the unit
sphere. Each head keeps ``n_clusters`` unit centroids (buffers, no gradient); a token belongs to the centroid
nearest to u (on the sphere, the largest u . mu). A token attends to the tokens of its own cluster, with
logits r_i . r_j / sqrt(d) (= sqrt(d) cos, a transformer-like range).

Routing, implemented as nearest-centroid assignment with sorting and chunking (the paper's other option,
balanced top-w per centroid, leaves tokens picked by no centroid without an output and needs an average over
the tokens picked twice; here every token has exactly one output): positions are sorted by (cluster,
position), the sorted sequence is cut into chunks of c = ceil(max_len / n_clusters) slots, and each query
sees the keys of its own cluster in its own chunk and the two neighbouring ones. A cluster of up to c tokens
(c + 1 in fact) lies within two adjacent chunks, so its members see each other exactly, which is the paper's
definition of routing attention; a larger cluster is cut down to a window of its ~3c members nearest in
position, instead of costing O(size^2). As with shared-QK Reformer, a token does not attend to itself unless
no other key is visible (with a shared q = k its own logit is the largest possible, sqrt(d)).

Centroids: drawn from the global RNG at construction (so reproducible from the run's seed, since
``lra.train.run`` seeds before building the model) and normalised. In training, after the assignment, each
centroid moves toward the mean direction of the real tokens assigned to it in the batch,
mu <- normalise(decay * mu + (1 - decay) * mean_i u_i), per head and layer; a centroid that got no token
is left alone. In eval they are frozen. They are buffers, so checkpoints (``state_dict``) carry them and a
resumed run continues from the saved state. On CUDA, ``scatter_add_``'s float summation order makes the
update reproducible only up to rounding.

Complexity: O(N * K * d) to assign N tokens to K centroids, O(N log N) to sort, O(N * 3c * d) time and
O(N * 3c) memory for the chunked logits with c = max_len / K. With the default K = ceil(sqrt(max_len)),
c ~ sqrt(N): O(N * sqrt(N) * d) in all. No N x N tensor is ever built.

Padding: padded tokens are put in an extra cluster K, which sorts after every real one and which no query
sees, and they never enter the centroid update. The chunk length is fixed at construction (capped at the
batch length: a batch shorter than one chunk is a single chunk either way), so a real token's sorted slot, chunk
and window never depend on how much padding follows. Appending padding, or changing what it holds, leaves the
outputs at real positions and the centroid update unchanged.

Deviations: assignment by sorting and chunking rather than balanced top-w (above). All heads are routing
heads (the paper mixes them with local-attention heads; the encoder here has one mixer kind per model).
No commitment loss (the paper's code adds beta * |x - sg(mu)|^2; the mixer contract returns no auxiliary
loss). The EMA averages each batch's per-cluster mean direction and re-normalises (the paper's equation
sums the assigned vectors; its code keeps EMAs of sums and counts); decay 0.999 as in the paper. Shared
Q/K in the encoder (the paper's code shares them only in decoders). Self is masked as in
Reformer. Causal decoding (the paper's setting) is not registered here: this is the bidirectional form.

Eager speed: the extern calls (the projections, the centroid scores, the sort, SDPA) are the same eager or compiled;
what compiling fuses are the passes between them, which eagerly are a kernel each over a (B, H, N, ...) tensor: the
casts, the concatenation of r and v, the gather into sorted order and its padding, the comparison, select and
self-mask that build SDPA's (B, H, C, c, 3c) additive mask (three passes where compiled writes it once), the
centroid update's normalisation and transposed copies, and in the backward the windows' unfold gradient, the rows'
zero-filled slice gradients and the sorted order's gather gradient (a scatter-add into zeros). The centroid update's
scatter-adds contend on K + 1 rows per head in both. Debugging eagerly, expect the same outputs up to rounding, a
step slower by a constant factor and a higher memory peak (each intermediate is materialised).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import MultiHeadMixer, pad_head_dim
from .registry import Taxonomy, register_model

SELF_LOGIT = -5e4  # added to a token's own logit: it sees itself only if nothing else is visible (fits fp16)


@register_model
class Routing(MultiHeadMixer):
    taxonomy = Taxonomy("Roy et al. 2021, arXiv 2003.05997", "N*sqrt(N)", ("LP",), decode=True)

    def __init__(
        self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *,
        n_clusters: int | None = None, decay: float = 0.999,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        n_clusters = math.ceil(math.sqrt(max_len)) if n_clusters is None else n_clusters
        if n_clusters < 1:
            raise ValueError(f"routing: n_clusters must be >= 1, got {n_clusters}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"routing: decay must be in [0, 1), got {decay}")
        self.n_clusters, self.decay = n_clusters, decay
        self.chunk = math.ceil(max_len / n_clusters)  # fixed, so chunks never depend on the padded length
        # Shared QK: one projection for queries/keys, one for values (as in models/reformer.py).
        self.qkv = nn.Linear(d_model, 2 * d_qkv, bias=False)
        centroids = F.normalize(torch.randn(n_heads, n_clusters, self.d_head), dim=-1)
        self.register_buffer("centroids", centroids)  # (H, K, Dh): unit vectors, saved in checkpoints

    def routing_vectors(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N, D) -> layer-normed shared query/key r and values v, each (B, H, N, Dh)."""
        B, N, _ = x.shape
        qk, v = self.qkv(x).view(B, N, 2, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)  # each (B, H, N, Dh)
        return F.layer_norm(qk, (self.d_head,)), v  # no gain/bias: |r| = sqrt(Dh), as the paper's code

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        self.check_length(N)
        r, v = self.routing_vectors(x)  # each (B, H, N, Dh)
        cluster = self.assign(r, mask)  # (B, H, N)
        if self.training:
            self.update_centroids(r, cluster)  # after the assignment: this batch is routed by the old centroids
        o = self.clustered_attention(r, v, cluster)  # (B, H, N, Dh)
        return self.out(o.transpose(1, 2).reshape(B, N, -1))  # (B, N, D)

    @torch.no_grad()
    def assign(self, r: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Nearest centroid per token and head, (B, H, N) in 0..K-1; padding gets the extra cluster K."""
        with torch.autocast(device_type=r.device.type, enabled=False):
            # for unit u and mu, |u - mu|^2 = 2 - 2 u.mu: the nearest centroid has the largest dot product
            scores = torch.einsum("bhnd,hkd->bhnk", r.float(), self.centroids.float())  # (B, H, N, K)
        return scores.argmax(-1).masked_fill(~mask[:, None, :], self.n_clusters)  # (B, H, N)

    @torch.no_grad()
    def update_centroids(self, r: torch.Tensor, cluster: torch.Tensor) -> None:
        """mu_k <- normalise(decay mu_k + (1 - decay) mean of the unit vectors of the real tokens assigned to k)."""
        B, H, N, Dh = r.shape
        K = self.n_clusters
        u = F.normalize(r.detach().float(), dim=-1).transpose(0, 1).reshape(H, B * N, Dh)  # (H, B*N, Dh)
        idx = cluster.transpose(0, 1).reshape(H, B * N)  # (H, B*N): padding in bucket K, dropped below
        sums = u.new_zeros(H, K + 1, Dh).scatter_add_(1, idx[..., None].expand(-1, -1, Dh), u)  # (H, K+1, Dh)
        counts = u.new_zeros(H, K + 1).scatter_add_(1, idx, u.new_ones(H, B * N))  # (H, K+1)
        sums, counts = sums[:, :K], counts[:, :K, None]  # (H, K, Dh), (H, K, 1)
        mean = sums / counts.clamp_min(1.0)  # (H, K, Dh)
        moved = F.normalize(self.decay * self.centroids.float() + (1 - self.decay) * mean, dim=-1)  # (H, K, Dh)
        self.centroids.copy_(torch.where(counts > 0, moved, self.centroids.float()))

    def clustered_attention(self, r: torch.Tensor, v: torch.Tensor, cluster: torch.Tensor) -> torch.Tensor:
        """Attention within clusters: sort by (cluster, position), chunk, attend to own cluster in +-1 chunk."""
        B, H, N, Dh = r.shape
        K = self.n_clusters
        c = min(self.chunk, N)  # a chunk longer than the batch would only hold padding slots
        pad = -N % c
        C = (N + pad) // c

        order = torch.argsort(cluster, dim=-1, stable=True)  # (B, H, N): sorted slot -> position, by (cluster, pos)
        rv = torch.cat([r.to(v.dtype), v], dim=-1)  # (B, H, N, 2Dh): one gather and one window for both
        s_rv = rv.gather(2, order[..., None].expand(-1, -1, -1, 2 * Dh))  # (B, H, N, 2Dh)
        s_cl = cluster.gather(2, order)  # (B, H, N)
        # An empty chunk before the first and after the last (no wrap-around), and the slots that fill the last
        # chunk: all in cluster K, which no real query matches. Padding sorts last, so this appends to it.
        s_rv = F.pad(s_rv, (0, 0, c, c + pad))  # (B, H, (C+2)c, 2Dh)
        s_cl = F.pad(s_cl, (c, c + pad), value=K)  # (B, H, (C+2)c)
        # Windows as overlapping views, no copy: chunk j's window is padded chunks j .. j+2.
        win = s_rv.unfold(2, 3 * c, c).transpose(-1, -2)  # (B, H, C, 3c, 2Dh)
        cl_win = s_cl.unfold(2, 3 * c, c)  # (B, H, C, 3c)
        s_q = s_rv[:, :, c:-c, :Dh].unflatten(2, (C, c))  # (B, H, C, c, Dh)
        q_cl = s_cl[:, :, c:-c].unflatten(2, (C, c))  # (B, H, C, c)
        q_cl = q_cl.masked_fill(q_cl == K, -2)  # padded queries match no key, not even other padding

        slot = torch.arange(3 * c, device=r.device)
        is_self = slot[None, :] == torch.arange(c, device=r.device)[:, None] + c  # (c, 3c): own slot, in own chunk
        # Additive mask: 0 within the cluster, -inf elsewhere; SELF_LOGIT on the query's own slot, so that a
        # token sees itself only when no other key of its cluster is in reach (then with weight 1, never NaN).
        zero, never = s_q.new_zeros(()), s_q.new_full((), float("-inf"))
        bias = torch.where(q_cl[..., None] == cl_win[..., None, :], zero, never)  # (B, H, C, c, 3c)
        bias = bias.masked_fill_(is_self, SELF_LOGIT)  # (B, H, C, c, 3c)

        # fused CUDA kernels take head sizes in multiples of 8; zero columns are exact (models/base.py). The keys and
        # values split, not sliced: eagerly the gradient of the windows is then one cat, not two zero-filled tensors
        # of the windows' size and their sum
        q_, k_, v_ = pad_head_dim(-(-Dh // 8) * 8, s_q, *win.split(Dh, dim=-1))
        Dp = q_.shape[-1]
        o = F.scaled_dot_product_attention(
            q_.reshape(B * H, C, c, Dp), k_.reshape(B * H, C, 3 * c, Dp), v_.reshape(B * H, C, 3 * c, Dp),
            attn_mask=bias.view(B * H, C, c, 3 * c), dropout_p=self.dropout_p, scale=Dh**-0.5,
        )[..., :Dh]  # (B*H, C, c, Dh)

        # Unsort: sorted slot i goes back to position order[i].
        o = o.reshape(B, H, C * c, Dh)[:, :, :N]  # (B, H, N, Dh), sorted
        return o.new_zeros(B, H, N, Dh).scatter(2, order[..., None].expand(-1, -1, -1, Dh), o)  # (B, H, N, Dh)
