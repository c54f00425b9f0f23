"""What every task loader shares: the split containers, the on-disk tensor cache, source fingerprints,
the seeded batch order and the start-up summary line. A task module only turns its source into tensors.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lra.errors import DataError, first_line
from lra.io import atomic_save, atomic_write_text, file_sha256, lock_for

log = logging.getLogger("lra.data")


@dataclass
class Split:
    tokens: torch.Tensor  # (n, L) or, for pair tasks, (n, 2, L); integer ids, 0 = pad
    labels: torch.Tensor  # (n,) int64

    def __len__(self) -> int:
        return len(self.labels)

    def head(self, n: int | None) -> Split:
        return self if n is None or n >= len(self) else Split(self.tokens[:n], self.labels[:n])


@dataclass
class TaskData:
    train: Split
    val: Split
    test: Split
    vocab_size: int
    n_classes: int
    seq_len: int
    pair: bool = False
    grid: tuple[int, int] | None = None  # (height, width) of an image task's pixels, row-major
    info: dict = field(default_factory=dict)  # source, split recipe, cache hit/miss: goes into the run row

    def version(self) -> str | None:
        """What a row records as the data: the loader's version of it (``info["data"]``: a generator's version and
        seed, a file's hash) where it gives one, else its source."""
        return self.info.get("data", self.info.get("source"))

    def summary(self) -> str:
        counts = torch.bincount(self.train.labels, minlength=self.n_classes).tolist()
        total = max(sum(counts), 1)
        balance = " ".join(f"{100 * c / total:.1f}" for c in counts)
        shape = f"2x{self.seq_len}" if self.pair else str(self.seq_len)
        return (
            f"{self.info.get('task', 'task')}: train {len(self.train):,} / val {len(self.val):,} / "
            f"test {len(self.test):,}, length {shape}, vocab {self.vocab_size}, {self.n_classes} classes "
            f"(train % {balance}), cache {self.info.get('cache', 'n/a')}"
        )


def smallest_int_dtype(vocab_size: int) -> torch.dtype:
    """Token tensors are stored compactly (uint8 for bytes/pixels/ListOps) and widened per batch."""
    return torch.uint8 if vocab_size <= 256 else torch.int16 if vocab_size <= 32767 else torch.int32


def fingerprint(paths: Iterable[Path]) -> list:
    """Cheap identity of source files (name, size, mtime): a changed source invalidates the cache."""
    out = []
    for p in sorted(Path(p) for p in paths):
        st = p.stat()
        out.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return out


def cache_key(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached(cache_dir: str | Path, name: str, spec: dict, build: Callable[[], dict]) -> tuple[dict, bool]:
    """Return ``build()``'s dict of tensors, from ``cache_dir/name-<hash(spec)>.pt`` when it is there.
    ``spec`` must hold everything the tensors depend on (source fingerprint, tokeniser settings, limits).
    Returns (tensors, hit).

    Safe for concurrent runs on a cold cache: the first process builds under a lock while the others wait, the
    file is published by rename, and its SHA-256 (in the ``.json`` beside it) is checked on every load, so a file
    torn, truncated or overwritten in place (bit rot) is rebuilt, never trusted."""
    path = Path(cache_dir).expanduser() / f"{name}-{cache_key(spec)}.pt"
    meta = path.with_suffix(".json")
    with lock_for(path):
        if path.exists() and meta.exists():
            try:
                recorded = json.loads(meta.read_text()).get("sha256")
                actual = file_sha256(path)
                if recorded == actual:
                    return torch.load(path, weights_only=True), True
                log.warning("cache %s does not match its recorded SHA-256 (%s != %s): rebuilding it", path,
                            str(actual)[:12], str(recorded)[:12])
            except Exception as e:  # noqa: BLE001 - a torn or stale file is rebuilt, never trusted
                log.warning("ignoring unreadable cache %s (%s: %s)", path, type(e).__name__, e)
        tensors = build()
        atomic_save(tensors, path)
        atomic_write_text(meta, json.dumps({"sha256": file_sha256(path), "spec": spec}, indent=1, default=str))
    return tensors, False


def generate_once(out: Path, generate: Callable[[], object], description: dict) -> None:
    """Run ``generate()`` (which writes into ``out``) unless ``out`` is complete; under a lock, so concurrent runs
    on a cold cache generate once and the others wait. ``out/complete.json`` is written last: a folder without it
    is unfinished (the generators resume an interrupted run) and is never read as data."""
    marker = out / "complete.json"
    with lock_for(out):
        if marker.exists():
            return
        generate()
        atomic_write_text(marker, json.dumps(description, indent=1, default=str))


def one_file(path: Path, split: Split, **shape) -> TaskData:
    """A task's ``read_file``: one file's examples as every split (an evaluation scores one), the file itself and
    its content's hash as the data (``shape``: the TaskData's vocab_size, n_classes, seq_len, and pair or grid)."""
    return TaskData(split, split, split, **shape, info={
        "source": str(path), "data": f"{path.name} sha256 {file_sha256(path)[:12]}", "split": "one file",
        "cache": "none"})


def read_parquet(path: Path, how_to_get: str):
    """One parquet file as a pyarrow table; a DataError saying what it needs where it cannot be read."""
    import pyarrow.parquet as pq  # pyarrow only where a parquet file is read: lra.data loads at every command's start

    try:
        return pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - a missing, unreadable or non-parquet file: one line saying which
        raise DataError(f"{path} is not a readable parquet file ({type(e).__name__}: "
                        f"{first_line(e)}); {how_to_get}") from None


def encode_bytes(texts: Iterable[str | bytes], length: int, truncate_bytes: int | None = None) -> torch.Tensor:
    """LRA's ``ByteTextEncoder``: id = UTF-8 byte + 1 (0 stays pad), truncate/right-pad to ``length``."""
    texts = list(texts)
    out = torch.zeros(len(texts), length, dtype=torch.int16)
    for i, t in enumerate(texts):
        b = t.encode("utf-8") if isinstance(t, str) else bytes(t)
        if truncate_bytes is not None:
            b = b[:truncate_bytes]
        b = b[:length]
        if b:
            out[i, : len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8).to(torch.int16) + 1
    return out


class BatchOrder:
    """The training batches as a pure function of (seed, step): epoch e is ``randperm(n)`` drawn from a
    generator seeded with (seed, e), cut into full batches. A resumed run sees exactly the batches the
    killed run would have seen.

    With ``lengths`` (each example's real length), batches are length-grouped: the epoch's shuffled examples are
    taken ``group`` batches at a time, sorted by length inside that window and cut into batches, and the epoch's
    batches are then shuffled. Each batch then holds examples of similar length (so ``trainer.trim`` cuts most
    of its padding) while every example is still seen once per epoch in a random context. This is not LRA's
    protocol (batches are no longer uniform samples): rows say ``batching=length_grouped``."""

    def __init__(self, n: int, batch_size: int, seed: int, lengths: torch.Tensor | None = None, group: int = 64):
        if n < batch_size:
            raise DataError(f"the training split has {n} examples, fewer than one batch of {batch_size}")
        if lengths is not None and len(lengths) != n:
            raise ValueError(f"lengths holds {len(lengths)} entries for {n} examples")
        self.n, self.batch_size, self.seed, self.lengths, self.group = n, batch_size, seed, lengths, group
        self.per_epoch = n // batch_size
        self._epoch, self._perm = -1, None

    def indices(self, step: int) -> torch.Tensor:
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.n, generator=g)
            self._epoch, self._perm = epoch, perm if self.lengths is None else self.grouped(perm, g)
        return self._perm[i * self.batch_size : (i + 1) * self.batch_size]

    def grouped(self, perm: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """The epoch's order with length-grouped batches (the examples past the last full batch dropped, as
        ``indices`` never reaches them)."""
        used = perm[: self.per_epoch * self.batch_size]
        window = self.group * self.batch_size
        chunks = [c[torch.argsort(self.lengths[c], stable=True)] for c in used.split(window)]  # sorted windows
        batches = torch.cat(chunks).view(self.per_epoch, self.batch_size)  # (batches, batch_size)
        return batches[torch.randperm(self.per_epoch, generator=g)].reshape(-1)  # batches in random order


def resolve_root(root: str | Path, inner: str) -> Path:
    """Accept the ``lra_release`` folder, its doubly nested ``lra_release/lra_release``, or the inner
    folder itself; return the folder that holds ``inner``."""
    root = Path(root).expanduser()
    for cand in (root, root / "lra_release", root / "lra_release" / "lra_release"):
        if (cand / inner).exists():
            return cand / inner
    if root.name == inner and root.exists():
        return root
    raise DataError(
        f"no '{inner}' under {root} (looked in {root}, {root}/lra_release, {root}/lra_release/lra_release). "
        "Download and unpack the LRA release: https://storage.googleapis.com/long-range-arena/lra_release.gz"
    )


# ---------------------------------------------------------------------------------------------------------
# Shared by the text, retrieval, image and pathfinder loaders: split limits, seeded splits, file digests,
# Hugging Face style sources, pixel ids and process-parallel decoding.

SPLITS = ("train", "val", "test")


def split_limits(data) -> dict[str, int | None]:
    """``data.limit.{train,val,test}`` as ints (None = the whole split)."""
    lim = data.get("limit") or {}
    return {s: None if lim.get(s) is None else int(lim.get(s)) for s in SPLITS}


def limit_recipe(limits: dict, seed: int) -> str:
    if all(v is None for v in limits.values()):
        return ""
    return ", limited to " + "/".join(str(limits[s]) for s in SPLITS) + f" (seeded random subset, seed {seed})"


def subset_indices(n: int, limit: int | None, seed: int, split: str) -> torch.Tensor:
    """``arange(n)`` when ``limit`` is None or covers the split, else ``limit`` indices drawn at random
    (seeded by ``seed`` and the split name) in random order. Real sources are often sorted by label, so
    a head would be one class."""
    if limit is None or limit >= n:
        return torch.arange(n)
    salt = int(hashlib.sha256(f"{seed}/{split}".encode()).hexdigest()[:15], 16)
    return torch.randperm(n, generator=torch.Generator().manual_seed(salt))[:limit]


def random_split_indices(n: int, lengths: list[int], seed: int) -> list[torch.Tensor]:
    """The index sets ``torch.utils.data.random_split(range(n), lengths, Generator().manual_seed(seed))``
    gives: one ``randperm`` cut into consecutive pieces (the S4 convention for CIFAR and Pathfinder)."""
    if sum(lengths) != n:
        raise ValueError(f"split lengths {lengths} do not add up to {n}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return list(torch.split(perm, lengths))


def digest_files(names: Iterable[str], root: Path) -> tuple[dict, list[int]]:
    """A fingerprint of many files (name relative to ``root``, size, mtime) as one short hash, and each
    file's size (-1 = missing), so that callers can skip empty files without a second ``stat``.
    Plain strings, not ``Path`` objects: this runs over 200,000 Pathfinder images on every load."""
    h, sizes = hashlib.sha256(), []
    base = os.path.join(str(root), "")
    for name in names:
        try:
            st = os.stat(base + name)
            size, mtime = st.st_size, st.st_mtime_ns
        except FileNotFoundError:
            size, mtime = -1, 0
        sizes.append(size)
        h.update(f"{name}\0{size}\0{mtime}\n".encode())
    return {"root": str(Path(root).resolve()), "files": len(sizes), "sha256": h.hexdigest()[:20]}, sizes


def pixel_tokens(pixels: torch.Tensor, zero_is_pad: bool) -> tuple[torch.Tensor, int]:
    """uint8 pixels -> (token ids, vocab size). Pixel 0 is black, not padding, so ids are pixel + 1
    (vocab 257); ``zero_is_pad`` keeps LRA's quirk of feeding raw pixels (black masked out, vocab 256)."""
    if zero_is_pad:
        return pixels, 256
    tokens = pixels.to(torch.int16)
    tokens += 1  # in place: Path-X is 3.3 G pixels
    return tokens, 257


def parallel_map(fn: Callable[[list], list], items: list, workers: int | None = None, chunk: int = 2048,
                 min_parallel: int = 4096) -> list:
    """``fn`` maps a list of items to a list of results (a picklable top-level function); large inputs
    run in chunks over processes, small ones in-process (a pool costs more than it saves)."""
    chunks = [items[i : i + chunk] for i in range(0, len(items), chunk)]
    workers = min(workers or os.cpu_count() or 1, 16, len(chunks))
    if workers <= 1 or len(items) < min_parallel:
        return [r for c in chunks for r in fn(c)]
    with ProcessPoolExecutor(workers) as pool:
        return [r for rs in pool.map(fn, chunks) for r in rs]


def _looks_local(path: str) -> bool:
    return path.startswith((".", "/", "~")) or "{split}" in path or path.endswith(".parquet") or "\\" in path


def hf_tables(path: str, splits: tuple[str, ...], how_to_get: str) -> tuple[dict, dict, str]:
    """The ``splits`` of a Hugging Face style dataset as pyarrow tables, from
    - a local folder of parquet files in the hub's layout (``<config>/<split>-00000-of-00001.parquet``,
      ``data/<split>-*.parquet``, ``<split>.parquet`` or ``<split>/*.parquet``),
    - a file template with ``{split}`` (``/data/imdb_{split}.parquet``, globs allowed), or
    - a hub id (``stanfordnlp/imdb``) read by ``datasets.load_dataset`` (network or the HF cache).
    Returns (tables, source fingerprint, description). Image columns keep their stored
    ``{bytes, path}`` structs (no decoding here)."""
    import pyarrow as pa  # pyarrow only where a parquet source is read: lra.data loads at every command's start
    import pyarrow.parquet as pq

    local = Path(path).expanduser()
    if "{split}" in path:
        files = {s: sorted(Path(p) for p in _glob(path.format(split=s))) for s in splits}
    elif local.is_dir():
        every = sorted(local.rglob("*.parquet"))
        files = {s: [p for p in every if p.name.startswith((f"{s}-", f"{s}.", f"{s}_")) or p.parent.name == s]
                 for s in splits}
    elif local.exists() or _looks_local(path):
        raise DataError(f"{path} is not a folder of parquet files nor a template with {{split}}; {how_to_get}")
    else:
        return _hub_tables(path, splits, how_to_get)
    missing = [s for s in splits if not files[s]]
    if missing:
        raise DataError(f"no parquet files for split(s) {', '.join(missing)} under {path} (expected e.g. "
                        f"plain_text/{missing[0]}-00000-of-00001.parquet); {how_to_get}")
    tables = {s: pa.concat_tables([pq.read_table(p) for p in files[s]]) for s in splits}
    return tables, {"parquet": fingerprint([p for s in splits for p in files[s]])}, f"parquet {local}"


def _glob(pattern: str) -> list[str]:
    return glob.glob(str(Path(pattern).expanduser()))


def _hub_tables(dataset_id: str, splits: tuple[str, ...], how_to_get: str) -> tuple[dict, dict, str]:
    import datasets  # datasets (seconds to import) only where a hub id is read

    try:
        ds = datasets.load_dataset(dataset_id)
    except Exception as e:  # no network, unknown id, ...: say what to do instead
        raise DataError(f"could not load the Hugging Face dataset {dataset_id!r} ({type(e).__name__}: {e}); "
                        f"{how_to_get}") from e
    missing = [s for s in splits if s not in ds]
    if missing:
        raise DataError(f"the Hugging Face dataset {dataset_id!r} has no split(s) {missing} (has {list(ds)})")
    tables = {s: ds[s].with_format("arrow")[:] for s in splits}
    return tables, {"hub": dataset_id, "fingerprints": {s: ds[s]._fingerprint for s in splits}}, f"hf {dataset_id}"
