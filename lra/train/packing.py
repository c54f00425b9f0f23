"""Packed and trimmed batches: several padded examples share one row, each computed exactly as if it had its own;
or a batch is cut after its longest example (``trim``, ``trainer.trim``), also exact.

Most tokens of the padded tasks are padding (ListOps averages about 1,040 real tokens of 2,000, IMDb reviews
1,299 bytes of 4,096), yet a random batch almost always holds one example near the cap, so cutting a batch to
its longest example saves little. Packing places the examples of a batch, longest first, into the first row
with room (first-fit decreasing); the model then runs on fewer rows of the same length.

A packed batch is four tensors, passed to :class:`lra.train.encoder.Classifier` in this order:

* ``tokens`` (R, M): the examples' real tokens, 0 elsewhere (padding and each example's CLS slot);
* ``segments`` (R, M): which example a position belongs to, 1..B in batch order (0 = padding);
* ``positions`` (R, M): the position within its example (the CLS slot is 0, as in an unpacked row);
* ``starts`` (B,): the flat index (row * M + column) of each example's first position, in batch order.

M is the unpacked row length (the sequence plus the CLS slot), so every example fits in a row. The mixers keep
the examples apart (``supports_segments``), positions restart in every example, and pooling reads each
example's own positions: every output equals the unpacked one up to floating-point order, and so do the loss
and its gradient. The batch, the schedule and the data order are LRA's: packing changes the speed, not the
protocol.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

TRIM_MULTIPLE = 128  # trim() keeps a multiple of this many positions


class Packed(NamedTuple):
    tokens: torch.Tensor  # (R, M) ids; 0 at padding and at CLS slots
    segments: torch.Tensor  # (R, M) int64: 1 + the example's index in the batch, 0 = padding
    positions: torch.Tensor  # (R, M) int64: position within the example (CLS slot = 0)
    starts: torch.Tensor  # (B,) int64: flat index of each example's first position


def real_lengths(tokens: torch.Tensor) -> torch.Tensor:
    """(B, L) ids -> (B,) real tokens per example, checking that all padding (id 0) comes after them: packing
    moves examples, so a pad inside an example (which the unpacked model masks in place) would shift positions."""
    real = tokens != 0  # (B, L)
    lengths = real.sum(1)  # (B,)
    prefix = torch.arange(tokens.shape[1]) < lengths[:, None]  # (B, L): the first `length` positions
    if not torch.equal(real, prefix):
        bad = int((real != prefix).any(1).nonzero()[0])
        raise ValueError(f"packing needs each example's padding (id 0) after its tokens; example {bad} of the batch "
                         f"has a pad inside it (run with trainer.pack=false)")
    return lengths


def real_ends(tokens: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """(n, L) or (n, 2, L) ids -> (n,) the position after each example's last real token (its longer document's),
    0 for an empty one; ``chunk`` examples at a time, so a whole training split costs little memory."""
    L = tokens.shape[-1]
    ends = []
    for part in tokens.reshape(tokens.shape[0], -1, L).split(chunk):
        real = (part != 0).any(1)  # (c, L): a real token in any document at this position
        from_end = real.flip(-1).to(torch.uint8).argmax(-1)  # (c,): padding positions after the last real one
        ends.append(torch.where(real.any(-1), L - from_end, 0))
    return torch.cat(ends) if ends else torch.zeros(0, dtype=torch.long)


def trim(tokens: torch.Tensor, multiple: int = TRIM_MULTIPLE) -> torch.Tensor:
    """Cut the positions after the batch's last real token, keeping a multiple of ``multiple`` (few distinct
    shapes for compiled models). Exact: every model's real outputs ignore appended padding (a registry-wide test)."""
    length = int(real_ends(tokens).max()) if tokens.numel() else 0
    keep = min(tokens.shape[-1], max(multiple, -(-length // multiple) * multiple))
    return tokens[..., :keep]


def first_fit_decreasing(sizes: list[int], capacity: int) -> list[tuple[int, int]]:
    """(row, offset) for each item: longest first, each into the first row with room."""
    free: list[int] = []  # room left in each row
    place = [(0, 0)] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        row = next((r for r, room in enumerate(free) if room >= sizes[i]), None)
        if row is None:
            row = len(free)
            free.append(capacity)
        place[i] = (row, capacity - free[row])
        free[row] -= sizes[i]
    return place


def pack(tokens: torch.Tensor, cls_token: bool) -> Packed:
    """(B, L) right-padded ids -> the packed batch, on the CPU, rows of length L + cls_token. Only the placement
    (first-fit, a list of B sizes) is Python; the tensors are filled by a fixed handful of vectorised operations
    whatever B is (one slice assignment per example cost the GPU's training step more host time than it saved)."""
    B, L = tokens.shape
    lengths = real_lengths(tokens)  # (B,)
    slot = int(cls_token)
    M = L + slot
    spans = lengths + slot  # (B,) positions each example takes in its row: the CLS slot, then its tokens
    place = torch.tensor(first_fit_decreasing(spans.tolist(), M), dtype=torch.long).reshape(B, 2)  # (row, column)
    R = int(place[:, 0].max()) + 1 if B else 1
    starts = place[:, 0] * M + place[:, 1]  # (B,) flat index of each example's first position
    within = torch.arange(M).expand(B, M)  # (B, M) position within the example
    # where each example's position goes in the flat (R * M) batch; positions past its span go to a spare slot
    # at R * M, dropped after (a few dense writes: no per-example loop, no boolean indexing)
    where = torch.where(within < spans[:, None], starts[:, None] + within, R * M)  # (B, M)

    def placed(values: torch.Tensor) -> torch.Tensor:  # (B, M) values -> (R, M), zero where nothing is placed
        flat = torch.zeros(R * M + 1, dtype=values.dtype).index_put_((where.flatten(),), values.flatten())
        return flat[:-1].view(R, M)
    example = torch.arange(1, B + 1)[:, None].expand(B, M)  # (B, M): 1 + the example's index
    return Packed(placed(F.pad(tokens, (slot, 0))), placed(example), placed(within), starts)


def pack_pairs(tokens: torch.Tensor, cls_token: bool) -> Packed:
    """(B, 2, L) document pairs -> the 2B documents packed, document 2b + t being pair b's t-th
    (:class:`~lra.train.encoder.Classifier` regroups them into pairs after pooling)."""
    B, two, L = tokens.shape
    return pack(tokens.reshape(B * two, L), cls_token)  # (2B, L): pairs side by side


def model_inputs(tokens: torch.Tensor, packed: bool, cls_token: bool) -> tuple[torch.Tensor, ...]:
    """What the classifier is called with for a batch of (B, L) or (B, 2, L) ids: the ids, or the packed
    batch's four tensors."""
    if not packed:
        return (tokens,)
    return tuple(pack_pairs(tokens, cls_token) if tokens.dim() == 3 else pack(tokens, cls_token))


def packed_share(tokens: torch.Tensor, cls_token: bool) -> float:
    """Rows after packing / rows before, for a batch: the fraction of the work that remains."""
    flat = tokens.reshape(-1, tokens.shape[-1])
    return pack(flat, cls_token).tokens.shape[0] / flat.shape[0]
