"""Nystromformer: the limit case (one landmark per token = exact softmax attention), padding that is exact
and never NaN, segment means over real tokens, and the pseudo-inverse iteration."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from models import create_model
from models.nystromformer import depthwise_skip, iterative_pinv, nystrom_attention, segment_means

BACKBONE = {"d_model": 32, "n_heads": 2, "d_qkv": 32, "dropout": 0.0, "max_len": 512}


def ragged_mask(N: int, lengths: list[int]) -> torch.Tensor:
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]  # (B, N)


def exact_attention(q, k, v, mask):
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, N, N)
    return logits.masked_fill(~mask[:, None, None, :], -math.inf).softmax(-1) @ v  # (B, H, N, Dh)


@pytest.mark.parametrize("n_landmarks", [20, 32])  # = N (one token per segment), and more landmarks than tokens
def test_one_landmark_per_token_is_exact_softmax_attention(n_landmarks):
    """m >= L: F = A = B over the real tokens, so F A^+ B = softmax(Q K^T) once the iteration converged; the
    second row (12 real of 20) also exercises the empty landmarks (masked columns, identity rows of A)."""
    torch.manual_seed(0)
    model = create_model("nystromformer", **BACKBONE, n_landmarks=n_landmarks, pinv_iterations=40,
                         conv_kernel=0).double().eval()
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    mask = ragged_mask(20, [20, 12])
    q, k, v = model.project(x)  # (B, H, N, Dh)
    o = exact_attention(q, k, v, mask)  # (B, H, N, Dh)
    want = model.out(o.transpose(1, 2).reshape(2, 20, 32))  # (B, N, D)
    got = model(x, mask)
    torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got[1, :12], want[1, :12], rtol=1e-9, atol=1e-9)


def test_fewer_landmarks_are_an_approximation_not_the_exact_result():
    """The limit test above must not pass by accident (e.g. an exact path regardless of m)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 64, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(1, 64, dtype=torch.bool)
    err = (nystrom_attention(q, k, v, mask, 8, 40) - exact_attention(q, k, v, mask)).abs().max()
    assert err > 1e-3


def test_heavy_padding_is_finite_and_exact():
    """3 real tokens of 200 (61 of the 64 landmarks empty), a row with one real token and a row with none:
    forward and backward stay finite, and the real outputs equal those of the unpadded sequence."""
    torch.manual_seed(0)
    model = create_model("nystromformer", **BACKBONE).train()
    x = torch.randn(3, 200, 32, requires_grad=True)
    mask = ragged_mask(200, [3, 1, 0])
    out = model(x, mask)
    (out * torch.randn_like(out)).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert x.grad[0, :3].abs().sum() > 0
    for p in model.parameters():
        assert torch.isfinite(p.grad).all()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x[:1], mask[:1])[:, :3], model(x[:1, :3], mask[:1, :3]), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(model(x[1:2], mask[1:2])[:, :1], model(x[1:2, :1], mask[1:2, :1]),
                                   atol=1e-5, rtol=1e-4)


def test_bf16_autocast_keeps_the_core_in_fp32():
    torch.manual_seed(0)
    model = create_model("nystromformer", **BACKBONE)
    x = torch.randn(2, 100, 32)
    mask = ragged_mask(100, [100, 7])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), model(x, mask), atol=0.1, rtol=0.05)


def test_mixed_backend_runs_the_long_products_in_bf16_and_stays_close():
    """backend=mixed (auto's): with fp32 inputs the same computation as fp32 (bit for bit); under bf16 autocast its
    N-sized products take bf16 operands (so it differs from the fp32 backend) yet stays within bf16's error of
    the fp32 model, padding included, and real outputs ignore appended padding."""
    torch.manual_seed(0)
    model = create_model("nystromformer", **BACKBONE, n_landmarks=16)
    x = torch.randn(2, 100, 32)
    mask = ragged_mask(100, [100, 37])
    reference = model(x, mask)  # (B, N, D) fp32
    model.backend = "mixed"
    torch.testing.assert_close(model(x, mask), reference, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = model(x, mask).float()
        model.backend = "fp32"
        full = model(x, mask).float()
        model.backend = "mixed"
        alone = model(x[1:, :37], mask[1:, :37]).float()
        model.backend = "auto"
        auto = model(x, mask).float()
    assert not torch.equal(mixed, full)
    assert torch.equal(auto, mixed)  # auto = mixed (the module docstring says why)
    for got in (mixed, full):
        torch.testing.assert_close(got[0], reference[0], atol=0.01, rtol=0.01)
        torch.testing.assert_close(got[1, :37], reference[1, :37], atol=0.01, rtol=0.01)
    torch.testing.assert_close(mixed[1:, :37], alone, atol=1e-3, rtol=1e-3)
    assert (mixed - reference).abs().mean() < 4 * (full - reference).abs().mean() + 1e-3


@pytest.mark.parametrize("N", [5, 80])  # shorter than the kernel, and longer
def test_skip_equals_the_grouped_convolution(N):
    """The skip as shifted copies equals the public code's grouped Conv2d (groups = heads, a (K, 1) window, zero
    padding), forward and backward, in fp64; under bf16 it returns bf16 within bf16's error of it."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 3, (35, 1), padding=(17, 0), groups=3, bias=False).double()
    v = torch.randn(2, 3, N, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 3, N, 8, dtype=torch.float64)
    want = conv(v)
    want_grads = torch.autograd.grad(want, (v, conv.weight), grad)
    got = depthwise_skip(v, conv.weight)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, (v, conv.weight), grad), want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    low = depthwise_skip(v.detach().bfloat16(), conv.weight.detach().float())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), want.detach(), rtol=0.02, atol=0.02)


def test_backend_is_checked():
    model = create_model("nystromformer", **BACKBONE)
    model.backend = "bf16"
    with pytest.raises(ValueError, match="backend must be one of"):
        model(torch.randn(1, 8, 32), torch.ones(1, 8, dtype=torch.bool))


def test_segment_means_follow_the_real_tokens():
    """Segments are laid over each example's real tokens: with L divisible by m they are the public code's
    reshape-means; otherwise every real token is in exactly one segment, sizes differ by at most one; holes
    and appended padding change nothing."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 48, 5, generator=g, dtype=torch.float64)
    mask = ragged_mask(48, [48, 30])
    means, landmark = segment_means(mask, 6, torch.float64)  # (B, m, N), (B, m)
    assert landmark.all()
    torch.testing.assert_close(means[0] @ x[0], x[0].view(6, 8, 5).mean(1))
    torch.testing.assert_close(means[1] @ x[1], x[1, :30].view(6, 5, 5).mean(1))
    uneven, _ = segment_means(ragged_mask(48, [37]), 8, torch.float64)  # 37 tokens in 8 segments
    member = uneven[0] > 0  # (m, N)
    assert (member.sum(0)[:37] == 1).all() and not member[:, 37:].any()
    assert set(member.sum(1).tolist()) == {4, 5}
    holes = torch.zeros(1, 60, dtype=torch.bool)
    keep = torch.randperm(60, generator=g)[:37].sort().values
    holes[0, keep] = True  # the same 37 tokens, scattered among padding
    scattered, _ = segment_means(holes, 8, torch.float64)
    torch.testing.assert_close(scattered[0][:, keep], uneven[0, :, :37])
    few, landmark = segment_means(ragged_mask(10, [3]), 8, torch.float64)
    assert landmark[0].tolist() == [True] * 3 + [False] * 5
    torch.testing.assert_close(few[0, :3, :3], torch.eye(3, dtype=torch.float64))


def test_iterative_pinv_converges_to_the_pseudo_inverse():
    """On a well-conditioned softmax matrix 6 iterations reach torch.linalg.pinv, the error shrinking each step."""
    g = torch.Generator().manual_seed(0)
    a = (0.5 * torch.randn(4, 32, 32, generator=g, dtype=torch.float64) + 4 * torch.eye(32)).softmax(-1)
    want = torch.linalg.pinv(a)
    errors = [(iterative_pinv(a, n) - want).abs().max().item() for n in range(1, 7)]
    assert all(later < earlier for earlier, later in itertools.pairwise(errors)), errors
    torch.testing.assert_close(iterative_pinv(a, 6), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(iterative_pinv(a.float(), 6), want.float(), rtol=1e-4, atol=1e-4)


def test_iterative_pinv_initialises_each_matrix_alone():
    """Z_0 = A^T / (|A|_1 |A|_inf) per matrix: a batch gives each matrix what it gets alone (the public code's
    batch-wide maximum does not, after 6 iterations)."""
    g = torch.Generator().manual_seed(0)
    a = torch.cat([(0.5 * torch.randn(1, 64, 64, generator=g)).softmax(-1),
                   (4.0 * torch.randn(1, 64, 64, generator=g)).softmax(-1)]).double()  # column-sum maxima 1.2, 3.1
    together = iterative_pinv(a, 6)
    for i in range(2):
        torch.testing.assert_close(together[i], iterative_pinv(a[i], 6), rtol=1e-12, atol=1e-12)


def test_options_are_validated():
    with pytest.raises(ValueError, match="odd"):
        create_model("nystromformer", **BACKBONE, conv_kernel=4)
    with pytest.raises(ValueError, match="n_landmarks"):
        create_model("nystromformer", **BACKBONE, n_landmarks=0)
