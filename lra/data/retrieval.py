"""Retrieval: do two ACL Anthology Network papers cite each other (Radev et al., 2013, "The ACL Anthology
Network Corpus")? LRA's ``matching`` task (Tay et al. 2021, arXiv 2011.04006; preprocessing as
``lra_benchmarks/matching/input_pipeline.py`` in github.com/google-research/long-range-arena), read from the
``lra_release`` archive's ``tsv_data/new_aan_pairs.{train,eval,test}.tsv``.

Format as LRA's input pipeline reads it: no header, tab-delimited, no quote handling, five fields
``label id1 id2 text1 text2``; the label is parsed as a float and used as the integer 0/1. Each text is
cut to its first 10,000 bytes, byte-encoded (id = byte + 1, vocab 257, 0 = pad) and cut/padded to
``task.seq_len`` (4,000) ids; tokens are (n, 2, seq_len) for the two-tower encoder. The text fields are
encoded as the raw field bytes, as LRA and S4 do (one third-party loader parses them as Python ``b'...'``
literals instead). Splits: train = train, val = eval, test = test. Unlike LRA, no example is dropped to
fill the last batch. A malformed line raises with its file and line number. One such file alone is an
evaluation's data (``read_file``).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from lra.errors import DataError

from . import register_task
from .common import (
    SPLITS,
    Split,
    TaskData,
    cached,
    encode_bytes,
    fingerprint,
    limit_recipe,
    one_file,
    resolve_root,
    smallest_int_dtype,
    split_limits,
    subset_indices,
)

log = logging.getLogger("lra.data")

VOCAB = 257
N_CLASSES = 2
FILES = {"train": "new_aan_pairs.train.tsv", "val": "new_aan_pairs.eval.tsv", "test": "new_aan_pairs.test.tsv"}
HOW_TO_GET = ("download and unpack the LRA release (https://storage.googleapis.com/long-range-arena/"
              "lra_release.gz, 8 GB; the TSVs are also in the Hugging Face dataset OpenNLPLab/lra) and set "
              "data.root to the folder that holds tsv_data/")
CHUNK = 4096  # lines tokenised at a time, so the raw texts of a 8.5 GB file never sit in memory at once


def count_lines(path: Path) -> int:
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def parse(path: Path, lineno: int, line: bytes) -> tuple[int, bytes, bytes]:
    fields = line.rstrip(b"\r\n").split(b"\t")
    if len(fields) != 5:
        raise DataError(f"{path}:{lineno}: expected 5 tab-separated fields (label id1 id2 text1 text2), "
                        f"got {len(fields)}")
    try:
        label = float(fields[0])
    except ValueError:
        raise DataError(f"{path}:{lineno}: the label must be a number, got {fields[0][:40]!r}") from None
    if label not in (0.0, 1.0):
        raise DataError(f"{path}:{lineno}: the label must be 0 or 1, got {fields[0][:40]!r}")
    return int(label), fields[3], fields[4]


def read_split(path: Path, keep: set[int] | None, seq_len: int, truncate_bytes: int) -> dict:
    """Tokenise the lines of ``path`` (1-based line numbers in ``keep``, or all); blank lines are skipped."""
    tokens, labels, rows = [], [], []
    last = max(keep, default=0) if keep is not None else None

    def flush():
        if rows:
            pair = [encode_bytes([r[k] for r in rows], seq_len, truncate_bytes) for k in (1, 2)]
            tokens.append(torch.stack(pair, dim=1).to(smallest_int_dtype(VOCAB)))  # (chunk, 2, L)
            labels.extend(r[0] for r in rows)
            rows.clear()

    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if keep is not None and lineno not in keep:
                if lineno > last:
                    break
                continue
            if line.strip():
                rows.append(parse(path, lineno, line))
            if len(rows) == CHUNK:
                flush()
    flush()
    if not labels:
        raise DataError(f"{path} holds no examples; {HOW_TO_GET}")
    return {"tokens": torch.cat(tokens), "labels": torch.tensor(labels, dtype=torch.long)}


def read_file(path: Path, task, data) -> TaskData:
    """One TSV file of the release's AAN pairs (``label id1 id2 text1 text2``), e.g. ``new_aan_pairs.test.tsv``."""
    seq_len = int(task.seq_len)
    pairs = read_split(path, None, seq_len, int(data.truncate_bytes))
    return one_file(path, Split(pairs["tokens"], pairs["labels"]), vocab_size=VOCAB, n_classes=N_CLASSES,
                    seq_len=seq_len, pair=True)


@register_task("retrieval", n_classes=N_CLASSES, pair=True, read_file=read_file)
def load(task, data, *, seed: int, progress: bool) -> TaskData:
    if not data.get("root"):
        raise DataError(f"the retrieval task reads the AAN pairs from the LRA release: {HOW_TO_GET}")
    folder = resolve_root(data.root, "tsv_data")
    paths = {s: folder / name for s, name in FILES.items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise DataError(f"missing {', '.join(missing)}; {HOW_TO_GET}")
    seq_len, truncate, limits = int(task.seq_len), int(data.truncate_bytes), split_limits(data)
    spec = {"task": "retrieval", "version": 1, "files": fingerprint(paths.values()), "seq_len": seq_len,
            "truncate_bytes": truncate, "limits": limits,
            "seed": seed if any(v is not None for v in limits.values()) else None}

    def build() -> dict:
        out = {}
        for s in SPLITS:
            keep = None
            if limits[s] is not None:  # a seeded random subset of the lines: counting them is one fast pass
                n = count_lines(paths[s])
                keep = set((subset_indices(n, limits[s], seed, s) + 1).tolist())
            for k, v in read_split(paths[s], keep, seq_len, truncate).items():
                out[f"{s}_{k}"] = v
        return out

    tensors, hit = cached(data.cache_dir, "retrieval", spec, build)
    splits = {s: Split(tensors[f"{s}_tokens"], tensors[f"{s}_labels"]) for s in SPLITS}
    out = TaskData(**splits, vocab_size=VOCAB, n_classes=N_CLASSES, seq_len=seq_len, pair=True,
                   info={"task": task.name, "source": str(folder), "cache": "hit" if hit else "miss",
                         "skipped": 0,
                         "split": "train=train, val=eval, test=test (LRA files)" + limit_recipe(limits, seed)})
    log.info("retrieval: %s, %s, cache %s", folder, out.info["split"], out.info["cache"])
    return out
