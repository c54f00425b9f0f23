"""The compile check (``engine.compiled_gradient_check``): compiled and eager gradients, each against a float64 copy
of the model's. Stand-ins for torch.compile give the wrong and the reordered executions; one test compiles for real
(Inductor's CPU code)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lra.train import engine
from lra.train.encoder import Classifier, Encoder


def tiny_classifier() -> Classifier:
    torch.manual_seed(0)
    enc = Encoder("transformer", {}, vocab_size=20, seq_len=32, n_layers=1, d_model=16, n_heads=2, d_qkv=16,
                  d_ff=16, dropout=0.1, attn_dropout=0.1, positions="learned", cls_token=True)
    return Classifier(enc, 16, 16, 3, "cls").train()


TOKENS, LABELS = torch.randint(1, 20, (4, 32), generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 1])


class ScaleGrad(torch.autograd.Function):
    """The identity forward, its gradient times ``factor`` backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class OneGradientScaled(nn.Module):
    """What a miscompiled model can look like: the same outputs, one parameter's gradient 1.1 times its own."""

    def __init__(self, model: nn.Module, name: str, factor: float = 1.1):
        super().__init__()
        self.model, self.name, self.factor = model, name, factor

    def forward(self, *args):
        p = dict(self.model.named_parameters())[self.name]
        return torch.func.functional_call(self.model, {self.name: ScaleGrad.apply(p, self.factor)}, args)


def test_a_rightly_compiled_model_passes_and_is_left_as_found():
    """Inductor's CPU code: its gradients are as close to float64's as the eager ones; the model keeps its mode and
    has no gradients left."""
    model = tiny_classifier()
    torch._dynamo.reset()
    check = engine.compiled_gradient_check(model, (TOKENS,), LABELS)
    assert check.precision == "fp32" and check.no_float64 is None and not check.rejected, check.describe()
    assert check.compiled_error <= check.bound and check.eager_error is not None
    assert check.name in dict(model.named_parameters()) and check.name in check.describe()
    assert model.training and all(p.grad is None for p in model.parameters())


def test_a_wrong_gradient_is_rejected_naming_its_parameter(monkeypatch):
    """One parameter's gradient 10% off (the outputs right): rejected, the message naming that parameter with both
    errors; every other parameter's gradient is the eager one, so the worst is the scaled one."""
    model = tiny_classifier()
    name = "encoder.blocks.0.norm1.bias"
    assert name in dict(model.named_parameters())
    monkeypatch.setattr(torch, "compile", lambda m, **kw: OneGradientScaled(m, name))
    check = engine.compiled_gradient_check(model, (TOKENS,), LABELS)
    assert check.rejected and check.name == name and check.compiled_error == pytest.approx(0.1, rel=1e-3)
    text = check.describe()
    assert text.startswith(f"{name}'s gradient is 1.00e-01 of its size off float64's compiled, ")
    assert f"{check.eager_error:.2e} eager" in text and "bound 4 x eager" in text


class Cancelling(nn.Module):
    """Logits from sums of many large terms that cancel (``a``'s columns: 4096 terms of size ~1e4 summing to ~1):
    fp32 keeps few correct digits of each sum, forward and backward, so its eager gradients are ~10% off float64's.
    ``reverse``: the same sums in the other order, as a compilation may order them."""

    def __init__(self, n: int = 4096, k: int = 48, classes: int = 3, reverse: bool = False):
        super().__init__()
        a = 1e4 * torch.randn(n, k, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        self.register_buffer("a", (a - a.mean(0) + 1 / n).float())  # (n, k): each column sums to about 1
        self.w = nn.Parameter(torch.ones(k))  # (k,)
        self.classes, self.reverse = classes, reverse

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, k)
        a = self.a.flip(0) if self.reverse else self.a
        s = (a * self.w).sum(0)  # (k,), each a sum of large cancelling terms
        return (x * s).reshape(len(x), self.classes, -1).sum(-1)  # (B, classes)


class Reordered(nn.Module):
    """``Cancelling`` through a stand-in compiler: its own parameters, its sums in the other order."""

    def __init__(self, model: Cancelling, **kwargs):
        super().__init__()
        self.model = model

    def forward(self, x):
        self.model.reverse = True
        try:
            return self.model(x)
        finally:
            self.model.reverse = False


def test_a_model_whose_eager_gradients_are_noisy_is_not_rejected_for_compiled_noise_alike(monkeypatch):
    """Eager fp32 ~10% off float64, the reordered execution as far off: accepted against float64, where the old
    compiled-against-eager rule (still the rule where a model has no float64 reference) rejected it."""
    monkeypatch.setattr(torch, "compile", Reordered)
    model = Cancelling()
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([0, 1, 2, 0])
    check = engine.compiled_gradient_check(model, (x,), labels)
    assert check.eager_error > 1e-2 and check.compiled_error > engine.PAIRWISE_TOLERANCE["fp32"]
    assert not check.rejected, check.describe()
    eager = engine.loss_gradients(model, model, (x,), labels)
    compiled = engine.loss_gradients(model, Reordered(model), (x,), labels)
    apart = engine.relative_errors(compiled, eager, ["w"])["w"]
    assert apart > engine.PAIRWISE_TOLERANCE["fp32"]  # compiled against eager: far apart
    # where the model does not run in float64, that pairwise rule is what the check has, and the notes say so
    monkeypatch.setattr(engine, "float64_gradients", lambda *a, **k: (_ for _ in ()).throw(TypeError("no float64")))
    pairwise = engine.compiled_gradient_check(model, (x,), labels)
    assert pairwise.rejected and pairwise.eager_error is None and pairwise.no_float64 == "TypeError: no float64"
    assert pairwise.compiled_error == pytest.approx(apart) and "no float64 reference" in pairwise.describe()
    assert any("does not run in float64" in note for note in pairwise.notes())


def test_the_float64_reference_is_a_copy_with_the_same_buffers_in_eval_mode():
    """Random features and masks are buffers: the copy keeps their numbers (widened), draws nothing (eval mode, so
    no dropout), and leaves the model in fp32; its gradients are the model's to fp32 rounding."""
    model = tiny_classifier()
    model.register_buffer("features", torch.randn(3, 5))
    state = torch.random.get_rng_state()
    grads = engine.float64_gradients(model, (TOKENS,), LABELS)
    assert torch.equal(torch.random.get_rng_state(), state)  # no draw
    assert all(g.dtype == torch.float64 for g in grads.values())
    assert all(p.dtype == torch.float32 for p in model.parameters()) and model.features.dtype == torch.float32
    model.eval()
    eager = engine.loss_gradients(model, model, (TOKENS,), LABELS)
    errors = engine.relative_errors(eager, grads, grads)
    assert max(errors.values()) < 1e-4
