"""Compressive Transformer: Transformer-XL's memory plus a compressed memory of the states evicted from it
(Rae, Potapenko, Jayakumar, Lillicrap, 2020, "Compressive Transformers for Long-Range Sequence Modelling",
https://arxiv.org/abs/1911.05507).

Transformer-XL (``models/transformer_xl.py``, read it first) lets segment t attend to [memory, segment], the
memory being this layer's stop-gradient inputs of the ``memory`` (M) segments before it. States older than
that are evicted; here, instead of being dropped, each evicted segment of S states is compressed at rate c
(``compression_rate``) into S / c slots by f_c, a strided 1-D convolution (kernel = stride = c) or mean
pooling (``compression``), and the last ``compressed_memory`` (n_cm) slots stay visible:

    segment t attends to [compressed memory (n_cm slots of segments before t - M), memory, segment],

oldest first, one softmax over all of them, with Transformer-XL's relative terms taken over that concatenated
window (a slot counts as one position, as the paper concatenates [cm, m] into one memory). The context of a
layer thus reaches (M S + c n_cm) tokens back instead of M S, for n_cm more keys per query.

As in the Transformer-XL file, all segments are computed at once: the evicted states of segment s are the
layer's inputs of segment s (stop-gradient), so compressing the whole (stop-gradient) input once, segment by
segment, and giving segment t the n_cm slots that end where segment t - M begins is exactly the paper's FIFO of
compressed memories. Segments must be a multiple of c so that no slot straddles two segments (the paper
compresses each evicted block on its own).

Complexity: O(N (n_cm + (M + 1) S) d) time and O(N (n_cm + (M + 1) S)) memory per layer, plus O(N d^2) for the
conv compression (O(N d) for mean); "N" for fixed S, M and n_cm.
Padding: padded states are zeroed before compressing. ``mean``: a partly padded slot averages only its real
states; ``conv``: it is the convolution of its real states with zeros in place of the padded ones (plus the
bias). A slot of only padding is masked like a padded key, so padding never enters the attention; appending
padding leaves real outputs unchanged. Padded queries get an output the encoder ignores.

Deviations from the paper:
* Training of f_c. The paper stops the task loss at the compressed memories and trains the convolution with a
  local auxiliary loss (attention reconstruction: the layer's attention over the evicted states versus over
  their compression). A mixer returns only its output, so there is no place for an auxiliary loss here (see
  the report's recommendation for the harness). Instead f_c is trained end to end by the task loss: its inputs
  stay stop-gradient like the memory (no gradient reaches earlier segments' states), but its weights are live,
  and the task loss reaches them through the keys and values of the slots within the same step (no
  backpropagation through time is needed, since all segments are in one pass). The convolution starts as mean
  pooling (each tap the identity / c, bias 0), so an untrained f_c gives slots in the space W_k and W_v were
  made for, and ``conv`` starts out as ``mean``.
* Bidirectional inside a segment, memory counted in segments, per-layer u and v: as in ``transformer_xl``.
* Compressed memory is counted in slots (n_cm); the paper's n_cm is the same. Slots for the last M + 1
  segments are computed though no segment reads them (one pass over the sequence is simpler than slicing).

Eager speed: as Transformer-XL's (its docstring says why): eager PyTorch writes each step around the scores as a
tensor of its own (table, scaling, mask, bias add, fp32 upcast, softmax, downcast, and about a dozen in the
backward), here over n_cm + (M + 1) S keys per query, where Inductor fuses them into a few kernels. The window is
also copied more often eagerly: Transformer-XL's [memory, segment] keys and values are concatenated, then copied
again behind the compressed slots, which are themselves padded in front (a copy) before being unfolded, while the
compiled layer writes each window once, reading it from its sources. Debugging eagerly, on a CPU or a GPU, expect it
several times slower than compiled and its peak memory higher.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from .registry import Taxonomy, register_model
from .transformer_xl import TransformerXL


def pad_front(t: torch.Tensor, count: int, dim: int) -> torch.Tensor:
    """``count`` zeros (False for a mask) before t along ``dim``."""
    return torch.cat([t.new_zeros(t.shape[:dim] + (count,) + t.shape[dim + 1:]), t], dim)


@register_model
class Compressive(TransformerXL):
    taxonomy = Taxonomy("Rae et al. 2020, arXiv 1911.05507", "N", ("RC",), decode=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        dropout: float,
        max_len: int,
        *,
        segment: int = 128,
        memory: int = 1,
        compressed_memory: int = 128,
        compression_rate: int = 4,
        compression: Literal["conv", "mean"] = "conv",
    ):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len, segment=segment, memory=memory)
        if compression not in ("conv", "mean"):
            raise ValueError(f"compression must be 'conv' (strided 1-D convolution) or 'mean', got {compression!r}")
        if compressed_memory < 0:
            raise ValueError(f"compressed_memory must be >= 0 slots, got {compressed_memory}")
        if compression_rate < 1 or segment % compression_rate:
            raise ValueError(f"compression_rate must be >= 1 and divide segment={segment}, got {compression_rate}")
        self.compressed_memory, self.rate, self.compression = int(compressed_memory), int(compression_rate), compression
        self.conv = None
        if compression == "conv":
            self.conv = nn.Conv1d(d_model, d_model, self.rate, stride=self.rate)  # f_c: c states -> one slot
            with torch.no_grad():  # start as mean pooling: every tap the identity / c
                self.conv.weight.copy_(torch.eye(d_model)[:, :, None].expand(-1, -1, self.rate) / self.rate)
                self.conv.bias.zero_()

    def compress(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """f_c over consecutive groups of c states: h (B, T, D), mask (B, T), T a multiple of c -> slots
        (B, T / c, D) and the slots' mask (B, T / c): a slot is real when any of its states is."""
        B, T, D = h.shape
        h = h * mask[..., None]  # (B, T, D): padded states weigh nothing in any slot
        real = mask.view(B, T // self.rate, self.rate)  # (B, T / c, c)
        if self.conv is not None:
            slots = self.conv(h.transpose(1, 2)).transpose(1, 2)  # (B, T / c, D)
        else:  # the mean of the real states only
            count = real.sum(-1, keepdim=True).clamp_min(1).to(h.dtype)  # (B, T / c, 1)
            slots = h.view(B, T // self.rate, self.rate, D).sum(2) / count  # (B, T / c, D)
        return slots, real.any(-1)

    def windows(self, x: torch.Tensor, mask: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: int):
        """Transformer-XL's windows with each segment's n_cm compressed slots in front: keys, values
        (B, H, n, n_cm + L, Dh) and key mask (B, n, n_cm + L)."""
        keys, values, keep = super().windows(x, mask, k, v, S)  # (B, H, n, L, Dh) x 2, (B, n, L)
        n, M, ncm = x.shape[1] // S, self.memory, self.compressed_memory
        if ncm == 0 or n <= M + 1:  # no segment has evicted states: exactly Transformer-XL
            return keys, values, keep
        slots, slot_keep = self.compress(x.detach(), mask)  # (B, n S / c, D), (B, n S / c): stop-gradient states
        k_c, v_c = self.project_kv(slots)  # (B, H, n S / c, Dh) each
        per = S // self.rate  # slots per segment
        # With ncm + M per zero slots in front, segment t's n_cm slots (those ending where segment t - M
        # starts) begin at padded slot t * per: windows of ncm at stride per.
        front = ncm + M * per

        def slide(t: torch.Tensor, dim: int) -> torch.Tensor:
            return pad_front(t, front, dim).unfold(dim, ncm, per).narrow(dim, 0, n)  # window last: (..., n, ..., ncm)

        k_c = slide(k_c, 2).transpose(-1, -2)  # (B, H, n, ncm, Dh)
        v_c = slide(v_c, 2).transpose(-1, -2)  # (B, H, n, ncm, Dh)
        slot_keep = slide(slot_keep, 1)  # (B, n, ncm)
        return (torch.cat([k_c, keys], dim=3), torch.cat([v_c, values], dim=3),  # (B, H, n, ncm + L, Dh)
                torch.cat([slot_keep, keep], dim=2))  # (B, n, ncm + L)
