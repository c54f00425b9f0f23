"""Pathfinder and Path-X (Linsley et al., 2018, "Learning long-range spatial dependencies with horizontal
gated recurrent units", arXiv 1805.08315): are the two dots joined by one dashed contour? LRA's ``image``
task on ``pathfinder32_hard`` / ``pathfinder128_hard`` (Tay et al. 2021, arXiv 2011.04006; preprocessing as
``get_pathfinder_base_datasets`` in ``lra_benchmarks/image/input_pipeline.py`` of
github.com/google-research/long-range-arena, the files as its ``lra_release`` archive holds them).

Reads the ``lra_release`` layout: ``pathfinder{res}/{folder}/metadata/<k>.npy`` (plain text, one line per
image: ``imgs/<k> sample_<i>.png <i> <label> ...``) and ``imgs/<k>/sample_<i>.png`` (8-bit gray), with
``folder`` = ``curv_baseline`` (easy), ``curv_contour_length_9`` (intermediate) or
``curv_contour_length_14`` (hard). When ``data.root`` is null the images are generated into the cache
by ``lra.data.pathfinder_gen`` (only as many as ``data.limit`` needs).

Order and split (S4 / S5 / Mega convention): metadata files sorted by integer stem, lines in file order,
empty or missing images dropped (LRA drops zero-length files; S4 blacklists the one known empty file),
then val = int(0.1 n), test = int(0.1 n), train = the rest, as ``torch.utils.data.random_split`` with
``data.split_seed`` (42). LRA sliced TFDS's order 80/10/10 instead. A non-empty image PIL cannot read is
dropped from its split and counted. Pixels are decoded once (in processes) into one uint8 cache file.

Ids: pixel + 1 (vocab 257) because 0 is the black background, not padding; ``data.pixel_zero_is_pad:
true`` feeds raw pixels as LRA did, which masks the whole background as padding (vocab 256).

One metadata file alone (``<folder>/metadata/<k>.npy``, its images under ``<folder>/imgs/``) is an evaluation's
data (``read_file``): every image it lists.
"""
from __future__ import annotations

import json
import logging
import math
from functools import partial
from pathlib import Path

import numpy as np
import torch

from lra.errors import DataError

from . import register_task
from .common import (
    SPLITS,
    Split,
    TaskData,
    cached,
    digest_files,
    fingerprint,
    generate_once,
    limit_recipe,
    one_file,
    parallel_map,
    pixel_tokens,
    random_split_indices,
    resolve_root,
    split_limits,
    subset_indices,
)

log = logging.getLogger("lra.data")

FOLDERS = {"easy": "curv_baseline", "intermediate": "curv_contour_length_9", "hard": "curv_contour_length_14"}
RESOLUTIONS = (32, 64, 128, 256)
N_CLASSES = 2


def how_to_get(res: int, difficulty: str) -> str:
    return (f"unpack the LRA release (https://storage.googleapis.com/long-range-arena/lra_release.gz) and set "
            f"data.root to it, or generate the images: python -m lra.generate pathfinder --resolution {res} "
            f"--difficulty {difficulty} --n 200000 --out DIR, then data.root=DIR (data.root=null generates "
            f"into the cache)")


def read_metadata(folder: Path) -> tuple[list[str], list[int], list[Path]]:
    """Image paths relative to ``folder`` and labels in the conventional order (files by integer stem,
    lines in file order), and the metadata files themselves."""
    meta = folder / "metadata"
    files = [p for p in meta.glob("*.npy") if p.stem.isdigit()] if meta.is_dir() else []
    if not files:
        raise DataError(f"no metadata/<k>.npy files in {folder}")
    files.sort(key=lambda p: int(p.stem))
    paths, labels = [], []
    for f in files:
        for path, label in metadata_lines(f):
            paths.append(path)
            labels.append(label)
    return paths, labels, files


def metadata_lines(file: Path) -> list[tuple[str, int]]:
    """One metadata file's (image path relative to its folder, label) per line, in order."""
    out = []
    for lineno, line in enumerate(file.read_text().splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) < 4 or not fields[3].lstrip("-").isdigit() or int(fields[3]) not in (0, 1):
            raise DataError(f"{file}:{lineno}: expected 'imgs/<k> sample_<i>.png <i> <label 0|1> ...', "
                            f"got {line[:80]!r}")
        out.append((f"{fields[0]}/{fields[1]}", int(fields[3])))
    return out


def decode_pngs(paths: list[str], side: int) -> list:
    """PNG paths -> (side * side,) uint8 rows; None for a file PIL cannot read."""
    from PIL import Image  # PIL only where images are decoded: lra.data loads at every command's start

    out = []
    for p in paths:
        try:
            with Image.open(p) as im:
                px = np.asarray(im if im.mode == "L" else im.convert("L"))
        except (OSError, SyntaxError, ValueError):  # PIL's errors for truncated / corrupt files
            out.append(None)
            continue
        if px.shape != (side, side):
            raise DataError(f"{p} is {px.shape[1]}x{px.shape[0]}, expected {side}x{side} (task.resolution)")
        out.append(px.reshape(-1))
    return out


def images_needed(limits: dict, full: int) -> int:
    """The smallest n whose 80/10/10 split covers every limit (all of ``full`` when any split is unlimited)."""
    if any(v is None for v in limits.values()):
        return full
    n = max(math.ceil(limits["train"] / 0.8), 10 * limits["val"], 10 * limits["test"], 10)
    while n - 2 * int(0.1 * n) < limits["train"] or int(0.1 * n) < max(limits["val"], limits["test"]):
        n += 1
    return min(n, full)


def generated_folder(data, res: int, difficulty: str, limits: dict, progress: bool) -> Path:
    """Generate into the cache (once, whatever the number of concurrent runs) and return the difficulty folder."""
    from . import pathfinder_gen  # the generator (and PIL) only where images are generated: as PIL above

    n, seed, version = images_needed(limits, int(data.generate.n)), int(data.generate.seed), \
        pathfinder_gen.GENERATOR_VERSION
    out = Path(data.cache_dir).expanduser() / "pathfinder_gen" / f"{res}px-{difficulty}-n{n}-seed{seed}-v{version}"

    def run_generator():  # resumes an interrupted run: finished batches are kept
        log.info("generating %d Pathfinder images (%dpx, %s, seed %d) into %s", n, res, difficulty, seed, out)
        pathfinder_gen.generate(out, resolution=res, difficulty=difficulty, n=n, seed=seed,
                                workers=data.get("workers"), progress=progress)

    generate_once(out, run_generator, {"n": n, "seed": seed, "resolution": res, "difficulty": difficulty,
                                       "version": version})
    return out / f"pathfinder{res}" / FOLDERS[difficulty]


def data_version(folder: Path) -> str:
    """What the rows record as the data: the generator's version for generated images, else the release."""
    manifest = folder / "pathfinder_gen.json"
    if manifest.exists():
        info = json.loads(manifest.read_text())
        return f"pathfinder_gen v{info.get('version', 1)} seed {info.get('seed')}"
    return f"release {folder}"


def source_folder(data, res: int, difficulty: str, limits: dict, progress: bool) -> Path:
    if not data.get("root"):
        return generated_folder(data, res, difficulty, limits, progress)
    try:
        base = resolve_root(data.root, f"pathfinder{res}")
    except DataError as e:
        raise DataError(f"{e}, or generate the images: python -m lra.generate pathfinder --resolution {res} "
                        f"--difficulty {difficulty} --n 200000 --out DIR") from None
    folder = base / FOLDERS[difficulty]
    if not folder.is_dir():
        raise DataError(f"no {FOLDERS[difficulty]} ({difficulty}) folder in {base}; {how_to_get(res, difficulty)}")
    return folder


def check(task) -> None:
    res, difficulty = task.get("resolution"), task.get("difficulty")
    if res not in RESOLUTIONS:
        raise ValueError(f"task.resolution={res!r} is not valid: choose one of {', '.join(map(str, RESOLUTIONS))}")
    if difficulty not in FOLDERS:
        raise ValueError(f"task.difficulty={difficulty!r} is not valid: choose one of {', '.join(FOLDERS)}")
    if int(task.seq_len) != res * res:
        raise ValueError(f"{res}x{res} images are {res * res} pixels; set task.seq_len={res * res}")


def read_file(path: Path, task, data) -> TaskData:
    """One metadata file of the release layout (``<folder>/metadata/<k>.npy``): every image it lists that can be
    read (under ``<folder>/imgs/``)."""
    res, folder = int(task.resolution), path.parent.parent
    lines = metadata_lines(path)
    pixels = parallel_map(partial(decode_pngs, side=res), [f"{folder}/{p}" for p, _ in lines], data.get("workers"),
                          chunk=1024, min_parallel=2048)
    got = [(px, label) for px, (_, label) in zip(pixels, lines) if px is not None]
    stacked = (torch.from_numpy(np.stack([g[0] for g in got])) if got
               else torch.zeros(0, res * res, dtype=torch.uint8))  # (n, res * res)
    tokens, vocab = pixel_tokens(stacked, bool(data.pixel_zero_is_pad))
    return one_file(path, Split(tokens, torch.tensor([g[1] for g in got], dtype=torch.long)), vocab_size=vocab,
                    n_classes=N_CLASSES, seq_len=res * res, grid=(res, res))


@register_task("pathfinder", n_classes=N_CLASSES, image=True, check=check, read_file=read_file)
@register_task("pathx", n_classes=N_CLASSES, image=True, check=check, read_file=read_file)
def load(task, data, *, seed: int, progress: bool) -> TaskData:
    res, difficulty = int(task.resolution), str(task.difficulty)
    limits, split_seed, zero_is_pad = split_limits(data), int(data.split_seed), bool(data.pixel_zero_is_pad)
    folder = source_folder(data, res, difficulty, limits, progress)
    try:
        paths, labels, meta = read_metadata(folder)
    except DataError as e:
        raise DataError(f"{e}; {how_to_get(res, difficulty)}") from None
    digest, sizes = digest_files(paths, folder)
    empty = sum(s == 0 for s in sizes)
    missing = sum(s < 0 for s in sizes)
    keep = [i for i, s in enumerate(sizes) if s > 0]
    if missing:
        log.warning("pathfinder: %d of %d images listed in %s/metadata are missing", missing, len(paths), folder)
    n = len(keep)
    n_eval = int(0.1 * n)
    parts = dict(zip(SPLITS, random_split_indices(n, [n - 2 * n_eval, n_eval, n_eval], split_seed)))
    spec = {"task": "pathfinder", "version": 1, "metadata": fingerprint(meta), "images": digest,
            "resolution": res, "difficulty": difficulty, "split_seed": split_seed, "limits": limits,
            "seed": seed if any(v is not None for v in limits.values()) else None}

    def build() -> dict:
        picks = {s: [keep[i] for i in parts[s][subset_indices(len(parts[s]), limits[s], seed, s)].tolist()]
                 for s in SPLITS}
        files = [f"{folder}/{paths[i]}" for s in SPLITS for i in picks[s]]
        pixels = iter(parallel_map(partial(decode_pngs, side=res), files, data.get("workers"),
                                   chunk=1024, min_parallel=2048))
        out, unreadable = {}, 0
        for s in SPLITS:
            got = [(px, labels[i]) for i, px in zip(picks[s], pixels) if px is not None]
            unreadable += len(picks[s]) - len(got)
            out[f"{s}_pixels"] = (torch.from_numpy(np.stack([g[0] for g in got])) if got
                                  else torch.zeros(0, res * res, dtype=torch.uint8))  # (n, res * res)
            out[f"{s}_labels"] = torch.tensor([g[1] for g in got], dtype=torch.long)
        out["unreadable"] = torch.tensor(unreadable)
        return out

    tensors, hit = cached(data.cache_dir, f"pathfinder{res}_{difficulty}", spec, build)
    unreadable = int(tensors["unreadable"])
    splits = {}
    for s in SPLITS:
        if not len(tensors[f"{s}_labels"]):
            raise DataError(f"the {s} split of {folder} is empty ({n} usable images); {how_to_get(res, difficulty)}")
        tokens, vocab = pixel_tokens(tensors[f"{s}_pixels"], zero_is_pad)
        splits[s] = Split(tokens, tensors[f"{s}_labels"])
    recipe = (f"{FOLDERS[difficulty]} {res}px, {n} usable images, random_split 80/10/10 seed {split_seed}"
              + limit_recipe(limits, seed))
    out = TaskData(**splits, vocab_size=vocab, n_classes=N_CLASSES, seq_len=res * res, grid=(res, res),
                   info={"task": task.name, "source": str(folder), "data": data_version(folder),
                         "cache": "hit" if hit else "miss",
                         "skipped": empty + missing + unreadable, "split": recipe,
                         "pixels": "raw, 0 = pad (LRA quirk)" if zero_is_pad else "pixel + 1"})
    log.info("%s: %s, %s, cache %s, skipped %d empty, %d missing, %d unreadable images", task.name, folder,
             recipe, out.info["cache"], empty, missing, unreadable)
    return out
