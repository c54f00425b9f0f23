"""The stall baseline of a task: the validation accuracy of classifiers that cannot use its long-range structure.

A run whose best validation accuracy is no better than this (``lra.leaderboard``: within ``STALL_BAND`` of it) has
learned nothing a model without long-range structure could not, so the leaderboard counts it as stalled. Each
classifier is fit on the training split and scored on validation; the baseline is the highest of

* the majority share of the validation split (the prior: what a constant prediction scores);
* **bag of tokens**: a multinomial logistic regression on each example's token frequencies and its log length, no
  order at all; for image tasks the frequencies are a histogram of pixel values in ``PIXEL_BINS`` bins (adjacent
  grey levels pooled: pixels are ordinal, and 256 sparse bins overfit); fit by full-batch L-BFGS (a quasi-Newton
  gradient method) on standardised features, on at most ``MAX_TRAIN`` training examples;
* **first token**: the majority training class of each value of the first token (closed form). On ListOps the first
  token is the root operator, and this is the best any function of the root alone can do. It is here because the
  bag of tokens falls below the ListOps plateaus: the runs of ``results/runs.csv`` that end at 24.30 validation
  (23.15 test) predict exactly MIN -> 0, MAX -> 0, MED -> 5, SM -> 0 on every example, and those at 32.35 (31.80)
  exactly MAX -> 9, else 0: partial lookups of the root operator, which the tree below it never enters. Elsewhere
  the first token is a byte or a pixel and scores about the prior.

Which one gave the baseline is its ``how``. ``python -m lra.run`` records it in every row with accuracies
(``val_baseline``, beside ``val_majority``); ``python -m lra.baseline task=<task> [overrides]`` measures it on the
task's data as a run with the same overrides would load it and writes it to ``<results>/baselines.csv``, the table
the leaderboard applies to rows older than the column.

    python -m lra.baseline task=listops [key=value ...] [--results DIR]
"""
from __future__ import annotations

import csv
import io
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lra.data import TaskData
from lra.io import atomic_write_text

PIXEL_BINS = 32  # histogram bins of an image task's pixel values
MAX_TRAIN = 50_000  # training examples the bag of tokens is fit on: enough for its few hundred weights
LBFGS_ITERATIONS = 100
L2 = 1e-4  # keeps the weights finite where a tiny split is separable
SUBSET_SEED = 0
BASELINE_COLUMNS = ["task", "data", "split", "n_train", "n_val", "n_test", "val_majority", "val_bag_of_tokens",
                    "val_first_token", "val_baseline", "how", "seconds"]


@dataclass
class Baseline:
    """One task's measurement (accuracies as fractions, like a run row's); a row of ``baselines.csv``."""

    task: str
    data: str
    split: str
    n_train: int
    n_val: int
    n_test: int
    val_majority: float
    val_bag_of_tokens: float
    val_first_token: float
    val_baseline: float  # the highest of the three
    how: str  # which one it is
    seconds: float  # time to compute, the data already loaded


def token_counts(tokens: torch.Tensor, vocab_size: int, chunk: int = 4096) -> torch.Tensor:
    """(n, vocab_size) float counts of each id per example (pair tasks: both documents together)."""
    rows = tokens.reshape(len(tokens), -1)
    out = torch.empty(len(rows), vocab_size)
    for start in range(0, len(rows), chunk):
        ids = rows[start : start + chunk].long()  # (c, L); not in place below: .long() of int64 ids is no copy
        ids = ids + torch.arange(len(ids)).unsqueeze(1) * vocab_size  # each row its own range of bins
        out[start : start + len(ids)] = torch.bincount(ids.flatten(), minlength=len(ids) * vocab_size).view(
            len(ids), vocab_size).float()
    return out


def bag_of_tokens(tokens: torch.Tensor, vocab_size: int, image: bool) -> torch.Tensor:
    """(n, features): frequencies of the non-pad ids (binned pixel values for images), then the log length."""
    counts = token_counts(tokens, vocab_size)[:, 1:]  # id 0 is padding
    length = counts.sum(1, keepdim=True)
    if image and counts.shape[1] > PIXEL_BINS:
        bins = torch.arange(counts.shape[1]) * PIXEL_BINS // counts.shape[1]  # adjacent grey levels together
        counts = torch.zeros(len(counts), PIXEL_BINS).index_add_(1, bins, counts)
    return torch.cat([counts / length.clamp(min=1), torch.log1p(length)], 1)


def logistic_regression(x: torch.Tensor, y: torch.Tensor, n_classes: int):
    """A fitted multinomial logistic regression, as a function from features to predicted classes."""
    mean, std = x.mean(0), x.std(0).nan_to_num(0).clamp(min=1e-6)
    z = torch.cat([(x - mean) / std, torch.ones(len(x), 1)], 1)  # standardised, then a bias column
    target = torch.nn.functional.one_hot(y, n_classes).float()
    w = torch.zeros(n_classes, z.shape[1])
    w.grad = torch.zeros_like(w)
    opt = torch.optim.LBFGS([w], max_iter=LBFGS_ITERATIONS, history_size=20, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:  # cross-entropy and its gradient by hand: no autograd graph over the features
        logits = z @ w.T  # (n, classes)
        p = logits.softmax(1)
        value = (logits.logsumexp(1) - (logits * target).sum(1)).mean() + L2 * w.square().sum()
        w.grad = (p - target).T @ z / len(z) + 2 * L2 * w  # (classes, features)
        return value

    opt.step(loss)
    return lambda features: (torch.cat([(features - mean) / std, torch.ones(len(features), 1)], 1) @ w.T).argmax(1)


def first_token_lookup(train_first: torch.Tensor, y: torch.Tensor, n_classes: int):
    """The majority training class of each first-token value (the overall majority for a value never seen)."""
    size = int(train_first.max()) + 1
    table = torch.zeros(size, n_classes).index_put_((train_first, y), torch.ones(len(y)), accumulate=True)
    prior = int(torch.bincount(y, minlength=n_classes).argmax())
    best = torch.where(table.sum(1) > 0, table.argmax(1), prior)
    return lambda first: torch.where(first < size, best[first.clamp(max=size - 1)], prior)


def _first(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.reshape(len(tokens), -1)[:, 0].long()


def accuracy(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    return (predicted == labels).sum().item() / max(len(labels), 1)  # exact: equal scores compare equal


def majority_share(labels: torch.Tensor, n_classes: int) -> float:
    """The share of the most frequent class: what a constant prediction scores."""
    return torch.bincount(labels, minlength=n_classes).max().item() / max(len(labels), 1)


def measure(data: TaskData) -> Baseline:
    """The stall baseline of ``data`` (fit on its training split, scored on validation)."""
    start = time.perf_counter()
    train, val, image = data.train, data.val, data.grid is not None
    if len(train) > MAX_TRAIN:  # a seeded subset: the same examples every time
        pick = torch.randperm(len(train), generator=torch.Generator().manual_seed(SUBSET_SEED))[:MAX_TRAIN]
        train = type(train)(train.tokens[pick], train.labels[pick])
    y = train.labels.long()
    predict = logistic_regression(bag_of_tokens(train.tokens, data.vocab_size, image), y, data.n_classes)
    bag = accuracy(predict(bag_of_tokens(val.tokens, data.vocab_size, image)), val.labels)
    lookup = first_token_lookup(_first(data.train.tokens), data.train.labels.long(), data.n_classes)
    first = accuracy(lookup(_first(val.tokens)), val.labels)
    majority = majority_share(val.labels, data.n_classes)
    # on a tie the simplest explanation: max keeps the first of equal values
    value, how = max([(majority, "majority class"), (first, "first token"), (bag, "bag of tokens")], key=lambda c: c[0])
    info = data.info
    return Baseline(task=str(info.get("task", "")), data=str(info.get("data", info.get("source", ""))),
                    split=str(info.get("split", "")), n_train=len(data.train), n_val=len(val), n_test=len(data.test),
                    val_majority=majority, val_bag_of_tokens=bag, val_first_token=first, val_baseline=value, how=how,
                    seconds=time.perf_counter() - start)


def write_baseline(path: Path, row: Baseline) -> None:
    """``row`` into the table at ``path``, replacing the task's earlier row (one per task)."""
    rows = []
    if path.exists():
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["task"] != row.task]
    values = {k: f"{v:.4f}" if isinstance(v, float) and k != "seconds" else f"{v:.1f}" if k == "seconds" else v
              for k, v in asdict(row).items()}
    rows = sorted([*rows, values], key=lambda r: r["task"])
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=BASELINE_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())
