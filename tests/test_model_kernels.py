"""Kernel-attention mixers: ``linear`` (elu + 1) and ``performer`` (FAVOR+ / LRA's relu variant).

Each model is checked against an explicit O(N^2) formula, for padding invariance, and for its own contract
(causal recurrent == causal parallel; FAVOR+ error falls with more features; feature redraw schedule)."""
from __future__ import annotations

import math

import pytest
import torch

from models import create_model
from models._favor import FavorAttention, favor_attention, favor_forward
from models.base import segment_members
from models.performer import orthogonal_gaussian
from tests.mixer_checks import create

BACKBONE = dict(d_model=32, n_heads=2, d_qkv=32, dropout=0.1, max_len=512)


def qkv(B=2, H=2, N=37, D=16, scale=1.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(scale * torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3))


def ragged_mask(B, N, lengths):
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]  # (B, N)


def naive_kernel_attention(fq, fk, v, mask, causal=False):
    """O(N^2): out_i = sum_j A_ij v_j / sum_j A_ij with A_ij = fq_i . fk_j over real (and, if causal, j <= i)."""
    a = fq @ fk.transpose(-1, -2)  # (B, H, N, N)
    a = a * mask[:, None, None, :]
    if causal:
        a = a.tril()
    return (a @ v) / (a.sum(-1, keepdim=True) + 1e-6)


def exact_softmax(q, k, v, mask):
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~mask[:, None, None, :], -math.inf)
    return logits.softmax(-1) @ v


# --------------------------------------------------------------------------------------------- linear


def test_linear_matches_naive_formula_with_padding():
    model = create_model("linear", **BACKBONE).double()
    q, k, v = qkv(N=41, dtype=torch.float64)
    mask = ragged_mask(2, 41, [41, 23])
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    ref = naive_kernel_attention(fq, fk, v, mask)
    torch.testing.assert_close(model.attend(q, k, v, mask), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_linear_causal_parallel_matches_naive(chunk):
    model = create("linear", **BACKBONE, causal=True, chunk_size=chunk).double()
    q, k, v = qkv(N=45, dtype=torch.float64, seed=1)
    mask = ragged_mask(2, 45, [45, 30])
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    ref = naive_kernel_attention(fq, fk, v, mask, causal=True)
    torch.testing.assert_close(model.attend(q, k, v, mask), ref, rtol=1e-10, atol=1e-10)


def test_linear_recurrent_steps_equal_causal_parallel():
    model = create("linear", **BACKBONE, causal=True, chunk_size=8)
    q, k, v = qkv(N=50, seed=2)
    mask = ragged_mask(2, 50, [50, 33])
    parallel = model.attend(q, k, v, mask)
    state, outs = None, []
    for t in range(q.shape[2]):
        o, state = model.recurrent_step(state, q[:, :, t], k[:, :, t], v[:, :, t], mask[:, t])
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 2), parallel, rtol=1e-5, atol=1e-5)


def test_linear_step_equals_causal_forward():
    torch.manual_seed(0)
    model = create_model("linear", **BACKBONE, causal=True).eval()
    x = torch.randn(3, 20, BACKBONE["d_model"])
    mask = torch.ones(3, 20, dtype=torch.bool)
    full = model(x, mask)
    state, outs = None, []
    for t in range(20):
        y, state = model.step(x[:, t], state)
        outs.append(y)
    torch.testing.assert_close(torch.stack(outs, 1), full, rtol=1e-5, atol=1e-5)


def test_linear_recurrent_step_needs_causal():
    model = create_model("linear", **BACKBONE)
    q = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="causal"):
        model.recurrent_step(None, q, q, q)


def test_linear_under_bf16_autocast_stays_close_to_fp32():
    model = create_model("linear", **BACKBONE)
    q, k, v = qkv(N=64, scale=3.0)
    mask = torch.ones(2, 64, dtype=torch.bool)
    ref = model.attend(q, k, v, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).norm() / ref.norm() < 2e-2


@pytest.mark.parametrize("packed", [False, True])
def test_linear_bf16_products_stay_close_to_the_fp64_formula(packed):
    """bf16 inputs: the two products with values (and their backward) take bf16 operands, the feature maps, key
    sums and normaliser stay fp32, so output and gradients are within 1% of fp64, and padded keys still add
    exactly nothing (a row of one example equals that row with padding appended)."""
    from models.linear import linear_attention
    q, k, v = qkv(B=2, H=2, N=300, D=16, seed=3, dtype=torch.float64)
    mask = ragged_mask(2, 300, [300, 200])
    segments = (torch.arange(300)[None] // 120 + 1) * mask if packed else None  # (B, N): examples of 120
    member = segment_members(segments) if packed else None
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = linear_attention(*ref, mask, False, 64, member)
    grad = torch.randn_like(ref_out)
    ref_grads = torch.autograd.grad(ref_out, ref, grad)

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = linear_attention(*low, mask, False, 64, member)
    assert out.dtype == torch.bfloat16 and rel(out, ref_out) < 1e-2
    grads = torch.autograd.grad(out, low, grad.bfloat16())
    assert all(g.dtype == torch.bfloat16 for g in grads)
    assert all(rel(g, r) < 1e-2 for g, r in zip(grads, ref_grads)), [rel(g, r) for g, r in zip(grads, ref_grads)]
    # the products really are bf16: fp32 products of the same rounded inputs differ from them
    out32 = linear_attention(*(t.detach().float() for t in low), mask, False, 64, member)
    assert not torch.equal(out.float(), out32.bfloat16().float())
    # the padded keys' values never reach an output in bf16 either
    wild = low[2].detach().clone()
    wild[1, :, 200:] = 1e4
    again = linear_attention(low[0].detach(), low[1].detach(), wild, mask, False, 64, member)
    assert torch.equal(again[:, :, :200], out.detach()[:, :, :200])


def test_linear_hand_written_backward_equals_autograd():
    """Unpacked non-causal rows take LinearAttentionFn: in fp64 its output and gradients are autograd's through
    kernel_attention (the packed and causal forms' path) to rounding, padded keys included; gradcheck passes."""
    from models.base import kernel_attention
    from models.linear import EPS, LinearAttentionFn, feature_map, linear_attention

    q, k, v = qkv(B=2, H=2, N=90, D=8, seed=5, dtype=torch.float64)
    mask = ragged_mask(2, 90, [90, 55])
    keep = mask[:, None, :, None].double()
    grad = torch.randn(2, 2, 90, 8, dtype=torch.float64)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = linear_attention(*ours, mask, False, 64)
    assert out.grad_fn.name().startswith("LinearAttentionFn")
    expected = kernel_attention(feature_map(ref[0]), feature_map(ref[1]) * keep, ref[2], None, EPS)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out, ours, grad), torch.autograd.grad(expected, ref, grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    small = [t[:1, :1, :20].clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *x: LinearAttentionFn.apply(*x, keep[:1, :, :20]), tuple(small))


def test_linear_backward_keeps_only_bf16_inputs_and_small_summaries():
    """What the hand-written backward buys: under bf16 the tensors kept for it are q, k, v in bf16 plus O(N) and
    O(Dh^2) summaries, under a third of the bytes autograd keeps through kernel_attention (its fp32 N x Dh maps)."""
    from models.base import kernel_attention
    from models.linear import EPS, feature_map, linear_attention

    def saved_bytes(fn):
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(sizes)

    B, H, N, D = 2, 4, 512, 32
    q, k, v = (t.bfloat16().requires_grad_() for t in qkv(B=B, H=H, N=N, D=D, seed=3))
    mask = torch.ones(B, N, dtype=torch.bool)
    ours = saved_bytes(lambda: linear_attention(q, k, v, mask, False, 64))
    inputs = 3 * B * H * N * D * 2  # q, k, v in bf16
    assert inputs <= ours < 1.1 * inputs  # the rest: the (Dh x Dh) summary, key sum, normaliser, mask
    keep = mask[:, None, :, None].float()
    autograd = saved_bytes(lambda: kernel_attention(feature_map(q), feature_map(k) * keep, v, None, EPS))
    assert ours < autograd / 3


# ------------------------------------------------------------------------------------------ performer


def favor_error(n_features, seed, D=16, N=64):
    model = create_model("performer", d_model=32, n_heads=2, d_qkv=2 * D, dropout=0.0, max_len=N,
                         n_features=n_features, seed=seed).double().eval()
    q, k, v = qkv(B=2, H=2, N=N, D=D, scale=0.4, seed=100 + seed, dtype=torch.float64)
    mask = ragged_mask(2, N, [N, N - 20])
    ref = exact_softmax(q, k, v, mask)
    return ((model.attend(q, k, v, mask) - ref).norm() / ref.norm()).item()


def test_favor_error_falls_with_more_features():
    errors = {m: sum(favor_error(m, s) for s in range(4)) / 4 for m in (16, 256, 2048)}
    # the estimator's std falls like 1/sqrt(m): 16x more features cut the error ~4x, 8x more ~2.8x
    # (measured 0.35 -> 0.086 -> 0.028); q, k are kept small since the variance grows like exp(|q' + k'|^2)
    assert errors[256] < 0.4 * errors[16], errors
    assert errors[2048] < 0.5 * errors[256], errors
    assert errors[2048] < 0.05, errors


def test_orthogonal_features_are_orthogonal_within_blocks():
    w = orthogonal_gaussian(40, 16, torch.Generator().manual_seed(0))  # 2 full blocks + 8 rows
    assert w.shape == (40, 16)
    for block in (w[:16], w[16:32], w[32:]):
        unit = block / block.norm(dim=-1, keepdim=True)
        torch.testing.assert_close(unit @ unit.t(), torch.eye(len(block)), atol=1e-5, rtol=0)


def test_favor_forward_and_backward_match_the_unstabilised_formula():
    """Both FAVOR+ paths (plain autograd, recompute-in-backward) equal phi(q)^T phi(k) attention written
    without any stabiliser (safe in fp64 for small inputs), values and gradients; stabilisers only move eps."""
    q, k, v = (t.requires_grad_() for t in qkv(N=23, D=8, scale=0.8, seed=3, dtype=torch.float64))
    mask = ragged_mask(2, 23, [23, 15])
    keep = mask[:, None, :, None]
    w = orthogonal_gaussian(24, 8, torch.Generator().manual_seed(1)).double()
    grad = torch.randn(2, 2, 23, 8, dtype=torch.float64)

    def phi(x):  # exp(w . x' - |x'|^2 / 2) / sqrt(m), x' = x Dh^-1/4
        x = x * 8**-0.25
        return torch.exp(x @ w.t() - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(24)

    ref = naive_kernel_attention(phi(q), phi(k), v, mask)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for fn in (favor_attention, lambda *a: FavorAttention.apply(*a, False)):
        out = fn(q, k, v, keep, w * 8**-0.25)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_favor_bf16_products_stay_close_to_the_fp64_formula():
    """With bf16 inputs the products with values and gradients run in bf16 (features, key sums and normaliser
    in fp32): outputs and gradients of both paths stay within bf16 rounding of the fp64 computation, and the
    normaliser, fp32, is exactly the fp32 computation's."""
    q, k, v = qkv(B=2, H=2, N=200, D=16, scale=1.0, seed=7, dtype=torch.float64)
    keep = ragged_mask(2, 200, [200, 130])[:, None, :, None]
    w = orthogonal_gaussian(64, 16, torch.Generator().manual_seed(2)).double() * 16**-0.25
    grad = torch.randn(2, 2, 200, 16, dtype=torch.float64)
    ref = [t.requires_grad_() for t in (q.clone(), k.clone(), v.clone())]
    ref_out = favor_attention(*ref, keep, w)
    ref_grads = torch.autograd.grad(ref_out, ref, grad)

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    assert favor_forward(*low, keep, w.float())[1].dtype == torch.float32  # the summary leaves the bf16 matmul
    _, _, ksum, den, _ = favor_forward(*low, keep, w.float())
    _, _, ksum32, den32, _ = favor_forward(*(t.detach().float() for t in low), keep, w.float())
    assert torch.equal(ksum, ksum32) and torch.equal(den, den32)
    for fn in (favor_attention, lambda *a: FavorAttention.apply(*a, False)):
        out = fn(*low, keep, w.float())
        assert rel(out, ref_out) < 1e-2
        grads = torch.autograd.grad(out, low, grad.float())
        assert all(g.dtype == torch.bfloat16 for g in grads)
        assert all(rel(g, r) < 2e-2 for g, r in zip(grads, ref_grads)), [rel(g, r) for g, r in zip(grads, ref_grads)]


def test_performer_eval_is_deterministic_and_training_redraws_on_schedule():
    model = create_model("performer", **BACKBONE, n_features=32, redraw_every=2, seed=5)
    x, mask = torch.randn(2, 10, 32), torch.ones(2, 10, dtype=torch.bool)
    model.eval()
    first = model.features.clone()
    torch.testing.assert_close(model(x, mask), model(x, mask), rtol=0, atol=0)
    assert torch.equal(model.features, first)
    model.train()
    seen = []
    for _ in range(5):
        model(x, mask)
        seen.append(model.features.clone())
    # calls 1-2 use draw 0, calls 3-4 draw 1, call 5 draw 2
    assert torch.equal(seen[0], first) and torch.equal(seen[1], first)
    assert not torch.equal(seen[2], first) and torch.equal(seen[2], seen[3])
    assert not torch.equal(seen[4], seen[2])
    assert model.train_calls == 5 and model.draws == 2


def test_performer_redraw_zero_never_redraws():
    model = create_model("performer", **BACKBONE, n_features=32, redraw_every=0).train()
    first = model.features.clone()
    x, mask = torch.randn(2, 10, 32), torch.ones(2, 10, dtype=torch.bool)
    for _ in range(3):
        model(x, mask)
    assert torch.equal(model.features, first)


def test_performer_schedule_breaks_a_compiled_graph_only_at_the_call_start_and_only_when_redrawing():
    """The redraw schedule is host-side bookkeeping (a graph break): it runs first in the mixer's call, so a compiled
    mixer stays one graph, and in eval or with redraw_every 0 the compiler never meets it."""
    x, mask = torch.randn(2, 10, 32), torch.ones(2, 10, dtype=torch.bool)
    for redraw_every, training in ((2, True), (2, False), (0, True)):
        model = create_model("performer", **BACKBONE, n_features=8, redraw_every=redraw_every).train(training)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(x, mask)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (redraw_every, training, explained)
    assert model.train_calls == 0 and model.draws == 0  # redraw_every 0: nothing counted
    model = create_model("performer", **BACKBONE, n_features=8, redraw_every=1).train()
    compiled = torch.compile(model, backend="eager")
    first = model.features.clone()
    compiled(x, mask), compiled(x, mask)
    assert model.train_calls == 2 and model.draws == 1 and not torch.equal(model.features, first)  # still on time


def test_a_classifier_advances_its_performer_schedules_once_per_call_and_compiles_to_one_graph():
    """lra's classifier advances every performer layer's redraw schedule first in its own call: a compiled model in
    training is one graph (with each layer doing it in its own call, 3 layers made 8), and the redraws keep time."""
    from lra.train.encoder import build_classifier

    backbone = dict(n_layers=3, d_model=32, n_heads=2, d_qkv=32, d_ff=32, d_classifier=32, dropout=0.0,
                    attn_dropout=0.0, positions="sinusoidal", pooling="cls")
    model = build_classifier("performer", dict(n_features=8, redraw_every=2), backbone, 20, 16, 3).train()
    tokens = torch.randint(1, 20, (2, 16))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(tokens)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    layers = [block.mixer for block in model.encoder.blocks]
    first = [layer.features.clone() for layer in layers]
    compiled = torch.compile(model, backend="eager")
    for _ in range(2):
        compiled(tokens)
    assert all(layer.schedule_outside and layer.train_calls == 3 and layer.draws == 1 for layer in layers)
    assert not any(torch.equal(layer.features, f) for layer, f in zip(layers, first))  # call 3 drew anew
    model.eval()
    compiled(tokens)
    assert all(layer.train_calls == 3 for layer in layers)  # eval: frozen


def test_performer_same_seed_same_features_and_checkpoint_roundtrip():
    a = create_model("performer", **BACKBONE, n_features=48, seed=7)
    b = create_model("performer", **BACKBONE, n_features=48, seed=7)
    c = create_model("performer", **BACKBONE, n_features=48, seed=8)
    assert torch.equal(a.features, b.features) and not torch.equal(a.features, c.features)
    a.redraw_every = 1
    a.train()
    x, mask = torch.randn(2, 10, 32), torch.ones(2, 10, dtype=torch.bool)
    for _ in range(3):
        a(x, mask)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.features, b.features) and (b.train_calls, b.draws) == (3, 2)
    assert torch.equal(b.draw(2), a.features)  # the features are a function of (seed, draw index)


def test_performer_seed_null_differs_per_layer_but_follows_the_run_seed():
    torch.manual_seed(3)
    a, b = (create_model("performer", **BACKBONE, n_features=32) for _ in range(2))
    torch.manual_seed(3)
    a2 = create_model("performer", **BACKBONE, n_features=32)
    assert not torch.equal(a.features, b.features) and torch.equal(a.features, a2.features)


def test_performer_relu_matches_lra_generalized_formula():
    model = create_model("performer", **BACKBONE, kernel="relu").double()
    q, k, v = qkv(N=30, dtype=torch.float64, seed=4)
    mask = ragged_mask(2, 30, [30, 11])
    fq, fk = torch.relu(q) + 1e-3, torch.relu(k) + 1e-3
    torch.testing.assert_close(model.attend(q, k, v, mask), naive_kernel_attention(fq, fk, v, mask),
                               rtol=1e-10, atol=1e-10)


def test_performer_bf16_autocast_is_finite_and_close():
    model = create_model("performer", **BACKBONE, n_features=64).eval()
    q, k, v = qkv(N=64, scale=4.0)  # large logits: exp would overflow without the stabilisers
    mask = ragged_mask(2, 64, [64, 40])
    ref = model.attend(q, k, v, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out.float() - ref).norm() / ref.norm() < 5e-2
    # the recompute-in-backward path (CUDA's default) under autocast: grads come back in the inputs' dtype
    w = model.features * 16**-0.25
    q, k, v = (t.bfloat16().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = FavorAttention.apply(q, k, v, mask[:, None, :, None], w, False)
    out.sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 and torch.isfinite(t.grad).all() for t in (q, k, v))


# Packed rows: row 0 holds a 9-token example, a 6-token one and a 1-token one, row 1 a 15- and a 5-token one;
# the rest is padding. The 6-token example's keys are 40x larger (see packed_case).
PACKED_ROWS = [[9, 6, 1], [15, 5]]


def packed_case(N=24, D=16, seed=11):
    """q, k, v (2, 2, N, D) fp64 for PACKED_ROWS, their (2, N) segment ids, and each example's (row, start, n)."""
    q, k, v = qkv(B=2, H=2, N=N, D=D, seed=seed, dtype=torch.float64)
    segments = torch.zeros(2, N, dtype=torch.long)
    spans = []
    for row, lengths in enumerate(PACKED_ROWS):
        start = 0
        for n in lengths:
            spans.append((row, start, n))
            segments[row, start : start + n] = len(spans)
            start += n
    k[0, :, 9:15] *= 40  # its FAVOR+ key exponents lie thousands below its neighbour's
    return q, k, v, segments, spans


def assert_packed_equals_alone(packed, alone, q, k, v, segments, spans):
    """packed(q, k, v, segments) on the packed rows and alone(q, k, v) on each example by itself (no padding)
    give the same outputs and gradients (fp64); padded outputs get no gradient, as in the encoder."""
    real = (segments != 0)[:, None, :, None]  # (B, 1, N, 1)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=q.dtype) * real
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = packed(*inputs, segments)
    grads = torch.autograd.grad(out, inputs, grad)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert all(torch.equal(g * ~real, torch.zeros_like(g)) for g in grads)  # padding receives nothing
    for row, start, n in spans:
        part = (slice(row, row + 1), slice(None), slice(start, start + n))
        own = [t[part].clone().requires_grad_() for t in (q, k, v)]
        ref = alone(*own)
        torch.testing.assert_close(out[part], ref, rtol=1e-10, atol=1e-12)
        for g, r in zip(grads, torch.autograd.grad(ref, own, grad[part])):
            torch.testing.assert_close(g[part], r, rtol=1e-10, atol=1e-12)


def favor_fp64():
    return create_model("performer", **BACKBONE, n_features=32, seed=2).double().eval()


def test_packed_case_needs_per_example_stabilisers():
    """In packed_case, a stabiliser over the whole row would underflow every key feature of the 6-token example
    (exp below -745 is 0 in fp64), leaving it a normaliser of eps instead of >= 1."""
    k = packed_case()[1]
    w = favor_fp64().features * 16**-0.25
    exponents = k @ w.t() - (k * k).sum(-1, keepdim=True) / 2 / 4  # (B, H, N, m): w . k' - |k'|^2 / 2
    assert (exponents[0, :, 9:15].amax(1) - exponents[0, :, :9].amax(1)).max() < -745


@pytest.mark.parametrize("path", ["autograd", "recompute"])
def test_favor_packed_rows_equal_each_example_alone(path):
    """Both FAVOR+ paths (the model's autograd path, and the hand-written backward that CUDA runs, here eager):
    per-example stabilisers and summaries make every packed example, the 1-token one and the one whose keys
    lie far below its neighbour's included, exactly what it is alone."""
    model = favor_fp64()
    w = model.features * 16**-0.25
    if path == "autograd":
        packed = lambda q, k, v, segments: model.attend(q, k, v, segments != 0, segments=segments)
        alone = lambda q, k, v: model.attend(q, k, v, torch.ones(1, q.shape[2], dtype=torch.bool))
    else:
        keep = lambda segments: (segments != 0)[:, None, :, None]  # (B, 1, N, 1)
        packed = lambda q, k, v, s: FavorAttention.apply(q, k, v, keep(s), w, False, segment_members(s))
        alone = lambda q, k, v: FavorAttention.apply(q, k, v, keep(torch.ones(1, q.shape[2])), w, False)
    assert_packed_equals_alone(packed, alone, *packed_case())


def test_performer_relu_packed_rows_equal_each_example_alone():
    model = create_model("performer", **BACKBONE, kernel="relu").double()
    packed = lambda q, k, v, segments: model.attend(q, k, v, segments != 0, segments=segments)
    alone = lambda q, k, v: model.attend(q, k, v, torch.ones(1, q.shape[2], dtype=torch.bool))
    assert_packed_equals_alone(packed, alone, *packed_case())


# Chunks (``chunk_size``): 1 position, 7 (not dividing N), N and more than N, against the unchunked forward and
# autograd's gradients of it, on the autograd path and on the hand-written backward (eager here, compiled on CUDA).
FAVOR_PATHS = {
    "autograd": lambda q, k, v, keep, w, member, chunk: favor_attention(q, k, v, keep, w, member, chunk),
    "recompute": lambda q, k, v, keep, w, member, chunk: FavorAttention.apply(q, k, v, keep, w, False, member, chunk),
}


def assert_chunks_equal_whole(fn, q, k, v, keep, w, member, chunk):
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=q.dtype) * keep
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = favor_attention(*inputs, keep, w, member)  # unchunked, differentiated by autograd
    ref_grads = torch.autograd.grad(ref, inputs, grad)
    out = fn(*inputs, keep, w, member, chunk)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, r in zip(torch.autograd.grad(out, inputs, grad), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    whole, chunked = favor_forward(q, k, v, keep, w, member), favor_forward(q, k, v, keep, w, member, chunk)
    assert torch.equal(whole[4], chunked[4])  # the key stabiliser: a maximum, exact in any order
    for a, b in zip(whole[1:4], chunked[1:4]):  # summaries, key sums, normaliser
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("path", FAVOR_PATHS)
@pytest.mark.parametrize("chunk", [1, 7, 23, 40])
def test_favor_chunks_equal_the_whole_sequence_with_padding(chunk, path):
    q, k, v = qkv(N=23, D=8, scale=1.5, seed=12, dtype=torch.float64)
    keep = ragged_mask(2, 23, [23, 10])[:, None, :, None]  # row 1: chunks 2 and 3 (of 7) hold only padding
    w = orthogonal_gaussian(24, 8, torch.Generator().manual_seed(3)).double() * 8**-0.25
    assert_chunks_equal_whole(FAVOR_PATHS[path], q, k, v, keep, w, None, chunk)


@pytest.mark.parametrize("path", FAVOR_PATHS)
@pytest.mark.parametrize("chunk", [1, 7, 24, 40])
def test_favor_chunks_equal_the_whole_sequence_in_packed_rows(chunk, path):
    """Chunks cut across examples (7: the 9-token example spans two chunks, one chunk holds three examples'
    keys), and each example keeps its own stabiliser: the 40x keys of the 6-token example included."""
    q, k, v, segments, _ = packed_case()
    keep = (segments != 0)[:, None, :, None]  # (B, 1, N, 1)
    w = favor_fp64().features * 16**-0.25
    assert_chunks_equal_whole(FAVOR_PATHS[path], q, k, v, keep, w, segment_members(segments), chunk)


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most elements of any tensor an op returns (views count their full size)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


@pytest.mark.parametrize("packed", [False, True])
def test_favor_chunks_never_form_a_whole_feature_map(packed):
    """The hand-written path with chunks of 8 forms no tensor of B H N m elements, forward or backward (the
    largest are the (B, H, N, Dh) inputs and outputs); without chunks it does."""
    B, H, N, D, m = 2, 2, 64, 8, 64
    q, k, v = (t.requires_grad_() for t in qkv(B=B, H=H, N=N, D=D, dtype=torch.float64))
    segments = torch.zeros(B, N, dtype=torch.long)
    segments[0, :30], segments[0, 30:50], segments[1, :64] = 1, 2, 3
    member = segment_members(segments) if packed else None
    keep = (segments != 0)[:, None, :, None]
    w = orthogonal_gaussian(m, D, torch.Generator().manual_seed(0)).double() * D**-0.25
    largest = {}
    for chunk in (None, 8):
        with LargestTensor() as mode:
            FavorAttention.apply(q, k, v, keep, w, False, member, chunk).square().sum().backward()
        largest[chunk] = mode.largest
    assert largest[None] >= B * H * N * m > 2 * B * H * N * D >= largest[8], largest


def test_favor_chunks_compile_like_eager():
    """The chunk loop unrolls under torch.compile (CPU Inductor here, as on CUDA): compiled forward and backward
    of FavorAttention (``fused``) equal eager, with padding and a chunk that does not divide N."""
    q, k, v = qkv(B=1, H=2, N=9, D=8, scale=1.5, seed=13, dtype=torch.float64)
    keep = ragged_mask(1, 9, [7])[:, None, :, None]
    w = orthogonal_gaussian(16, 8, torch.Generator().manual_seed(4)).double() * 8**-0.25
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(6), dtype=q.dtype)
    results = []
    for fused in (False, True):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = FavorAttention.apply(*inputs, keep, w, fused, None, 5)  # chunks of 5 and 4
        results.append([out, *torch.autograd.grad(out, inputs, grad)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [0, -4, 2.5, True])
def test_performer_chunk_size_must_be_positive_or_none(chunk_size):
    """``chunk_size`` is how the torch path runs (a setting, not an option): checked where it is set."""
    with pytest.raises(ValueError, match=r"chunk_size must be an integer >= 1, or null \(no chunks\), got "):
        create("performer", **BACKBONE, chunk_size=chunk_size)
    assert create("performer", **BACKBONE).chunk_size is None
    assert create("performer", **BACKBONE, chunk_size=16).chunk_size == 16
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1, got None"):
        create("linear", **BACKBONE, chunk_size=None)


@pytest.mark.parametrize(
    "name,bad",
    [("performer", dict(kernel="cos")), ("performer", dict(n_features=0)), ("performer", dict(redraw_every=-1)),
     ("performer", dict(chunk_size=0)), ("linear", dict(chunk_size=0)), ("performer", dict(recompute=1))],
)
def test_bad_options_fail_at_construction(name, bad):
    with pytest.raises(ValueError):
        create(name, **BACKBONE, **bad)


# -------------------------------------------------------------------------------------------- padding


@pytest.mark.parametrize(
    "name,options",
    [("linear", {}), ("linear", dict(causal=True, chunk_size=8)), ("performer", {}),
     ("performer", dict(recompute=False)), ("performer", dict(kernel="relu")), ("performer", dict(chunk_size=5))],
)
def test_appending_padding_leaves_real_outputs_unchanged(name, options):
    torch.manual_seed(0)
    model = create(name, **BACKBONE, **options).eval()  # options may name how it runs (chunk_size, recompute)
    x = torch.randn(2, 19, 32)
    mask = ragged_mask(2, 19, [19, 12])
    base = model(x, mask)
    # 13 extra padded positions full of large junk: they must not reach any real position
    x_padded = torch.cat([x, 50 * torch.randn(2, 13, 32)], 1)
    mask_padded = torch.cat([mask, torch.zeros(2, 13, dtype=torch.bool)], 1)
    out = model(x_padded, mask_padded)[:, :19]
    real = mask[..., None]
    torch.testing.assert_close(out * real, base * real, rtol=1e-5, atol=1e-5)
    # and the junk in sample 1's own padding (positions 12..18) does not matter either
    x_junk = x.clone()
    x_junk[1, 12:] = 50 * torch.randn(7, 32)
    torch.testing.assert_close(model(x_junk, mask) * real, base * real, rtol=1e-5, atol=1e-5)
