"""DeBERTa: the log buckets at known distances, c2p / p2c gathers against the paper's dense formula, the layer
against dense disentangled attention, and the c2c / sqrt(3 d) limit without relative embeddings; the FlexAttention
path against the dense one (outputs and gradients), its elementwise buckets against the dense index, and the
dense index's cache."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from models import create_model
from models._flex_dropout import dense_draws
from models.deberta import cached_index, log_bucket, position_rows, relative_gather, relative_index, run_bounds

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
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_on_cuda_the_layer_and_its_gradients_match_the_cpu(backend):
    """CUDA's relative gathers (prefix-sum backward), or its FlexAttention (compiled by the layer), against the
    CPU's dense path (torch.gather's own backward), in fp32."""
    model, x = build(position_buckets=8, max_relative_positions=16), torch.randn(2, 50, D)
    mask = lengths_mask([50, 37], 50)
    grads = []
    for device in ("cpu", "cuda"):
        m = model.to(device)
        m.backend = backend if device == "cuda" else "dense"
        xi = x.to(device, copy=True).requires_grad_()  # a leaf of its own on each device (x.to("cpu") is x itself)
        out = m(xi, mask.to(device))
        out.backward(torch.ones_like(out))
        grads.append((out.cpu(), xi.grad.cpu(), m.rel_embeddings.grad.cpu()))
        m.zero_grad()
    for cpu, cuda in zip(*grads):
        torch.testing.assert_close(cuda, cpu, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- the FlexAttention path and the dense index's cache

@pytest.mark.parametrize("options", CONFIGS + [{"position_buckets": 64, "max_relative_positions": 2048}])
def test_elementwise_rows_equal_the_dense_index(options):
    """The score_mod's delta(i, j) and delta(j, i), elementwise from int32 q_idx - kv_idx, are the dense index's
    rows bit for bit: over every pair (i, j) at n = 600 (past the defaults' last bucket), and at every distance
    up to 16K against the rows relative_index gathers from (the (n, n) index itself would be 2 GB there)."""
    model = build(**options)
    n = 600
    i = torch.arange(n, dtype=torch.int32)
    row, col = position_rows(i[:, None] - i[None, :], model.buckets, model.max_relative)  # (n, n) each
    delta = model.relative_index(n, torch.device("cpu"))  # (n, n) long
    assert torch.equal(row.long(), delta) and torch.equal(col.long(), delta.t())
    d = torch.arange(1 - 16_400, 16_400, dtype=torch.int32)  # every i - j for i, j < 16400, as score_mod gets them
    row, col = position_rows(d, model.buckets, model.max_relative)  # int32, elementwise
    want = (log_bucket(d.long(), model.buckets, model.max_relative) if model.buckets else d.long()) + model.span
    want = want.clamp(0, 2 * model.span - 1)  # relative_index's rows, from the long distances it computes with
    assert torch.equal(row.long(), want) and torch.equal(col.long(), want.flip(0))  # flip: the row of -d


def run_with_grads(model, x, mask, backend, compile_model: bool = False):
    """model's output and the gradients of its input and every parameter, through ``backend``."""
    model.backend = backend
    model.zero_grad()
    x = x.clone().requires_grad_()
    out = (torch.compile(model) if compile_model else model)(x, mask)
    out.backward(torch.cos(out))  # a loss that weighs every output differently
    return {"out": out.detach(), "x": x.grad, **{name: p.grad.clone() for name, p in model.named_parameters()}}


@pytest.mark.parametrize("options", CONFIGS)
@pytest.mark.parametrize("lengths", [None, [150, 77]])  # two 128-wide key tiles: full, partial and skipped ones
def test_flex_path_equals_dense_path_with_gradients(options, lengths, flex_backward_on_cpu):
    """fp64, so that any difference is the method's, not rounding: output, input gradient and the gradients of
    P, its LayerNorm and the projections. Head size 12 (the flex path pads it to 16)."""
    model = build(n_heads=2, d_qkv=24, **options).double()
    x = torch.randn(2, 150, D, dtype=torch.float64)
    mask = None if lengths is None else lengths_mask(lengths, 150)
    dense, flex = (run_with_grads(model, x, mask, backend) for backend in ("dense", "flex"))
    assert {"rel_embeddings", "rel_norm.weight", "qkv.weight", "out.weight"} <= dense.keys()
    for name in dense:
        torch.testing.assert_close(flex[name], dense[name], atol=1e-10, rtol=1e-10, msg=name)
    assert dense["rel_embeddings"].abs().sum() > 0


def test_flex_rows_of_only_padding_stay_finite(flex_backward_on_cpu):
    model = build(position_buckets=8, max_relative_positions=16)
    grads = run_with_grads(model, torch.randn(2, 30, D), lengths_mask([30, 0], 30), "flex")
    assert all(g.isfinite().all() for g in grads.values())
    assert (grads["out"][1] == 0).all()  # a row with no key attends to nothing: FlexAttention gives 0


def test_flex_is_taken_by_default_only_without_attention_dropout_and_only_in_evaluation():
    model = create_model("deberta", d_model=D, n_heads=2, d_qkv=D, dropout=0.1, max_len=128)
    assert not model.train().flex_runs(on_cuda=True)  # auto: dropout active -> dense (SDPA applies it)
    assert model.eval().flex_runs(on_cuda=True) and not model.flex_runs(on_cuda=False)
    assert not model.eval().flex_runs(on_cuda=True, needs_grad=True)  # auto: a training step stays dense
    no_dropout = create_model("deberta", d_model=D, n_heads=2, d_qkv=D, dropout=0.0, max_len=128).train()
    assert not no_dropout.flex_runs(on_cuda=True, needs_grad=True) and no_dropout.flex_runs(on_cuda=True)
    no_dropout.backend = "flex"
    assert no_dropout.flex_runs(on_cuda=True, needs_grad=True)  # asked for by name: gradients too
    model.backend = "flex"
    assert model.flex_runs(on_cuda=False)
    assert model.train().flex_runs(on_cuda=True)  # asked for by name with dropout: it applies it (_flex_dropout)
    model.backend = "sdpa"
    with pytest.raises(ValueError):
        model.eval().flex_runs(on_cuda=True)


def test_dense_index_is_built_once_per_length_and_device():
    model, cpu = build(position_buckets=8, max_relative_positions=16), torch.device("cpu")
    delta, bounds = model.index(40, cpu)
    assert model.index(40, cpu)[0] is delta and bounds is None  # bounds: CUDA's gathers only
    other_layer = build(position_buckets=8, max_relative_positions=16)
    assert other_layer.index(40, cpu)[0] is delta  # shared by the layers, keyed by the buckets
    assert build(position_buckets=0, max_relative_positions=5).index(40, cpu)[0] is not delta
    assert torch.equal(delta, relative_index(40, cpu, 8, 16))
    assert model.index(41, cpu)[0].shape == (41, 41)


def test_compiled_dense_path_traces_once_and_ignores_the_cache():
    """Under torch.compile the index is built inside the graph: one graph for repeated steps, none added when
    eager code fills the cache for another length in between (no guard on it), and no graph break."""
    model = build(position_buckets=8, max_relative_positions=16).train()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, mask = torch.randn(2, 40, D), lengths_mask([40, 27], 40)
    want = model(x, mask)
    compiled = torch.compile(model, backend=counting_backend, fullgraph=True)
    for _ in range(2):
        compiled(x, mask).sum().backward()
    model(torch.randn(2, 44, D), lengths_mask([44, 44], 44))  # eager: caches another length
    got = compiled(x, mask)
    assert len(graphs) == 1 and cached_index.cache_info().currsize >= 1
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_on_cuda_the_flex_buckets_equal_the_dense_index():
    """Inside the compiled FlexAttention kernel (Triton's log and division, not the CPU's) delta(i, j) and delta(j, i)
    are the CPU's dense rows at every distance up to 16K: a mismatch adds 1000 to its score, which the row's
    logsumexp would show."""
    n = 16_385
    for options in CONFIGS:
        model = build(**options)
        ref = position_rows(torch.arange(1 - n, n), model.buckets, model.max_relative)[0]  # (2n - 1,) CPU, long
        cuda_eager = position_rows(torch.arange(1 - n, n, device="cuda"), model.buckets, model.max_relative)[0]
        assert torch.equal(cuda_eager.cpu(), ref), "the dense index built on CUDA differs from the CPU's"
        ref = ref.cuda()

        def score_mod(score, b, h, q_idx, kv_idx):
            row, col = position_rows(q_idx - kv_idx, model.buckets, model.max_relative)
            bad = (row != ref[q_idx - kv_idx + n - 1]) | (col != ref[kv_idx - q_idx + n - 1])
            return score + bad.float() * 1000.0

        q = torch.zeros(1, 1, n, 16, device="cuda")
        _, lse = torch.compile(flex_attention)(q, q, q, score_mod=score_mod, return_lse=True)
        assert lse.max().item() < 100, f"{options}: rows differ at queries {(lse > 100).nonzero()[:8].tolist()}"


@pytest.mark.gpu
def test_on_cuda_compiled_flex_matches_dense_in_bf16():
    """The model compiled whole (as lra trains it) on the flex path, in bf16 autocast at N = 1024 with padding,
    against the dense path: outputs and gradients (input, P, projections) may be no further from the fp32 dense
    reference than twice the bf16 dense path's own error, plus 1 % of the reference's scale."""
    torch.manual_seed(0)
    model = create_model("deberta", d_model=64, n_heads=4, d_qkv=64, dropout=0.0, max_len=1024).cuda()
    x, mask = torch.randn(2, 1024, 64, device="cuda"), lengths_mask([1024, 700], 1024).cuda()
    ref = run_with_grads(model, x, mask, "dense")  # fp32
    with torch.autocast("cuda", dtype=torch.bfloat16):
        dense = run_with_grads(model, x, mask, "dense")
        flex = run_with_grads(model, x, mask, "flex", compile_model=True)
    for name in ("out", "x", "rel_embeddings", "qkv.weight", "out.weight"):
        want = ref[name].float()
        flex_err = (flex[name].float() - want).abs().max().item()
        dense_err = (dense[name].float() - want).abs().max().item()
        assert flex_err <= 2 * dense_err + 0.01 * want.abs().max().item(), (name, flex_err, dense_err)


def test_flex_applies_attention_dropout_as_dense_attention_with_the_same_draws(flex_backward_on_cpu):
    """Asked for by name in training, the flex path drops weights through ``_flex_dropout``: equal to the dense
    disentangled attention whose softmax weights are dropped by the same draws, in output and gradients."""
    torch.manual_seed(0)
    model = create_model("deberta", d_model=D, n_heads=2, d_qkv=D, dropout=0.3, max_len=160, position_buckets=8,
                         max_relative_positions=16).train()
    model.backend = "flex"
    x = torch.randn(2, 150, D, requires_grad=True)
    mask = lengths_mask([150, 77], 150)
    q, k, v = model.project(x)  # each (B, H, N, Dh)
    torch.manual_seed(5)
    got = model.attend(q, k, v, mask)  # (B, H, N, Dh)
    torch.manual_seed(5)  # the seed the flex call drew: its first use of the generator
    seed = torch.randint(0, 2**31 - 1, (1,))
    scale = model.score_scale(q.shape[-1])
    c2p, p2c = model.c2p_p2c(q, k, mask, scale)  # (B, H, N, N) each; p2c masks the padded keys
    weights = torch.softmax(q @ k.transpose(-1, -2) * scale + c2p + p2c, -1)  # (B, H, N, N)
    want = (weights * dense_draws(seed, 0.3, weights.shape) / 0.7) @ v  # (B, H, N, Dh)
    real = mask[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real])
    loss = torch.randn_like(got) * real
    params = [x, *(p for name, p in model.named_parameters() if not name.startswith("out."))]  # attend's inputs
    grads = [torch.autograd.grad((out * loss).sum(), params, retain_graph=True) for out in (got, want)]
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
