"""Packed batches (lra.train.packing, trainer.pack): the layout, exact equality with unpacked rows for every mixer that
declares it keeps segments apart (outputs and gradients), and the runner's use of it; trimmed batches
(trainer.trim) and length-grouped batching (schedule.batching)."""
from __future__ import annotations

import contextlib
import json

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

import lra.train.run as runner
import models.base as base
from lra.data import BatchOrder, Split
from lra.errors import ConfigError
from lra.train.encoder import build_classifier
from lra.train.packing import first_fit_decreasing, model_inputs, pack, real_ends, real_lengths, trim
from models import create_model, list_models
from models.registry import get_model_class
from models.transformer import run_starts
from tests.test_data_tasks import aan_root  # noqa: F401 (fixture)

SEGMENT_MODELS = [n for n in list_models() if getattr(get_model_class(n), "supports_segments", False)]
TINY = ("task.seq_len=1000", "backbone.n_layers=1", "backbone.dropout=0.0", "backbone.attn_dropout=0.0",
        "schedule.steps=12", "schedule.eval_every=6")


def padded_batch(n: int, length: int, vocab: int = 20, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (n,), generator=g)
    lengths[0] = length  # one example at the cap, as in most real batches
    tokens = torch.randint(1, vocab, (n, length), generator=g)
    tokens[torch.arange(length) >= lengths[:, None]] = 0  # (n, length), right-padded
    return tokens


def test_first_fit_decreasing_places_longest_first_into_the_first_row_with_room():
    assert first_fit_decreasing([3, 8, 5, 2], 10) == [(1, 5), (0, 0), (1, 0), (0, 8)]
    assert first_fit_decreasing([], 10) == []


def test_pack_layout():
    tokens = torch.tensor([[5, 6, 7, 0, 0, 0], [1, 2, 0, 0, 0, 0], [9, 9, 9, 9, 9, 9], [4, 0, 0, 0, 0, 0]])
    p = pack(tokens, cls_token=True)
    # sizes with the CLS slot: 4, 3, 7, 2 into rows of 7: [ex 2], [ex 0 | ex 1], [ex 3]
    assert p.tokens.tolist() == [[0, 9, 9, 9, 9, 9, 9], [0, 5, 6, 7, 0, 1, 2], [0, 4, 0, 0, 0, 0, 0]]
    assert p.segments.tolist() == [[3] * 7, [1, 1, 1, 1, 2, 2, 2], [4, 4, 0, 0, 0, 0, 0]]
    assert p.positions.tolist() == [list(range(7)), [0, 1, 2, 3, 0, 1, 2], [0, 1, 0, 0, 0, 0, 0]]
    assert p.starts.tolist() == [7, 11, 0, 14]
    no_cls = pack(tokens, cls_token=False)
    assert no_cls.tokens.shape == (2, 6) and no_cls.positions[1].tolist() == [0, 1, 2, 0, 1, 0]


def reference_pack(tokens: torch.Tensor, cls_token: bool) -> tuple[list, list, list, list]:
    """The packed layout written out example by example: what ``pack`` must produce."""
    slot, M = int(cls_token), tokens.shape[1] + int(cls_token)
    lengths = [int((row != 0).sum()) for row in tokens]
    place = first_fit_decreasing([n + slot for n in lengths], M)
    R = max((row for row, _ in place), default=0) + 1
    out, seg, pos = ([[0] * M for _ in range(R)] for _ in range(3))
    for b, ((row, col), n) in enumerate(zip(place, lengths, strict=True)):
        for i in range(slot + n):
            seg[row][col + i], pos[row][col + i] = b + 1, i
            if i >= slot:
                out[row][col + i] = int(tokens[b, i - slot])
    return out, seg, pos, [row * M + col for row, col in place]


@pytest.mark.parametrize("cls_token", [True, False])
@pytest.mark.parametrize("n", [1, 7, 32])
def test_pack_equals_the_layout_written_out_example_by_example(n, cls_token):
    tokens = padded_batch(n, 40, seed=n)
    tokens[-1] = 0  # an empty example too
    p = pack(tokens, cls_token)
    assert [p.tokens.tolist(), p.segments.tolist(), p.positions.tolist(), p.starts.tolist()] == \
        list(reference_pack(tokens, cls_token))


def test_packing_a_batch_takes_as_many_tensor_operations_for_64_examples_as_for_4():
    """On a GPU the host builds each packed batch while the device waits: one operation per example (a Python loop)
    cost more host time than packing saved (docs/performance.md, packing), so the count must not grow with the batch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for n in (4, 64):
        tokens = padded_batch(n, 100, seed=1)
        Count.calls = 0
        with Count():
            pack(tokens, cls_token=True)
        counts.append(Count.calls)
    assert counts[0] == counts[1] < 60


def test_a_pad_inside_an_example_is_refused():
    with pytest.raises(ValueError, match="example 1 of the batch has a pad inside it"):
        real_lengths(torch.tensor([[1, 2, 0], [1, 0, 2]]))


def classifier(name: str, pooling: str, pair: bool = False, n_layers: int = 2):
    """A small fp64 classifier; ``name`` may be "<model>:<backend>" (a mixer attribute: how it runs, e.g. the
    transformer's "jagged", CUDA's packed path, on the CPU), set on every layer."""
    name, _, backend = name.partition(":")
    bb = OmegaConf.create(dict(n_layers=n_layers, d_model=32, n_heads=4, d_qkv=32, d_ff=64, dropout=0.0,
                               attn_dropout=0.0, pooling=pooling, d_classifier=16))
    model = build_classifier(name, {}, bb, vocab_size=20, seq_len=48, n_classes=3, pair=pair).double()
    for block in model.encoder.blocks if backend else ():
        block.mixer.backend = backend
    return model


@pytest.mark.parametrize("name", SEGMENT_MODELS + ["transformer:jagged"])  # CUDA's path for the transformer, on CPU
@pytest.mark.parametrize("pooling", ["cls", "mean", "last"])
@pytest.mark.parametrize("pair", [False, True])
def test_packed_outputs_and_gradients_equal_unpacked(name, pooling, pair):
    torch.manual_seed(0)
    model = classifier(name, pooling, pair)
    tokens = padded_batch(12, 48)
    if pair:
        tokens = tokens.view(6, 2, 48)
    inputs = model_inputs(tokens, True, cls_token=pooling == "cls")
    assert inputs[0].shape[0] < tokens.reshape(-1, 48).shape[0]  # fewer rows than examples
    labels = torch.arange(tokens.shape[0]) % 3

    def loss_and_grads(*args):
        model.zero_grad()
        logits = model(*args)
        torch.nn.functional.cross_entropy(logits, labels).backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    ref, ref_grads = loss_and_grads(tokens)
    out, grads = loss_and_grads(*inputs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10)


def test_jagged_runs_of_packed_rows():
    """Each example is one sequence of the jagged batch; the padding after a row's last example is another."""
    segments = torch.tensor([[1, 1, 1, 2, 2, 0], [3, 3, 3, 3, 3, 3], [4, 4, 0, 0, 0, 0]])
    assert run_starts(segments).tolist() == [0, 3, 5, 6, 12, 14, 18]


def test_the_varlen_path_hands_the_kernel_each_run_end_to_end(monkeypatch):
    """``varlen_attention``'s layout on the CPU, the CUDA kernel replaced by softmax attention over each run it is
    handed: equal to the block-diagonal mask's attention (what the kernel computes is held to it on a GPU)."""
    import models.transformer as transformer

    def per_run(q, k, v, offsets, max_len, dropout_p, scale):  # (T, H, Dh) each, runs at offsets
        assert offsets.dtype == torch.int32 and max_len == 6 and dropout_p == 0.0
        out = torch.empty_like(q)
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            assert b - a <= max_len
            out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1) for x in (q, k, v)), scale=scale).transpose(0, 1)
        return out

    monkeypatch.setattr(transformer, "flash_varlen", per_run)
    segments = torch.tensor([[1, 1, 1, 2, 2, 0], [3, 3, 3, 3, 3, 3], [4, 4, 0, 0, 0, 0]])
    q, k, v = torch.randn(3, 3, 2, 6, 8, dtype=torch.float64).unbind(0)  # each (R, H, M, Dh)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=base.same_segment(segments),
                                                             scale=0.5)
    transformer.run_starts.cache_clear()
    torch.testing.assert_close(transformer.varlen_attention(q, k, v, segments, 0.0, 0.5), dense)


def test_the_packed_path_is_the_one_asked_for_where_it_can_run():
    mixer = create_model("transformer", d_model=32, n_heads=4, d_qkv=32, dropout=0.0, max_len=16)
    cpu = torch.zeros(1, 4, 16, 8)
    assert mixer.packed_path(cpu) == "dense"  # auto, off CUDA
    mixer.backend = "varlen"
    assert mixer.packed_path(cpu) == "jagged"  # flash's kernel is CUDA's: its twin runs
    mixer.backend = "flash"
    with pytest.raises(ValueError, match="backend must be one of auto, varlen, jagged, dense, small_head, got 'flash'"):
        mixer.packed_path(cpu)


@pytest.mark.parametrize("name", ["linear", "performer"])
def test_a_packed_forward_reads_its_segments_once_not_once_a_layer(name, monkeypatch):
    """The kernel mixers' segment membership is read off the device (S, the most examples in a row): once per
    forward, shared by its layers, not a host synchronisation in every layer."""
    import models.base as base

    calls, onehot = [], base.segment_onehot
    monkeypatch.setattr(base, "segment_onehot", lambda seg: calls.append(1) or onehot(seg))
    model = classifier(name, "cls", n_layers=3)
    inputs = model_inputs(padded_batch(6, 47), packed=True, cls_token=True)
    model(*inputs)
    assert len(calls) == 1
    model(*model_inputs(padded_batch(6, 47, seed=1), packed=True, cls_token=True))  # another batch: read anew
    assert len(calls) == 2


def test_a_mixer_that_cannot_keep_segments_apart_refuses_them():
    mixer = create_model("nystromformer", d_model=32, n_heads=4, d_qkv=32, dropout=0.0, max_len=16)
    segments = torch.ones(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match="supports_segments=False"):
        mixer(torch.randn(2, 16, 32), segments != 0, segments=segments)
    causal = create_model("linear", d_model=32, n_heads=4, d_qkv=32, dropout=0.0, max_len=16, causal=True)
    assert not causal.supports_segments  # a causal prefix would run on into the next example
    assert not classifier("linformer", "cls").supports_packing and classifier("transformer", "cls").supports_packing


def test_a_packed_run_equals_an_unpacked_one(smoke_cfg, tmp_path):
    plain = runner.run(smoke_cfg(*TINY))
    packed = runner.run(smoke_cfg(*TINY, "trainer.pack=true", f"run_dir={tmp_path / 'packed'}"))
    assert packed["packed"] is True and plain["packed"] is False
    assert packed["config_hash"] == plain["config_hash"]  # exact: a speed setting, not a different run
    for key in ("val_acc", "test_acc", "final_val_acc", "final_test_acc", "best_step"):
        assert packed[key] == pytest.approx(plain[key]), key
    rows = pd.read_csv(tmp_path / "results" / "runs.csv")
    assert rows.packed.tolist() == [False, True]
    losses = [[h["train_loss"] for h in json.loads((tmp_path / d / "history.json").read_text())]
              for d in ("run", "packed")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)  # the same updates, step by step


def test_a_pair_task_packs_both_documents_and_trims_exactly(smoke_cfg, tmp_path, aan_root):  # noqa: F811
    pair = (f"data.root={aan_root}", "task=retrieval", "task.seq_len=64", "backbone.n_layers=1",
            "backbone.dropout=0.0", "backbone.attn_dropout=0.0", "schedule.batch_size=4", "schedule.steps=6",
            "schedule.eval_every=3", "trainer.eval_batch_size=4")
    plain = runner.run(smoke_cfg(*pair))
    fast = runner.run(smoke_cfg(*pair, "trainer.pack=true", "trainer.trim=true", f"run_dir={tmp_path / 'fast'}"))
    assert fast["packed"] is True and fast["config_hash"] == plain["config_hash"]
    for key in ("val_acc", "test_acc", "final_test_acc", "best_step"):
        assert fast[key] == pytest.approx(plain[key]), key
    losses = [[h["train_loss"] for h in json.loads((tmp_path / d / "history.json").read_text())]
              for d in ("run", "fast")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)  # the same updates, step by step


def test_pack_true_says_why_it_cannot_and_auto_falls_back(smoke_cfg, tmp_path):
    with pytest.raises(ConfigError, match="model linformer cannot keep packed examples apart .*transformer"):
        runner.run(smoke_cfg(*TINY, "model=linformer", "trainer.pack=true"))
    with pytest.raises(ConfigError, match="task listops has no padding"):  # every example cut at 256 tokens
        runner.run(smoke_cfg(*TINY, "task.seq_len=256", "trainer.pack=true", f"run_dir={tmp_path / 'cut'}"))
    assert not (tmp_path / "results" / "runs.csv").exists()  # a refused configuration records no row
    row = runner.run(smoke_cfg(*TINY, "model=linformer", "trainer.pack=auto", f"run_dir={tmp_path / 'auto'}"))
    assert row["status"] == "ok" and row["packed"] is False


@pytest.mark.heavy  # CI's second tier: compiles every packing model on the CPU
@pytest.mark.parametrize("name", SEGMENT_MODELS + ["transformer:jagged"])
def test_a_compiled_model_takes_packed_batches_of_any_row_count(name):
    """The row count changes every batch: torch.compile must follow (the second shape compiles a dynamic graph)
    and match eager; the jagged transformer and the kernel mixers read sizes off the data outside the graph."""
    torch.manual_seed(0)
    model = classifier(name, "cls", n_layers=1).float()  # one layer: the compile time is the test's
    compiled = torch.compile(model)
    batches = [model_inputs(padded_batch(10, 48, seed=seed), True, cls_token=True) for seed in (0, 2)]
    assert batches[0][0].shape[0] != batches[1][0].shape[0]  # two row counts
    for inputs in batches:
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)


def test_trim_is_not_applied_where_outputs_depend_on_the_padded_length(smoke_cfg, caplog):
    cfg = smoke_cfg(*TINY, "model=local", "model.strided=true", "trainer.trim=true")
    with caplog.at_level("WARNING", logger="lra"):
        assert runner.run(cfg)["status"] == "ok"
    assert "trainer.trim: not applied: model local's outputs depend on the padded length" in caplog.text
    assert classifier("local", "cls").supports_trimming and classifier("transformer", "mean").supports_trimming


def test_trim_cuts_after_the_batchs_last_real_token_to_a_multiple():
    tokens = torch.zeros(3, 2, 1000, dtype=torch.long)
    tokens[0, 1, :300] = 5  # the longer document decides
    tokens[1, 0, :10] = 5
    tokens[2, 0, [0, 2]] = 5  # a pad inside an example stays a pad, in place
    assert real_ends(tokens).tolist() == [300, 10, 3] and real_ends(torch.zeros(2, 5)).tolist() == [0, 0]
    assert trim(tokens).shape == (3, 2, 384) and trim(tokens[1:]).shape == (2, 2, 128)
    assert trim(tokens, multiple=256).shape[-1] == 512 and trim(torch.ones(2, 100)).shape == (2, 100)


def test_length_grouped_batches_hold_similar_lengths_and_cover_the_epoch():
    lengths = torch.randint(1, 2000, (640,), generator=torch.Generator().manual_seed(0))
    plain, grouped = BatchOrder(640, 32, 0), BatchOrder(640, 32, 0, lengths=lengths, group=4)
    epoch = [grouped.indices(s) for s in range(20)]
    assert sorted(torch.cat(epoch).tolist()) == list(range(640))  # every example once per epoch
    spread = lambda order: sum(float(lengths[order.indices(s)].max() - lengths[order.indices(s)].min())
                               for s in range(20)) / 20
    assert spread(grouped) < 0.3 * spread(plain)  # each batch spans a small part of the lengths
    again = BatchOrder(640, 32, 0, lengths=lengths, group=4)
    assert torch.equal(again.indices(27), grouped.indices(27))  # a pure function of (seed, step): resumable


def test_a_trimmed_run_equals_an_untrimmed_one_and_length_grouping_is_named(smoke_cfg, tmp_path, monkeypatch):
    kept = []

    def recording_trim(tokens):
        kept.append((runner_trim(tokens).shape[-1], tokens.shape[-1]))
        return runner_trim(tokens)

    runner_trim = runner.trim
    monkeypatch.setattr(runner, "trim", recording_trim)
    grouped = (*TINY, "schedule.batching=length_grouped")
    full = runner.run(smoke_cfg(*grouped))
    trimmed = runner.run(smoke_cfg(*grouped, "trainer.trim=true", f"run_dir={tmp_path / 'trim'}"))
    assert any(k < n for k, n in kept)  # some batches were cut
    assert trimmed["config_hash"] == full["config_hash"] and trimmed["batching"] == "length_grouped"
    for key in ("val_acc", "test_acc", "final_test_acc", "best_step"):
        assert trimmed[key] == pytest.approx(full[key]), key
    plain = runner.run(smoke_cfg(*TINY, f"run_dir={tmp_path / 'plain'}"))
    assert plain["batching"] == "random" and plain["config_hash"] != full["config_hash"]


def test_a_trimmed_evaluation_goes_in_length_order_and_counts_the_same():
    """Evaluation batches sorted by length are each cut near their own length; the accuracy is the untrimmed one."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 1024, (96,), generator=g)
    tokens = torch.where(torch.arange(1024)[None] < lengths[:, None], torch.randint(1, 9, (96, 1024), generator=g), 0)
    split = Split(tokens, torch.randint(0, 2, (96,), generator=g))
    seen = []

    class ParityOfTheFirstToken(torch.nn.Module):  # a fixed rule per example, whatever its padding
        def forward(self, tokens):
            seen.append(tokens.shape[-1])
            first = tokens[:, 0] % 2
            return torch.stack([1 - first, first], -1).float()

    model, no_autocast = ParityOfTheFirstToken(), contextlib.nullcontext
    full = runner.accuracy(model, split, 16, torch.device("cpu"), no_autocast, cls_token=False)
    widths_full, seen[:] = list(seen), []
    cut = runner.accuracy(model, split, 16, torch.device("cpu"), no_autocast, cls_token=False, trimmed=True)
    assert cut == full and widths_full == [1024] * 6
    assert seen == sorted(seen) and sum(seen) < 0.7 * sum(widths_full)  # short batches first, most cut well short


@pytest.mark.gpu
@pytest.mark.parametrize("name", SEGMENT_MODELS + ["transformer:varlen"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_cuda_packed_rows_equal_unpacked_compiled_and_eager(name, precision):
    """The CUDA paths (fused kernels, fla's variable-length scans, compiled cores, the whole model compiled): the
    logits of packed rows equal the unpacked ones, within the precision's rounding."""
    torch.manual_seed(0)
    model = classifier(name, "cls").float().cuda().eval()
    tokens = padded_batch(24, 48)
    inputs = tuple(t.cuda() for t in model_inputs(tokens, True, cls_token=True))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    tol = dict(rtol=5e-2, atol=5e-2) if precision == "bf16" else dict(rtol=2e-3, atol=2e-3)
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=precision == "bf16"):
        ref = model(tokens.cuda()).float()
        torch.testing.assert_close(model(*inputs).float(), ref, **tol)
        compiled = torch.compile(model)
        for seed in range(2):  # two row counts: the compiled model follows
            batch = padded_batch(24, 48, seed=seed + 1)
            packed = tuple(t.cuda() for t in model_inputs(batch, True, cls_token=True))
            torch.testing.assert_close(compiled(*packed).float(), model(batch.cuda()).float(), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["varlen", "jagged"])
def test_on_cuda_the_packed_transformer_trains_fused_with_attention_dropout(monkeypatch, path):
    """LRA's attention dropout on packed rows goes to the fused kernels (a block-diagonal mask would leave SDPA only
    its slow memory-efficient kernel) and trains: finite gradients. Under bf16 "auto" takes varlen; jagged is named.
    Equality: the CPU tests."""
    import models.transformer as transformer
    calls, fused = [], getattr(transformer, f"{path}_attention")
    monkeypatch.setattr(transformer, f"{path}_attention", lambda *a: calls.append(a[4]) or fused(*a))  # dropout_p
    torch.manual_seed(0)
    bb = OmegaConf.create(dict(n_layers=2, d_model=64, n_heads=4, d_qkv=64, d_ff=64, dropout=0.0, attn_dropout=0.1,
                               pooling="cls", d_classifier=16))
    model = build_classifier("transformer", {}, bb, vocab_size=20, seq_len=48, n_classes=3).cuda().train()
    for block in model.encoder.blocks:
        block.mixer.backend = "auto" if path == "varlen" else path
    tokens = padded_batch(24, 48)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(*(t.cuda() for t in model_inputs(tokens, True, cls_token=True))).float().sum().backward()
    assert calls == [0.1, 0.1] and all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", SEGMENT_MODELS)
def test_packed_rows_keep_batchnorm_statistics_and_recipe_backbones_exact(name):
    """S4-style blocks (BatchNorm over real tokens, post-norm, no MLP, no positions, mean pooling), in training
    mode: the batch statistics see the same real tokens packed or not."""
    torch.manual_seed(0)
    bb = OmegaConf.create(dict(n_layers=2, d_model=32, n_heads=4, d_qkv=32, d_ff=32, dropout=0.0, attn_dropout=0.0,
                               pooling="mean", cls_token=False, d_classifier=16, norm="batchnorm", prenorm=False,
                               mlp=False, positions="none"))
    model = build_classifier(name, {}, bb, vocab_size=20, seq_len=48, n_classes=3).double().train()
    tokens = padded_batch(12, 48)
    ref = model(tokens)
    torch.testing.assert_close(model(*model_inputs(tokens, True, cls_token=False)), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.gpu
def test_on_cuda_the_varlen_path_trains_as_the_jagged_one():
    """The flash kernel called directly (auto's choice under bf16) and through the nested tensor: the same logits
    and gradients (bf16, no dropout), and with LRA's attention dropout finite gradients through the direct call."""
    torch.manual_seed(0)
    tokens = padded_batch(24, 48)
    results = []
    probe = torch.zeros(1, 4, 16, 8, device="cuda")
    mixer = create_model("transformer", d_model=32, n_heads=4, d_qkv=32, dropout=0.0, max_len=16)
    assert mixer.packed_path(probe.bfloat16()) == "varlen" and mixer.packed_path(probe) == "jagged"  # auto
    for backend in ("jagged", "varlen"):
        torch.manual_seed(0)  # the same weights for both
        model = classifier(f"transformer:{backend}", "cls").float().cuda().train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(*(t.cuda() for t in model_inputs(tokens, True, cls_token=True))).float()
        logits.sum().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()]))
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=5e-2, atol=5e-2)
    for block in model.encoder.blocks:
        block.mixer.attn_dropout = 0.1  # LRA's attention dropout (dropout_p while training)
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(*(t.cuda() for t in model_inputs(tokens, True, cls_token=True))).float().sum().backward()
    assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)


@pytest.mark.heavy  # CI's second tier: a compiled run on the CPU
def test_compiled_trimmed_training_keeps_the_batch_size_an_int(smoke_cfg, monkeypatch):
    """Evaluated after the first step (batches of another size, through the same code), then trained at a new
    length: torch.compile recompiles the training graph with the length a symbol, and the batch size must stay an
    int there (a FlexAttention table's gradient needs int sizes: models/patterns.score_table)."""
    batch_dims = []  # per training graph: the token ids' (batch size, length) as traced

    def recording(graph, example_inputs):
        if torch.is_grad_enabled():
            traced = [node.meta["example_value"] for node in graph.graph.nodes if node.op == "placeholder"]
            ids = [t for t in traced if isinstance(t, torch.Tensor) and t.dtype == torch.long and t.dim() == 2]
            batch_dims.append((ids[0].shape[0], ids[0].shape[1]))
        return graph.forward

    real_compile = torch.compile
    monkeypatch.setattr(runner.engine, "resolve_compile", lambda flag, device: True)
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, **kw: real_compile(model, backend=recording))
    row = runner.run(smoke_cfg(*TINY, "trainer.trim=true", "trainer.compile=true", "schedule.steps=12",
                               "schedule.batching=length_grouped", "schedule.eval_every=1",
                               "trainer.compile_check=false"))  # the check's graphs are its own (reset after it)
    assert row["status"] == "ok" and row["compiled"]
    assert any(type(length) is not int for _, length in batch_dims), batch_dims  # a graph with a symbolic length
    assert all(type(batch) is int for batch, _ in batch_dims), batch_dims
