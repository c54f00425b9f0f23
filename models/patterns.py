"""Block-sparse attention patterns, run as FlexAttention on CUDA or as a dense boolean mask elsewhere.

Shared by ``local``, ``sparse``, ``longformer`` and ``bigbird``. A model subclasses ``BlockSparseMixer`` and
defines its pattern once, in ``pattern(b, q, k, *context)``: an elementwise function of sample, query-block
and key-block indices (plus per-batch tensors from ``context``, e.g. BigBird's random blocks) saying which
block pairs attend. It is evaluated on index grids to lay out the tiles and the dense mask, and on scalars
inside FlexAttention's ``mask_mod``, so the two paths cannot disagree. On top of it a model may declare
``global_tokens``: that many leading positions attend to and are attended by everything, at token
granularity (Longformer's global CLS). The per-sample key padding mask is applied in both paths, so padded
keys never contribute; ``mask=None`` (no padding in the batch) lays out one set of tiles for all samples, which
FlexAttention and SDPA broadcast over the batch.

Two executions of the same pattern:

- **FlexAttention** (CUDA by default; ``backend="flex"`` forces it, e.g. in tests, where it runs eagerly):
  the block layout is pooled to FlexAttention's 128 x 128 tiles and turned into a ``BlockMask`` directly
  (kv- and q-major tile lists): a tile is *full* (no masking inside) when every pair in it is allowed and
  all its keys are real, *partial* (``mask_mod`` evaluated) when some pair may be allowed, and skipped
  otherwise, so the cost grows with the number of allowed tiles, not with N^2. Building the mask costs
  O(B (N/128)^2) block-level operations per call; ``create_block_mask`` would instead evaluate ``mask_mod`` at
  every one of the B N^2 positions, and since the padding mask changes every batch its result could not be
  cached. ``tests/test_model_patterns.py`` checks that both constructions give the same tiles.
  The call goes through ``torch.compile`` (the fused kernel exists only compiled): traced with the model
  when the model is compiled (lra's default on CUDA), else compiled here per call site. A static pattern without
  key padding (the pixel tasks, the benches) depends on the length alone: its tile lists are made once per length
  and kept, instead of a few small eager kernels on every call.
- **Dense mask** (CPU, or ``backend="dense"``): the layout is expanded to a (B, 1, N, N) boolean mask for
  ``F.scaled_dot_product_attention``. O(N^2) time and memory: it exists for correctness and CPU tests, and
  speed claims for these models must come from the flex path.

Granularity: a model's ``block`` must divide 128 or be a multiple of it, so that pattern blocks and
FlexAttention tiles nest (LRA's block 50 straddles tiles and would make every tile partial). The layout is
laid out for N rounded up to a multiple of max(block, 128), so any N up to ``max_len`` works: the dense path
pads q, k, v to that length with masked positions and cuts the output back; the flex path keeps them at N,
since the kernel bounds-checks the last tile itself, and positions past N then make no tile partial.

A tile is partial for three reasons: the pattern allows some but not all of its block pairs (blocks smaller
than 128), a global token cuts through it, or it holds padded keys. Partial tiles evaluate the mask_mod per
position and cost several times a full tile; the defaults avoid them.

Rows with no allowed key (padded queries whose whole neighbourhood is padding) return 0 in both paths:
SDPA and FlexAttention define a fully masked row as 0, in output and gradient; the tests check both paths.

Attention dropout is not applied: FlexAttention has no dropout on attention probabilities, and the dense
path skips it too so that CPU and GPU train the same model (the encoder's residual and MLP dropout still
apply).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from ._flex_dropout import flex_attention_dropout
from .base import MultiHeadMixer, compiled, pad_head_dim, takes_fused_path

FLEX_BLOCK = 128  # FlexAttention's tile: sparsity is counted in whole 128 x 128 tiles
MIN_FLEX_HEAD_DIM = 16  # the Triton kernel rejects smaller head dims; zero-padding q, k, v is exact


def check_block(block: int) -> None:
    if block < 1 or (FLEX_BLOCK % block and block % FLEX_BLOCK):
        raise ValueError(
            f"block={block}: pattern blocks must divide {FLEX_BLOCK} or be a multiple of it, so that they nest "
            f"in FlexAttention's {FLEX_BLOCK}-wide tiles (LRA's block 50 maps to 64 or 128)"
        )


def padded_length(n: int, block: int) -> int:
    """The internal length: a multiple of both the pattern block and the FlexAttention tile."""
    unit = max(block, FLEX_BLOCK)
    return -(-n // unit) * unit


def dense_mask(layout, keep, block: int, global_tokens: int) -> torch.Tensor:
    """(B or 1, N/block, N/block) layout, (B, N) key mask -> (B, 1, N, N) bool: True = query may see key."""
    N, nb = keep.shape[1], layout.shape[-1]
    allowed = layout[:, :, None, :, None].expand(-1, nb, block, nb, block)  # (B or 1, nb, block, nb, block)
    allowed = allowed.reshape(-1, N, N)  # (B or 1, N, N)
    if global_tokens:
        pos = torch.arange(N, device=keep.device)
        allowed = allowed | (pos[:, None] < global_tokens) | (pos[None, :] < global_tokens)
    return (allowed & keep[:, None, :])[:, None]  # (B, 1, N, N): padded keys never contribute


def dense_attend(q, k, v, layout, keep, block: int, global_tokens: int) -> torch.Tensor:
    """softmax attention through SDPA with the pattern expanded to a dense boolean mask; q, k, v padded to the
    layout's length."""
    mask = dense_mask(layout, keep, block, global_tokens)  # (B, 1, N, N)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, N, Dh)


@torch.library.custom_op("lra_models::ordered_tiles", mutates_args=())
def ordered_tiles(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, R, C) bool tiles -> FlexAttention's (count per row, column indices with the active ones first).

    A custom op, so that ``torch.compile`` calls it as one opaque kernel instead of lowering it: inside the graph
    Inductor miscompiles both constructions (torch 2.11, CUDA), an argsort one with an illegal memory access and
    the scatter below with ``InductorError: TypeError: list indices must be integers or slices`` at 129 x 129
    tiles (longformer and bigbird at N = 16K + CLS). torch's own
    ``_dense_to_ordered`` keeps its argsort out of Inductor the same way. Run eagerly it costs
    O(B H R C) on a few thousand elements."""
    C = dense.shape[-1]
    active = dense.to(torch.int32)
    count = active.sum(-1, dtype=torch.int32)  # (B, H, R)
    rank_active = active.cumsum(-1) - 1  # (B, H, R, C): slot of each active column
    rank_inactive = count[..., None] + (1 - active).cumsum(-1) - 1  # inactive columns go after them
    slot = torch.where(dense, rank_active, rank_inactive).long()  # (B, H, R, C): a permutation of 0..C-1
    columns = torch.arange(C, dtype=torch.int32, device=dense.device).expand_as(active)
    return count, torch.empty_like(active).scatter_(-1, slot, columns)  # (B, H, R), (B, H, R, C)


@torch.library.custom_op("lra_models::realized", mutates_args=())
def realized(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` that ``torch.compile`` makes as one opaque kernel, so it is a buffer of its own.

    A tensor that a ``mask_mod`` reads must be a realised buffer. Inside a compiled inference graph Inductor
    otherwise fuses the key mask computed from the input into its consumers (torch 2.11 CUDA: ``'function'
    object has no attribute 'graph'``; BigBird: ``convert FlexibleLayout to FixedLayout first``; torch 2.13
    CPU: ``All the buffers in the score and mask subgraph should be in ... input_buffers``), which breaks every
    evaluation of the padded block-sparse models under ``trainer.compile``. A training graph realises it anyway."""
    return x.clone()


@realized.register_fake
def _realized_shape(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


realized.register_autograd(lambda ctx, grad: grad)  # a copy: its gradient is the output's (score_table's tables)


def listed_tiles(count: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The inverse of ``ordered_tiles``: (B, H, R) counts and (B, H, R, C) indices -> (B, H, R, C) bool tiles."""
    listed = torch.arange(index.shape[-1], device=index.device) < count[..., None]  # the first `count` are real
    return torch.zeros_like(index, dtype=torch.bool).scatter_(-1, index.long(), listed)


@ordered_tiles.register_fake
def _ordered_tiles_shapes(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return dense.new_empty(dense.shape[:-1], dtype=torch.int32), dense.new_empty(dense.shape, dtype=torch.int32)


def score_table(table: torch.Tensor, bounds: dict[int, int] | None = None, flat: bool = False) -> torch.Tensor:
    """A table that a score_mod reads (and differentiates where it takes a gradient), as torch.compile must give it to
    FlexAttention: a buffer of its own (``realized``, through which the gradient passes), zero-padded at the end of
    each dim of ``bounds`` to its bound (the longest length the mixer takes). Eagerly the table itself.

    Realised: otherwise Inductor inlines the table's last operation into the kernel's score_mod, and the kernel's
    code generator cannot emit every operation there: in an inference graph it fuses a table computed from the input
    into the kernel's inputs, and the padding below, a masked load, fails the lowering of DeBERTa's trimmed training
    step (torch 2.11, CUDA: "'function' object has no attribute 'graph'").
    Padded: a table that takes a gradient must have sizes that are ints. Traced with a symbolic length (trimmed
    batches), its gradient buffer is sized by a ``sym_size`` in the kernel's backward subgraph, which Inductor's
    lowering cannot take (torch 2.11, CUDA: "int() argument must be a string, a bytes-like object or a real
    number, not 'tuple'"). Padded, the size is the bound whatever the length: n + (bound - n) folds to it; an
    untrimmed batch is at the bound already. The batch size stays an int: training batches are full, and the runner
    marks their size static. tests/test_flex_dynamic_shapes.py checks both on the CPU. ``flat``: the table 1-D (after
    padding), the buffer itself and not a view of it (the CPU's kernel template takes no view)."""
    if not torch.compiler.is_compiling():
        return table.flatten() if flat else table
    if bounds:
        pad = []
        for dim in reversed(range(table.dim())):  # F.pad's order: the last dim first
            pad += [0, bounds[dim] - table.shape[dim]] if dim in bounds else [0, 0]
        table = F.pad(table, pad)
    return realized(table.flatten() if flat else table)


def row_starts(rows: int, stride, device: torch.device) -> torch.Tensor:
    """(rows,) int64: where each of ``rows`` rows of ``stride`` entries starts in a flat buffer, for a mod to look up
    (``starts[b] + i``) rather than compute (``b * stride + i``): compiled with dynamic shapes (trimmed batches change
    the length) the stride is an expression of the input's length, and a mod that closes over such a SymInt fails
    Inductor's FlexAttention lowering (pytorch/pytorch#182606; tests/test_flex_dynamic_shapes.py)."""
    return realized(torch.arange(rows, device=device) * stride)  # a buffer of its own for the mods (``realized``)


def flex_block_mask(layout, keep, block: int, global_tokens: int, rule, length: int | None = None,
                    key_padding: bool = True, kept: dict | None = None) -> BlockMask:
    """The pattern and the key padding mask as a FlexAttention BlockMask for sequences of ``length`` (default:
    all of ``keep``). ``layout`` (B or 1, Np/block, Np/block) decides the tiles; ``rule(b, q_block, k_block)``,
    the same pattern as a function of indices, decides the positions inside partial tiles. Positions from
    ``length`` to Np do not exist for the kernel (it bounds-checks the last tile), so they neither make a tile
    partial nor need a lookup; ``key_padding=False`` (no padding before ``length``) drops the mask_mod's
    lookup of ``keep`` altogether. Index arithmetic and 1-D loads are FlexAttention's fast form of a mask_mod;
    looking the layout up with a multi-dimensional gather per position is several times slower
    (pytorch/torchtitan#2171, for a 2-D index). ``kept``: a dict that keeps the tile lists by length
    and device, for a pattern that depends on the length alone (no key padding, no per-sample context)."""
    B, Np = keep.shape
    n = Np if length is None else length
    lists = kept_tile_lists(kept, (n, keep.device), lambda: flex_tiles(layout, keep, block, global_tokens, n))
    keep_flat = realized(keep.reshape(-1)) if key_padding else None  # (B * Np,), a buffer for the mask_mod
    row_start = row_starts(B, Np, keep.device) if key_padding else None  # (B,): each sample's first in keep_flat

    def mask_mod(b, h, q_idx, kv_idx):
        if B == 1:  # one mask for the whole batch (FlexAttention broadcasts it): look everything up in sample 0
            b = b * 0
        allowed = rule(b, q_idx // block, kv_idx // block)
        if global_tokens:
            allowed = allowed | (q_idx < global_tokens) | (kv_idx < global_tokens)
        return allowed & keep_flat[row_start[b] + kv_idx] if key_padding else allowed

    return block_mask_of(lists, n, mask_mod)


def flex_tiles(layout, keep, block: int, global_tokens: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pattern's tiles for ``flex_block_mask``: (B, 1, ntr, ntr) partial (mask_mod decides inside) and full
    (computed whole), for sequences of length ``n``."""
    B, Np = keep.shape
    nt, nb = Np // FLEX_BLOCK, layout.shape[-1]
    layout = layout.expand(B, -1, -1)  # (B, Np/block, Np/block)
    # Pool the pattern to tiles: `some` = the tile holds an allowed block pair, `every` = all its pairs are.
    if block <= FLEX_BLOCK:
        # blocks wholly past the end are out of range: allowed for `every`, absent for `some`
        outside = torch.arange(nb, device=keep.device) * block >= n  # (nb,)
        beyond = outside[:, None] | outside[None, :]  # (nb, nb)
        r = FLEX_BLOCK // block
        some = (layout & ~beyond).reshape(B, nt, r, nt, r).any(4).any(2)  # (B, nt, nt)
        every = (layout | beyond).reshape(B, nt, r, nt, r).all(4).all(2)  # (B, nt, nt)
    else:
        s = block // FLEX_BLOCK
        some = every = layout.repeat_interleave(s, 1).repeat_interleave(s, 2)  # (B, nt, nt)
    if global_tokens:
        start = torch.arange(nt, device=keep.device) * FLEX_BLOCK
        g_some, g_every = start < global_tokens, start + FLEX_BLOCK <= global_tokens  # (nt,)
        some = some | g_some[:, None] | g_some[None, :]
        every = every | g_every[:, None] | g_every[None, :]
    in_range = torch.arange(Np, device=keep.device) < n  # (Np,)
    real_all = (keep | ~in_range).view(B, nt, FLEX_BLOCK).all(-1)  # (B, nt): no padded key inside the sequence
    real_any = keep.view(B, nt, FLEX_BLOCK).any(-1)  # (B, nt)
    ntr = -(-n // FLEX_BLOCK)  # tiles the sequence spans
    full = (every & real_all[:, None, :])[:, :ntr, :ntr]  # (B, ntr, ntr): computed without mask_mod
    partial = (some & real_any[:, None, :])[:, :ntr, :ntr] & ~full  # (B, ntr, ntr): mask_mod decides inside
    return partial[:, None], full[:, None]


def padding_block_mask(mask: torch.Tensor) -> BlockMask:
    """(B, N) key mask -> FlexAttention BlockMask: the key padding alone (every tile of the pattern allowed), through
    ``flex_block_mask``: tiles whose keys are all real are computed whole, those of only padding skipped, the rest
    look the mask up per key. For the dense mixers' flex paths (DeBERTa, the synthesizer)."""
    N = mask.shape[1]
    nt = -(-N // FLEX_BLOCK)
    keep = F.pad(mask, (0, nt * FLEX_BLOCK - N))  # (B, nt * 128): no key past N
    every_tile = torch.ones(1, nt, nt, dtype=torch.bool, device=mask.device)  # (1, nt, nt)
    return flex_block_mask(every_tile, keep, FLEX_BLOCK, 0, lambda b, q_block, k_block: True, length=N)


def tile_lists(partial: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(B, H, nt, nt) bool tiles (``partial``: mask_mod decides inside; ``full``: computed whole) -> FlexAttention's
    eight tile lists: counts and indices of the partial and full tiles, kv-major, then q-major (for the backward
    pass: the transposed tiles, ordered the same way). A pattern that depends on nothing but the length may keep
    them: each ``ordered_tiles`` is a handful of small eager kernels on every call."""
    return (*ordered_tiles(partial), *ordered_tiles(full), *ordered_tiles(partial.transpose(-1, -2).contiguous()),
            *ordered_tiles(full.transpose(-1, -2).contiguous()))


def kept_tile_lists(kept: dict | None, key, tiles) -> tuple[torch.Tensor, ...]:
    """``tile_lists(*tiles())``, made once per ``key`` (length, device) and kept in ``kept``, for a pattern that
    depends on the length alone; made on every call where ``kept`` is None."""
    if kept is None:
        return tile_lists(*tiles())
    if key not in kept:
        kept[key] = tile_lists(*tiles())
    return kept[key]


def block_mask_of(lists: tuple[torch.Tensor, ...], length: int, mask_mod) -> BlockMask:
    """``tile_lists`` and the mask_mod -> the BlockMask of a length-``length`` sequence."""
    kv_num, kv_index, full_kv_num, full_kv_index, q_num, q_index, full_q_num, full_q_index = lists
    return BlockMask(
        seq_lengths=(length, length), kv_num_blocks=kv_num, kv_indices=kv_index, full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_index, q_num_blocks=q_num, q_indices=q_index, full_q_num_blocks=full_q_num,
        full_q_indices=full_q_index, BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK), mask_mod=mask_mod,
    )


def tile_block_mask(partial: torch.Tensor, full: torch.Tensor, length: int, mask_mod) -> BlockMask:
    """(B, H, nt, nt) bool tiles (``partial``: mask_mod decides inside; ``full``: computed whole) -> the
    BlockMask of a length-``length`` sequence."""
    return block_mask_of(tile_lists(partial, full), length, mask_mod)


# The forward kernel's work tile where many tiles evaluate a mask_mod that reads tensors. Inductor's default
# forward tile on Hopper (bf16, head 64) is 128 x 128; with such a mask_mod inside, the forward is then many times
# slower than the backward (ListOps with LRA's 64-blocks and key padding; docs/gpu.md).
# Full tiles keep the default.
SMALL_FORWARD_TILES = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64}


def flex_attend(q, k, v, block_mask: BlockMask | None, small_tiles: bool = False, score_mod=None,
                scale: float | None = None, dropout_p: float = 0.0, kernel_options: dict | None = None) -> torch.Tensor:
    """FlexAttention over the pattern's BlockMask (eager unless traced by torch.compile, see
    ``BlockSparseMixer``). q, k, v (B, H, N, Dh) at their own length: the kernel bounds-checks the last tile, so
    they are not padded to it. ``small_tiles``: the forward kernel works in 64 x 64 tiles (on CUDA), for masks
    whose partial tiles look tensors up (``SMALL_FORWARD_TILES``); the result is the same. ``score_mod`` and
    ``scale`` (default Dh^-0.5, of the true head size) go to the kernel; ``dropout_p``: attention dropout, which
    FlexAttention lacks, through ``_flex_dropout``; ``kernel_options``: more of Inductor's kernel options (on CUDA).
    """
    Dh = q.shape[-1]
    q, k, v = pad_head_dim(MIN_FLEX_HEAD_DIM, q, k, v)  # (B, H, N, max(Dh, 16))
    options = {**(SMALL_FORWARD_TILES if small_tiles else {}), **(kernel_options or {})}  # Inductor's, on CUDA
    out = flex_attention_dropout(q, k, v, dropout_p, score_mod=score_mod, block_mask=block_mask,
                                 scale=Dh**-0.5 if scale is None else scale,
                                 kernel_options=options if q.is_cuda and options else None)  # (B, H, N, max(Dh, 16))
    return out[..., :Dh]


def flex_call(fn, on_cuda: bool, *args):
    """``fn(*args)`` for a function that calls FlexAttention with a mask_mod built inside it. FlexAttention is fast
    only compiled: on CUDA, outside a graph being traced, ``fn`` goes through ``torch.compile`` here, with the
    mixer among its arguments, so that the per-batch mask_mod closure is traced instead of guarded on; a model
    compiled as a whole (lra's default on CUDA) traces straight through. Elsewhere it runs eagerly (tests)."""
    if on_cuda and not torch.compiler.is_compiling():
        return compiled(fn, dynamic=False)(*args)
    return fn(*args)


def real_blocks(keep: torch.Tensor, block: int) -> torch.Tensor:
    """(B, N) key mask -> (B,) blocks up to the last real token: unchanged by padding appended after it."""
    extent = (keep.long() * torch.arange(1, keep.shape[1] + 1, device=keep.device)).amax(-1)  # (B,)
    return (extent + block - 1) // block


class BlockSparseMixer(MultiHeadMixer):
    """Multi-head attention restricted to a block pattern; subclasses define ``pattern`` (and, when the
    pattern depends on the sample, ``context``).

    ``backend``: "auto" (FlexAttention on CUDA, dense mask elsewhere), "flex" or "dense". It is an attribute,
    not a constructor option, because it changes how the model runs, never what it computes.
    ``static_pattern``: True when the pattern needs no ``context``, so its layout can be cached per length (with
    or without padding; the tile lists are kept per length for every pattern when there is no padding).
    """

    backends = ("auto", "flex", "dense")  # the values of ``backend`` (how it runs, not what it computes)
    static_pattern = True
    # mask=None (no padding in the batch): one (1, N) key mask and one layout for all samples, so the tiles
    # and the pattern's per-sample context (BigBird's) are built once per call instead of once per sample
    accepts_no_mask = True

    def __init__(self, d_model: int, n_heads: int, d_qkv: int, dropout: float, max_len: int, *, block: int,
                 global_tokens: int = 0):
        super().__init__(d_model, n_heads, d_qkv, dropout, max_len)
        check_block(block)
        if global_tokens < 0:
            raise ValueError(f"global_tokens={global_tokens} must be >= 0")
        self.block, self.global_tokens = block, global_tokens
        self.backend = "auto"
        self._layouts: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._tile_lists: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}  # FlexAttention's, per N

    def pattern(self, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *context: torch.Tensor) -> torch.Tensor:
        """True where query block ``q`` of sample ``b`` may attend to key block ``k``. Called twice with the
        same code: on broadcast index grids, b (B, 1, 1), q (1, nb, 1), k (1, 1, nb), to lay out the tiles
        and the dense mask; and on scalars inside FlexAttention's ``mask_mod``. So: elementwise tensor ops
        only, and per-sample tensors from ``context`` read with 1-D indexing."""
        raise NotImplementedError

    def context(self, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-batch tensors the pattern reads, from the (B, N) key mask. None by default."""
        return ()

    def block_layout(self, keep: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(B, N) key mask, N a multiple of the block -> (B or 1, nb, nb) allowed block pairs, context."""
        nb, device = keep.shape[1] // self.block, keep.device
        cache = self.static_pattern and not torch.compiler.is_compiling()
        if cache and (nb, device) in self._layouts:
            return self._layouts[(nb, device)], ()
        context = self.context(keep)
        blocks = torch.arange(nb, device=device)
        b = torch.arange(keep.shape[0], device=device)[:, None, None]
        layout = self.pattern(b, blocks[None, :, None], blocks[None, None, :], *context)
        layout = layout.expand(layout.shape[0], nb, nb)  # (B or 1, nb, nb)
        if cache:
            self._layouts[(nb, device)] = layout
        return layout, context

    def lay_out(self, mask: torch.Tensor | None, n: int, device: torch.device):
        """(B, n) key mask, or None for no padding -> keep (B or 1, Np), layout (B or 1, Np/block, Np/block) and
        ``rule(b, q_block, k_block)``, the pattern as a function of indices, for a length-``n`` input."""
        pad = padded_length(n, self.block) - n
        if mask is None:  # no padding in the batch: one key mask, for the internal padding, serves every sample
            keep = (torch.arange(n + pad, device=device) < n)[None]  # (1, Np)
        else:
            keep = F.pad(mask, (0, pad), value=False)  # (B, Np): internal padding is masked like any other
        layout, context = self.block_layout(keep)
        context = tuple(realized(c) for c in context)  # read by the mask_mod: buffers of their own

        def rule(b, q_block, k_block):
            return self.pattern(b, q_block, k_block, *context)

        return keep, layout, rule

    def block_mask(self, mask: torch.Tensor | None, n: int, device: torch.device) -> BlockMask:
        """The FlexAttention BlockMask of a length-``n`` input with (B, n) key mask ``mask`` (None: no padding,
        and then no key lookup in the mask_mod). Without padding the tiles depend on the length alone, a pattern
        with a ``context`` included (it reads the key mask, here the same for every length-``n`` input, and the
        module's fixed buffers), so they are listed once per length and kept; loading a state dict drops them."""
        keep, layout, rule = self.lay_out(mask, n, device)
        return flex_block_mask(layout, keep, self.block, self.global_tokens, rule, n, key_padding=mask is not None,
                               kept=self._tile_lists if mask is None else None)

    def _load_from_state_dict(self, *args, **kwargs):
        # kept tiles and layouts may follow from buffers being replaced (BigBird's random plan)
        self._tile_lists.clear()
        self._layouts.clear()
        super()._load_from_state_dict(*args, **kwargs)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        self.check_length(q.shape[2])
        return self.attend_blocks(q, k, v, mask)

    def attend_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
        """The pattern over q, k, v (B, H, N, Dh) as given, by FlexAttention or the dense mask (``backend``)."""
        use_flex = takes_fused_path(self, "flex", q.is_cuda)
        if use_flex:
            return flex_call(_block_sparse_attend, q.is_cuda, self, q, k, v, mask, True)
        return _block_sparse_attend(self, q, k, v, mask, False)


def _block_sparse_attend(mixer: BlockSparseMixer, q, k, v, mask, use_flex: bool) -> torch.Tensor:
    N = q.shape[2]
    if use_flex:
        # many partial tiles (their mask_mod reads the key mask and any pattern context): key padding cuts through
        # tiles in every sample, blocks smaller than a tile split them; otherwise only the last tile can be partial
        many_partial = mask is not None or mixer.block < FLEX_BLOCK
        return flex_attend(q, k, v, mixer.block_mask(mask, N, q.device), small_tiles=many_partial)
    keep, layout, _ = mixer.lay_out(mask, N, q.device)
    q, k, v = (F.pad(t, (0, 0, 0, keep.shape[1] - N)) for t in (q, k, v))  # (B, H, Np, Dh)
    return dense_attend(q, k, v, layout, keep, mixer.block, mixer.global_tokens)[:, :, :N]  # (B, H, N, Dh)
