"""Set Transformer: the induced set attention block (ISAB), attention through m learned inducing points.

Paper: Juho Lee, Yoonho Lee, Jungtaek Kim, Adam R. Kosiorek, Seungjin Choi, Yee Whye Teh, "Set Transformer: A
Framework for Attention-based Permutation-Invariant Neural Networks", ICML 2019, https://arxiv.org/abs/1810.00825
(Sec. 3.2, ISAB).

m learned inducing points I (``n_inducing``) first attend to the sequence, then the sequence attends to what they
gathered:

    H   = MAB(I, X) = LN(H0 + rFF(H0)),  H0 = LN(I + Multihead(I, X, X))   (padded keys of X masked)
    out = Multihead(X, H, H)

Multihead is the usual multi-head softmax attention (SDPA, as the transformer, scale 1/sqrt(Dh)) with its
output projection; the queries, keys and values of X come from one projection (``qkv``), as in every mixer here.

What of the paper's MAB is kept. The paper's ISAB(X) = MAB(X, H), and MAB(X, Y) wraps Multihead(X, Y, Y) in a
residual, a LayerNorm, an rFF and another LayerNorm. For the outer MAB(X, H) the encoder already supplies all of
these around the mixer (x + Mixer(LN x), then x + MLP(LN x)), so the mixer returns Multihead(X, H, H) alone. The
inner MAB(I, X) lives on the m inducing slots, which the encoder never sees, so the mixer keeps it whole
(``mab: true``): the residual through I gives H a learned part that does not depend on X (without it H is only
a mixture of the values of X), and the last LayerNorm fixes the scale of H before it is projected into keys and
values, as the encoder's LayerNorm does for a mixer's input. It costs O(m d^2), nothing next to O(N m d).
``mab: false`` drops the residual, LayerNorms and rFF: H = Multihead(I, X, X), a plain two-hop attention.

Positions: none of its own; the encoder adds position embeddings to X. Without them the mixer is permutation
equivariant: H is a sum over the tokens of X, and each output row depends on its own token and H only.

Complexity: O(N m d) time and O(N m) memory for the two attentions (N x m and m x N scores), O(m d^2) for the
inducing side: linear in N. n_inducing defaults to 32, the authors' point-cloud setting (main_pointcloud.py,
sets of 100 to 5000 points); 32 slots is 1.6% of ListOps' 2000 tokens, in the range of the other fixed-size
summaries here (linformer's k = 16).

Padding: padded keys are masked in Multihead(I, X, X), so H, hence every output, depends only on the real
tokens, whatever is appended or written at padded positions. A row with no real token at all (only padded queries
there) lets the inducing points see its padding instead of nothing, so its junk outputs stay finite.
``mask=None`` (no padding anywhere) runs both attentions unmasked.

Deviations from the paper and its code: pre-LN around the mixer (the encoder's) instead of MAB's post-LN for the
outer block; the rFF of the inner MAB is one Linear + ReLU with a residual, as in the authors' code (the paper
allows any row-wise feedforward); the attention scale is 1/sqrt(head size) (the authors' code divides by the
square root of the full width); the residual adds I itself (the authors' code adds the projected query I W_q);
multi-head attention has an output projection as in the paper's equations (the authors' code has none); the
inducing points start as N(0, 1), the scale of the LayerNormed tokens the encoder hands a mixer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import MultiHeadMixer, pad_head_dim
from .registry import Taxonomy, register_model


@register_model
class SetTransformer(MultiHeadMixer):
    taxonomy = Taxonomy("Lee et al. 2019, arXiv 1810.00825", "N", ("M",), decode=False)
    accepts_no_mask = True  # mask=None: both attentions unmasked

    def __init__(
        self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *, n_inducing: int = 32,
        mab: bool = True,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if n_inducing < 1:
            raise ValueError(f"set_transformer: n_inducing must be >= 1, got {n_inducing}")
        self.n_inducing, self.mab = int(n_inducing), bool(mab)
        self.inducing = nn.Parameter(torch.randn(n_inducing, d_model))  # I (m, D)
        self.inducing_q = nn.Linear(d_model, d_qkv, bias=False)  # queries of I
        self.inducing_out = nn.Linear(d_qkv, d_model, bias=False)  # output projection of Multihead(I, X, X)
        self.summary_kv = nn.Linear(d_model, 2 * d_qkv, bias=False)  # keys and values of H
        if self.mab:
            self.norm0, self.norm1 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.rff = nn.Linear(d_model, d_model)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None):
        """Softmax attention through SDPA, (B, H, Nq, Dh) x (B, H, Nk, Dh) x 2 -> (B, H, Nq, Dh)."""
        d_head = q.shape[-1]
        # head sizes off a multiple of 8 send SDPA to its math kernel on CUDA (see transformer.py)
        q, k, v = pad_head_dim(-(-d_head // 8) * 8, q, k, v)  # (B, H, *, multiple of 8)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=self.dropout_p, scale=d_head**-0.5)
        return o[..., :d_head]  # (B, H, Nq, Dh)

    def induce(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """H = MAB(I, X) from the keys and values of X, (B, H, N, Dh) each, and mask (B, N) -> (B, m, D)."""
        B, n_heads, _, d_head = k.shape
        m = self.n_inducing
        q = self.inducing_q(self.inducing).view(m, n_heads, d_head).transpose(0, 1)  # (H, m, Dh)
        key_mask = None
        if mask is not None:
            # a row with no real token holds only padded queries: its inducing points see that padding, not nothing
            key_mask = (mask | ~mask.any(-1, keepdim=True))[:, None, None, :]  # (B, 1, 1, N)
        o = self.attention(q.expand(B, -1, -1, -1), k, v, key_mask)  # (B, H, m, Dh)
        h = self.inducing_out(o.transpose(1, 2).reshape(B, m, n_heads * d_head))  # (B, m, D)
        if self.mab:
            h = self.norm0(self.inducing + h)  # (B, m, D)
            h = self.norm1(h + F.relu(self.rff(h)))  # (B, m, D)
        return h

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, N, _ = x.shape
        H, Dh, m = self.n_heads, self.d_head, self.n_inducing
        q, k, v = self.project(x)  # each (B, H, N, Dh)
        h = self.induce(k, v, mask)  # (B, m, D)
        kh, vh = self.summary_kv(h).view(B, m, 2, H, Dh).permute(2, 0, 3, 1, 4)  # each (B, H, m, Dh)
        o = self.attention(q, kh, vh, None)  # (B, H, N, Dh): every inducing slot is real
        return self.out(o.transpose(1, 2).reshape(B, N, H * Dh))  # (B, N, D)
