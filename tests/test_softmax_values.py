"""``models.base.softmax_values``: dropout(softmax(scores)) @ values with the weights recomputed in the backward
(``torch.utils.checkpoint``). The recomputation must draw the forward's dropout mask, eagerly and under
torch.compile, or every gradient would be silently wrong. Values = the identity make the output the dropped weights
themselves, so the forward's mask is visible and the gradients can be checked against it."""
from __future__ import annotations

import pytest
import torch

from models.base import softmax_values

P = 0.3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def check(fn, device: str):
    torch.manual_seed(0)
    L = 32
    scores = torch.randn(4, 16, L, device=device, requires_grad=True)
    values = torch.eye(L, device=device).expand(4, L, L).clone().requires_grad_()
    dropped = fn(scores, values, P)  # (4, 16, L): dropout(softmax(scores)), the forward's mask visible
    grad = torch.randn_like(dropped)
    dropped.backward(grad)
    assert ((dropped == 0).float().mean() - P).abs() < 0.05  # dropout was applied
    torch.testing.assert_close(values.grad, dropped.detach().transpose(-1, -2) @ grad, atol=1e-5, rtol=1e-5)
    p = torch.softmax(scores.detach(), -1)
    grad_p = grad * (dropped.detach() > 0) / (1 - P)  # through the forward's mask
    torch.testing.assert_close(scores.grad, p * (grad_p - (grad_p * p).sum(-1, keepdim=True)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_the_backward_draws_the_forwards_dropout_mask(device):
    check(softmax_values, device)


@pytest.mark.parametrize("device", DEVICES)
def test_the_backward_draws_the_forwards_dropout_mask_compiled(device):
    torch._dynamo.reset()
    check(torch.compile(softmax_values), device)


def test_without_dropout_it_is_softmax_times_values_in_the_values_dtype():
    scores = torch.randn(2, 5, 7, dtype=torch.float64)
    values = torch.randn(2, 7, 3, dtype=torch.float64)
    out = softmax_values(scores, values, 0.0)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ values)
