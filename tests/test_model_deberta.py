"""DeBERTa: the log buckets at known distances, c2p / p2c gathers against the paper's dense formula, the layer
against dense disentangled attention, and the c2c / sqrt(3 d) limit without relative embeddings."""
from __future__ import annotations

import math

import pytest
import torch

from models import create_model
from models.deberta import log_bucket, relative_gather, run_bounds

D = 32


def build(n_heads: int = 2, d_qkv: int = D, **options):
    torch.manual_seed(0)
    return create_model("deberta", d_model=D, n_heads=n_heads, d_qkv=d_qkv, dropout=0.0, max_len=128,
                        **options).eval()


def lengths_mask(lengths: list[int], n: int) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, n)


# |d| <= buckets / 2 = 4 exact; beyond: 4 + ceil(log(|d| / 4) / log(31 / 4) * 3), e.g. 8 -> 4 + ceil(1.02) = 6
SMALL = {0: 0, 1: 1, -3: -3, 4: 4, -4: -4, 5: 5, 8: 6, -8: -6, 16: 7, 31: 7, -31: -7, 32: 8, 100: 9}
# v3's defaults: exact to 128, then 128 + ceil(log(|d| / 128) / log(511 / 128) * 127), 511 -> the last, 255
DEFAULT = {127: 127, 128: 128, -128: -128, 129: 129, 200: 169, -200: -169, 511: 255, -511: -255, 512: 256}


@pytest.mark.parametrize("buckets,max_distance,table", [(8, 32, SMALL), (256, 512, DEFAULT)])
def test_log_buckets_at_known_distances(buckets, max_distance, table):
    d = torch.tensor(list(table))
    assert log_bucket(d, buckets, max_distance).tolist() == list(table.values())


def test_log_buckets_are_odd_and_monotone():
    d = torch.arange(0, 3000)
    b = log_bucket(d, 256, 512)
    assert torch.equal(log_bucket(-d, 256, 512), -b) and (b.diff() >= 0).all() and (b.diff() <= 1).all()
    assert len(b[(d > 128) & (d < 512)].unique()) == 127  # the 383 distances 129 ... 511 share 127 buckets


def paper_delta(n: int, model) -> torch.Tensor:
    """delta(i, j): the row of P for i - j, from its definition. (n, n) long."""
    i = torch.arange(n)
    d = i[:, None] - i[None, :]  # (n, n)
    if model.buckets:
        d = log_bucket(d, model.buckets, model.max_relative)
    return (d + model.span).clamp(0, 2 * model.span - 1)


def test_without_buckets_delta_is_v1s_clipped_distance():
    model = build(position_buckets=0, max_relative_positions=3)
    want = torch.tensor([[3, 2, 1, 0, 0], [4, 3, 2, 1, 0], [5, 4, 3, 2, 1], [5, 5, 4, 3, 2], [5, 5, 5, 4, 3]])
    assert torch.equal(model.relative_index(5, torch.device("cpu")), want)


def dense_terms(model, q, k):
    """Eq. 4's position terms with the relative vectors laid out per pair (N x N x Dh per head): c2p[i, j] =
    q_i . K_r[delta(i, j)], p2c[i, j] = k_j . Q_r[delta(j, i)]."""
    q_r, k_r = model.relative_projections()  # (H, 2k, Dh)
    delta = paper_delta(q.shape[2], model)  # (N, N)
    c2p = torch.einsum("bhid,hijd->bhij", q, k_r[:, delta])  # k_r[:, delta][h, i, j] = K_r[delta(i, j)]
    p2c = torch.einsum("bhjd,hjid->bhij", k, q_r[:, delta])  # q_r[:, delta][h, j, i] = Q_r[delta(j, i)]
    return c2p, p2c


CONFIGS = [{"position_buckets": 8, "max_relative_positions": 16},  # exact, log-spaced and clamped distances
           {"position_buckets": 0, "max_relative_positions": 5},  # v1 clipping
           {}]  # the defaults: every distance of a short input is exact


@pytest.mark.parametrize("options", CONFIGS)
def test_gathered_terms_equal_the_dense_formula(options):
    model = build(**options)
    q, k, _ = model.project(torch.randn(2, 30, D))  # (B, H, N, Dh)
    with torch.no_grad():
        got, want = model.c2p_p2c(q, k), dense_terms(model, q, k)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[1], got[1].transpose(-1, -2))  # p2c is not c2p's layout by accident
    mask = lengths_mask([30, 21], 30)
    with torch.no_grad():  # scaled and masked on the small tables: the same terms, padded keys at the minimum
        c2p, p2c = model.c2p_p2c(q, k, mask, scale=0.25)
    torch.testing.assert_close(c2p, want[0] * 0.25, atol=1e-5, rtol=1e-5)
    keys = mask[:, None, None, :].expand_as(p2c)
    torch.testing.assert_close(p2c[keys], want[1][keys] * 0.25, atol=1e-5, rtol=1e-5)
    assert (p2c[~keys] == torch.finfo(p2c.dtype).min).all()


@pytest.mark.parametrize("options", CONFIGS)
@pytest.mark.parametrize("dim", [-1, -2])
def test_relative_gather_equals_torch_gather_forward_and_backward(options, dim):
    """The prefix-sum backward (no scatter) gives gather's gradient, every distance past the last bucket too."""
    model, n = build(**options), 40
    delta = model.relative_index(n, torch.device("cpu"))  # (n, n)
    entries = 2 * model.span
    assert (delta[:, 1:] <= delta[:, :-1]).all()  # what the prefix sums rely on
    index = delta if dim == -1 else delta.t().contiguous()
    shape = (2, 3, n, entries) if dim == -1 else (2, 3, entries, n)
    table = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 3, n, n, dtype=torch.float64)
    got = relative_gather(table, delta, dim, run_bounds(delta, entries))  # CUDA's path, as the model takes it
    (got_grad,) = torch.autograd.grad(got, table, grad)
    want = torch.gather(table, dim, index.expand(2, 3, n, n))
    (want_grad,) = torch.autograd.grad(want, table, grad)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_grad, want_grad)


def test_relative_gather_compiles_into_one_graph_like_eager():
    """The runner compiles the model: CUDA's gathers must trace whole (no graph break) and match eager."""
    model, n = build(position_buckets=8, max_relative_positions=16), 40
    delta = model.relative_index(n, torch.device("cpu"))

    def p2c(table):  # the down-the-columns gather, the transposed case
        return relative_gather(table, delta, -2, run_bounds(delta, 2 * model.span))

    table, grad = torch.randn(2, 3, 2 * model.span, n, requires_grad=True), torch.randn(2, 3, n, n)
    want = torch.autograd.grad(p2c(table), table, grad)[0]
    got = torch.autograd.grad(torch.compile(p2c, fullgraph=True)(table), table, grad)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("options", CONFIGS)
@pytest.mark.parametrize("d_qkv,n_heads", [(32, 2), (24, 2)])  # head sizes 16 and 12 (zero-padded to 16)
def test_layer_equals_dense_disentangled_attention(options, d_qkv, n_heads):
    model = build(n_heads=n_heads, d_qkv=d_qkv, **options)
    x = torch.randn(2, 30, D)
    mask = lengths_mask([30, 19], 30)
    with torch.no_grad():
        q, k, v = model.project(x)  # (B, H, N, Dh)
        c2p, p2c = dense_terms(model, q, k)
        scores = (q @ k.transpose(-1, -2) + c2p + p2c) / math.sqrt(3 * (d_qkv // n_heads))  # (B, H, N, N)
        o = scores.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1) @ v  # (B, H, N, Dh)
        want = model.out(o.transpose(1, 2).reshape(2, 30, d_qkv))
        got = model(x, mask)
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-4)


def test_zero_relative_embeddings_leave_content_attention_over_sqrt_3d():
    model = build()
    with torch.no_grad():
        model.rel_embeddings.zero_()  # LayerNorm(0) is its bias, 0 at init: Q_r = K_r = 0
        x = torch.randn(2, 30, D)
        mask = lengths_mask([30, 22], 30)
        q, k, v = model.project(x)
        scores = q @ k.transpose(-1, -2) / math.sqrt(3 * D // 2)  # (B, H, N, N)
        o = scores.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1) @ v
        want = model.out(o.transpose(1, 2).reshape(2, 30, D))
        torch.testing.assert_close(model(x, mask)[mask], want[mask], atol=1e-5, rtol=1e-4)


def test_rows_of_only_padding_stay_finite():
    model = build()
    out = model(torch.randn(2, 30, D), lengths_mask([30, 0], 30))
    assert torch.isfinite(out).all()


def test_relative_embeddings_learn_through_both_terms():
    model = build(position_buckets=8, max_relative_positions=16).train()
    q, k, _ = model.project(torch.randn(1, 20, D))
    for term in model.c2p_p2c(q, k):
        model.zero_grad()
        term.sum().backward(retain_graph=True)
        assert model.rel_embeddings.grad.abs().sum() > 0


@pytest.mark.parametrize("options", [{"position_buckets": 1}, {"position_buckets": -2},
                                     {"max_relative_positions": 0}, {"position_buckets": 256,
                                                                     "max_relative_positions": 129}])
def test_invalid_options_are_refused(options):
    with pytest.raises(ValueError):
        build(**options)


@pytest.mark.gpu
def test_on_cuda_the_layer_and_its_gradients_match_the_cpu():
    """CUDA's relative gathers (prefix-sum backward) against the CPU's (torch.gather's own), in fp32."""
    model, x = build(position_buckets=8, max_relative_positions=16), torch.randn(2, 50, D)
    mask = lengths_mask([50, 37], 50)
    grads = []
    for device in ("cpu", "cuda"):
        m = model.to(device)
        xi = x.to(device, copy=True).requires_grad_()  # a leaf of its own on each device (x.to("cpu") is x itself)
        out = m(xi, mask.to(device))
        out.backward(torch.ones_like(out))
        grads.append((out.cpu(), xi.grad.cpu(), m.rel_embeddings.grad.cpu()))
        m.zero_grad()
    for cpu, cuda in zip(*grads):
        torch.testing.assert_close(cuda, cpu, atol=1e-4, rtol=1e-4)
