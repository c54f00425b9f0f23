"""ListOps generator (LRA's algorithm, seeded) and loader."""
from __future__ import annotations

import random
import statistics
from collections import Counter

import pytest
import torch

from lra.data import listops
from lra.data.listops import OPERATORS, VOCAB, generate, generate_trees, read_tsv, token_ids, tokenize
from lra.errors import DataError


@pytest.fixture(scope="module")
def reference_trees():
    """LRA's algorithm (lra_benchmarks/data/listops.py), random.seed(0), run to 3,000 accepted trees."""
    return generate_trees(random.Random(0), 3000)


def op_depth(source: str) -> int:
    depth = best = 0
    for tok in source.split():
        if tok in OPERATORS:
            depth += 1
            best = max(best, depth)
        elif tok == "]":
            depth -= 1
    return best


@pytest.mark.heavy  # CI's second tier: thousands of trees against the reference
def test_generator_matches_reference_statistics(reference_trees):
    rows, drawn = reference_trees
    assert drawn == 36_618  # the original's count at seed 0: same RNG call order as the original
    lengths = [len(tokenize(s)) for s, _ in rows]
    assert min(lengths) > 500 and max(lengths) < 2000
    assert statistics.median(lengths) == pytest.approx(994.5, abs=30)
    assert statistics.mean(lengths) == pytest.approx(1063.7, abs=30)
    labels = Counter(v for _, v in rows)
    expected = [17.1, 9.1, 7.7, 7.8, 9.0, 8.8, 7.7, 7.6, 7.7, 17.3]
    for d in range(10):
        assert 100 * labels[d] / len(rows) == pytest.approx(expected[d], abs=1.0), d
    assert {op_depth(s) for s, _ in rows} == {9}
    ops = Counter(t for s, _ in rows for t in s.split() if t in OPERATORS)
    total = sum(ops.values())
    for op in OPERATORS:
        assert ops[op] / total == pytest.approx(0.25, abs=0.01)


def evaluate(source: str) -> int:
    """An independent evaluator of the printed expression (stack machine over the rewritten tokens)."""
    stack: list = []
    for tok in source.split():
        if tok in ("(", ")"):
            continue
        if tok == "]":
            args = []
            while not isinstance(stack[-1], str):
                args.append(stack.pop())
            op = stack.pop()
            stack.append(listops.apply_op(op, args[::-1]))
        elif tok in OPERATORS:
            stack.append(tok)
        else:
            stack.append(int(tok))
    (value,) = stack
    return value


def test_labels_are_the_expressions_values(reference_trees):
    rows, _ = reference_trees
    for source, value in rows[:300]:
        assert evaluate(source) == value


def test_median_operator_truncates_like_numpy():
    assert listops.apply_op("[MED", [1, 2]) == 1  # int(numpy.median([1, 2])) = int(1.5)
    assert listops.apply_op("[MED", [3, 1, 2]) == 2
    assert listops.apply_op("[SM", [7, 8]) == 5


def test_same_seed_gives_byte_identical_files(tmp_path):
    a = generate(tmp_path / "a", seed=3, train=40, val=8, test=8, workers=1, progress=False)
    b = generate(tmp_path / "b", seed=3, train=40, val=8, test=8, workers=2, progress=False)
    c = generate(tmp_path / "c", seed=4, train=40, val=8, test=8, workers=1, progress=False)
    for split in ("train", "val", "test"):
        assert (a / f"basic_{split}.tsv").read_bytes() == (b / f"basic_{split}.tsv").read_bytes()
    assert (a / "basic_train.tsv").read_bytes() != (c / "basic_train.tsv").read_bytes()


def test_tsv_round_trip_and_uniqueness(tmp_path):
    folder = generate(tmp_path, seed=0, train=30, val=6, test=6, workers=1, progress=False)
    # csv's default line end, as the original
    assert (folder / "basic_train.tsv").read_bytes().startswith(b"Source\tTarget\r\n")
    sources = set()
    for split, n in (("train", 30), ("val", 6), ("test", 6)):
        data = read_tsv(folder / f"basic_{split}.tsv", seq_len=2000)
        assert data.tokens.shape == (n, 2000) and data.tokens.dtype == torch.uint8
        with open(folder / f"basic_{split}.tsv") as f:
            rows = [line.rstrip("\r\n").split("\t") for line in f][1:]
        for i, (source, target) in enumerate(rows):
            ids = tokenize(source)
            assert data.tokens[i, : len(ids)].tolist() == ids and data.tokens[i, len(ids):].eq(0).all()
            assert data.labels[i].item() == int(target) == evaluate(source)
            sources.add(source)
    assert len(sources) == 42  # unique across splits


def test_tokenizer_follows_lra_rewrite():
    ids = tokenize("( ( ( [MAX 2 ) 9 ) ] )")
    assert [VOCAB[i] for i in ids] == ["[MAX", "2", "9", "]"]
    assert 0 not in ids and len(VOCAB) == 16  # pad + 15 symbols


@pytest.mark.parametrize("source", ["( ( ( [MAX 2 ) 9 ) ] )", "[SM 1 ]", "( [MIN\t3\u00a0] )\x1c(", "", "( )",
                                    "[MED ( 0 ( 9 ] ] ) )"])
def test_read_tsvs_tokenizer_is_the_rewrite(source):
    """read_tsv's string-operation tokenizer gives ``tokenize``'s ids, whatever whitespace split() separates on."""
    assert token_ids(source).tolist() == tokenize(source)


@pytest.mark.parametrize("source", ["( [MEAN 2 ] )", "( [MIN 12 ] )", "( [MIN 1 ]) )", "[MINX", "a 1"])
def test_read_tsvs_tokenizer_refuses_what_tokenize_refuses(source):
    with pytest.raises(KeyError):
        tokenize(source)
    with pytest.raises(KeyError):
        token_ids(source)


def test_truncation(tmp_path):
    folder = generate(tmp_path, seed=0, train=5, val=1, test=1, workers=1, progress=False)
    data = read_tsv(folder / "basic_train.tsv", seq_len=100)
    assert data.tokens.shape == (5, 100) and data.tokens.ne(0).all()  # every tree is longer than 500


@pytest.mark.parametrize("line, message", [
    ("( [MAX 2 ] )\t10", "target must be an integer 0-9"),
    ("( [MAX 2 ] )\tx", "target must be an integer 0-9"),
    ("( [MEAN 2 ] )\t2", r"unknown ListOps symbol '\[MEAN'"),
    ("( [MAX 2 ] )", "expected 2 tab-separated fields"),
])
def test_malformed_input_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "basic_train.tsv"
    path.write_text(f"Source\tTarget\n( [MIN 1 ] )\t1\n{line}\n")
    with pytest.raises(DataError, match=message) as e:
        read_tsv(path, 2000)
    assert f"{path}:3" in str(e.value)


def test_missing_release_folder_says_how_to_get_it(smoke_cfg, tmp_path):
    from lra.data import load_task

    with pytest.raises(DataError, match="lra_release.gz"):
        load_task(smoke_cfg(f"data.root={tmp_path / 'nowhere'}"))


def test_loader_caches_and_invalidates(smoke_cfg, tmp_path):
    from lra.data import load_task

    folder = generate(tmp_path / "release", seed=1, train=20, val=4, test=4, workers=1, progress=False)
    cold = f"data.cache_dir={tmp_path / 'cache'}"
    cfg = smoke_cfg(f"data.root={tmp_path / 'release'}", cold)
    first = load_task(cfg)
    assert first.info["cache"] == "miss" and len(first.train) == 20
    second = load_task(cfg)
    assert second.info["cache"] == "hit" and torch.equal(first.train.tokens, second.train.tokens)
    path = folder / "basic_test.tsv"
    path.write_text(path.read_text().replace("\t", "\t", 1))  # same content, new mtime: still a new source
    assert load_task(cfg).info["cache"] == "miss"
    assert load_task(smoke_cfg(f"data.root={tmp_path / 'release'}", cold, "task.seq_len=1000")).info["cache"] == "miss"


def test_smoke_generates_only_its_slice(smoke_cfg, tmp_path):
    from lra.data import load_task

    data = load_task(smoke_cfg(f"data.cache_dir={tmp_path / 'cache'}"))
    assert (len(data.train), len(data.val), len(data.test)) == (160, 32, 32)
    assert data.info["cache"] == "miss"
    generated = list((tmp_path / "cache" / "listops").glob("*/listops-1000/basic_train.tsv"))
    assert len(generated) == 1 and generated[0].read_text().count("\n") == 161
