"""Self-pretraining on the task's own training split (``pretrain=mlm|causal``; Amos, Berant and Gupta 2024, "Never
Train from Scratch", arXiv 2310.02980): the objective's inputs and targets, the encoder with a token head, and the
config of the pretraining phase. The runner (``lra.train.run``) trains the phase with its own loop and step, then the
task's classifier from the encoder's weights (its head freshly initialised).

Targets are token ids, one per output position of the encoder (B, N'), N' = N + 1 with a CLS slot, ``IGNORE`` where
nothing is predicted: the engine's cross-entropy (``engine.classification_loss``, torch's default ``ignore_index``)
then averages over the predicted tokens only.

* ``mlm``: each real token (never padding, never the CLS slot) is masked with chance ``pretrain.mask_rate``,
  independently, and at least one per example; a masked token's embedding is replaced by a learned mask vector (its
  content is gone, its position embedding stays) and the token head predicts its id there. Rows of a pair task
  (Retrieval) are its documents, each masked alone.
* ``causal``: the mixers run in their causal form (``supports_causal``, models/base.py) and each output position
  predicts the next token: output p predicts token p with a CLS slot (the slot is output 0), token p + 1 without.
  Padding is never a target.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from lra.provenance import config_hash
from lra.train.encoder import Encoder, scheduled_mixers

IGNORE = -100  # the target of a position that predicts nothing: F.cross_entropy's default ignore_index
# The mask draw of pretraining step s is a generator seeded with seed * 1_000_003 + s + MASK_STREAM: a function of
# (seed, step), so a resumed run masks as the uninterrupted one, and apart from BatchOrder's seeds (seed * 1_000_003
# + epoch) while epochs number fewer than 2^40.
MASK_STREAM = 2**40
FOLDER = "pretrain"  # the pretraining phase's folder inside the run's
ENCODER = "encoder.pt"  # the pretrained encoder's weights, in that folder, written when the phase ends ok


def pretraining(cfg: DictConfig) -> bool:
    return cfg.pretrain.objective != "none"


def pretraining_config(cfg: DictConfig) -> DictConfig:
    """The config the pretraining phase runs: the run's (resolved), with the pretraining's schedule
    (``pretrain.steps``, ``lr``, ``warmup_steps``, ``stop_at``; null: the task's) as ``schedule.*`` and ``optim.*``,
    unpacked and untrimmed batches, and its own folder, ``<run_dir>/pretrain``. Its config hash names the pretraining
    in the row (``pretrain_hash``)."""
    pre = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    p = pre.pretrain
    with open_dict(pre):
        pre.schedule.steps = p.steps if p.steps is not None else pre.schedule.steps
        pre.schedule.stop_at = p.stop_at
        pre.optim.lr = p.lr if p.lr is not None else pre.optim.lr
        pre.optim.warmup_steps = p.warmup_steps if p.warmup_steps is not None else pre.optim.warmup_steps
        pre.trainer.pack, pre.trainer.trim = "false", False  # rows of one example each, cut nowhere
        pre.run_dir = str(Path(pre.run_dir) / FOLDER)
    return pre


def pretrain_hash(cfg: DictConfig) -> str | None:
    """The config hash of the run's pretraining phase (``pretraining_config``); None without pretraining."""
    if not pretraining(cfg):
        return None
    anywhere = copy.deepcopy(cfg)  # the folder names no setting (``run_dir`` is not hashed): none to resolve here
    with open_dict(anywhere):
        anywhere.run_dir = "."
    return config_hash(OmegaConf.to_container(pretraining_config(anywhere), resolve=True))


def mask_noise(seed: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Uniform [0, 1) draws of pretraining step ``step`` (``MASK_STREAM``), on the CPU."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed * 1_000_003 + step + MASK_STREAM))


def masked_positions(tokens: torch.Tensor, rate: float, noise: torch.Tensor) -> torch.Tensor:
    """(B, N) ids and (B, N) uniform draws -> (B, N) bool: the real tokens whose draw is below ``rate``; an example
    with a real token and none below it masks its real token of the lowest draw, so every example predicts one."""
    real = tokens != 0  # (B, N)
    masked = (noise < rate) & real
    none = real.any(-1) & ~masked.any(-1)  # (B,)
    lowest = noise.masked_fill(~real, 2.0).argmin(-1)  # (B,): the real token of the lowest draw
    masked[none, lowest[none]] = True
    return masked


def at_outputs(targets: torch.Tensor, cls_token: bool) -> torch.Tensor:
    """(B, N) targets of the token positions -> (B, N') targets of the encoder's outputs (the CLS slot's IGNORE)."""
    return torch.cat([targets.new_full((targets.shape[0], 1), IGNORE), targets], 1) if cls_token else targets


def masked_targets(tokens: torch.Tensor, masked: torch.Tensor, cls_token: bool) -> torch.Tensor:
    """(B, N) ids and masked positions -> (B, N') int64 targets: the id where masked, else IGNORE."""
    return at_outputs(torch.where(masked, tokens.long(), IGNORE), cls_token)


def next_token_targets(tokens: torch.Tensor, cls_token: bool) -> torch.Tensor:
    """(B, N) ids -> (B, N') int64 targets: output p's is token p with a CLS slot (p = 0 the slot), token p + 1
    without; IGNORE past the last token and at padding."""
    ids = tokens.long() if cls_token else tokens.long()[:, 1:]  # (B, N') or (B, N - 1): the next token of each output
    ids = torch.cat([ids, ids.new_zeros(ids.shape[0], 1)], 1)  # (B, N'): the last output has none
    return ids.masked_fill(ids == 0, IGNORE)


def objective_batch(objective: str, tokens: torch.Tensor, cls_token: bool, rate: float | None = None,
                    noise: torch.Tensor | None = None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A batch of (B, N) ids -> (the TokenModel's inputs, the (B N',) targets), on the CPU."""
    if objective == "mlm":
        masked = masked_positions(tokens, rate, noise)
        return (tokens, masked), masked_targets(tokens, masked, cls_token).flatten()
    if objective == "causal":
        return (tokens,), next_token_targets(tokens, cls_token).flatten()
    raise ValueError(f"pretrain.objective must be mlm or causal, got {objective!r}")


class TokenModel(nn.Module):
    """The task's encoder with a token head in place of pooling and the classifier's head: (B, N) ids and, for mlm,
    the (B, N) positions to mask -> (B N', V) logits of each output position's target token. The encoder is the
    classifier's (``Classifier.encoder``): its weights are what the task's training starts from."""

    def __init__(self, encoder: Encoder, d_model: int, vocab_size: int, objective: str, padded: bool = True):
        super().__init__()
        self.encoder, self.objective, self.padded = encoder, objective, padded
        self.scheduled = scheduled_mixers(encoder)
        # mlm: what a masked position holds instead of its token's embedding (the position embedding is added after)
        self.mask_vector = nn.Parameter(torch.zeros(d_model)) if objective == "mlm" else None
        self.head = nn.Linear(d_model, vocab_size)
        if objective == "causal":
            encoder.set_causal(True)

    @torch.compiler.disable  # host-side: its graph break falls at the start of the model's call
    def advance_schedules(self) -> None:
        for mixer in self.scheduled:
            mixer.advance_schedule()

    def forward(self, tokens: torch.Tensor, masked: torch.Tensor | None = None) -> torch.Tensor:
        if self.training and self.scheduled:
            self.advance_schedules()
        x = self.encoder.embed_tokens(tokens)  # (B, N, D)
        if masked is not None:
            x = torch.where(masked.unsqueeze(-1), self.mask_vector.to(x.dtype), x)  # (B, N, D)
        h, _ = self.encoder.encode(x, tokens != 0 if self.padded else None)  # (B, N', D)
        return self.head(h).flatten(0, 1)  # (B N', V)


class TokenLoss:
    """The engine's cross-entropy over the predicted tokens (``engine.classification_loss``), counting on the
    device, without a synchronisation, how many of them the logits' argmax got right: the curve's ``token_acc``."""

    def __init__(self, loss, device: torch.device):
        self.loss = loss
        self.correct = torch.zeros((), dtype=torch.long, device=device)
        self.count = torch.zeros((), dtype=torch.long, device=device)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            predicted = targets != IGNORE
            self.correct += ((logits.argmax(-1) == targets) & predicted).sum()
            self.count += predicted.sum()
        return self.loss(logits, targets)

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(correct, predicted) since the last take, and zero for the next."""
        counts = self.correct.clone(), self.count.clone()
        self.correct.zero_()
        self.count.zero_()
        return counts


def encoder_weights(state: dict) -> dict:
    """A TokenModel's state dict -> its encoder's (the ``encoder.`` entries, without the prefix): nothing of the
    token head or the mask vector."""
    return {k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")}
