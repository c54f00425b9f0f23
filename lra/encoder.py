"""The one encoder every model shares, so that models differ only in their token mixer.

Token embedding + position embedding (learned or sinusoidal) -> optional CLS slot -> ``n_layers``
pre-LayerNorm blocks ``x + Drop(Mixer(LN x))``, ``x + MLP(LN x)`` with a GELU MLP -> final LayerNorm ->
pooling (CLS or masked mean) -> Dense-ReLU-Dense head (LRA's ``classifier_head``).

A pair task (retrieval) encodes both documents with the same encoder and classifies
``[u, v, u*v, u-v]`` (LRA paper App. A.1.3): the mixer never knows it is looking at a pair.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from models import create_model
from models.registry import Grid, get_model_class


def sinusoidal_positions(n: int, d: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    table = torch.zeros(n, d)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq[: d // 2])
    return table  # (n, d)


class Block(nn.Module):
    def __init__(self, mixer: nn.Module, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.norm1, self.mixer = nn.LayerNorm(d_model), mixer
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model), nn.Dropout(dropout)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, **mixer_inputs) -> torch.Tensor:
        x = x + self.drop(self.mixer(self.norm1(x), mask, **mixer_inputs))
        return x + self.mlp(self.norm2(x))


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
    ):
        super().__init__()
        if positions not in ("learned", "sinusoidal"):
            raise ValueError(f"positions must be 'learned' or 'sinusoidal', got {positions!r}")
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
        self.embed = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embed.weight, std=1.0)  # LRA: N(0, 1), no sqrt(d) scaling
        if positions == "learned":
            self.pos = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        else:
            self.register_buffer("pos", sinusoidal_positions(max_len, d_model), persistent=False)
        if cls_token:
            self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.drop = nn.Dropout(dropout)
        backbone = dict(d_model=d_model, n_heads=n_heads, d_qkv=d_qkv, dropout=attn_dropout, max_len=max_len)
        self.blocks = nn.ModuleList(
            Block(create_model(model, **backbone, **model_options), d_model, d_ff, dropout) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        # a registered mixer need not subclass MultiHeadMixer: without the attribute it gets a mask
        self.mixers_accept_no_mask = all(getattr(block.mixer, "accepts_no_mask", False) for block in self.blocks)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        B = tokens.shape[0]
        if mask is None and not self.mixers_accept_no_mask:
            mask = torch.ones_like(tokens, dtype=torch.bool)  # (B, N)
        x = self.embed(tokens)  # (B, N, D)
        if self.cls_token:
            x = torch.cat([self.cls.expand(B, -1, -1), x], dim=1)  # (B, N + 1, D)
            if mask is not None:
                mask = torch.cat([mask.new_ones(B, 1), mask], dim=1)  # (B, N + 1)
        x = self.drop(x + self.pos[: x.shape[1]])
        for block in self.blocks:
            x = block(x, mask, **self.mixer_inputs)
        return self.norm(x), mask


def pool(h: torch.Tensor, mask: torch.Tensor | None, mode: str) -> torch.Tensor:
    """(B, N, D) -> (B, D). ``mean`` averages real tokens only (LRA averaged the padding in too, which
    makes the prediction depend on how much padding a batch carries)."""
    if mode == "cls":
        return h[:, 0]
    if mode == "mean" and mask is None:
        return h.mean(1)
    if mode == "mean":
        m = mask.unsqueeze(-1).to(h.dtype)  # (B, N, 1)
        return (h * m).sum(1) / m.sum(1).clamp_min(1.0)
    raise ValueError(f"pooling must be 'cls' or 'mean', got {mode!r}")


class Classifier(nn.Module):
    """Encoder + pooling + head. ``pair=True`` takes (B, 2, N) tokens and classifies the pair.
    ``padded=False`` promises that no token is 0 (pixel tasks): the padding mask is dropped, which lets the
    transformer use SDPA's unmasked kernels (about 30% faster per layer); the outputs are the same."""

    def __init__(self, encoder: Encoder, d_model: int, d_hidden: int, n_classes: int, pooling: str, pair: bool = False,
                 padded: bool = True):
        super().__init__()
        if pooling == "cls" and not encoder.cls_token:
            raise ValueError("pooling='cls' needs the encoder's CLS token (cls_token=true)")
        self.encoder, self.pooling, self.pair, self.padded = encoder, pooling, pair, padded
        if pair:
            self.head = nn.Sequential(
                nn.Linear(4 * d_model, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_hidden // 2), nn.ReLU(),
                nn.Linear(d_hidden // 2, n_classes),
            )
        else:
            self.head = nn.Sequential(nn.Linear(d_model, d_hidden), nn.ReLU(), nn.Linear(d_hidden, n_classes))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h, mask = self.encoder(tokens, tokens != 0 if self.padded else None)
        return pool(h, mask, self.pooling)  # (B, D)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.pair:
            return self.head(self.embed(tokens))  # (B, C)
        B, two, N = tokens.shape
        z = self.embed(tokens.reshape(B * two, N)).view(B, two, -1)  # both towers in one pass: (B, 2, D)
        u, v = z[:, 0], z[:, 1]
        return self.head(torch.cat([u, v, u * v, u - v], dim=-1))  # (B, C)


def build_classifier(model: str, model_options: dict, backbone, vocab_size: int, seq_len: int, n_classes: int,
                     pair: bool = False, padded: bool = True, grid: tuple[int, int] | None = None) -> Classifier:
    """The model a run or a benchmark trains: ``backbone`` is the task's ``backbone`` config section (with
    ``cls_token`` null meaning ``pooling == 'cls'``), ``model_options`` the model config without ``name``,
    ``padded`` whether any token may be 0 (see ``Classifier``), ``grid`` the (height, width) of an image task."""
    b = backbone
    cls_token = b.pooling == "cls" if b.get("cls_token") is None else bool(b.cls_token)
    encoder = Encoder(
        model, model_options, vocab_size=vocab_size, seq_len=seq_len, n_layers=b.n_layers, d_model=b.d_model,
        n_heads=b.n_heads, d_qkv=b.d_qkv, d_ff=b.d_ff, dropout=b.dropout, attn_dropout=b.attn_dropout,
        positions=b.get("positions", "learned"), cls_token=cls_token, grid=grid,
    )
    return Classifier(encoder, b.d_model, b.d_classifier, n_classes, b.pooling, pair=pair, padded=padded)
