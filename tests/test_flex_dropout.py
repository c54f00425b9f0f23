"""Attention dropout for FlexAttention (models/_flex_dropout.py): equal to dropout on the softmax weights with the
same draws (outputs and gradients), the draws' rate and independence, rows whose weights all drop, and the backward
graphs a compiler receives (each FlexAttention backward gets its output's gradient). CPU, eager (the backward check
lifted: conftest's flex_backward_on_cpu)."""
from __future__ import annotations

import pytest
import torch

from models._flex_dropout import dense_draws, flex_attention_dropout
from tests.mixer_checks import captured_values_backend

B, H, N, DH = 2, 3, 70, 8


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_equals_dropout_on_the_softmax_weights_with_the_same_draws(p, flex_backward_on_cpu):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, DH, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(H, N, N, dtype=torch.float64, requires_grad=True)
    seed = torch.tensor([987654321])

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    got = flex_attention_dropout(q, k, v, p, score_mod=score_mod, scale=0.3, seed=seed)
    weights = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + bias, -1)  # (B, H, N, N)
    want = (weights * dense_draws(seed, p, (B, H, N, N)) / (1 - p)) @ v
    torch.testing.assert_close(got, want)
    loss = torch.randn(B, H, N, DH, dtype=torch.float64)
    for g, w in zip(torch.autograd.grad((got * loss).sum(), (q, k, v, bias)),
                    torch.autograd.grad((want * loss).sum(), (q, k, v, bias))):
        torch.testing.assert_close(g, w)


def test_no_dropout_is_one_flex_call_and_plain_attention():
    q, k, v = (torch.randn(B, H, N, DH) for _ in range(3))
    want = torch.softmax(q @ k.transpose(-1, -2) * DH**-0.5, -1) @ v
    torch.testing.assert_close(flex_attention_dropout(q, k, v, 0.0), want, atol=1e-5, rtol=1e-4)


def test_dropout_one_drops_everything_and_a_rate_outside_zero_one_is_refused():
    q, k, v = (torch.randn(B, H, N, DH) for _ in range(3))
    assert torch.equal(flex_attention_dropout(q, k, v, 1.0), torch.zeros(B, H, N, DH))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        flex_attention_dropout(q, k, v, 1.5)


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_the_draws_keep_each_weight_with_probability_one_minus_p_independently(p):
    shape = (4, 4, 256, 256)
    keep = dense_draws(torch.tensor([42]), p, shape).double()  # (4, 4, 256, 256): 1M draws
    n = keep.numel()
    assert abs(keep.mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    rows = keep.mean(-1).flatten()  # each row's share of kept weights: binomial over 256
    assert rows.std().item() < 1.2 * (p * (1 - p) / 256) ** 0.5
    centred = keep - keep.mean()
    for neighbour in (centred.roll(1, -1), centred.roll(1, -2), centred.roll(1, 1), centred.roll(1, 0)):
        correlation = (centred * neighbour).mean() / centred.var()
        assert abs(correlation.item()) < 5 / n**0.5  # next key, next query, next head, next sample
    other = dense_draws(torch.tensor([43]), p, shape).double()
    assert abs(((keep - keep.mean()) * (other - other.mean())).mean() / centred.var()) < 5 / n**0.5  # seeds


def test_rows_whose_weights_all_drop_give_zero_and_finite_gradients(flex_backward_on_cpu):
    """At p = 0.9 over 6 keys about half the rows lose every weight (0.9^6): those give 0, as dropout does; a
    row with no key at all (masked by the score_mod) gives 0 too, with finite gradients everywhere."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, DH, requires_grad=True) for _ in range(3))
    k6, v6 = k[:, :, :6], v[:, :, :6]
    seed = torch.tensor([7])

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx == 0, float("-inf"), score)  # query 0 sees no key

    out = flex_attention_dropout(q, k6, v6, 0.9, score_mod=score_mod, seed=seed)
    keep = dense_draws(seed, 0.9, (1, 2, 40, 6))
    empty = ~keep.any(-1)  # (1, 2, 40)
    assert empty.sum() > 10
    assert (out[empty] == 0).all() and (out[:, :, 0] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


class BackwardCaptured(Exception):
    """Stops a backward once its graph is captured: the CPU's eager FlexAttention backward, which would run it, is not
    what a GPU runs (Inductor lowers the graph instead)."""


def capturing_backend(grad_outs: list, stop: bool = False):
    """A torch.compile backend that hands on the graphs AOTAutograd makes, as Inductor would receive them, and
    appends to ``grad_outs`` the output gradient (``grad_out``) of each flex_attention_backward in the backward
    graph; ``stop``: raise BackwardCaptured instead of running that graph."""
    from torch._dynamo.backends.common import aot_autograd

    def backward_compiler(graph, example_inputs):
        grad_outs.extend(node.args[5] for node in graph.graph.nodes if "flex_attention_backward" in str(node.target))
        if stop:
            raise BackwardCaptured
        return graph

    torch._dynamo.reset()
    return aot_autograd(fw_compiler=lambda graph, example_inputs: graph, bw_compiler=backward_compiler)


@pytest.mark.heavy  # CI's second tier: compiled on the CPU
def test_every_flex_call_gets_a_gradient_for_its_output_when_compiled(flex_backward_on_cpu):
    """The normaliser's call is used for its log-normaliser only; if no gradient reached its output, the compiled
    backward would hand FlexAttention's backward a None grad_out, which Inductor's lowering cannot take (it failed
    so on an H200). The backward graph AOTAutograd gives Inductor is captured here on the CPU: each
    flex_attention_backward gets a gradient tensor for its output, and the gradients equal eager's."""
    grad_outs = []
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, 16, requires_grad=True) for _ in range(3))
    seed = torch.tensor([5])
    compiled = torch.compile(flex_attention_dropout, backend=capturing_backend(grad_outs), fullgraph=True)
    got = compiled(q, k, v, 0.2, seed=seed)
    got_grads = torch.autograd.grad(got.sum(), (q, k, v))
    assert len(grad_outs) == 2 and all(g is not None for g in grad_outs)
    want = flex_attention_dropout(q, k, v, 0.2, seed=seed)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(g, w)


@pytest.mark.heavy  # CI's second tier: compiled on the CPU
@pytest.mark.parametrize("how", ["dynamic shapes", "p changed after compiling"])
def test_no_symbolic_int_reaches_a_kernel_when_sizes_or_p_are_dynamic(how):
    """Heads, keys and the drop threshold are captured by the score_mod as a tensor. As Python ints they become
    SymInts when compiled with dynamic shapes, or when p changes on a compiled module (Dynamo then makes it
    dynamic), and Inductor's FlexAttention lowering fails on a SymInt among its captured values (on an H200:
    "'ShapeAsConstantBuffer' object has no attribute 'dtype'"). Dynamo's graph is checked on the CPU: every captured
    value is a tensor, and the compiled draws equal eager's."""
    class Dropout(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = 0.0

        def forward(self, q, k, v):
            return flex_attention_dropout(q, k, v, self.p, seed=torch.tensor([7]))

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, 16) for _ in range(3))
    captured, module = [], Dropout()
    dynamic = True if how == "dynamic shapes" else None  # None: Dynamo's default, which makes a changed value dynamic
    compiled = torch.compile(module, backend=captured_values_backend(captured), dynamic=dynamic)
    with torch.no_grad():
        compiled(q, k, v)
        for p in (0.1, 0.2):
            module.p = p
            torch.testing.assert_close(compiled(q, k, v), module(q, k, v))
    assert captured and all(isinstance(value, torch.Tensor) for call in captured for value in call), captured


@pytest.mark.heavy  # CI's second tier: compiled on the CPU
@pytest.mark.parametrize("name", ["deberta", "etc"])
def test_the_models_flex_paths_with_dropout_give_every_flex_backward_a_gradient(name, flex_backward_on_cpu):
    """The same check on the training graphs of the models whose ``backend="flex"`` applies attention dropout
    (the path that failed to compile on an H200): every flex_attention_backward in the compiled layer's backward
    graph gets a gradient tensor for its output."""
    from models import create_model

    grad_outs = []
    torch.manual_seed(0)
    layer = create_model(name, d_model=32, n_heads=2, d_qkv=32, dropout=0.1, max_len=160).train()
    layer.backend = "flex"
    x = torch.randn(2, 150, 32, requires_grad=True)
    mask = torch.ones(2, 150, dtype=torch.bool)
    mask[1, 120:] = False  # (2, 150): key padding in the second example
    out = torch.compile(layer, backend=capturing_backend(grad_outs, stop=True))(x, mask)  # (2, 150, 32)
    with pytest.raises(BackwardCaptured):
        out.sum().backward()
    assert len(grad_outs) == 2 and all(g is not None for g in grad_outs)


@pytest.mark.gpu
def test_compiled_on_cuda_equals_dropout_with_the_same_draws():
    """The Triton kernels (compiled) draw as the eager reference does (the hash's int64 arithmetic in the kernel)
    and differentiate through both log-normalisers (the lse gradient in Inductor's backward): outputs and
    gradients equal dropout on the softmax weights with the same draws, fp32, N = 300 over three tiles."""
    torch.manual_seed(0)
    n, p = 300, 0.2
    q, k, v = (torch.randn(B, H, n, 16, device="cuda", requires_grad=True) for _ in range(3))
    bias = torch.randn(H, n, n, device="cuda", requires_grad=True)
    seed = torch.tensor([123456789], device="cuda")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    got = torch.compile(flex_attention_dropout)(q, k, v, p, score_mod=score_mod, scale=0.25, seed=seed)
    weights = torch.softmax(q @ k.transpose(-1, -2) * 0.25 + bias, -1)  # (B, H, n, n)
    want = (weights * dense_draws(seed, p, (B, H, n, n)).to(weights.device) / (1 - p)) @ v
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
    loss = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad((got * loss).sum(), (q, k, v, bias)),
                    torch.autograd.grad((want * loss).sum(), (q, k, v, bias))):
        torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-3)
