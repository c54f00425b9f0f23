"""Memory-compressed attention: keys and values shortened c-fold by a strided convolution along the sequence.

Paper: Peter J. Liu, Mohammad Saleh, Etienne Pot, Ben Goodrich, Ryan Sepassi, Lukasz Kaiser, Noam Shazeer,
"Generating Wikipedia by Summarizing Long Sequences", ICLR 2018, https://arxiv.org/abs/1801.10198 (Sec. 4.2.3
local attention, 4.2.4 memory-compressed attention).

After the usual projections, the keys and the values are each passed through a convolution with kernel = stride
= c (``compression``, the paper's 3): slot j = sum_t W_t k_{jc+t}, t < c, one kernel for keys and one for values,
each mixing all heads' channels. Every one of the N queries then attends, with plain softmax attention (SDPA, as
the transformer), to the ceil(N/c) compressed slots. ``local_block = L`` cuts the sequence into contiguous blocks
of L tokens and runs the same thing inside each block: a block's queries see the ceil(L/c) slots of their own
block and nothing else (the "local + memory-compressed" combination).

Complexity: global, O(N * N/c * d) time: still quadratic (taxonomy "N^2"), c times cheaper than the transformer;
O(N * N/c) memory on SDPA's math kernel, O(N) on the fused ones. With ``local_block = L``, O(N * L/c * d) time
and O(N * L/c) memory: linear in N. The convolution costs O(N d_qkv^2), as one more projection.

Padding, exactly:
1. K and V are set to 0 at padded positions (``torch.where``: junk, even non-finite, never enters) before the
   convolution, which has no bias, so a slot depends only on the real tokens in it.
2. Slots are aligned at position 0 and the sequence is zero-extended at its end to whole blocks and each block to
   whole slots. The last, partial slot of a short sequence therefore convolves [real..., 0, 0], which is what it
   convolves once padding is appended (padding is 0 by step 1): appending padding changes no slot that holds a
   real token.
3. A slot made only of padding (key 0, value 0) would still take weight exp(0)/Z; it is masked out of the
   softmax. A slot is real when any of its c tokens is real.
4. A block with no real slot holds only padded queries; it attends to all its (zero) slots instead of none, so
   padded positions get a finite junk output, never NaN (a NaN there would reach the encoder's masked mean
   through 0 * NaN).
Outputs at padded positions are computed and meaningless (the encoder ignores them). Moving real tokens by an
amount that is not a multiple of c changes which kernel tap they meet: a property of the method.

Deviations from the paper:
- The paper's T-DMCA interleaves layers: local attention in blocks of 256 (L) and memory-compressed attention over
  the whole sequence (M), as L M L M L. Here every layer of the encoder gets the same mixer options, so the two are
  combined inside one layer instead (``local_block``). ``compression: 1`` with ``local_block: L`` is the paper's L
  layer, up to a reparameterisation (the 1 x 1 convolution is a linear map on K and V, absorbed by the projections).
- The paper decodes left to right (a query sees only slots that end at or before it); this registration is
  bidirectional, for classification (taxonomy decode=True records what the method can do).
- The paper leaves the convolution's details open. Here: no bias (a key bias adds q.b to every logit of a query,
  which cancels in the softmax; dropping both keeps padding-only slots exactly 0); separate kernels for K and V
  over all heads' channels (tensor2tensor's ``multihead_self_attention_reduced`` compresses the layer input with
  one convolution before projecting; mesh-tensorflow's version takes group means instead); initialised with
  variance 1 / (d_qkv c), so that at initialisation a slot has the scale of one key (tf's glorot default for the
  same convolution gives the same variance).
- Exact padding (above) is ours; the paper does not discuss padding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import MultiHeadMixer, pad_head_dim
from .registry import Taxonomy, register_model


@register_model
class MemoryCompressed(MultiHeadMixer):
    taxonomy = Taxonomy("Liu et al. 2018, arXiv 1801.10198", "N^2", ("FP", "M"), decode=True)

    def __init__(
        self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *, compression: int = 3,
        local_block: int | None = None,
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        if compression < 1:
            raise ValueError(f"memory_compressed: compression must be >= 1, got {compression}")
        if local_block is not None and local_block < 1:
            raise ValueError(f"memory_compressed: local_block must be >= 1 or null (global), got {local_block}")
        self.compression, self.local_block = int(compression), local_block
        # The strided convolution's weight, [keys | values, tap t, input channel, output channel]. With kernel =
        # stride, slot j reads only its own c tokens, so the convolution is one matmul over the flattened slot: a
        # GEMM whose output has channels last, as SDPA's fused kernels need (nn.Conv1d's (B, C, S) output, viewed
        # back, sent the CPU to SDPA's math fallback).
        bound = (3.0 / (d_qkv * compression)) ** 0.5  # uniform with variance 1 / fan_in: a slot keeps a key's scale
        self.kernel = nn.Parameter(torch.empty(2, compression, d_qkv, d_qkv).uniform_(-bound, bound))

    def compress_kv(self, kv: torch.Tensor, mask: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kv (B, N, 2 d_qkv) projected keys and values, mask (B, N) -> compressed kv (B nb, S, 2 d_qkv) and the
        slot mask (B nb, S), True = the slot holds a real token; nb = ceil(N / block) blocks of S = ceil(block / c)
        slots each."""
        B, N, C = kv.shape
        c, nb = self.compression, -(-N // block)
        S = -(-block // c)
        kv = torch.where(mask[..., None], kv, 0.0)  # (B, N, C): padding is exactly 0 before the convolution
        kv = F.pad(kv, (0, 0, 0, nb * block - N)).reshape(B * nb, block, C)  # (B nb, block, C): whole blocks
        kv = F.pad(kv, (0, 0, 0, S * c - block)).reshape(B * nb, S, c, 2, C // 2)  # (B nb, S, c, 2, d_qkv): whole slots
        kv = torch.einsum("bstgi,gtio->bsgo", kv, self.kernel).reshape(B * nb, S, C)  # (B nb, S, C): the convolution
        real = F.pad(mask, (0, nb * block - N)).reshape(B * nb, block)  # (B nb, block)
        real = F.pad(real, (0, S * c - block)).reshape(B * nb, S, c).any(-1)  # (B nb, S): any real token in the slot
        # a block without a real slot holds only padded queries: let them see every slot rather than none (NaN)
        real = real | ~real.any(-1, keepdim=True)  # (B nb, S)
        return kv, real

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        self.check_length(N)
        H, Dh = self.n_heads, self.d_head
        block = N if self.local_block is None else self.local_block  # global = one block over everything
        nb = -(-N // block)
        q, kv = self.qkv(x).split([H * Dh, 2 * H * Dh], dim=-1)  # (B, N, H Dh), (B, N, 2 H Dh)
        kv, real = self.compress_kv(kv, mask, block)  # (B nb, S, 2 H Dh), (B nb, S)
        S = kv.shape[1]
        k, v = kv.view(B * nb, S, 2, H, Dh).permute(2, 0, 3, 1, 4)  # each (B nb, H, S, Dh), Dh contiguous
        q = F.pad(q, (0, 0, 0, nb * block - N)).reshape(B * nb, block, H, Dh).transpose(1, 2)  # (B nb, H, block, Dh)
        # head sizes off a multiple of 8 send SDPA to its math kernel on CUDA (see transformer.py)
        q, k, v = pad_head_dim(-(-Dh // 8) * 8, q, k, v)  # (B nb, H, *, multiple of 8)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None, :], dropout_p=self.dropout_p,
                                           scale=Dh**-0.5)  # (B nb, H, block, Dh padded)
        o = o[..., :Dh].transpose(1, 2).reshape(B, nb * block, H * Dh)[:, :N]  # (B, N, H Dh)
        return self.out(o)  # (B, N, D)
