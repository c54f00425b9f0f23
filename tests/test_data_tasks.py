"""Loaders for text, retrieval, image, pathfinder and pathx, on small files written here in each task's
original format (HF parquet folders, aclImdb, AAN TSV, lra_release Pathfinder layout), plus a slice of the
real IMDb / CIFAR-10 copies in ../shared/data when they are there."""
from __future__ import annotations

import copy
import functools
import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf
from PIL import Image

from lra.data import load_task
from lra.data.common import parallel_map, random_split_indices, subset_indices
from lra.data.image import tf_grayscale
from lra.data.pathfinder import decode_pngs, images_needed
from lra.errors import ConfigError, DataError
from tests.conftest import ROOT, compose_cfg

SHARED = ROOT.parent / "shared" / "data"


@functools.cache
def task_config(task: str):
    return compose_cfg([f"task={task}", "run_dir=x"])


def make_cfg(task: str, tmp_path: Path, *overrides: str):
    """The composed task config with ``key=value`` overrides (composing once per task: Hydra takes ~0.5 s)."""
    cfg = copy.deepcopy(task_config(task))
    for item in (f"data.cache_dir={tmp_path / 'cache'}", *overrides):
        key, value = item.split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value), merge=False)  # struct mode: unknown keys raise
    return cfg


def bump_mtime(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


# ------------------------------------------------------------------------------------------------ text
DOCS = {  # label-sorted like the real copies: neg first
    "train": [("bad <br />film", 0), ("awful", 0), ("dull plot", 0), ("meh", 0),
              ("great, très bien", 1), ("loved it", 1), ("superb", 1), ("fine fine fine fine fine", 1)],
    "test": [("boring", 0), ("no", 0), ("poor acting", 0), ("wow", 1), ("yes!", 1), ("brilliant", 1)],
}


def imdb_dataset(split: str):
    import datasets

    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})
    texts, labels = zip(*DOCS[split])
    return datasets.Dataset.from_dict({"text": list(texts), "label": list(labels)}, features=features)


def write_imdb_parquet(root: Path) -> Path:
    """The documents as an HF parquet folder, root/imdb."""
    folder = root / "imdb"
    for split in DOCS:
        (folder / "plain_text").mkdir(parents=True, exist_ok=True)
        imdb_dataset(split).to_parquet(str(folder / "plain_text" / f"{split}-00000-of-00001.parquet"))
    return folder


@pytest.fixture
def imdb_parquet(tmp_path):
    return write_imdb_parquet(tmp_path)


@pytest.fixture
def acl_imdb(tmp_path):
    root = tmp_path / "aclImdb"
    for split, docs in DOCS.items():
        for i, (text, label) in enumerate(docs):
            d = root / split / ("pos" if label else "neg")
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{i}_{8 if label else 2}.txt").write_text(text, encoding="utf-8")
    (root / "train" / "pos" / "notes.md").write_text("not a review")
    return tmp_path  # the parent: the loader finds aclImdb/ inside it


def expected_ids(text: str, length: int) -> list[int]:
    ids = [b + 1 for b in text.encode("utf-8")][:length]
    return ids + [0] * (length - len(ids))


def test_text_parquet_folder_tokens_labels_splits(tmp_path, imdb_parquet):
    data = load_task(make_cfg("text", tmp_path, f"data.path={imdb_parquet}", "task.seq_len=16"))
    assert (len(data.train), len(data.val), len(data.test)) == (8, 6, 6)
    assert data.vocab_size == 257 and data.seq_len == 16 and data.n_classes == 2 and not data.pair
    assert data.train.tokens.shape == (8, 16) and data.train.tokens.dtype == torch.int16
    for split, docs in (("train", DOCS["train"]), ("test", DOCS["test"])):
        s = getattr(data, split)
        assert s.tokens.tolist() == [expected_ids(t, 16) for t, _ in docs]  # bytes + 1, truncated, 0-padded
        assert s.labels.tolist() == [lab for _, lab in docs]
    assert torch.equal(data.val.tokens, data.test.tokens)  # LRA: validation is the test split
    assert 0 <= int(data.train.tokens.min()) and int(data.train.tokens.max()) <= 256
    assert "val=test" in data.info["split"] and data.info["cache"] == "miss"


def test_text_aclimdb_matches_parquet_and_counts_skipped(tmp_path, imdb_parquet, acl_imdb):
    acl = load_task(make_cfg("text", tmp_path, f"data.path={acl_imdb}", "task.seq_len=32"))
    pq = load_task(make_cfg("text", tmp_path, f"data.path={imdb_parquet}", "task.seq_len=32"))
    assert torch.equal(acl.train.tokens, pq.train.tokens) and torch.equal(acl.test.labels, pq.test.labels)
    assert acl.info["skipped"] == 1 and acl.info["source"].startswith("aclImdb")


def test_text_hub_path_via_load_dataset(tmp_path, imdb_parquet, monkeypatch):
    import datasets

    asked = []

    def fake_load_dataset(name, *args, **kwargs):
        asked.append(name)
        return datasets.DatasetDict({s: imdb_dataset(s) for s in DOCS})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    hub = load_task(make_cfg("text", tmp_path, "task.seq_len=16"))
    assert asked == ["stanfordnlp/imdb"] and hub.info["source"] == "hf stanfordnlp/imdb"
    local = load_task(make_cfg("text", tmp_path, f"data.path={imdb_parquet}", "task.seq_len=16"))
    assert torch.equal(hub.train.tokens, local.train.tokens) and torch.equal(hub.test.labels, local.test.labels)
    assert load_task(make_cfg("text", tmp_path, "task.seq_len=16")).info["cache"] == "hit"

    def offline(*args, **kwargs):
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="stanfordnlp/imdb.*hub unreachable.*local-dir"):
        load_task(make_cfg("text", tmp_path, "task.seq_len=8"))


def test_text_cache_hit_and_invalidation(tmp_path, imdb_parquet):
    args = (f"data.path={imdb_parquet}", "task.seq_len=16")
    assert load_task(make_cfg("text", tmp_path, *args)).info["cache"] == "miss"
    assert load_task(make_cfg("text", tmp_path, *args)).info["cache"] == "hit"
    assert load_task(make_cfg("text", tmp_path, f"data.path={imdb_parquet}", "task.seq_len=20")).info["cache"] == "miss"
    bump_mtime(imdb_parquet / "plain_text" / "test-00000-of-00001.parquet")
    assert load_task(make_cfg("text", tmp_path, *args)).info["cache"] == "miss"


def test_text_limits_are_seeded_random_subsets(tmp_path, imdb_parquet):
    full = load_task(make_cfg("text", tmp_path, f"data.path={imdb_parquet}", "task.seq_len=16"))
    limited = {}
    for seed in range(4):
        args = (f"data.path={imdb_parquet}", "task.seq_len=16", f"seed={seed}",
                "data.limit.train=3", "data.limit.val=2", "data.limit.test=4")
        a, b = (load_task(make_cfg("text", tmp_path / f"{name}{seed}", *args)) for name in "ab")
        assert torch.equal(a.train.tokens, b.train.tokens) and torch.equal(a.test.tokens, b.test.tokens)  # determinism
        assert (len(a.train), len(a.val), len(a.test)) == (3, 2, 4)
        assert torch.equal(a.val.tokens, a.test.tokens[:2])  # val is a prefix of test, as val == test in LRA
        rows = {tuple(r) for r in full.train.tokens.tolist()}
        assert all(tuple(r) in rows for r in a.train.tokens.tolist())
        idx = subset_indices(8, 3, seed, "train")
        assert torch.equal(a.train.tokens, full.train.tokens[idx])
        limited[seed] = a.train.labels.tolist()
    assert any(labels != [0, 0, 0] for labels in limited.values())  # not the label-sorted head


def test_text_missing_source_says_how_to_get_it(tmp_path):
    with pytest.raises(DataError, match="stanfordnlp/imdb.*aclImdb"):
        load_task(make_cfg("text", tmp_path, f"data.path={tmp_path / 'no_such_folder'}"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no parquet files for split.*train"):
        load_task(make_cfg("text", tmp_path, f"data.path={tmp_path / 'empty'}"))


# ------------------------------------------------------------------------------------------- retrieval
def aan_line(label: str, t1: str, t2: str, i: int) -> str:
    return f"{label}\tid{i}a\tid{i}b\t{t1}\t{t2}\n"


def write_aan_release(root: Path) -> Path:
    """AAN pairs as the LRA release unpacks them, root/lra_release."""
    folder = root / "lra_release" / "lra_release" / "tsv_data"  # the archive's doubly nested layout
    folder.mkdir(parents=True)
    for split, n in (("train", 12), ("eval", 5), ("test", 4)):
        lines = [aan_line("1.0" if i % 2 else "0.0", f"doc {split} {i} " + "x" * 40, f"other {i}", i) for i in range(n)]
        (folder / f"new_aan_pairs.{split}.tsv").write_text("".join(lines))
    return root / "lra_release"


@pytest.fixture
def aan_root(tmp_path):
    return write_aan_release(tmp_path)


def test_retrieval_pairs_shapes_labels_truncation(tmp_path, aan_root):
    args = (f"data.root={aan_root}", "task.seq_len=16", "data.truncate_bytes=12")
    data = load_task(make_cfg("retrieval", tmp_path, *args))
    assert data.pair and data.vocab_size == 257 and data.seq_len == 16
    assert (len(data.train), len(data.val), len(data.test)) == (12, 5, 4)
    assert data.train.tokens.shape == (12, 2, 16)
    assert data.train.labels.tolist() == [i % 2 for i in range(12)]
    first = "doc train 0 " + "x" * 40
    assert data.train.tokens[0, 0].tolist() == expected_ids(first[:12], 16)  # 12 bytes kept, then padding
    assert data.train.tokens[0, 1].tolist() == expected_ids("other 0", 16)
    assert "val=eval" in data.info["split"]


def test_retrieval_limits_cache_and_invalidation(tmp_path, aan_root):
    args = (f"data.root={aan_root}", "task.seq_len=24", "data.limit.train=5", "data.limit.val=2", "data.limit.test=3")
    a = load_task(make_cfg("retrieval", tmp_path, *args))
    assert (len(a.train), len(a.val), len(a.test)) == (5, 2, 3) and a.info["cache"] == "miss"
    b = load_task(make_cfg("retrieval", tmp_path, *args))
    assert b.info["cache"] == "hit" and torch.equal(a.train.tokens, b.train.tokens)
    picked = sorted((subset_indices(12, 5, 0, "train")).tolist())  # file order of the seeded subset
    full = load_task(make_cfg("retrieval", tmp_path, f"data.root={aan_root}", "task.seq_len=24"))
    assert torch.equal(a.train.tokens, full.train.tokens[picked])
    tsv = aan_root / "lra_release" / "tsv_data" / "new_aan_pairs.eval.tsv"
    tsv.write_text(tsv.read_text() + aan_line("1", "new", "pair", 99))
    assert load_task(make_cfg("retrieval", tmp_path, *args)).info["cache"] == "miss"


def test_retrieval_malformed_and_missing(tmp_path, aan_root):
    with pytest.raises(DataError, match="lra_release.gz"):
        load_task(make_cfg("retrieval", tmp_path))  # data.root unset
    with pytest.raises(DataError, match="lra_release.gz"):
        load_task(make_cfg("retrieval", tmp_path, f"data.root={tmp_path / 'nowhere'}"))
    tsv = aan_root / "lra_release" / "tsv_data" / "new_aan_pairs.test.tsv"
    lines = tsv.read_text().splitlines(keepends=True)
    tsv.write_text("".join(lines[:2]) + "1.0\tonly\tthree fields\n" + "".join(lines[2:]))
    with pytest.raises(DataError, match=r"new_aan_pairs\.test\.tsv:3: expected 5 tab-separated fields"):
        load_task(make_cfg("retrieval", tmp_path, f"data.root={aan_root}", "task.seq_len=8"))
    tsv.write_text("".join(lines[:1]) + aan_line("2.0", "a", "b", 7))
    with pytest.raises(DataError, match=r"test\.tsv:2: the label must be 0 or 1"):
        load_task(make_cfg("retrieval", tmp_path, f"data.root={aan_root}", "task.seq_len=8"))
    (aan_root / "lra_release" / "tsv_data" / "new_aan_pairs.eval.tsv").unlink()
    with pytest.raises(DataError, match=r"missing .*new_aan_pairs\.eval\.tsv"):
        load_task(make_cfg("retrieval", tmp_path, f"data.root={aan_root}"))


# ----------------------------------------------------------------------------------------------- image
def test_tf_grayscale_on_known_pixels():
    rgb = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255], [0, 0, 0], [10, 200, 30]], np.uint8)
    # truncate((0.2989 R + 0.5870 G + 0.1140 B) / 255 * 255.5)
    assert tf_grayscale(rgb).tolist() == [76, 149, 29, 255, 0, 124]
    green = Image.new("RGB", (1, 1), (0, 255, 0)).convert("L").getpixel((0, 0))
    assert green == 150  # PIL rounds 299/587/114 per mille: one level off TF, hence our own formula


CIFAR_COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255), (0, 0, 0),
                 (10, 200, 30), (40, 40, 40), (90, 10, 200), (128, 128, 0), (5, 250, 250)]


def cifar_dataset(n: int):
    """n flat-coloured PNG images; image i has label i % 10 and that label's colour."""
    import datasets

    cells = []
    for i in range(n):
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), CIFAR_COLOURS[i % 10]).save(buf, format="PNG")
        cells.append({"bytes": buf.getvalue(), "path": None})
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    labels = sorted(i % 10 for i in range(n))  # label-sorted, like the shared copy
    cells = [cells[lab] for lab in labels]
    return datasets.Dataset.from_dict({"img": cells, "label": labels}, features=features)


def write_cifar_parquet(root: Path) -> Path:
    """50 images (40 train, 10 test) as an HF parquet folder, root/cifar10."""
    folder = root / "cifar10" / "plain_text"
    folder.mkdir(parents=True)
    cifar_dataset(40).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    cifar_dataset(10).to_parquet(str(folder / "test-00000-of-00001.parquet"))
    return root / "cifar10"


@pytest.fixture
def cifar_parquet(tmp_path):
    return write_cifar_parquet(tmp_path)


def test_image_split_pixels_and_cache(tmp_path, cifar_parquet):
    data = load_task(make_cfg("image", tmp_path, f"data.path={cifar_parquet}"))
    assert (len(data.train), len(data.val), len(data.test)) == (36, 4, 10)
    assert data.vocab_size == 257 and data.train.tokens.shape == (36, 1024) and data.train.tokens.dtype == torch.int16
    gray = tf_grayscale(np.array(CIFAR_COLOURS, np.uint8)).astype(int) + 1
    for split in (data.train, data.val, data.test):  # every image still carries its own label's grey level
        assert all((row == gray[lab]).all() for row, lab in zip(split.tokens.numpy(), split.labels.tolist()))
    assert int(data.train.tokens.min()) >= 1  # the black image is id 1, not padding
    # membership is torch's random_split(train, [36, 4], seed 42) over the label-sorted rows
    train_idx, val_idx = torch.utils.data.random_split(range(40), [36, 4], generator=torch.Generator().manual_seed(42))
    sorted_labels = sorted(i % 10 for i in range(40))
    assert data.val.labels.tolist() == [sorted_labels[i] for i in val_idx.indices]
    assert data.train.labels.tolist() == [sorted_labels[i] for i in train_idx.indices]
    again = load_task(make_cfg("image", tmp_path, f"data.path={cifar_parquet}", "data.pixel_zero_is_pad=true"))
    assert again.info["cache"] == "hit"  # the id policy is applied after the cache
    assert again.vocab_size == 256 and again.train.tokens.dtype == torch.uint8
    assert torch.equal(again.train.tokens.to(torch.int16) + 1, data.train.tokens)
    reseeded = load_task(make_cfg("image", tmp_path, f"data.path={cifar_parquet}", "data.split_seed=1"))
    assert reseeded.info["cache"] == "miss"
    bump_mtime(cifar_parquet / "plain_text" / "train-00000-of-00001.parquet")
    assert load_task(make_cfg("image", tmp_path, f"data.path={cifar_parquet}")).info["cache"] == "miss"


def test_image_limits_and_errors(tmp_path, cifar_parquet):
    args = (f"data.path={cifar_parquet}", "data.limit.train=7", "data.limit.val=2", "data.limit.test=5")
    a = load_task(make_cfg("image", tmp_path / "a", *args))
    b = load_task(make_cfg("image", tmp_path / "b", *args))
    assert (len(a.train), len(a.val), len(a.test)) == (7, 2, 5)
    assert torch.equal(a.train.tokens, b.train.tokens) and torch.equal(a.test.labels, b.test.labels)
    assert len(set(a.test.labels.tolist())) > 1  # a random subset, not the label-sorted head
    with pytest.raises(DataError, match="uoft-cs/cifar10"):
        load_task(make_cfg("image", tmp_path, f"data.path={tmp_path / 'nothing_here'}"))
    with pytest.raises(ConfigError, match="task.seq_len=1024"):
        load_task(make_cfg("image", tmp_path, f"data.path={cifar_parquet}", "task.seq_len=512"))


# ------------------------------------------------------------------------------------------ pathfinder
META_FILES = (2, 10, 0)  # 10 sorts after 2 by integer stem, before it as text
PER_FILE = 14


def write_pathfinder(root: Path, res: int = 32) -> tuple[Path, list[int]]:
    """lra_release layout with one empty and one corrupt PNG. Image number g (in the conventional order)
    has pixel[0] = g + 1 so that tests can follow it; returns (release root, labels in order)."""
    folder = root / "lra_release" / f"pathfinder{res}" / "curv_contour_length_14"
    (folder / "metadata").mkdir(parents=True)
    rng = np.random.default_rng(0)
    labels = []
    for k in sorted(META_FILES):
        lines = []
        (folder / "imgs" / str(k)).mkdir(parents=True)
        for i in range(PER_FILE):
            label = int(rng.integers(2))
            lines.append(f"imgs/{k} sample_{i}.png {i} {label} 1.0 14 2 2 0.5 1 1")
            labels.append(label)
            px = rng.integers(0, 256, size=(res, res), dtype=np.uint8)
            px[0, 0] = (sorted(META_FILES).index(k) * PER_FILE + i) + 1
            Image.fromarray(px, mode="L").save(folder / "imgs" / str(k) / f"sample_{i}.png")
        (folder / "metadata" / f"{k}.npy").write_text("\n".join(lines) + "\n")
    (folder / "imgs" / "2" / "sample_3.png").write_bytes(b"")  # LRA's known empty file has a twin here
    (folder / "imgs" / "10" / "sample_5.png").write_bytes(b"\x89PNG not really")  # unreadable
    return root, labels


def order_ids() -> list[int]:
    """pixel[0] - 1 of each image in conventional order: metadata files by integer stem."""
    base = {k: sorted(META_FILES).index(k) * PER_FILE for k in META_FILES}
    return [base[k] + i for k in sorted(META_FILES) for i in range(PER_FILE)]


def test_pathfinder_layout_order_split_and_skips(tmp_path):
    root, labels = write_pathfinder(tmp_path / "release")
    data = load_task(make_cfg("pathfinder", tmp_path, f"data.root={root}"))
    empty_g = sorted(META_FILES).index(2) * PER_FILE + 3
    corrupt_g = sorted(META_FILES).index(10) * PER_FILE + 5
    ids = [g for g in order_ids() if g != empty_g]
    n = len(ids)  # 41 usable before decoding; 80/10/10 as random_split with seed 42
    parts = random_split_indices(n, [n - 2 * (n // 10), n // 10, n // 10], 42)
    assert data.info["skipped"] == 2 and data.vocab_size == 257 and data.seq_len == 1024
    for split, part in zip((data.train, data.val, data.test), parts):
        want = [ids[i] for i in part.tolist() if ids[i] != corrupt_g]
        assert (split.tokens[:, 0] - 2).tolist() == want  # id = pixel + 1 and pixel[0] = g + 1
        assert split.labels.tolist() == [labels[g] for g in want]
        assert split.tokens.shape[1] == 1024 and int(split.tokens.min()) >= 1
    assert len(data.train) + len(data.val) + len(data.test) == n - 1
    lra = load_task(make_cfg("pathfinder", tmp_path, f"data.root={root}", "data.pixel_zero_is_pad=true"))
    assert lra.info["cache"] == "hit" and lra.vocab_size == 256 and lra.train.tokens.dtype == torch.uint8


def test_pathfinder_cache_reuse_and_invalidation(tmp_path):
    root, _ = write_pathfinder(tmp_path / "release")
    args = (f"data.root={root}",)
    assert load_task(make_cfg("pathfinder", tmp_path, *args)).info["cache"] == "miss"
    hit = load_task(make_cfg("pathfinder", tmp_path, *args))
    assert hit.info["cache"] == "hit" and hit.info["skipped"] == 2  # the unreadable count is cached too
    cache_files = list((tmp_path / "cache").glob("pathfinder32_hard-*.pt"))
    assert len(cache_files) == 1  # one tensor file for all splits
    png = root / "lra_release" / "pathfinder32" / "curv_contour_length_14" / "imgs" / "0" / "sample_1.png"
    bump_mtime(png)
    assert load_task(make_cfg("pathfinder", tmp_path, *args)).info["cache"] == "miss"
    assert load_task(make_cfg("pathfinder", tmp_path, *args, "data.split_seed=7")).info["cache"] == "miss"
    limits = ("data.limit.train=6", "data.limit.val=2", "data.limit.test=2")
    limited = load_task(make_cfg("pathfinder", tmp_path, *args, *limits))
    assert (len(limited.train), len(limited.val), len(limited.test)) <= (6, 2, 2) and len(limited.train) >= 5


def test_pathfinder_errors(tmp_path):
    root, _ = write_pathfinder(tmp_path / "release")
    with pytest.raises(DataError, match="curv_baseline.*lra.generate pathfinder --resolution 32 --difficulty easy"):
        load_task(make_cfg("pathfinder", tmp_path, f"data.root={root}", "task.difficulty=easy"))
    with pytest.raises(DataError, match="pathfinder64.*lra_release.gz.*--resolution 64 --difficulty hard"):
        load_task(make_cfg("pathfinder", tmp_path, f"data.root={root}", "task.resolution=64", "task.seq_len=4096"))
    with pytest.raises(ConfigError, match="task.seq_len=4096"):
        load_task(make_cfg("pathfinder", tmp_path, f"data.root={root}", "task.resolution=64"))
    meta = root / "lra_release" / "pathfinder32" / "curv_contour_length_14" / "metadata" / "10.npy"
    meta.write_text(meta.read_text() + "imgs/10 sample_99.png 99\n")
    with pytest.raises(DataError, match=r"10\.npy:15: expected"):
        load_task(make_cfg("pathfinder", tmp_path, f"data.root={root}"))


def test_pathx_config_and_decoder(tmp_path):
    cfg = make_cfg("pathx", tmp_path)
    assert (cfg.task.resolution, cfg.task.seq_len, cfg.optim.grad_clip) == (128, 16384, 1.0)
    assert cfg.backbone.pooling == "mean"
    root, _ = write_pathfinder(tmp_path / "release", res=128)
    limits = ("data.limit.train=4", "data.limit.val=1", "data.limit.test=1")
    data = load_task(make_cfg("pathx", tmp_path, f"data.root={root}", *limits))
    assert data.seq_len == 16384 and data.train.tokens.shape[1] == 16384 and data.info["task"] == "pathx"
    pngs = sorted(str(p) for p in (root / "lra_release" / "pathfinder128").rglob("*.png"))[:6]
    serial = decode_pngs(pngs, 128)
    pooled = parallel_map(lambda_free_decode_128, pngs, workers=2, chunk=3, min_parallel=0)  # real processes
    assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(serial, pooled))


def lambda_free_decode_128(paths):
    return decode_pngs(paths, 128)


def test_pathfinder_generates_into_cache_when_root_is_null(tmp_path):
    pytest.importorskip("lra.data.pathfinder_gen", reason="lra.data.pathfinder_gen (the generator) is not there yet")
    assert images_needed({"train": 240, "val": 48, "test": 48}, 200_000) == 480  # the smoke limits
    assert images_needed({"train": 4, "val": 1, "test": 1}, 200_000) == 10
    args = ("data.limit.train=4", "data.limit.val=1", "data.limit.test=1", "data.workers=1", "trainer.progress=false")
    data = load_task(make_cfg("pathfinder", tmp_path, *args))
    assert (len(data.train), len(data.val), len(data.test)) == (4, 1, 1)
    assert data.train.tokens.shape == (4, 1024) and set(data.train.labels.tolist()) <= {0, 1}
    pngs = list((tmp_path / "cache" / "pathfinder_gen").rglob("*.png"))
    assert len(pngs) == 10  # only what the limits need
    assert load_task(make_cfg("pathfinder", tmp_path, *args)).info["cache"] == "hit"


# ------------------------------------------------------------------------------------------- real data
@pytest.mark.skipif(not (SHARED / "imdb").is_dir() or not (SHARED / "cifar10").is_dir(),
                    reason=f"no real IMDb / CIFAR-10 parquet folders at {SHARED} (a fresh clone without ../shared)")
def test_real_imdb_and_cifar_slices(tmp_path):
    limits = ("data.limit.train=24", "data.limit.val=8", "data.limit.test=8")
    text = load_task(make_cfg("text", tmp_path, f"data.path={SHARED / 'imdb'}", "task.seq_len=512", *limits))
    assert text.train.tokens.shape == (24, 512) and set(text.train.labels.tolist()) == {0, 1}
    assert int(text.train.tokens.max()) <= 256 and (text.train.tokens[:, 0] > 0).all()
    image = load_task(make_cfg("image", tmp_path, f"data.path={SHARED / 'cifar10'}", *limits))
    assert image.train.tokens.shape == (24, 1024) and len(set(image.train.labels.tolist())) > 3
    assert 1 <= int(image.train.tokens.min()) and int(image.train.tokens.max()) <= 256
    assert "45000, 5000" in image.info["split"]
