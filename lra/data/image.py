"""Image: CIFAR-10 (Krizhevsky, 2009, "Learning Multiple Layers of Features from Tiny Images") as a sequence
of 1,024 grayscale pixels, LRA's ``image`` task on ``cifar10`` (Tay et al. 2021, arXiv 2011.04006; preprocessing
as ``lra_benchmarks/image/input_pipeline.py`` in github.com/google-research/long-range-arena).

Grayscale exactly as TF ``rgb_to_grayscale`` (what LRA used): in float32, g = (0.2989 R + 0.5870 G +
0.1140 B) / 255, back to uint8 as truncate(g * 255.5). PIL ``convert("L")`` / torchvision rounds with
299/587/114 per mille and differs by one level on some pixels (pure green: 150 vs 149). Row-major 32x32.

Ids: pixel 0 is black, not padding, so ids are pixel + 1 (vocab 257). ``data.pixel_zero_is_pad: true``
reproduces LRA, which fed raw pixels and so masked black pixels as padding (vocab 256).

Splits: LRA took TFDS ``train[:90%]`` / ``train[90%:]`` / ``test`` in TFDS's own order, which only TFDS
reproduces; we split the 50,000 training images 45,000 / 5,000 like ``torch.utils.data.random_split``
with ``data.split_seed`` (42, the S4 / Mega convention). Membership depends on the source's row order
(the hub copy keeps the original order; a local copy sorted by label splits otherwise). Test = test.
Sources (``data.path``): ``uoft-cs/cifar10`` on the hub, or a local folder / template of its parquet files. One
parquet file of its columns (``img`` or ``image``, ``label``) alone is an evaluation's data (``read_file``).
"""
from __future__ import annotations

import io
import logging
from functools import partial
from pathlib import Path

import numpy as np
import torch

from lra.errors import DataError

from . import register_task
from .common import (
    Split,
    TaskData,
    cached,
    hf_tables,
    limit_recipe,
    one_file,
    parallel_map,
    pixel_tokens,
    random_split_indices,
    read_parquet,
    split_limits,
    subset_indices,
)

log = logging.getLogger("lra.data")

SIDE = 32
N_CLASSES = 10
TF_GRAY = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)  # tf.image.rgb_to_grayscale weights
HOW_TO_GET = ("set data.path to a Hugging Face id (uoft-cs/cifar10, needs the hub or its cache) or to a local "
              "copy of its parquet files (huggingface-cli download uoft-cs/cifar10 --repo-type dataset "
              "--local-dir DIR)")


def tf_grayscale(rgb: np.ndarray) -> np.ndarray:
    """(..., 3) uint8 -> (...) uint8, the float32 arithmetic of TF's rgb_to_grayscale + convert_image_dtype."""
    scaled = rgb.astype(np.float32) * np.float32(1.0 / 255.0)  # convert_image_dtype(uint8 -> float32)
    gray = scaled @ TF_GRAY  # (...,)
    return (gray * np.float32(255.5)).astype(np.uint8)  # float -> uint8 scales by max + 0.5 and truncates


def decode_gray(items: list, side: int) -> list:
    """Image cells (``{bytes, path}`` structs as the hub stores them) -> (side * side,) uint8 gray rows."""
    from PIL import Image  # PIL only where images are decoded: lra.data loads at every command's start

    out = []
    for item in items:
        data = item.get("bytes") if isinstance(item, dict) else item
        src = io.BytesIO(data) if data else item.get("path")
        with Image.open(src) as im:
            rgb = np.asarray(im.convert("RGB"))
        if rgb.shape != (side, side, 3):
            raise DataError(f"expected {side}x{side} images, got {rgb.shape[1]}x{rgb.shape[0]}")
        out.append(tf_grayscale(rgb).reshape(-1))
    return out


def columns(table, split: str) -> tuple[list, torch.Tensor]:
    img = next((c for c in ("img", "image") if c in table.column_names), None)
    if img is None or "label" not in table.column_names:
        raise DataError(f"the CIFAR-10 {split} split needs an 'img' (or 'image') and a 'label' column, "
                        f"has {table.column_names}")
    labels = torch.tensor(table.column("label").to_pylist(), dtype=torch.long)
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"CIFAR-10 {split} labels must be 0-9, found {labels.min().item()}..{labels.max().item()}")
    return table.column(img), labels


def check(task) -> None:
    if int(task.seq_len) != SIDE * SIDE:
        raise ValueError(f"CIFAR-10 images are {SIDE}x{SIDE} = {SIDE * SIDE} pixels; set task.seq_len={SIDE * SIDE}")


def gray_pixels(img, workers: int | None) -> torch.Tensor:
    """An image column's cells as (n, 1024) uint8 gray rows, decoded in processes."""
    gray = parallel_map(partial(decode_gray, side=SIDE), img.to_pylist(), workers)
    return torch.from_numpy(np.stack(gray)) if gray else torch.zeros(0, SIDE * SIDE, dtype=torch.uint8)


def read_file(path: Path, task, data) -> TaskData:
    """One parquet file of the hub's columns (``img`` or ``image``, ``label``), e.g. its ``test-00000-of-00001``."""
    img, labels = columns(read_parquet(path, HOW_TO_GET), str(path))
    tokens, vocab = pixel_tokens(gray_pixels(img, data.get("workers")), bool(data.pixel_zero_is_pad))
    return one_file(path, Split(tokens, labels), vocab_size=vocab, n_classes=N_CLASSES, seq_len=SIDE * SIDE,
                    grid=(SIDE, SIDE))


@register_task("image", n_classes=N_CLASSES, image=True, check=check, read_file=read_file)
def load(task, data, *, seed: int, progress: bool) -> TaskData:
    limits, split_seed, zero_is_pad = split_limits(data), int(data.split_seed), bool(data.pixel_zero_is_pad)
    if not data.get("path"):
        raise DataError(f"data.path is not set; {HOW_TO_GET}")
    tables, source_fp, desc = hf_tables(str(data.path), ("train", "test"), HOW_TO_GET)
    (train_img, train_lab), (test_img, test_lab) = columns(tables["train"], "train"), columns(tables["test"], "test")
    n_val = len(train_lab) // 10  # LRA: train[90%:]
    parts = random_split_indices(len(train_lab), [len(train_lab) - n_val, n_val], split_seed)
    rows = {"train": (train_img, train_lab, parts[0]), "val": (train_img, train_lab, parts[1]),
            "test": (test_img, test_lab, torch.arange(len(test_lab)))}
    spec = {"task": "image", "version": 1, "source": source_fp, "split_seed": split_seed, "limits": limits,
            "seed": seed if any(v is not None for v in limits.values()) else None}

    def build() -> dict:
        out = {}
        for s, (img, lab, idx) in rows.items():
            idx = idx[subset_indices(len(idx), limits[s], seed, s)]
            out[f"{s}_pixels"] = gray_pixels(img.take(idx.numpy()), data.get("workers"))  # (n, 1024)
            out[f"{s}_labels"] = lab[idx].clone()
        return out

    tensors, hit = cached(data.cache_dir, "image", spec, build)
    splits = {}
    for s in rows:
        tokens, vocab = pixel_tokens(tensors[f"{s}_pixels"], zero_is_pad)
        splits[s] = Split(tokens, tensors[f"{s}_labels"])
    recipe = (f"train/val = random_split(train, [{len(parts[0])}, {len(parts[1])}], seed {split_seed}), "
              f"test = test" + limit_recipe(limits, seed))
    out = TaskData(**splits, vocab_size=vocab, n_classes=N_CLASSES, seq_len=SIDE * SIDE, grid=(SIDE, SIDE),
                   info={"task": task.name, "source": desc, "cache": "hit" if hit else "miss", "skipped": 0,
                         "split": recipe, "pixels": "raw, 0 = pad (LRA quirk)" if zero_is_pad else "pixel + 1"})
    log.info("image: %s, %s, cache %s", desc, recipe, out.info["cache"])
    return out
