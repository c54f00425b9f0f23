"""Tests over the whole registry: a model is covered the moment it registers."""
from __future__ import annotations

import inspect
import math
import re
import sys
import time

import pytest
import torch

import lra.train.run as runner
from lra.train.encoder import Classifier, Encoder
from models import create_model, get_model_class, list_models
from models.base import checked_setting, execution_settings
from models.registry import CLASSES, COMPLEXITIES, Grid, Taxonomy

MODELS = list_models()
GRID_MODELS = [m for m in MODELS if getattr(get_model_class(m), "needs_grid", False)]
SEQUENCE_MODELS = [m for m in MODELS if m not in GRID_MODELS]
LRA_TABLE_1 = {"transformer", "local", "sparse", "longformer", "linformer", "reformer", "sinkhorn", "synthesizer",
               "bigbird", "linear", "performer"}
GRID_16 = Grid(16, 16, prefix=1)  # the CLS slot + 16 x 16 pixels: N = 257


def make(name: str, d_model=32, n_heads=2, max_len=300, dropout=0.0):
    torch.manual_seed(0)
    return create_model(name, d_model=d_model, n_heads=n_heads, d_qkv=d_model, dropout=dropout, max_len=max_len)


def mix(model, x: torch.Tensor, mask: torch.Tensor | None, grid: Grid = GRID_16) -> torch.Tensor:
    """``model(x, mask)``, with the pixel grid for a 2-D mixer (``x`` must then hold ``grid.length`` tokens)."""
    return model(x, mask, grid=grid) if getattr(model, "needs_grid", False) else model(x, mask)


def test_registry_holds_the_lra_zoo():
    assert LRA_TABLE_1 <= set(MODELS)


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ValueError, match="known models: .*transformer"):
        create_model("transfomer")


@pytest.mark.parametrize("name", MODELS)
def test_unknown_option_fails(name):
    with pytest.raises(TypeError, match="has no option"):
        create_model(name, d_model=32, n_heads=2, d_qkv=32, dropout=0.0, max_len=64, no_such_option=1)


@pytest.mark.parametrize("name", MODELS)
def test_docstring_cites_paper_and_complexity(name):
    cls = get_model_class(name)
    doc = (cls.__doc__ or "") + (sys.modules[cls.__module__].__doc__ or "")  # the class's module, whatever its name
    assert "arxiv.org" in doc.lower() and "complexity" in doc.lower(), name


@pytest.mark.parametrize("name", MODELS)
def test_declares_its_taxonomy_entry(name):
    t = get_model_class(name).taxonomy
    assert isinstance(t, Taxonomy) and "arxiv" in t.paper.lower()
    assert t.complexity in COMPLEXITIES and set(t.classes) <= set(CLASSES) and isinstance(t.decode, bool)


def test_a_taxonomy_with_an_unknown_complexity_or_class_is_refused():
    with pytest.raises(ValueError, match="complexity"):
        Taxonomy("x, arXiv 0000.00000", "N^3")
    with pytest.raises(ValueError, match="class"):
        Taxonomy("x, arXiv 0000.00000", "N", ("XX",))


@pytest.mark.parametrize("name", MODELS)
def test_a_mixer_with_several_executions_lists_them(name):
    """A ``backend`` attribute (how a mixer runs) comes with ``backends``, its values, "auto" (the default) first:
    what trainer.mixer_backend (or trainer.mixer.backend) and the benches' variants are checked against before anything
    runs. Those declared
    ``nondeterministic_backends`` are some of them, never "auto" and never all: trainer.deterministic runs another."""
    mixer = make(name)
    if hasattr(mixer, "backend"):
        assert mixer.backend == "auto" and mixer.backends[0] == "auto" and len(set(mixer.backends)) >= 2
        unordered = set(getattr(mixer, "nondeterministic_backends", ()))
        assert unordered <= set(mixer.backends[1:]) and set(mixer.backends[1:]) - unordered
    else:
        assert not hasattr(mixer, "backends") and not hasattr(mixer, "nondeterministic_backends")


EXECUTION = [(name, key) for name in MODELS for key in getattr(get_model_class(name), "execution", {})]


@pytest.mark.parametrize("name", MODELS)
def test_each_setting_of_how_a_mixer_runs_is_declared_documented_and_no_option(name):
    """Every setting of how a mixer runs (``execution_settings``: its ``backend`` and its ``execution`` declaration)
    is an attribute of each built mixer at an allowed default, named in the model's docstring, never a constructor
    option (so never in the config hash): one mechanism, which trainer.mixer and the benches' variants set."""
    cls, mixer = get_model_class(name), make(name)
    for key in execution_settings(cls):
        assert key not in inspect.signature(cls).parameters, f"{name}.{key} is a constructor option"
        assert checked_setting(mixer, key, getattr(mixer, key)) == getattr(mixer, key), f"{name}.{key}"
        declared = "backends" if key == "backend" else "execution"  # the class that declares it documents it
        owner = next(c for c in cls.__mro__ if declared in vars(c))
        doc = (sys.modules[owner.__module__].__doc__ or "") + (owner.__doc__ or "")
        assert re.search(rf"\b{key}\b", doc), f"{name}: {owner.__module__}'s docstring does not name {key}"
        with pytest.raises(ValueError, match=f"{key} must be"):
            checked_setting(mixer, key, "no such value" if key != "backend" else 0)
    with pytest.raises(ValueError, match="is not a setting of how it runs"):
        checked_setting(mixer, "d_model", 8)


def values_to_try(allowed) -> list:
    return list(allowed) if isinstance(allowed, tuple) else [1, 7] + ([None] if None in allowed else [])


@pytest.mark.parametrize(("name", "key"), EXECUTION)
def test_a_setting_of_how_a_mixer_runs_changes_nothing_it_computes(name, key):
    """Each value of a declared setting that runs on the CPU gives the default's outputs and input gradients: how it
    runs, never what (a value that needs CUDA says so and is skipped here; the GPU tests compare those)."""
    x = torch.randn(2, 257, 32)
    mask = torch.ones(2, 257, dtype=torch.bool)
    mask[1, 190:] = False

    def run(mixer):
        x_ = x.clone().requires_grad_()
        out = mix(mixer.eval(), x_, mask)
        (out[mask] * torch.linspace(-1, 1, 32)).sum().backward()
        return out[mask], x_.grad

    want = run(make(name))
    for value in values_to_try(get_model_class(name).execution[key]):
        mixer = make(name)
        setattr(mixer, key, checked_setting(mixer, key, value))
        try:
            got = run(mixer)
        except (ValueError, ImportError) as e:
            assert "CUDA" in str(e), f"{name} with {key}={value!r}: {e}"
            continue
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name} with {key}={value!r}: {m}")


@pytest.mark.parametrize("name", MODELS)
def test_options_are_keyword_only_with_defaults(name):
    """The constructor is the schema: every option after the backbone arguments has a default."""
    sig = inspect.signature(get_model_class(name))
    for key, param in list(sig.parameters.items())[5:]:
        assert param.kind is param.KEYWORD_ONLY and param.default is not param.empty, f"{name}.{key}"


@pytest.mark.parametrize("name", MODELS)
def test_shape_and_gradients_reach_every_parameter(name):
    model = make(name).train()
    x = torch.randn(2, 257, 32, requires_grad=True)
    mask = torch.ones(2, 257, dtype=torch.bool)
    mask[1, 200:] = False
    out = mix(model, x, mask)
    assert out.shape == (2, 257, 32) and torch.isfinite(out).all()
    (out * torch.randn_like(out)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient reaches {pname}"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, f"{name}: zero gradient at {pname}"


@pytest.mark.parametrize("name", SEQUENCE_MODELS)
def test_padding_does_not_change_real_positions(name):
    """Append padding (with junk in it): outputs at the real positions stay the same."""
    model = make(name).eval()
    if not getattr(model, "padding_invariant", True):
        pytest.skip(f"{name} documents why it cannot be padding-invariant")
    n_real, n_padded = 150, 256
    x = torch.randn(1, n_padded, 32)
    mask = torch.zeros(1, n_padded, dtype=torch.bool)
    mask[:, :n_real] = True
    with torch.no_grad():
        short = model(x[:, :n_real], mask[:, :n_real])
        long = model(x, mask)
        x2 = x.clone()
        x2[:, n_real:] = torch.randn(1, n_padded - n_real, 32) * 10
        junk = model(x2, mask)
    torch.testing.assert_close(long[:, :n_real], short, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(junk[:, :n_real], short, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", GRID_MODELS)
def test_masked_pixels_do_not_contribute(name):
    """A 2-D mixer honours a mask with holes (LRA's ``pixel_zero_is_pad``): junk at masked pixels changes no
    real position's output."""
    model = make(name).eval()
    x = torch.randn(1, 257, 32)
    mask = torch.rand(1, 257) > 0.3
    mask[:, 0] = True
    x2 = x.clone()
    x2[~mask] = torch.randn(int((~mask).sum()), 32) * 10
    with torch.no_grad():
        torch.testing.assert_close(mix(model, x2, mask)[mask], mix(model, x, mask)[mask], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", SEQUENCE_MODELS)
def test_encoder_logits_ignore_appended_padding(name):
    torch.manual_seed(0)
    enc = Encoder(name, {}, vocab_size=20, seq_len=300, n_layers=2, d_model=32, n_heads=2, d_qkv=32, d_ff=64,
                  dropout=0.0, attn_dropout=0.0, positions="learned", cls_token=True)
    model = Classifier(enc, 32, 64, 10, "cls").eval()
    if not all(getattr(b.mixer, "padding_invariant", True) for b in enc.blocks):
        pytest.skip(f"{name} documents why it cannot be padding-invariant")
    tokens = torch.randint(1, 20, (2, 120))
    padded = torch.cat([tokens, torch.zeros(2, 130, dtype=torch.long)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded), model(tokens), atol=2e-5, rtol=1e-4)
    mean = Classifier(enc, 32, 64, 10, "mean").eval()
    with torch.no_grad():
        torch.testing.assert_close(mean(padded), mean(tokens), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("pooling", ["cls", "mean", "last"])
def test_mask_free_classifier_equals_the_masked_one_without_padding(name, pooling):
    """padded=False (pixel tasks) drops the mask; with no pad token the logits must not change."""
    torch.manual_seed(0)
    enc = Encoder(name, {}, vocab_size=20, seq_len=144, n_layers=2, d_model=32, n_heads=2, d_qkv=32, d_ff=64,
                  dropout=0.0, attn_dropout=0.0, positions="learned", cls_token=pooling == "cls", grid=(12, 12))
    masked = Classifier(enc, 32, 64, 10, pooling).eval()
    free = Classifier(enc, 32, 64, 10, pooling, padded=False).eval()
    free.head = masked.head
    tokens = torch.randint(1, 20, (2, 144))
    with torch.no_grad():
        torch.testing.assert_close(free(tokens), masked(tokens), atol=1e-5, rtol=1e-5)


# Models whose step makes a host-side decision a compiled model cannot trace: a graph break (and a device sync) in
# every layer, every step. gla: per-key decays take the factorised or the exact inside-chunk scores by reading
# each chunk's total decay (torch.cond's backward refused the two branches' gradient layouts).
GRAPH_BREAKS = {"gla"}


@pytest.mark.heavy  # CI's second tier: torch.compile of every model
@pytest.mark.parametrize("name", MODELS)
def test_a_compiled_model_in_training_is_one_graph(name):
    """Every graph break costs a compiled model its host time and fusion in each layer of each step (a performer
    model of three layers was eight graphs; an fnet one eleven): compiled in training, with padding, a model is one
    graph, but for those listed above."""
    torch.manual_seed(0)
    enc = Encoder(name, {}, vocab_size=20, seq_len=64, n_layers=2, d_model=32, n_heads=2, d_qkv=32, d_ff=32,
                  dropout=0.1, attn_dropout=0.1, positions="learned", cls_token=True, grid=(8, 8))
    model = Classifier(enc, 32, 32, 3, "cls").train()
    tokens = torch.randint(1, 20, (2, 64))
    tokens[1, 40:] = 0  # padding
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(tokens)
    assert (explained.graph_count == 1) == (name not in GRAPH_BREAKS), explained.break_reasons[:2]


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_on_cuda_a_compiled_model_has_its_eager_gradients(name):
    """Inductor's CUDA code has given wrong gradients where eager CUDA, ``aot_eager`` and the CPU were exact (Mamba:
    its dt gradients 0.5x to 2.6e4x off in the whole model, at init, in fp32; docs/gpu.md, compilation). Compiled on the
    GPU, every model passes the runner's compile check (``engine.compiled_gradient_check``: compiled and eager
    gradients each against a float64 copy's, fp32, eval mode, the training loss; under bf16 autocast where the fp32
    graphs do not compile; compiled against eager where the model does not run in float64): one layer, an Image row
    (1,024 pixels and the CLS token: 1,025 positions)."""
    from lra.train import engine

    torch.manual_seed(0)
    enc = Encoder(name, {}, vocab_size=257, seq_len=1024, n_layers=1, d_model=64, n_heads=2, d_qkv=64, d_ff=64,
                  dropout=0.0, attn_dropout=0.0, positions="learned", cls_token=True, grid=(32, 32))
    model = Classifier(enc, 64, 64, 10, "cls", padded=False).cuda()
    tokens = torch.randint(0, 257, (4, 1024), device="cuda")
    labels = torch.randint(0, 10, (4,), device="cuda")
    torch._dynamo.reset()
    bf16 = engine.autocast("bf16", torch.device("cuda"))
    check = engine.compiled_gradient_check(model, (tokens,), labels, bf16)
    assert check.precision is not None, f"{name}: torch.compile failed in {check.failed}"
    assert not check.rejected, f"{name}: {check.describe()}"


def test_runner_builds_pixel_tasks_mask_free():
    from lra.data import Split, TaskData

    split = Split(torch.randint(1, 257, (4, 2000)), torch.zeros(4, dtype=torch.long))
    data = TaskData(split, split, split, vocab_size=257, n_classes=10, seq_len=2000)
    assert runner.task_shape(data).padded is False
    holes = Split(split.tokens.clone(), split.labels)
    holes.tokens[0, -5:] = 0
    assert runner.task_shape(TaskData(split, holes, split, 257, 10, 2000)).padded is True


def _fwd_bwd_seconds(*names: str, rounds: int = 3) -> list[float]:
    """Each model's best forward + backward pass at N = 1024 (a 32 x 32 grid for 2-D mixers), d 64, 2 heads,
    batch 2, the models taking turns in each round, so a load spike on a busy machine meets all of them. On one
    thread: torch's threads wait for each other at every op, and on a machine with more busy processes than cores
    that wait hits a model of many small ops (sinkhorn) far harder than one of a few large ones."""
    models = [make(name, d_model=64, max_len=1025).train() for name in names]
    x = torch.randn(2, 1024, 64, requires_grad=True)
    mask = torch.ones(2, 1024, dtype=torch.bool)
    best = [float("inf")] * len(names)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(rounds):
            for i, model in enumerate(models):
                t = time.perf_counter()
                mix(model, x, mask, Grid(32, 32)).sum().backward()
                best[i] = min(best[i], time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return best


@pytest.mark.heavy  # CI's second tier: every model timed at 1K
@pytest.mark.parametrize("name", MODELS)
def test_cpu_forward_backward_at_1k_is_within_a_factor_of_the_transformer(name):
    """A ratio, not milliseconds: a busy machine slows both sides alike. The CPU paths are the readable
    references (dense masks for the block patterns), so the bound is loose; it catches an accidental
    O(N^2 d)-per-token loop or a Python loop over positions."""
    model, transformer = _fwd_bwd_seconds(name, "transformer", rounds=4)
    assert model / transformer < 8, f"{name}: {model / transformer:.1f}x the transformer's forward + backward on CPU"


@pytest.mark.parametrize("name", MODELS)
def test_smoke_run(name, smoke_cfg):
    """A few training steps through the runner: ListOps, or generated Pathfinder for a 2-D mixer."""
    task = ("task=pathfinder",) if name in GRID_MODELS else ("task=listops", "task.seq_len=512")
    row = runner.run(smoke_cfg(*task, f"model={name}", "backbone.n_layers=1", "schedule.steps=6",
                               "schedule.eval_every=3", "data.limit.train=48", "data.limit.val=16",
                               "data.limit.test=16"))
    assert row["model"] == name and row["steps"] == 6 and 0 <= row["test_acc"] <= 1


@pytest.mark.parametrize("d_qkv,n_heads", [(16, 4), (24, 2), (64, 4)])  # head sizes 4, 12 (padded), 16
def test_transformer_equals_the_softmax_formula_for_any_head_size(d_qkv, n_heads):
    """Head sizes off the multiple of 8 are zero-padded for the fused kernels; the result must not change."""
    torch.manual_seed(0)
    m = create_model("transformer", d_model=32, n_heads=n_heads, d_qkv=d_qkv, dropout=0.0, max_len=64).eval()
    x = torch.randn(2, 40, 32)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 25:] = False
    q, k, v = m.project(x)  # (B, H, N, Dh)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d_qkv // n_heads)  # (B, H, N, N)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    o = scores.softmax(-1) @ v  # (B, H, N, Dh)
    want = m.out(o.transpose(1, 2).reshape(2, 40, d_qkv))
    torch.testing.assert_close(m(x, mask), want, atol=1e-5, rtol=1e-5)


@pytest.mark.heavy  # CI's second tier: torch.compile of every model, on the CPU
@pytest.mark.parametrize("name", MODELS)
def test_on_the_cpu_a_compiled_model_has_its_eager_gradients(name):
    """The compile check runs wherever a model is compiled (``trainer.compile_check=auto``), since Inductor's CPU
    code can be wrong too (torch 2.13: the backward of a padded tensor's overlapping ``unfold`` alone, off by more
    than the gradient's size). Compiled on the CPU, every model passes the check, with padding and a CLS token, its
    pattern's blocks not dividing the length: a CPU run with ``trainer.compile=true`` trains compiled."""
    from lra.train import engine

    torch.manual_seed(0)
    enc = Encoder(name, {}, vocab_size=20, seq_len=100, n_layers=1, d_model=32, n_heads=2, d_qkv=32, d_ff=32,
                  dropout=0.0, attn_dropout=0.0, positions="learned", cls_token=True, grid=(10, 10))
    model = Classifier(enc, 32, 32, 3, "cls")
    tokens = torch.randint(1, 20, (4, 100))
    tokens[1, 70:] = 0  # padding
    torch._dynamo.reset()
    check = engine.compiled_gradient_check(model, (tokens,), torch.tensor([0, 1, 2, 1]))
    assert check.precision is not None, f"{name}: torch.compile failed in {check.failed}"
    assert not check.rejected, f"{name}: {check.describe()}"
