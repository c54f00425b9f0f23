"""On CUDA: the block-sparse models' FlexAttention path equals their dense-mask path (outputs and gradients), with
and without padding and with no mask at all, at lengths that are and are not multiples of the block, for the
defaults and for the settings that leave tiles partial (LRA's 64-blocks, a global token). Reformer's FlexAttention
round equals its SDPA round the same way."""
from __future__ import annotations

import pytest
import torch

from models import create_model

SPECS = [("local", {}), ("local", {"block": 64, "strided": True}), ("sparse", {}), ("longformer", {}),
         ("longformer", {"global_tokens": 1}), ("bigbird", {}), ("bigbird", {"block": 64})]
CASES = [(1152, "none"), (1025, "none"), (1025, "holes"), (1025, "mask=None")]


def outputs_and_grads(model, x, mask, backend):
    model.backend = backend
    model.zero_grad()
    x = x.clone().requires_grad_()
    y = model(x, mask)
    (y if mask is None else y * mask[..., None]).square().mean().backward()
    return y.detach(), x.grad, model.qkv.weight.grad.clone()


def assert_same(flex, reference):
    """Output, input gradient and weight gradient within 1e-4 of the reference's largest value."""
    for what, a, b in zip(("output", "dx", "dW"), flex, reference, strict=True):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-4, f"{what}: relative error {err:.1e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name,options", SPECS, ids=[n + "".join(f"-{k}{v}" for k, v in o.items()) for n, o in SPECS])
@pytest.mark.parametrize("n,padding", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_flex_attention_equals_the_dense_mask(name, options, n, padding):
    torch.manual_seed(0)
    m = create_model(name, d_model=64, n_heads=2, d_qkv=64, dropout=0.0, max_len=2048, **options).cuda()
    x = torch.randn(3, n, 64, device="cuda")
    mask = torch.ones(3, n, dtype=torch.bool, device="cuda")
    if padding == "holes":
        mask[1, 600:] = False
        mask[2, ::3] = False
    if padding == "mask=None":
        mask = None
    assert_same(outputs_and_grads(m, x, mask, "flex"), outputs_and_grads(m, x, mask, "dense"))


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"n_buckets": 10}], ids=["bucket64", "lra-10-chunks"])
@pytest.mark.parametrize("n", [1152, 1025])
@pytest.mark.parametrize("padding", ["holes", "mask=None"])
def test_reformer_flex_round_equals_the_sdpa_round(options, n, padding):
    """Reformer's one hash round: FlexAttention over the sorted sequence (compiled, as it runs on CUDA) equals the
    SDPA round over chunk windows, outputs and gradients, with padding and a sample that is one real token, and
    without a mask (its FlexAttention mask then reads no tensor)."""
    torch.manual_seed(0)
    m = create_model("reformer", d_model=64, n_heads=2, d_qkv=64, dropout=0.0, max_len=2048, **options).cuda()
    x = torch.randn(3, n, 64, device="cuda")
    mask = torch.ones(3, n, dtype=torch.bool, device="cuda")
    mask[1, 600:] = False
    mask[2, 1:] = False
    mask = None if padding == "mask=None" else mask
    assert_same(outputs_and_grads(m, x, mask, "flex"), outputs_and_grads(m, x, mask, "sdpa"))
