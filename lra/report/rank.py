"""Ranks with confidence: each model's rank on a task (or an average of tasks), its interval, and the group of
models not distinguishable from the best, by a bootstrap over seeds and test examples.

Per-example predictions are not stored, so the bootstrap is parametric, and equivalent to resampling test examples
for an accuracy: in each of ``N_BOOT`` replicates a cell's seeds (its selected ``ok`` runs) are drawn with
replacement, as many as it has, and each drawn seed's test accuracy ``a`` is replaced by ``Binomial(n_test, a) /
n_test``, the spread of an accuracy measured on ``n_test`` examples; the cell's value is their mean. A cell of one
seed varies by that test-set noise alone (its note says so): its interval is narrower than the spread another seed
would show. An average's replicate is the mean of its tasks' replicates, so it carries every task's seeds.

In each replicate the models (those with a value, within one experiment) are ranked, 1 = best, ties sharing the
better rank. ``rank`` is the rank of the observed values; ``rank_lo``, ``rank_hi`` the 2.5th and 97.5th percentiles
of the replicates' ranks; ``p_best`` the share of replicates in which the model ranks first; the **best group** is
the models with ``p_best >= BEST_P`` (2.5 %): those the data cannot tell apart from the best at that level.
``test_lo``, ``test_hi`` are the percentiles of the value itself.

Reproducible: each (experiment, model, task) cell draws from its own generator, seeded by ``SEED`` and the cell's
name, so a cell's replicates do not change when models are added or removed.
"""
from __future__ import annotations

import zlib

import numpy as np
import pandas as pd

N_BOOT = 2000
SEED = 0
LEVEL = (2.5, 97.5)  # percentiles of the intervals
BEST_P = 0.025  # the least chance of ranking first that keeps a model in the best group
RANK_COLUMNS = ["test_lo", "test_hi", "rank", "rank_lo", "rank_hi", "p_best", "best_group"]


def replicates(accuracies, n_test: int, name: str, n_boot: int = N_BOOT) -> np.ndarray:
    """(n_boot,) bootstrap values of the mean of ``accuracies`` (one per seed, %) measured on ``n_test`` examples."""
    acc = np.asarray(accuracies, dtype=float) / 100
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    seeds = acc[rng.integers(0, len(acc), size=(n_boot, len(acc)))]  # (n_boot, seeds), drawn with replacement
    return 100 * (rng.binomial(n_test, seeds) / n_test).mean(1)


def ranks_of(values: np.ndarray) -> np.ndarray:
    """Ranks along the last axis, 1 = highest; equal values share the better rank."""
    return 1 + (values[..., None, :] > values[..., :, None]).sum(-1)


def rank_table(observed: pd.Series, draws: dict[str, np.ndarray]) -> pd.DataFrame:
    """Per model (``observed``: model -> value; ``draws``: model -> its replicates), the columns ``RANK_COLUMNS``."""
    models = list(observed.index)
    if not models:
        return pd.DataFrame(columns=RANK_COLUMNS)
    boot = np.stack([draws[m] for m in models], axis=1)  # (n_boot, models)
    ranks = ranks_of(boot)
    p_best = (ranks == 1).mean(0)
    return pd.DataFrame({
        "test_lo": np.percentile(boot, LEVEL[0], axis=0), "test_hi": np.percentile(boot, LEVEL[1], axis=0),
        "rank": ranks_of(observed.to_numpy(dtype=float)),
        "rank_lo": np.percentile(ranks, LEVEL[0], axis=0, method="lower").astype(int),
        "rank_hi": np.percentile(ranks, LEVEL[1], axis=0, method="higher").astype(int),
        "p_best": p_best, "best_group": p_best >= BEST_P}, index=models)
