"""Synthesizer: attention weights that are learned (synthesized) rather than computed from token pairs.

Paper: Yi Tay, Dara Bahri, Donald Metzler, Da-Cheng Juan, Zhe Zhao, Che Zheng, "Synthesizer: Rethinking
Self-Attention in Transformer Models", ICML 2021, https://arxiv.org/abs/2005.00743.

Per head, synthesized logits S (N x N) replace or join the dot product:
  ``variant: random``             S = R[:N, :N], a learned max_len x max_len matrix per head;
  ``variant: factorized_random``  S = R1[:N] R2[:N]^T with R1, R2 of shape (max_len, ``factor_rank``);
  ``variant: dense``              S[i, :] = W2 relu(W1 x_i + b1) + b2, W1: d_model -> d_qkv (split per
                                  head), W2: d_head -> max_len shared by the heads (as LRA), sliced to N.
With ``keep_dot_product`` (LRA's default: random + dot product) the logits are QK^T/sqrt(d) + S and go
through fused ``scaled_dot_product_attention`` as an additive float mask (softmax in fp32 inside the
kernel); without it softmax(S) V is computed explicitly with an fp32 softmax and the query/key
projections do not exist (only values are projected). The value path always uses V.

Complexity: O(N^2 d) time and O(B H N^2) memory (with padding, the logit bias is materialised per batch, since
the mask differs per example; without padding (``mask=None``, the pixel tasks) the random variants' bias stays one
(1, H, N, N) tensor that SDPA broadcasts over the batch, sparing two (B, H, N, N) passes forward and one
backward); parameters H max_len^2 for ``random`` (LRA's choice: 64M per layer at max_len 4000 with 4 heads),
2 H max_len r for ``factorized_random``, O(d^2 + d max_len) for ``dense``. It is a quadratic model: it shows
what learned, input-independent attention can do.

Deviations from LRA's code: LRA's dense mode reshapes (B, N, H, max_len) straight to (B, H, N, max_len)
without a transpose (scrambling heads and positions); we transpose. Init: R ~ N(0, 1/max_len), and R1,
R2 scaled so R1 R2^T has the same variance (LRA: lecun-normal). Text configs that asked for
factorized_random were silently run as random in LRA (its config key was never read); both are available here.

Three executions of the dot-product variants (``backend``, an attribute: how it runs, never what it computes):
``sdpa`` passes the synthesized logits to fused SDPA as a float mask, which leaves SDPA its memory-efficient
kernel; ``explicit`` forms the (B, H, N, N) logits itself (Q K^T from bf16 operands with fp32 products and sums, as
a fused kernel's), adds S, and applies an fp32 softmax, the dropout and the product with V as separate operations
that ``torch.compile`` fuses, the same steps as the variants without the dot product; its memory is O(B H N^2) for
the saved weights (one compiled layer: slower than ``sdpa`` at 4K and 16K, in several times its memory;
results/layer_bench.csv, rows ``lra synthesizer(backend=explicit)``).
``flex`` runs FlexAttention with a score_mod that adds S[h, i, j] to each score, read from the table itself (fp32;
its gradient summed over the batch in the kernel's backward) and padded keys left out by a BlockMask: no (B, H, N,
N) bias is built, where SDPA's float mask, once padding makes it per example, is one, and its gradient another, and
the bias keeps SDPA off its flash kernel. Attention dropout through ``_flex_dropout``. One compiled layer (batch
32, heads of 64, bf16) runs faster than ``sdpa`` at 1K and 4K in less memory (results/layer_bench.csv,
rows ``lra synthesizer`` and ``lra synthesizer(backend=flex)``), and LRA's Text run (padded, attention dropout)
trains faster in less memory (docs/gpu.md). ``auto`` is ``flex`` for the random variants (one table for the
batch) on a CUDA device whose shared memory holds its tiles (``flex_fits``: compute capability 9.0's 228 KiB per
multiprocessor do, 8.0's 164 KiB do not), else ``sdpa`` (``dense``'s per-example fp32 tables would double SDPA's
bf16 bias).

Padding: padded keys are masked (-inf) in every variant and S is indexed by absolute position, so
appending padding leaves outputs at real positions exactly unchanged, and padded token content never
reaches them.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .base import MultiHeadMixer, chosen_backend, takes_fused_path
from .patterns import flex_attend, flex_call, padding_block_mask, score_table
from .registry import Taxonomy, register_model

VARIANTS = ("dense", "random", "factorized_random")
BACKENDS = ("auto", "sdpa", "explicit", "flex")


# Triton stages each tile of the fp32 table through shared memory, once per pipeline stage. With Inductor's 128 x 128
# forward tiles for bf16 heads of 64 the forward asks for 245,760 bytes, 3 stages x 64 KiB of table + 48 KiB of q, k
# and v, more than the 232,448 a compute capability 9.0 multiprocessor offers: no kernel fits. The forward takes 64 x
# 64 tiles (patterns.SMALL_FORWARD_TILES: 72 KiB) and the backward 2 stages of its 64 x 128 and 128 x 64 tiles (176
# KiB even if its two loops' buffers add up).
TABLE_BACKWARD = {"bwd_num_stages": 2}
FLEX_SHARED_MEMORY = 176 * 1024  # bytes of shared memory per multiprocessor those tiles may ask for


@torch.compiler.assume_constant_result
def flex_fits(device: torch.device) -> bool:
    """Whether ``auto`` runs ``flex`` on ``device``: a CUDA device whose multiprocessors hold FLEX_SHARED_MEMORY.
    A constant to torch.compile (read once at trace time, not guarded on)."""
    if device.type != "cuda":
        return False
    props = torch.cuda.get_device_properties(device.index or 0)
    return props.shared_memory_per_multiprocessor >= FLEX_SHARED_MEMORY


def _flex_attend(mixer: Synthesizer, q, k, v, synthesized, mask) -> torch.Tensor:
    """The dot-product variants' attention as one FlexAttention call: q, k, v (B, H, N, Dh), the synthesized logits
    (1 or B, H, N, N), mask (B, N) or None -> (B, H, N, Dh)."""
    L = mixer.max_len
    # fp32: the kernel adds them to fp32 scores, and its backward sums their gradient over the batch by atomic adds;
    # N padded to its bound under torch.compile (patterns.score_table: a gradient's size must be an int)
    table = score_table(synthesized.float(), {2: L, 3: L})  # (1 or B, H, N, N)
    per_example = table.shape[0] > 1  # dense: one table per example; the random variants: one for the batch

    def score_mod(score, b, h, q_idx, kv_idx):  # score: q . k / sqrt(Dh), fp32
        return score + table[b if per_example else 0, h, q_idx, kv_idx]

    block_mask = None if mask is None else padding_block_mask(mask)
    # (B, H, N, Dh); tiles whose loads of the table fit the card's shared memory (TABLE_BACKWARD)
    return flex_attend(q, k, v, block_mask, small_tiles=True, score_mod=score_mod, dropout_p=mixer.dropout_p,
                       kernel_options=TABLE_BACKWARD)


@register_model
class Synthesizer(MultiHeadMixer):
    taxonomy = Taxonomy("Tay et al. 2021, arXiv 2005.00743", "N^2", ("LR", "LP"), decode=True)
    backends = BACKENDS  # the values of ``backend`` (how it runs, not what it computes)
    # FlexAttention sums the gradient of the table its score_mod reads by atomic adds (no fixed order), and torch's
    # deterministic mode neither checks nor replaces them: under it ``auto`` keeps off flex and asking for it is refused
    nondeterministic_backends = ("flex",)
    accepts_no_mask = True  # mask=None: the random variants' bias stays (1, H, N, N), broadcast over the batch

    def __init__(
        self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *,
        variant: Literal["random", "factorized_random", "dense"] = "random", keep_dot_product: bool = True,
        factor_rank: int = 32,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if variant not in VARIANTS:
            raise ValueError(f"synthesizer: variant must be one of {VARIANTS}, got {variant!r}")
        if variant == "factorized_random" and factor_rank < 1:
            raise ValueError(f"synthesizer: factor_rank must be >= 1, got {factor_rank}")
        self.variant, self.keep_dot_product = variant, keep_dot_product
        self.backend = "auto"  # "sdpa" | "explicit" | "flex" (the dot-product variants' attention); how, not what
        if not keep_dot_product:
            self.qkv = nn.Linear(d_model, d_qkv, bias=False)  # values only: Q and K would get no gradient
        H, L = n_heads, max_len
        if variant == "random":
            self.R = nn.Parameter(torch.randn(H, L, L) * L**-0.5)
        elif variant == "factorized_random":
            scale = (factor_rank * L) ** -0.25  # so that R1 R2^T ~ N(0, 1/max_len), like ``random``
            self.R1 = nn.Parameter(torch.randn(H, L, factor_rank) * scale)
            self.R2 = nn.Parameter(torch.randn(H, L, factor_rank) * scale)
        else:
            self.syn_hidden = nn.Linear(d_model, d_qkv)
            self.syn_logits = nn.Linear(self.d_head, L)  # rows = key positions, sliced to N

    def synthesized(self, x: torch.Tensor) -> torch.Tensor:
        """The synthesized logits S: (1, H, N, N) for the random variants, (B, H, N, N) for dense."""
        B, N, _ = x.shape
        if self.variant == "random":
            return self.R[None, :, :N, :N]  # (1, H, N, N)
        if self.variant == "factorized_random":
            return (self.R1[:, :N] @ self.R2[:, :N].transpose(1, 2))[None]  # (1, H, N, N)
        h = F.relu(self.syn_hidden(x)).view(B, N, self.n_heads, self.d_head)  # (B, N, H, Dh)
        s = F.linear(h, self.syn_logits.weight[:N], self.syn_logits.bias[:N])  # (B, N, H, N)
        return s.transpose(1, 2)  # (B, H, N, N)

    def attend_explicitly(self, logits: torch.Tensor, v: torch.Tensor, pad_keys: torch.Tensor | None) -> torch.Tensor:
        """softmax(logits) V with the weights formed: logits (1 or B, H, N, N), v (B, H, N, Dh), padded keys
        masked; the softmax in fp32, the dropout drawn per example. -> (B, H, N, Dh)."""
        with torch.autocast(device_type=v.device.type, enabled=False):
            s = logits.float()  # (1 or B, H, N, N)
            if pad_keys is not None:
                # finfo.min, not -inf: an example with no real token gets uniform weights, not NaN
                s = s.masked_fill(pad_keys, torch.finfo(torch.float32).min)  # (B, H, N, N)
            p = torch.softmax(s, dim=-1)
        # expanded first: without padding p may be (1, H, N, N), and each example needs its own dropout mask
        p = F.dropout(p.expand(v.shape[0], -1, -1, -1), self.dropout_p, training=self.training)  # (B, H, N, N)
        return torch.matmul(p.to(v.dtype), v)  # (B, H, N, Dh)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, N, _ = x.shape
        self.check_length(N)
        H, Dh = self.n_heads, self.d_head
        pad_keys = None if mask is None else ~mask[:, None, None, :]  # (B, 1, 1, N); None: no padding
        if chosen_backend(self) == "explicit" and self.keep_dot_product:
            q, k, v = self.project(x)  # each (B, H, N, Dh)
            synthesized = self.synthesized(x)  # (1 or B, H, N, N)
            with torch.autocast(device_type=x.device.type, enabled=False):
                # bf16 operands are exact in fp32 (and in TF32): fp32 products and sums, as a fused kernel's
                s = q.float() @ k.float().transpose(-1, -2) * Dh**-0.5 + synthesized.float()  # (B, H, N, N)
            o = self.attend_explicitly(s, v, pad_keys)  # (B, H, N, Dh)
        elif self.keep_dot_product and takes_fused_path(self, "flex", self.variant != "dense" and flex_fits(x.device)):
            q, k, v = self.project(x)  # each (B, H, N, Dh)
            o = flex_call(_flex_attend, x.is_cuda, self, q, k, v, self.synthesized(x), mask)  # (B, H, N, Dh)
        elif self.keep_dot_product:
            q, k, v = self.project(x)  # each (B, H, N, Dh)
            bias = self.synthesized(x).to(q.dtype)  # (1 or B, H, N, N)
            if pad_keys is not None:
                bias = bias.masked_fill(pad_keys, float("-inf"))  # (B, H, N, N)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=self.dropout_p)  # (B, H, N, Dh)
        else:
            v = self.qkv(x).view(B, N, H, Dh).transpose(1, 2)  # (B, H, N, Dh)
            o = self.attend_explicitly(self.synthesized(x), v, pad_keys)  # (B, H, N, Dh)
        return self.out(o.transpose(1, 2).reshape(B, N, H * Dh))  # (B, N, D)
