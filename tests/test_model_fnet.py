"""FNet: Re(fft2) over each example's own length, one example at a time; appended padding; holes; the input
gradient (the mixer has no parameters, so the registry's gradient test is vacuous for it) by gradcheck and
against the explicit DFT-matrix formula."""
from __future__ import annotations

import math

import pytest
import torch

from models import create_model
from models.fnet import dft_per_length, fast_size

BACKBONE = {"d_model": 16, "n_heads": 2, "d_qkv": 16, "dropout": 0.0, "max_len": 512}


def ragged_mask(N: int, lengths: list[int]) -> torch.Tensor:
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]  # (B, N)


def dft_matrix(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64)
    return torch.polar(torch.ones(n, n, dtype=torch.float64), -2 * math.pi * torch.outer(k, k) / n)  # (n, n)


@pytest.mark.parametrize("norm", ["none", "ortho"])
def test_equals_fft2_of_each_examples_real_part(norm):
    """Lengths 53 (prime), 97 (= N, full), 1, 13 and 96 in one batch of N = 97: every example gets
    Re(fft2) of its own L x D block, padded positions 0."""
    torch.manual_seed(0)
    model = create_model("fnet", **BACKBONE, norm=norm)
    lengths = [53, 97, 1, 13, 96]
    x = torch.randn(5, 97, 16, dtype=torch.float64)
    mask = ragged_mask(97, lengths)
    out = model(x, mask)
    for b, n in enumerate(lengths):
        want = torch.fft.fft2(x[b, :n]).real / (math.sqrt(n * 16) if norm == "ortho" else 1)  # (L, D)
        torch.testing.assert_close(out[b, :n], want, rtol=1e-10, atol=1e-10)
        assert (out[b, n:] == 0).all()


def test_fp32_chirp_z_is_as_accurate_as_the_plain_fft():
    """At N = 1024 in fp32, Bluestein's error against an fp64 reference is of the plain FFT's order."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(2, 1024, 8, generator=g, dtype=torch.complex64)
    length = torch.tensor([1021, 700])
    y = y * ragged_mask(1024, length.tolist())[..., None]
    got = dft_per_length(y, length)
    for b, n in enumerate(length.tolist()):
        want = torch.fft.fft(y[b, :n].to(torch.complex128), dim=0)
        scale = want.abs().max()
        plain = (torch.fft.fft(y[b, :n], dim=0) - want).abs().max() / scale
        assert (got[b, :n] - want).abs().max() / scale < 4 * plain + 1e-6


def test_appended_padding_and_junk_change_nothing():
    torch.manual_seed(0)
    model = create_model("fnet", **BACKBONE)
    x = torch.randn(2, 40, 16)
    mask = ragged_mask(40, [40, 25])
    ref = model(x, mask)
    for extra in (1, 24, 200):  # different chirp-z FFT sizes
        junk = torch.cat([x, 10 * torch.randn(2, extra, 16)], dim=1)
        out = model(junk, torch.cat([mask, torch.zeros(2, extra, dtype=torch.bool)], dim=1))
        torch.testing.assert_close(out[0, :40], ref[0], rtol=1e-5, atol=1e-4)  # outputs ~ sqrt(L D) ~ 25
        torch.testing.assert_close(out[1, :25], ref[1, :25], rtol=1e-5, atol=1e-4)
        assert (out[:, 40:] == 0).all()


def test_a_hole_is_a_zero_token():
    """A padded token inside the window (LRA's pixel-0-as-pad quirk) counts as a zero token and outputs 0."""
    torch.manual_seed(0)
    model = create_model("fnet", **BACKBONE)
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    mask = ragged_mask(30, [20])
    mask[0, [3, 11]] = False
    zeroed = x[0, :20] * mask[0, :20, None]
    want = torch.fft.fft2(zeroed).real * mask[0, :20, None]
    torch.testing.assert_close(model(x, mask)[0, :20], want, rtol=1e-10, atol=1e-10)


def test_mask_free_equals_all_real():
    model = create_model("fnet", **BACKBONE)
    x = torch.randn(2, 33, 16)
    torch.testing.assert_close(model(x, None), model(x, torch.ones(2, 33, dtype=torch.bool)))


@pytest.mark.parametrize("norm", ["none", "ortho"])
def test_input_gradient_passes_gradcheck(norm):
    model = create_model("fnet", **BACKBONE, norm=norm)
    x = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)
    mask = ragged_mask(6, [6, 4])
    mask[0, 2] = False  # a hole too
    assert torch.autograd.gradcheck(lambda t: model(t, mask), (x,))


def test_input_gradient_is_the_explicit_dft_formula():
    """out = Re(C_L X C_D) with symmetric DFT matrices C, so d sum(G * out) / dX = Re(C_L G C_D) on the real
    block and 0 at padding."""
    torch.manual_seed(0)
    model = create_model("fnet", **BACKBONE)
    lengths = [9, 4]
    x = torch.randn(2, 11, 6, dtype=torch.float64, requires_grad=True)
    mask = ragged_mask(11, lengths)
    g = torch.randn(2, 11, 6, dtype=torch.float64)
    (model(x, mask) * g).sum().backward()
    for b, n in enumerate(lengths):
        c_l, c_d = dft_matrix(n), dft_matrix(6)
        forward = (c_l @ x[b, :n].detach().to(torch.complex128) @ c_d).real  # the formula itself, no FFT
        torch.testing.assert_close(model(x, mask)[b, :n].detach(), forward, rtol=1e-10, atol=1e-10)
        want = (c_l @ g[b, :n].to(torch.complex128) @ c_d).real  # (L, D)
        torch.testing.assert_close(x.grad[b, :n], want, rtol=1e-10, atol=1e-10)
        assert (x.grad[b, n:] == 0).all()


def test_bf16_autocast_runs_in_fp32():
    model = create_model("fnet", **BACKBONE)
    x = torch.randn(2, 50, 16)
    mask = ragged_mask(50, [50, 17])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, mask)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(x, mask))


def test_fast_sizes():
    assert [fast_size(n) for n in (1, 7, 17, 511, 8193)] == [1, 8, 18, 512, 8640]


@pytest.mark.parametrize("lengths", [[40, 40], [40, 23]])
def test_compiled_it_is_one_graph_and_the_same_with_or_without_padding(lengths):
    """Eager, a batch of full rows takes the plain FFT after a host check; compiled, that check would break the graph
    in every layer, so the transform over each length runs whatever the lengths: the same numbers either way."""
    torch.manual_seed(0)
    mixer = create_model("fnet", **BACKBONE)
    x, mask = torch.randn(2, 40, 16, dtype=torch.float64), ragged_mask(40, lengths)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(mixer)(x, mask)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    compiled = torch.compile(mixer, backend="eager")
    torch.testing.assert_close(compiled(x, mask), mixer(x, mask), rtol=1e-10, atol=1e-10)
