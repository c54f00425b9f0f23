"""ListOps (Nangia & Bowman 2018) as LRA generated it (``lra_benchmarks/data/listops.py``), seeded.

Generator: LRA's algorithm, with the same RNG call order as the original (children are drawn before the
operator), so ``generate_trees`` with ``random.Random(0)`` draws the trees the original draws after
``random.seed(0)`` (tests/test_listops.py checks their statistics). Unlike the original, which dumps a Python
``set`` (hash order), rows keep first-seen order and the process is seeded, so the same seed gives
byte-identical files. Generation runs in fixed chunks, each with its own seed, so the output
does not depend on the number of worker processes.

Loader: ``basic_{train,val,test}.tsv`` (header ``Source<TAB>Target``) from an LRA release folder or from
the generator's cache; LRA's rewrite (``]`` -> its own token, parentheses dropped), a fixed vocabulary
(0 = pad), truncate/pad to ``task.seq_len``. One such file alone is an evaluation's data (``read_file``).
"""
from __future__ import annotations

import csv
import logging
import os
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from lra.errors import DataError
from lra.io import temporary_name

from . import register_task
from .common import (
    Split,
    TaskData,
    cached,
    fingerprint,
    generate_once,
    one_file,
    resolve_root,
    smallest_int_dtype,
)

log = logging.getLogger("lra.data")

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
VALUE_P = 0.25  # a node branches when uniform > VALUE_P fails, i.e. is a leaf with probability 0.75
MAX_DEPTH, MAX_ARGS, MIN_LENGTH, MAX_LENGTH = 10, 10, 500, 2000
# pad = 0, then the 15 symbols; the close bracket is its own token as in LRA's rewrite
VOCAB = ["<pad>", *OPERATORS, "]", *map(str, range(10))]
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}
SPLITS = ("train", "val", "test")
N_CLASSES = 10
CHUNK = 2_000  # accepted trees per generator chunk; chunk j is seeded with (seed, j)


def apply_op(op: str, values: list[int]) -> int:
    if op == "[MIN":
        return min(values)
    if op == "[MAX":
        return max(values)
    if op == "[MED":  # numpy.median then int(): mean of the two middle values, truncated
        s = sorted(values)
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else int((s[mid - 1] + s[mid]) / 2)
    return sum(values) % 10  # [SM


def tree(rng: random.Random, depth: int = 1) -> tuple[str, int, int]:
    """One random expression: (source string, value, length without parentheses)."""
    r = rng.random() if depth < MAX_DEPTH else 1.0
    if r > VALUE_P:
        d = rng.randint(0, 9)
        return str(d), d, 1
    n = rng.randint(2, MAX_ARGS)
    kids = [tree(rng, depth + 1) for _ in range(n)]
    op = rng.choice(OPERATORS)
    # Left-nested pairs ((((op, k1), k2) ... kn), ']') printed as "( " a " " b " )"
    source = "( " * (n + 1) + op + " " + " ) ".join(k[0] for k in kids) + " ) ] )"
    return source, apply_op(op, [k[1] for k in kids]), 2 + sum(k[2] for k in kids)


def generate_trees(rng: random.Random, n_accepted: int, min_length=MIN_LENGTH, max_length=MAX_LENGTH):
    """Draw trees until ``n_accepted`` have min_length < length < max_length. Returns (rows, n_drawn)."""
    rows, drawn = [], 0
    while len(rows) < n_accepted:
        source, value, length = tree(rng)
        drawn += 1
        if min_length < length < max_length:
            rows.append((source, value))
    return rows, drawn


def _chunk(args: tuple[int, int, int]) -> list[tuple[str, int]]:
    """The first ``count`` trees of chunk ``j``: a smaller request gets a prefix of a larger one."""
    seed, j, count = args
    return generate_trees(random.Random(f"listops-{seed}-{j}"), count)[0]


def generate(out_dir: str | Path, seed: int = 0, train: int = 96_000, val: int = 2_000, test: int = 2_000,
             workers: int | None = None, progress: bool = True) -> Path:
    """Write ``out_dir/listops-1000/basic_{train,val,test}.tsv`` with unique trees; returns that folder."""
    total = train + val + test
    folder = Path(out_dir) / "listops-1000"
    workers = workers or min(os.cpu_count() or 1, 16)
    unique: dict[str, int] = {}
    j = 0
    with tqdm(total=total, desc="generating ListOps", unit="tree", disable=not progress) as bar, \
            ProcessPoolExecutor(workers) as pool:
        while len(unique) < total:
            missing = total - len(unique)
            batch = range(j, j + max(-(-missing // CHUNK), 1))
            j += len(batch)
            for rows in pool.map(_chunk, [(seed, k, min(CHUNK, missing)) for k in batch]):
                for source, value in rows:
                    if len(unique) < total and source not in unique:
                        unique[source] = value
                        bar.update(1)
    rows = list(unique.items())
    folder.mkdir(parents=True, exist_ok=True)
    bounds = {"train": (0, train), "val": (train, train + val), "test": (train + val, total)}
    for split, (a, b) in bounds.items():
        path = folder / f"basic_{split}.tsv"
        tmp = temporary_name(path)
        with open(tmp, "w", newline="") as f:  # csv's default '\r\n' line ends, as the original
            w = csv.writer(f, delimiter="\t")
            w.writerow(["Source", "Target"])
            w.writerows(rows[a:b])
        os.replace(tmp, path)  # a killed generation never leaves a half file that looks complete
    return folder


def tokenize(source: str) -> list[int]:
    """LRA's rewrite: parentheses dropped, ']' kept as its own token; KeyError on an unknown symbol."""
    return [TOKEN_ID[t] for t in source.split() if t not in ("(", ")")]


# read_tsv's form of ``tokenize``, in C-level string operations instead of a Python loop over ~1,000 tokens a row.
# Once every whitespace-separated word is known to be a symbol or a parenthesis, the words joined without spaces
# hold each symbol's characters in order; an operator is the only word with a '[', so each '[' starts one and
# becomes a letter of its own, the parentheses are dropped, and every character left is one token.
SYMBOLS = frozenset((*VOCAB[1:], "(", ")"))
OPERATOR_LETTER = {op: chr(ord("a") + i) for i, op in enumerate(OPERATORS)}
NO_PARENTHESES = str.maketrans("", "", "()")
CHAR_ID = np.zeros(128, dtype=np.uint8)  # a character of the rewritten row -> its token id (0: none occurs)
for _symbol in ("]", *map(str, range(10))):
    CHAR_ID[ord(_symbol)] = TOKEN_ID[_symbol]
for _op, _letter in OPERATOR_LETTER.items():
    CHAR_ID[ord(_letter)] = TOKEN_ID[_op]


def token_ids(source: str) -> np.ndarray:
    """``tokenize(source)`` as a uint8 array; KeyError on an unknown symbol, as ``tokenize`` raises it."""
    words = source.split()
    if not SYMBOLS.issuperset(words):
        tokenize(source)  # raises the KeyError naming the first unknown symbol
    joined = "".join(words)
    for op, letter in OPERATOR_LETTER.items():
        joined = joined.replace(op, letter)
    return CHAR_ID[np.frombuffer(joined.translate(NO_PARENTHESES).encode("ascii"), dtype=np.uint8)]


def read_tsv(path: Path, seq_len: int) -> Split:
    with open(path, newline="") as f:
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header != ["Source", "Target"]:
            raise DataError(f"{path}:1: expected the header 'Source<TAB>Target', got {header!r}")
        rows = list(reader)
    tokens = torch.zeros(len(rows), seq_len, dtype=smallest_int_dtype(len(VOCAB)))
    array = tokens.numpy()  # the same memory: rows are written through it
    labels = torch.empty(len(rows), dtype=torch.long)
    for i, row in enumerate(rows):
        line = i + 2
        if len(row) != 2:
            raise DataError(f"{path}:{line}: expected 2 tab-separated fields (Source, Target), got {len(row)}")
        try:
            ids = token_ids(row[0])
        except KeyError as e:
            raise DataError(
                f"{path}:{line}: unknown ListOps symbol {e.args[0]!r}; expected one of {VOCAB[1:]}"
            ) from None
        if not row[1].strip().isdigit() or not 0 <= int(row[1]) <= 9:
            raise DataError(f"{path}:{line}: the target must be an integer 0-9, got {row[1]!r}")
        ids = ids[:seq_len]
        array[i, : len(ids)] = ids
        labels[i] = int(row[1])
    return Split(tokens, labels)


def source_folder(data, progress: bool) -> Path:
    """The folder holding basic_*.tsv: ``data.root`` if given, else the generator's cache (generated now
    when missing, only as many trees as ``data.limit`` asks for; once, whatever the number of concurrent runs)."""
    if data.get("root"):
        folder = resolve_root(data.root, "listops-1000")
        missing = [s for s in SPLITS if not (folder / f"basic_{s}.tsv").exists()]
        if missing:
            raise DataError(f"{folder} lacks basic_{{{','.join(missing)}}}.tsv; unpack the full LRA release or "
                            f"generate the data: python -m lra.generate listops --out DIR")
        return folder
    gen, limit = data.generate, data.limit
    sizes = {s: min(gen[s], limit[s]) if limit[s] is not None else gen[s] for s in SPLITS}
    name = f"seed{gen.seed}-{sizes['train']}-{sizes['val']}-{sizes['test']}"
    out = Path(data.cache_dir).expanduser() / "listops" / name

    def run_generator():
        log.info("no ListOps data in %s: generating %s trees (seed %d)", out, sizes, gen.seed)
        generate(out, seed=gen.seed, **sizes, progress=progress)

    generate_once(out, run_generator, {"seed": gen.seed, **sizes})
    return out / "listops-1000"


def read_file(path: Path, task, data) -> TaskData:
    """One TSV file of the release's format (``Source<TAB>Target``, that header first), e.g. a ``basic_test.tsv``."""
    seq_len = int(task.seq_len)
    return one_file(path, read_tsv(path, seq_len), vocab_size=len(VOCAB), n_classes=N_CLASSES, seq_len=seq_len)


@register_task("listops", n_classes=N_CLASSES, read_file=read_file)
def load(task, data, *, seed: int, progress: bool) -> TaskData:
    folder = source_folder(data, progress)
    paths = [folder / f"basic_{s}.tsv" for s in SPLITS]
    seq_len = int(task.seq_len)
    spec = {"task": "listops", "files": fingerprint(paths), "seq_len": seq_len, "vocab": VOCAB}
    tensors, hit = cached(data.cache_dir, "listops", spec, lambda: {
        f"{s}_{k}": getattr(read_tsv(p, seq_len), k) for s, p in zip(SPLITS, paths) for k in ("tokens", "labels")
    })
    splits = {s: Split(tensors[f"{s}_tokens"], tensors[f"{s}_labels"]).head(data.limit[s]) for s in SPLITS}
    return TaskData(**splits, vocab_size=len(VOCAB), n_classes=N_CLASSES, seq_len=seq_len,
                    info={"task": "listops", "source": str(folder), "split": "LRA files",
                          "cache": "hit" if hit else "miss"})
