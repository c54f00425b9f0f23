"""Transformer-XL: relative attention against the paper's formula, the stop-gradient memory, the memory span."""
from __future__ import annotations

import math

import pytest
import torch

from models import create_model

D, H = 32, 2


def build(max_len: int = 64, **options):
    torch.manual_seed(0)
    return create_model("transformer_xl", d_model=D, n_heads=H, d_qkv=D, dropout=0.0, max_len=max_len, **options)


def lengths_mask(lengths: list[int], n: int) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, n)


def paper_sinusoid(p: torch.Tensor, d: int) -> torch.Tensor:
    """R_p = [sin(p / 10000^(2k/d)), cos(p / 10000^(2k/d))], halves concatenated; p any shape -> (..., d)."""
    angle = p[..., None].double() / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    return torch.cat([angle.sin(), angle.cos()], dim=-1).float()


def relative_reference(model, x, mask, span):
    """Dense attention with the paper's four terms, every query i over the keys j with span(i, j) True:
    (q_i + u) . k_j + (q_i + v) . W_r R_{i-j}, scaled by 1/sqrt(Dh), padded keys removed. (B, N, D) -> same."""
    B, N, _ = x.shape
    q, k, v = model.project(x)  # (B, H, N, Dh)
    i = torch.arange(N)
    table = paper_sinusoid(i[:, None] - i[None, :], D).to(x.dtype)  # (N, N, D): R_{i-j}
    r = model.r_net(table).view(N, N, H, -1)  # (N, N, H, Dh): W_r R_{i-j}
    a = torch.einsum("bhid,bhjd->bhij", q, k)
    b = torch.einsum("bhid,ijhd->bhij", q, r)
    c = torch.einsum("hd,bhjd->bhj", model.u, k)[:, :, None, :]
    d = torch.einsum("hd,ijhd->hij", model.v, r)[None]
    scores = (a + b + c + d) / math.sqrt(D // H)  # (B, H, N, N)
    visible = span(i[:, None], i[None, :]) & mask[:, None, None, :]  # (B, 1, N, N)
    o = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v  # (B, H, N, Dh)
    return model.out(o.transpose(1, 2).reshape(B, N, -1))


@pytest.mark.parametrize("segment", [40, 64])  # exactly N, and longer than N
def test_one_segment_is_full_attention_with_the_papers_relative_terms(segment):
    model = build(segment=segment, memory=1).eval()
    x = torch.randn(2, 40, D)
    mask = lengths_mask([40, 27], 40)
    with torch.no_grad():
        got, want = model(x, mask), relative_reference(model, x, mask, lambda i, j: torch.ones_like(i - j, dtype=bool))
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["explicit", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradients_of_both_backends_equal_the_papers_formula(dtype, backend):
    """Explicit scores, or SDPA with the position term as its float mask: every parameter's and the input's
    gradient equals the dense formula's (one segment, so no stop-gradient memory takes part)."""
    model = build(segment=64, memory=1).to(dtype).train()
    model.backend = backend
    x = torch.randn(2, 40, D, dtype=dtype, requires_grad=True)
    mask = lengths_mask([40, 27], 40)
    weight = torch.randn(2, 40, D, dtype=dtype) * mask[..., None]  # a loss over real positions only
    grads = []
    for fn in (lambda: model(x, mask), lambda: relative_reference(model, x, mask, lambda i, j: (i - j) == (i - j))):
        model.zero_grad()
        x.grad = None
        (fn() * weight).sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    tol = 1e-6 if dtype == torch.float64 else 1e-4  # fp64: both read fp32-rounded sinusoids
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["explicit", "sdpa"])
@pytest.mark.parametrize("memory", [1, 2])
def test_segments_with_memory_equal_dense_attention_over_the_memory_span(memory, backend):
    """Forward values only (the memory's stop-gradient changes no value): query i in segment i // S sees keys
    of segments i // S - memory ... i // S, at their true distance i - j (rel_shift + the windows)."""
    S = 8
    model = build(segment=S, memory=memory).eval()
    model.backend = backend
    x = torch.randn(2, 37, D)  # 5 segments, the last one partial
    mask = lengths_mask([37, 30], 37)
    mask[0, 5] = False  # a hole inside the memory of a later segment

    def span(i, j):
        return (j // S <= i // S) & (j // S >= i // S - memory)

    with torch.no_grad():
        got, want = model(x, mask), relative_reference(model, x, mask, span)
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-4)


def test_no_gradient_reaches_a_previous_segment_through_the_memory():
    S = 8
    model = build(segment=S, memory=1).train()
    x = torch.randn(1, 3 * S, D, requires_grad=True)
    out = model(x, torch.ones(1, 3 * S, dtype=torch.bool))
    out[:, 2 * S:].sum().backward()  # the last segment's outputs only
    assert torch.equal(x.grad[:, :2 * S], torch.zeros_like(x.grad[:, :2 * S]))  # its memory got no gradient
    assert x.grad[:, 2 * S:].abs().sum() > 0
    assert model.qkv.weight.grad.abs().sum() > 0  # W_k, W_v still learn from the memory's keys and values


@pytest.mark.parametrize("memory", [1, 2])
def test_a_segment_sees_exactly_its_memory_span(memory):
    """With memory M, changing the tokens M + 1 segments back changes nothing; M segments back does."""
    S = 8
    model = build(segment=S, memory=memory).eval()
    x = torch.randn(1, 4 * S, D)
    mask = torch.ones(1, 4 * S, dtype=torch.bool)
    last = slice(3 * S, 4 * S)
    with torch.no_grad():
        base = model(x, mask)
        for back, seen in ((memory + 1, False), (memory, True)):
            x2 = x.clone()
            start = (3 - back) * S
            x2[:, start:start + S] = torch.randn(1, S, D)
            changed = not torch.allclose(model(x2, mask)[:, last], base[:, last], atol=1e-6)
            assert changed is seen, f"memory {memory}: a change {back} segment(s) back is {'un' * seen}seen"


def test_appended_padding_changes_nothing_across_segments():
    model = build(max_len=128, segment=8, memory=2).eval()
    x = torch.randn(2, 45, D)
    lengths = [45, 31]
    with torch.no_grad():
        y = model(x, lengths_mask(lengths, 45))
        x_long = torch.cat([x, torch.randn(2, 30, D) * 10], dim=1)  # junk in the new padding
        x_long[1, 31:45] = torch.randn(14, D) * 10  # and in the old
        y_long = model(x_long, lengths_mask(lengths, 75))
    for b, n in enumerate(lengths):
        torch.testing.assert_close(y_long[b, :n], y[b, :n], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["explicit", "sdpa"])
def test_a_window_of_only_padding_stays_finite_with_either_backend(backend):
    model = build(segment=8, memory=1).eval()
    model.backend = backend
    mask = lengths_mask([20, 0], 40)  # the second row is all padding: no query sees a real key
    out = model(torch.randn(2, 40, D), mask)
    assert torch.isfinite(out).all()


def test_backend_is_checked():
    model = build()
    model.backend = "flex"
    with pytest.raises(ValueError, match="backend must be one of"):
        model(torch.randn(1, 8, D), torch.ones(1, 8, dtype=torch.bool))


@pytest.mark.parametrize("options", [{"segment": 0}, {"memory": -1}])
def test_invalid_options_are_refused(options):
    with pytest.raises(ValueError):
        build(**options)
