"""Text: IMDb sentiment (Maas et al., 2011, "Learning Word Vectors for Sentiment Analysis") classified from
raw UTF-8 bytes, as LRA's ``text_classification`` task (Tay et al. 2021, arXiv 2011.04006; preprocessing as
``lra_benchmarks/text_classification/input_pipeline.py`` in github.com/google-research/long-range-arena).

Tokens: LRA's ``ByteTextEncoder``: id = byte + 1, vocab 257, 0 = pad; raw text (``<br />`` kept, no
lowercasing), truncated and right-padded to ``task.seq_len``. Splits as LRA: train = ``train``,
validation = test = ``test`` (IMDb has no validation set; LRA reports the last checkpoint).

Sources (``data.path``): a Hugging Face dataset id (``stanfordnlp/imdb``), a local folder of the hub's
parquet files (e.g. ``data/imdb``), a parquet template with ``{split}``, or the original ``aclImdb``
folder (``{train,test}/{pos,neg}/<id>_<rating>.txt``; files not named like that are skipped and counted).
One parquet file of the hub's columns (``text``, ``label``) alone is an evaluation's data (``read_file``).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from lra.errors import DataError

from . import register_task
from .common import (
    Split,
    TaskData,
    cached,
    digest_files,
    encode_bytes,
    hf_tables,
    limit_recipe,
    one_file,
    read_parquet,
    smallest_int_dtype,
    split_limits,
    subset_indices,
)

log = logging.getLogger("lra.data")

VOCAB = 257  # 256 byte values + pad
N_CLASSES = 2
HOW_TO_GET = ("set data.path to a Hugging Face id (stanfordnlp/imdb, needs the hub or its cache), to a local "
              "copy of its parquet files (huggingface-cli download stanfordnlp/imdb --repo-type dataset "
              "--local-dir DIR), or to an unpacked aclImdb folder "
              "(https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz)")
ACL_NAME = re.compile(r"^(\d+)_(\d+)\.txt$")


class Docs:
    """One split of the source, read lazily: labels now, texts only for the rows asked for."""

    def __init__(self, labels: torch.Tensor, read):
        self.labels, self.read = labels, read

    def __len__(self) -> int:
        return len(self.labels)


def acl_folder(path: Path) -> Path | None:
    for cand in (path, path / "aclImdb"):
        if (cand / "train" / "pos").is_dir() and (cand / "test" / "pos").is_dir():
            return cand
    return None


def acl_source(root: Path) -> tuple[dict, dict, int]:
    """aclImdb: each split's files ordered by (label, numeric id), neg = 0, pos = 1."""
    docs, paths, skipped = {}, [], 0
    for split in ("train", "test"):
        files, labels = [], []
        for label, sub in enumerate(("neg", "pos")):
            named = []
            for p in (root / split / sub).iterdir():
                m = ACL_NAME.match(p.name)
                if m and p.is_file():
                    named.append((int(m.group(1)), p))
                else:
                    skipped += 1
            named.sort()
            files += [p for _, p in named]
            labels += [label] * len(named)
        if not files:
            raise DataError(f"{root}/{split}/{{pos,neg}} holds no <id>_<rating>.txt files; {HOW_TO_GET}")
        paths += files
        docs[split] = Docs(torch.tensor(labels), lambda idx, files=files: [files[i].read_bytes() for i in idx])
    digest, _ = digest_files([str(p.relative_to(root)) for p in paths], root)
    return docs, {"aclImdb": digest}, skipped


def table_source(tables: dict) -> dict:
    docs = {}
    for split, t in tables.items():
        for col in ("text", "label"):
            if col not in t.column_names:
                raise DataError(f"the IMDb {split} split has no {col!r} column (columns: {t.column_names})")
        labels = torch.tensor(t.column("label").to_pylist(), dtype=torch.long)
        texts = t.column("text")
        docs[split] = Docs(labels, lambda idx, col=texts: col.take(idx).to_pylist())
    return docs


def open_source(path: str) -> tuple[dict, dict, str, int]:
    """(docs per split, source fingerprint, description, skipped files)."""
    folder = Path(path).expanduser()
    acl = acl_folder(folder) if folder.is_dir() else None
    if acl is not None:
        docs, fp, skipped = acl_source(acl)
        return docs, fp, f"aclImdb {acl}", skipped
    tables, fp, desc = hf_tables(path, ("train", "test"), HOW_TO_GET)
    return table_source(tables), fp, desc, 0


def check_labels(docs: Docs, where: str) -> None:
    bad = set(docs.labels.unique().tolist()) - {0, 1}
    if bad:
        raise DataError(f"IMDb labels must be 0 (neg) or 1 (pos), found {sorted(bad)} in {where}")


def read_file(path: Path, task, data) -> TaskData:
    """One parquet file of the hub's columns (``text``, ``label``), e.g. its ``test-00000-of-00001.parquet``."""
    docs = table_source({"test": read_parquet(path, HOW_TO_GET)})["test"]
    check_labels(docs, str(path))
    seq_len = int(task.seq_len)
    tokens = encode_bytes(docs.read(list(range(len(docs)))), seq_len).to(smallest_int_dtype(VOCAB))
    return one_file(path, Split(tokens, docs.labels), vocab_size=VOCAB, n_classes=N_CLASSES, seq_len=seq_len)


@register_task("text", n_classes=N_CLASSES, read_file=read_file)
def load(task, data, *, seed: int, progress: bool) -> TaskData:
    seq_len, limits = int(task.seq_len), split_limits(data)
    if not data.get("path"):
        raise DataError(f"data.path is not set; {HOW_TO_GET}")
    docs, source_fp, desc, skipped = open_source(str(data.path))
    for split, d in docs.items():
        check_labels(d, f"the {split} split of {desc}")
    # val and test are both IMDb's test split: draw one subset large enough for either limit, so that
    # val is a prefix of test (identical when the limits agree), as in LRA where they are the same set.
    lv, lt = limits["val"], limits["test"]
    test_limit = None if lv is None or lt is None else max(lv, lt)
    picks = {"train": subset_indices(len(docs["train"]), limits["train"], seed, "train"),
             "test": subset_indices(len(docs["test"]), test_limit, seed, "test")}
    subset = {"train": limits["train"], "test": test_limit}
    spec = {"task": "text", "version": 1, "source": source_fp, "seq_len": seq_len, "subset": subset,
            "seed": seed if any(v is not None for v in subset.values()) else None}

    def build() -> dict:
        out = {}
        for split, idx in picks.items():
            rows = idx.tolist()
            out[f"{split}_tokens"] = encode_bytes(docs[split].read(rows), seq_len).to(smallest_int_dtype(VOCAB))
            out[f"{split}_labels"] = docs[split].labels[idx].clone()
        return out

    tensors, hit = cached(data.cache_dir, "text", spec, build)
    test = Split(tensors["test_tokens"], tensors["test_labels"])
    out = TaskData(
        train=Split(tensors["train_tokens"], tensors["train_labels"]), val=test.head(lv), test=test.head(lt),
        vocab_size=VOCAB, n_classes=N_CLASSES, seq_len=seq_len,
        info={"task": task.name, "source": desc, "cache": "hit" if hit else "miss", "skipped": skipped,
              "split": "train=train, val=test, test=test (LRA: IMDb has no validation set)"
                       + limit_recipe(limits, seed),
              "val_is_test": True},  # the best-validation checkpoint is picked on test: report the final weights
    )
    log.info("text: %s, %s, cache %s, %d files skipped", desc, out.info["split"], out.info["cache"], skipped)
    return out
