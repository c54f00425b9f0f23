"""The one encoder every model shares, so that models differ only in their token mixer.

Token embedding + position embedding (learned or sinusoidal) -> optional CLS slot -> ``n_layers``
pre-LayerNorm blocks ``x + Drop(Mixer(LN x))``, ``x + MLP(LN x)`` with a GELU MLP -> final LayerNorm ->
pooling (CLS, masked mean or last) -> Dense-ReLU-Dense head (LRA's ``classifier_head``).

A pair task (retrieval) encodes both documents with the same encoder and classifies
``[u, v, u*v, u-v]`` (LRA paper App. A.1.3): the mixer never knows it is looking at a pair.

The backbone options that published recipes of other model families train with (``experiment=`` presets;
LRA's protocol keeps the defaults above, so there models still differ only in the mixer):

* ``norm``: ``layernorm`` | ``batchnorm`` (over channels, its statistics over real tokens only: see
  :class:`MaskedBatchNorm`);
* ``prenorm: false``: post-norm blocks ``x = N(x + Drop(Mixer x))``, ``x = N(x + MLP x)``, and no final norm
  (the output of the last block is already normalised), as S4's backbone;
* ``mlp: false``: blocks of the mixer alone (the S4 family's blocks; ``d_ff`` is then unused);
* ``positions: none``: no position embedding (SSMs and convolutions know the order already);
* ``embedding: pixels``: an image task's pixel values ``((id - 1) / 255 - pixel_mean) / pixel_std`` through
  ``Linear(1, d_model)`` instead of a table of 257 token vectors (S4's continuous input); id 0 stays padding;
* ``pooling: last``: each example's last real position (S4's decoder ``mode: last``).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

from lra.config import backbone_defaults  # the schema's defaults, in one place
from models import create_model
from models.base import make_dropout
from models.registry import Grid, get_model_class


def sinusoidal_positions(n: int, d: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    table = torch.zeros(n, d)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq[: d // 2])
    return table  # (n, d)


class LayerNorm(nn.LayerNorm):
    """LayerNorm with the norms' common call ``norm(x, mask)``: each token is normalised on its own, so the
    mask is not needed (and the parameter names stay those of ``nn.LayerNorm``)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x)


class MaskedBatchNorm(nn.BatchNorm1d):
    """BatchNorm over the channels of (B, N, D) hidden states whose batch statistics (and so its running
    statistics) count real tokens only. S4's BatchNorm counted the padding too, which makes a token's output
    depend on how much padding its batch carries; here appending padding changes nothing, in training or in
    evaluation. Padded positions are normalised with the same statistics (finite, and masked downstream).
    The statistics are computed in fp32 whatever the autocast dtype; under DDP each process keeps its own
    (no SyncBatchNorm, as S4's Lightning trainer by default)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None or not self.training:  # every token counts, or the running statistics are used
            return super().forward(x.reshape(-1, x.shape[-1])).view_as(x)
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 at least (fp64 stays, for tests)
        m = mask.unsqueeze(-1).to(acc)  # (B, N, 1)
        xf = x.to(acc)
        count = m.sum()
        mean = (xf * m).sum((0, 1)) / count  # (D,)
        var = ((xf - mean).square() * m).sum((0, 1)) / count  # (D,) biased: what the batch is normalised with
        if self.track_running_stats:
            with torch.no_grad():  # as nn.BatchNorm1d: momentum (or a cumulative average), unbiased variance
                self.num_batches_tracked.add_(1)
                factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                unbiased = var * count / (count - 1).clamp_min(1.0)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        y = (xf - mean) * torch.rsqrt(var + self.eps)  # (B, N, D)
        if self.affine:
            y = y * self.weight + self.bias
        return y.to(x.dtype)


NORMS = {"layernorm": LayerNorm, "batchnorm": MaskedBatchNorm}


class Block(nn.Module):
    """Pre-norm (default): ``x + Drop(Mixer(N x))``, then ``x + MLP(N x)``. Post-norm (``prenorm=False``):
    ``N(x + Drop(Mixer x))``, then ``N(x + MLP x)``. ``mlp=False``: the mixer sub-block alone. ``tie_dropout``:
    every Drop here draws one mask per example and channel for all positions (``models.base.TiedDropout``)."""

    def __init__(self, mixer: nn.Module, d_model: int, d_ff: int, dropout: float, norm: str = "layernorm",
                 prenorm: bool = True, mlp: bool = True, tie_dropout: bool = False):
        super().__init__()
        self.prenorm = prenorm
        self.norm1, self.mixer = NORMS[norm](d_model), mixer
        self.norm2 = self.mlp = None
        if mlp:
            self.norm2 = NORMS[norm](d_model)
            self.mlp = nn.Sequential(
                nn.Linear(d_model, d_ff), nn.GELU(), make_dropout(dropout, tie_dropout), nn.Linear(d_ff, d_model),
                make_dropout(dropout, tie_dropout),
            )
        self.drop = make_dropout(dropout, tie_dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, **mixer_inputs) -> torch.Tensor:
        if self.prenorm:
            x = x + self.drop(self.mixer(self.norm1(x, mask), mask, **mixer_inputs))
            return x if self.mlp is None else x + self.mlp(self.norm2(x, mask))
        x = self.norm1(x + self.drop(self.mixer(x, mask, **mixer_inputs)), mask)
        return x if self.mlp is None else self.norm2(x + self.mlp(x), mask)


class Encoder(nn.Module):
    """(B, N) token ids with 0 = pad -> (B, N', D) hidden states and the (B, N') mask they go with
    (N' = N + 1 with a CLS slot). ``mask=None`` means no padding: when every mixer declares
    ``accepts_no_mask`` they get None (the transformer then runs SDPA's unmasked kernels); otherwise an
    all-true mask is built once here. A 2-D mixer (``needs_grid``) also gets the task's pixel ``grid``
    (height, width) as a :class:`~models.registry.Grid` that places the CLS slot before the pixels."""

    def __init__(
        self,
        model: str,
        model_options: dict,
        vocab_size: int,
        seq_len: int,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_qkv: int,
        d_ff: int,
        dropout: float,
        attn_dropout: float,
        positions: str = "learned",
        cls_token: bool = True,
        grid: tuple[int, int] | None = None,
        norm: str = "layernorm",
        prenorm: bool = True,
        mlp: bool = True,
        embedding: str = "tokens",
        pixel_mean: float = 0.5,
        pixel_std: float = 0.5,
        tie_dropout: bool = False,
        embedding_dropout: float | None = None,
    ):
        super().__init__()
        if positions not in ("learned", "sinusoidal", "none"):
            raise ValueError(f"positions must be 'learned', 'sinusoidal' or 'none', got {positions!r}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
        if embedding not in ("tokens", "pixels"):
            raise ValueError(f"embedding must be 'tokens' or 'pixels', got {embedding!r}")
        if embedding == "pixels" and grid is None:
            raise ValueError("embedding='pixels' reads pixel values and needs an image task (image, pathfinder, "
                             "pathx); this task's tokens are symbols")
        if not pixel_std > 0:
            raise ValueError(f"pixel_std must be positive, got {pixel_std}")
        self.mixer_inputs = {}
        if getattr(get_model_class(model), "needs_grid", False):
            if grid is None:
                raise ValueError(f"model {model!r} attends over the 2-D pixel grid and needs an image task "
                                 f"(image, pathfinder, pathx); this task's sequence has no grid")
            height, width = grid
            if height * width != seq_len:
                raise ValueError(f"grid {height}x{width} does not cover the {seq_len} tokens of the sequence")
            self.mixer_inputs["grid"] = Grid(height, width, prefix=int(cls_token))
        self.cls_token = cls_token
        max_len = seq_len + int(cls_token)
        self.embedding, self.pixel_mean, self.pixel_std = embedding, float(pixel_mean), float(pixel_std)
        if embedding == "tokens":
            self.embed = nn.Embedding(vocab_size, d_model)
            nn.init.normal_(self.embed.weight, std=1.0)  # LRA: N(0, 1), no sqrt(d) scaling
        else:
            self.embed = nn.Linear(1, d_model)  # S4's `encoder: linear` on one gray channel, default init
        if positions == "learned":
            self.pos = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        elif positions == "sinusoidal":
            self.register_buffer("pos", sinusoidal_positions(max_len, d_model), persistent=False)
        else:
            self.pos = None
        if cls_token:
            self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        embedding_dropout = dropout if embedding_dropout is None else embedding_dropout  # null: LRA's, the same
        # a tied mask is one per row: in a packed row it would be shared by several examples (supports_segments)
        self.tied_dropout = bool(tie_dropout) and max(dropout, embedding_dropout) > 0
        self.drop = make_dropout(embedding_dropout, tie_dropout)
        backbone = dict(d_model=d_model, n_heads=n_heads, d_qkv=d_qkv, dropout=attn_dropout, max_len=max_len)
        self.blocks = nn.ModuleList(
            Block(create_model(model, **backbone, **model_options), d_model, d_ff, dropout, norm, prenorm, mlp,
                  tie_dropout)
            for _ in range(n_layers)
        )
        # post-norm blocks end normalised already; S4's backbone has a final norm only with pre-norm blocks
        self.norm = NORMS[norm](d_model) if prenorm else None
        # a registered mixer need not subclass MultiHeadMixer: without the attribute it gets a mask
        self.mixers_accept_no_mask = all(getattr(block.mixer, "accepts_no_mask", False) for block in self.blocks)

    def set_causal(self, causal: bool) -> None:
        """Every mixer in its causal form (``causal=True``: each output from the positions at and before it) or not;
        a ValueError for a mixer without one (``supports_causal``, models/base.py)."""
        for block in self.blocks:
            if not getattr(block.mixer, "supports_causal", False):
                raise ValueError(f"{type(block.mixer).__name__} has no causal form (supports_causal)")
            block.mixer.causal = bool(causal)

    @property
    def supports_segments(self) -> bool:
        """Whether packed rows (:mod:`lra.train.packing`) give every example exactly its own outputs: every mixer keeps
        segments apart, no 2-D grid is needed (a grid is one image to a row), and no tied dropout mask (one a row)
        would be shared by the examples of a row."""
        return not self.mixer_inputs and not self.tied_dropout and all(
            getattr(b.mixer, "supports_segments", False) for b in self.blocks)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None, segments: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if segments is not None:
            return self.forward_packed(tokens, segments, positions)
        return self.encode(self.embed_tokens(tokens), mask)  # embed_tokens: (B, N) -> (B, N, D)

    def encode(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedded tokens (B, N, D) and their (B, N) mask (None: no padding) -> (B, N', D) hidden states and their
        mask: ``forward`` after the token embedding, which a caller may change first (masked-token pretraining puts
        its mask vector in, ``lra.train.pretrain``)."""
        B, N = x.shape[:2]
        if mask is None and not self.mixers_accept_no_mask:
            mask = torch.ones(B, N, dtype=torch.bool, device=x.device)  # (B, N)
        if self.cls_token:
            x = torch.cat([self.cls.expand(B, -1, -1), x], dim=1)  # (B, N + 1, D)
            if mask is not None:
                mask = torch.cat([mask.new_ones(B, 1), mask], dim=1)  # (B, N + 1)
        x = self.drop(x if self.pos is None else x + self.pos[: x.shape[1]])
        for block in self.blocks:
            x = block(x, mask, **self.mixer_inputs)
        return (x if self.norm is None else self.norm(x, mask)), mask

    def forward_packed(self, tokens: torch.Tensor, segments: torch.Tensor,
                       positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed rows (:mod:`lra.train.packing`): tokens, segments, positions (R, M) -> ((R, M, D), mask (R, M)). Each
        example gets the CLS vector in its first slot and the position embeddings from 0, as in its own row."""
        if not self.supports_segments:
            raise ValueError("packed rows need mixers that keep segments apart (supports_segments)")
        mask = segments != 0  # (R, M)
        x = self.embed_tokens(tokens)  # (R, M, D)
        if self.cls_token:
            cls_slot = (positions == 0) & mask  # (R, M): each example's first position
            x = torch.where(cls_slot.unsqueeze(-1), self.cls.to(x.dtype), x)  # (R, M, D)
        x = self.drop(x if self.pos is None else x + self.pos[positions])  # pos[positions]: (R, M, D)
        for block in self.blocks:
            x = block(x, mask, segments=segments)
        return (x if self.norm is None else self.norm(x, mask)), mask

    def pixel_values(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, N) ids = pixel + 1 -> (B, N) normalised gray values ((id - 1) / 255 - mean) / std, fp32."""
        return ((tokens.float() - 1.0) / 255.0 - self.pixel_mean) / self.pixel_std

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embedding == "tokens":
            return self.embed(tokens)  # (B, N, D)
        # in fp32 even under bf16 autocast: bf16's 8-bit mantissa cannot tell neighbouring gray levels apart
        with torch.autocast(device_type=tokens.device.type, enabled=False):
            return self.embed(self.pixel_values(tokens).unsqueeze(-1))  # (B, N, 1) -> (B, N, D)


POOLINGS = ("cls", "mean", "last")


def pool(h: torch.Tensor, mask: torch.Tensor | None, mode: str) -> torch.Tensor:
    """(B, N, D) -> (B, D). ``mean`` averages real tokens only (LRA averaged the padding in too, which
    makes the prediction depend on how much padding a batch carries); ``last`` takes each example's last real
    position."""
    if mode == "cls":
        return h[:, 0]
    if mode == "mean":
        if mask is None:
            return h.mean(1)
        m = mask.unsqueeze(-1).to(h.dtype)  # (B, N, 1)
        return (h * m).sum(1) / m.sum(1).clamp_min(1.0)
    if mode == "last":
        if mask is None:
            return h[:, -1]
        last = (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(1)  # (B,): the last True
        return h[torch.arange(h.shape[0], device=h.device), last]  # (B, D)
    raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {mode!r}")


def pool_packed(h: torch.Tensor, segments: torch.Tensor, starts: torch.Tensor, mode: str) -> torch.Tensor:
    """Packed rows (R, M, D) -> (B, D) in batch order, B = len(starts): each example's CLS slot, its last
    position, or the mean of its own positions (CLS slot included, as ``pool`` over an unpacked row's mask)."""
    flat = h.reshape(-1, h.shape[-1])  # (R M, D)
    if mode == "cls":
        return flat[starts]  # (B, D)
    if mode not in ("mean", "last"):
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {mode!r}")
    owner = segments.reshape(-1)  # (R M,): 1..B, 0 = padding
    if mode == "last":  # each example's positions are contiguous: its last is the largest flat index it owns
        where = torch.arange(owner.shape[0], device=owner.device)  # (R M,)
        last = where.new_zeros(starts.shape[0] + 1).scatter_reduce_(0, owner, where, "amax")  # (B + 1,)
        return flat[last[1:]]  # (B, D)
    n, acc = starts.shape[0] + 1, torch.promote_types(h.dtype, torch.float32)  # sums in fp32 at least
    sums = flat.new_zeros(n, flat.shape[-1], dtype=acc).index_add_(0, owner, flat.to(acc))  # (B + 1, D)
    counts = flat.new_zeros(n, dtype=acc).index_add_(0, owner, torch.ones_like(owner, dtype=acc))  # (B + 1,)
    return (sums[1:] / counts[1:, None].clamp_min(1.0)).to(h.dtype)  # (B, D): row 0 gathered the padding


def scheduled_mixers(encoder: Encoder) -> list[nn.Module]:
    """The encoder's mixers with host-side bookkeeping per training call (the performer's feature redraws), told
    that the model around them advances it (``schedule_outside``): once per call, first, where the graph break it
    costs a compiled model splits nothing; in each layer it would split the model's graph in three there."""
    scheduled = [block.mixer for block in encoder.blocks if hasattr(block.mixer, "advance_schedule")]
    for mixer in scheduled:
        mixer.schedule_outside = True
    return scheduled


class Classifier(nn.Module):
    """Encoder + pooling + head. ``pair=True`` takes (B, 2, N) tokens and classifies the pair.
    ``padded=False`` promises that no token is 0 (pixel tasks): the padding mask is dropped, which lets the
    transformer use SDPA's unmasked kernels (faster than the masked ones); the outputs are the same.
    ``head``: "mlp" is LRA's Dense-ReLU-Dense of width ``d_hidden`` (a pair: 4D -> d_hidden -> d_hidden/2 -> C);
    "linear" one Linear from the pooled features to the classes (the S4 family's decoder; single sequences only)."""

    def __init__(self, encoder: Encoder, d_model: int, d_hidden: int, n_classes: int, pooling: str, pair: bool = False,
                 padded: bool = True, head: str = "mlp"):
        super().__init__()
        if pooling == "cls" and not encoder.cls_token:
            raise ValueError("pooling='cls' needs the encoder's CLS token (cls_token=true)")
        if head not in ("mlp", "linear"):
            raise ValueError(f"head must be 'mlp' or 'linear', got {head!r}")
        if head == "linear" and pair:
            raise ValueError("head='linear' is for single sequences: a pair task (retrieval) combines its two "
                             "documents through the MLP head (backbone.head=mlp)")
        self.encoder, self.pooling, self.pair, self.padded = encoder, pooling, pair, padded
        self.scheduled = scheduled_mixers(encoder)  # advanced once per training call (advance_schedules)
        if head == "linear":
            self.head = nn.Linear(d_model, n_classes)
        elif pair:
            self.head = nn.Sequential(
                nn.Linear(4 * d_model, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_hidden // 2), nn.ReLU(),
                nn.Linear(d_hidden // 2, n_classes),
            )
        else:
            self.head = nn.Sequential(nn.Linear(d_model, d_hidden), nn.ReLU(), nn.Linear(d_hidden, n_classes))

    @property
    def supports_packing(self) -> bool:
        return self.encoder.supports_segments

    @property
    def supports_trimming(self) -> bool:
        """Whether cutting appended padding leaves every real output unchanged (``trainer.trim``): every mixer but
        one that declares ``padding_invariant = False`` (local's strided groups depend on the length)."""
        return all(getattr(b.mixer, "padding_invariant", True) for b in self.encoder.blocks)

    @torch.compiler.disable  # host-side: its graph break falls at the start of the model's call
    def advance_schedules(self) -> None:
        for mixer in self.scheduled:
            mixer.advance_schedule()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h, mask = self.encoder(tokens, tokens != 0 if self.padded else None)
        return pool(h, mask, self.pooling)  # (B, D)

    def forward(self, tokens: torch.Tensor, segments: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, starts: torch.Tensor | None = None) -> torch.Tensor:
        """(B, N) ids, or (B, 2, N) pairs -> (B, C) logits; or a packed batch's four tensors (``lra.train.packing``;
        for a pair task its documents are the 2B examples, pair b being documents 2b and 2b + 1)."""
        if self.training and self.scheduled:
            self.advance_schedules()
        if segments is not None:
            h, _ = self.encoder(tokens, None, segments, positions)  # (R, M, D)
            z = pool_packed(h, segments, starts, self.pooling)  # (B or 2B, D)
        elif self.pair:
            B, two, N = tokens.shape
            z = self.embed(tokens.reshape(B * two, N))  # both towers in one pass: (2B, D)
        else:
            z = self.embed(tokens)  # (B, D)
        if not self.pair:
            return self.head(z)  # (B, C)
        z = z.view(-1, 2, z.shape[-1])  # (B, 2, D)
        u, v = z[:, 0], z[:, 1]
        return self.head(torch.cat([u, v, u * v, u - v], dim=-1))  # (B, C)


def build_classifier(model: str, model_options: dict, backbone, vocab_size: int, seq_len: int, n_classes: int,
                     pair: bool = False, padded: bool = True, grid: tuple[int, int] | None = None) -> Classifier:
    """The model a run or a benchmark trains: ``backbone`` is the task's ``backbone`` config section (with
    ``cls_token`` null meaning ``pooling == 'cls'``), ``model_options`` the model config without ``name``,
    ``padded`` whether any token may be 0 (see ``Classifier``), ``grid`` the (height, width) of an image task.
    Keys a backbone section may lack (one saved before they existed) take today's defaults."""
    b = SimpleNamespace(**{**backbone_defaults(), **backbone})
    cls_token = b.pooling == "cls" if b.cls_token is None else bool(b.cls_token)
    encoder = Encoder(
        model, model_options, vocab_size=vocab_size, seq_len=seq_len, n_layers=b.n_layers, d_model=b.d_model,
        n_heads=b.n_heads, d_qkv=b.d_qkv, d_ff=b.d_ff, dropout=b.dropout, attn_dropout=b.attn_dropout,
        positions=b.positions, cls_token=cls_token, grid=grid, norm=b.norm, prenorm=bool(b.prenorm), mlp=bool(b.mlp),
        embedding=b.embedding, pixel_mean=b.pixel_mean, pixel_std=b.pixel_std, tie_dropout=bool(b.tie_dropout),
        embedding_dropout=b.embedding_dropout,
    )
    return Classifier(encoder, b.d_model, b.d_classifier, n_classes, b.pooling, pair=pair, padded=padded,
                      head=b.head)
