"""``gla``: the chunked form (both of its per-key branches) against the recurrence with padding, the whole
bidirectional mixer against the paper's equations step by step, packed rows against each example alone (every
scan form, both branches, gates that forget fast), and the fla (CUDA) path against the reference (its wrapper
also on CPU, with a stand-in kernel, variable-length mode included)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from models import _scan, create_model
from tests.conftest import tune_lightest_config_only
from tests.mixer_checks import (
    PACKED_ROWS,
    assert_fast_scan_matches_chunked,
    assert_fast_scan_on_packed_rows_matches_chunked,
    assert_packed_rows_equal_each_example_alone,
    assert_reset_scan_equals_separate_pieces,
    create,
)

BACKBONE = {"d_model": 16, "n_heads": 2, "d_qkv": 16, "dropout": 0.0, "max_len": 128}  # heads: Dk 4, Dv 8


def make(**options):
    torch.manual_seed(0)
    m = create("gla", **BACKBONE, **options).double().eval()  # options may name how it runs (scan, ...)
    with torch.no_grad():  # gate logits spread over [-8, 3]: decays from ~1 down to ~0.6 per step
        for f in m.forget:
            f[1].bias.uniform_(-8.0, 3.0)
    return m


def ragged(lengths, N):
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]  # (B, N)


def reference_mixer(m, u):
    """One example's real tokens u (n, D), from the paper's equations, one step at a time: alpha_t =
    sigmoid(x_t W1 W2 + b)^(1/tau), S_t = diag(alpha_t) S_{t-1} + k_t^T v_t, o_t = q_t S_t / sqrt(Dk), the
    reversed pass the same from the last token back; y = out(RMSNorm_head(o_fwd + o_rev) * swish(x W_r))."""
    n = u.shape[0]
    H, Dk, Dv = m.n_heads, m.d_hk, m.d_hv
    qk = (u @ m.qk.weight.T).view(n, 2, 2, H, Dk)  # (n, direction, q | k, H, Dk)
    v = (u @ m.v.weight.T).view(n, H, Dv)
    o = torch.zeros(n, H, Dv, dtype=u.dtype)
    for d, steps in ((0, range(n)), (1, reversed(range(n)))):
        alpha = torch.sigmoid(m.forget[d](u)).pow(1.0 / m.tau).view(n, H, Dk)  # in (0, 1), not log space
        S = torch.zeros(H, Dk, Dv, dtype=u.dtype)
        for t in steps:
            S = alpha[t][..., None] * S + qk[t, d, 1][..., None] * v[t][:, None]
            o[t] += torch.einsum("hk,hkv->hv", qk[t, d, 0], S) / Dk ** 0.5
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight
    r = F.silu(u @ m.gate.weight.T).view(n, H, Dv)
    return (o * r).reshape(n, -1) @ m.out.weight.T  # (n, D)


@pytest.mark.parametrize("factorised", [True, False])
def test_bidirectional_mixer_equals_the_equations_step_by_step(factorised, monkeypatch):
    """Both passes (the reversed one over each example's real tokens only), their sum, norm and output gate."""
    if not factorised:
        monkeypatch.setattr(_scan, "FACTOR_LIMIT", -1.0)  # the exact C x C x K branch
    m = make(chunk_size=8)
    u = torch.randn(2, 29, 16, dtype=torch.float64)
    mask = ragged([29, 13], 29)
    with torch.no_grad():
        out = m(u, mask)
        for b, n in enumerate((29, 13)):
            torch.testing.assert_close(out[b, :n], reference_mixer(m, u[b, :n]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_equals_recurrent_with_padding(chunk):
    m = make(chunk_size=chunk)
    u = torch.randn(3, 37, 16, dtype=torch.float64)
    mask = ragged([37, 21, 6], 37)
    mask[0, 4:9] = False  # a hole too
    with torch.no_grad():
        out = m(u, mask)
        m.scan = "recurrent"
        torch.testing.assert_close(out, m(u, mask), rtol=1e-10, atol=1e-10)


def test_junk_at_masked_positions_anywhere_changes_no_real_output():
    """Holes, not only right padding: a masked step neither writes nor decays the state (k = 0, log alpha = 0)."""
    m = make(chunk_size=8)
    u = torch.randn(2, 40, 16, dtype=torch.float64)
    mask = torch.rand(2, 40, generator=torch.Generator().manual_seed(1)) > 0.3
    u2 = u.clone()
    u2[~mask] = torch.randn(int((~mask).sum()), 16, dtype=torch.float64) * 10
    with torch.no_grad():
        torch.testing.assert_close(m(u2, mask)[mask], m(u, mask)[mask], rtol=1e-10, atol=1e-10)


def scan_inputs(B=2, H=3, N=45, K=8, V=6, gate_scale=1.0, seed=0):
    """Random q, k, v, per-key log decays, the last 10 steps of row 1 padded (k = 0, g = 0)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, N, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, N, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(gate_scale * torch.randn(B, H, N, K, generator=gen, dtype=torch.float64)) / 16
    k[1, :, -10:], g[1, :, -10:] = 0.0, 0.0
    return q, k, v, g


@pytest.mark.parametrize("gate_scale", [1.0, 2000.0])  # gentle gates: factorised; alpha ~ 0 at times: exact branch
def test_chunked_scan_is_exact_and_finite_however_fast_it_forgets(gate_scale):
    q, k, v, g = scan_inputs(gate_scale=gate_scale)
    G = g.unflatten(2, (3, 15)).sum(3)  # (B, H, 3, K): each chunk's total log decay
    assert (-G.min() > _scan.FACTOR_LIMIT) == (gate_scale > 1)  # each case takes the branch it names
    want, S = _scan.recurrent(q, k, v, g, 0.5)
    torch.testing.assert_close(_scan.chunked(q, k, v, g, 15, 0.5), want, rtol=1e-10, atol=1e-10)
    got = _scan.chunked(*(t.float() for t in (q, k, v, g)), 15, 0.5)  # fp32: no overflow, no 0 * inf
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-4)
    # the padded steps left row 1's state as it was after its last real step
    torch.testing.assert_close(S[1], _scan.recurrent(*(t[1:, :, :-10] for t in (q, k, v, g)), 0.5)[1][0])


@pytest.mark.parametrize("n", [1, 2, 5, 16, 17, 65])
@pytest.mark.parametrize("per_key", [False, True])
def test_chunk_ends_equal_the_chunk_by_chunk_recurrence(n, per_key):
    """``_scan.chunk_ends`` (per key: groups of ceil(sqrt(n)) chunks, then across groups; per head: one n x n
    weight) against the recurrence over chunks, end_c = exp(total_c) end_{c-1} + summary_c, with a reset's log
    decay among the totals."""
    torch.manual_seed(n)
    total = -torch.rand(2, 3, n, 4 if per_key else 1, dtype=torch.float64) * 2  # (B, H, n, K | 1)
    total[0, 0, n // 2] = _scan.RESET
    summary = torch.randn(2, 3, n, 4, 5, dtype=torch.float64)  # (B, H, n, K, V)
    end, want = torch.zeros_like(summary[:, :, 0]), []  # (B, H, K, V)
    for c in range(n):
        end = total[:, :, c, :, None].exp() * end + summary[:, :, c]
        want.append(end)
    want = torch.stack(want, 2)  # (B, H, n, K, V)
    torch.testing.assert_close(_scan.chunk_ends(total, summary), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gate_scale", [0.1, 8.0])  # the factorised branch (exp(+-G) up to e^40) and the exact one
def test_chunked_scan_under_bf16_autocast_stays_finite_and_close(gate_scale):
    """On a GPU the chunked form runs inside the model's bf16 autocast, so its products take bf16 operands
    (``_scan``'s precision note): the factors exp(+-G) stay in range, and the outputs stay within bf16's rounding
    of the recurrence."""
    q, k, v, g = scan_inputs(gate_scale=gate_scale)
    want = _scan.recurrent(q, k, v, g, 0.5)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _scan.chunked(*(t.float() for t in (q, k, v, g)), 15, 0.5)
    assert got.dtype == torch.bfloat16  # the products followed autocast
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()


def fake_chunk_gla(q, k, v, g, scale, cu_seqlens=None):
    """fla's chunk_gla per its documented semantics ((B, T, H, K) layout, g (B, T, H, K) log decay; with
    ``cu_seqlens``, B = 1 and each sequence from a zero state), from its naive recurrence, so the wrapper's
    layout, padding, scale and variable-length mode can be checked on CPU."""
    assert q.is_contiguous() and g.is_contiguous() and q.shape == k.shape == g.shape
    assert q.shape[-1] % 16 == 0 and v.shape[-1] % 16 == 0
    if cu_seqlens is not None:
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and cu_seqlens[0] == 0
        assert cu_seqlens[-1] == q.shape[1] and (cu_seqlens.diff() > 0).all()
        pieces = [fake_chunk_gla(*(t[:, s:e] for t in (q, k, v, g)), scale)[0]
                  for s, e in itertools.pairwise(cu_seqlens.tolist())]
        return torch.cat(pieces, 1), None
    o, S = _scan.recurrent(*(t.transpose(1, 2) for t in (q, k, v, g)), scale)
    return o.transpose(1, 2), S


def test_fla_wrapper_layout_padding_and_scale_on_cpu(monkeypatch):
    monkeypatch.setattr(_scan, "fla_ops", lambda: (None, fake_chunk_gla))
    q, k, v, g = scan_inputs(K=4, V=8)  # padded to 16 for the kernel
    torch.testing.assert_close(_scan.fla(q, k, v, g, 0.5).double(), _scan.chunked(q, k, v, g, 16, 0.5),
                               rtol=1e-5, atol=1e-5)
    reset = torch.zeros(2, 45, dtype=torch.bool)
    reset[0, [0, 7, 8, 30]] = reset[1, [3, 34]] = True  # row 1 begins mid-example: its own sequence from 0
    torch.testing.assert_close(_scan.fla(q, k, v, g, 0.5, reset).double(), _scan.chunked(q, k, v, g, 16, 0.5, reset),
                               rtol=1e-5, atol=1e-5)


def reset_of(B=2, N=45):
    """Resets inside a chunk of 15, at chunk starts, two in one chunk; row 1's only in its real steps."""
    reset = torch.zeros(B, N, dtype=torch.bool)
    reset[0, [0, 7, 15, 16, 30, 44]] = reset[1, [3, 34]] = True
    return reset


@pytest.mark.parametrize("gate_scale", [1.0, 2000.0])  # the factorised branch; the exact one (alpha ~ 0 at times)
def test_chunked_scan_with_resets_equals_each_piece_alone(gate_scale):
    q, k, v, g = scan_inputs(gate_scale=gate_scale)
    assert_reset_scan_equals_separate_pieces(q, k, v, g, reset_of(), 15, 0.5)
    got = _scan.chunked(*(t.float() for t in (q, k, v, g)), 15, 0.5, reset_of())  # fp32: finite, close
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _scan.chunked(q, k, v, g, 15, 0.5, reset_of()), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(("scan", "chunk", "factorised"), [("recurrent", 64, True), ("chunked", 1, True),
                                                           ("chunked", 4, True), ("chunked", 4, False),
                                                           ("chunked", 64, True)])
def test_packed_rows_equal_each_example_alone(scan, chunk, factorised, monkeypatch):
    """Both passes reset at each example's start (the reversed pass at its last position), in every CPU form."""
    if not factorised:
        monkeypatch.setattr(_scan, "FACTOR_LIMIT", -1.0)  # the exact C x C x K branch
    m = make(chunk_size=chunk, scan=scan)
    assert_packed_rows_equal_each_example_alone(m, PACKED_ROWS, 29, 16)


def test_packed_rows_with_gates_that_forget_fast_stay_finite_and_exact():
    """Gate logits down to -3000 (log alpha ~ -190 per step): the exact branch, in fp64 and fp32."""
    m = make(chunk_size=4)
    with torch.no_grad():
        for f in m.forget:
            f[1].bias.uniform_(-3000.0, 3.0)
        g = F.logsigmoid(m.forget[0](torch.randn(1, 8, 16, dtype=torch.float64))) / m.tau  # (1, 8, Dk)
    assert -g.unflatten(1, (2, 4)).sum(2).min() > _scan.FACTOR_LIMIT  # chunks past the factorised bound
    assert_packed_rows_equal_each_example_alone(m, PACKED_ROWS, 29, 16)
    assert_packed_rows_equal_each_example_alone(m.float(), PACKED_ROWS, 29, 16, torch.float32, tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options", [{"d_model": 64, "n_heads": 2, "d_qkv": 64}, {"d_model": 32, "n_heads": 4, "d_qkv": 16}]
)
def test_fla_path_equals_the_reference_on_cuda(options):
    """fla's chunk_gla (TF32 dots inside) against the fp32 chunked form: outputs and every gradient."""
    pytest.importorskip("fla.ops.gla")
    torch.manual_seed(0)
    d = options["d_model"]
    m = create_model("gla", dropout=0.0, max_len=512, **options).cuda()
    assert_fast_scan_matches_chunked(m, d, ragged)


@pytest.mark.gpu
def test_fla_path_on_packed_rows_equals_the_reference_on_cuda():
    """fla's variable-length mode (one sequence per example) against the chunked form with resets."""
    pytest.importorskip("fla.ops.gla")
    torch.manual_seed(0)
    m = create_model("gla", d_model=32, n_heads=2, d_qkv=32, dropout=0.0, max_len=64).cuda()
    assert_fast_scan_on_packed_rows_matches_chunked(m, 32)


def test_gpu_tests_compile_the_lightest_config_of_each_autotuned_kernel(monkeypatch):
    """The GPU tests' stand-in for autotuning (conftest's ``tune_lightest_config_only``) leaves a kernel one config,
    the lightest of those its own pruning keeps."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    def keep_bk_64(configs, nargs, **kwargs):
        return [c for c in configs if c.kwargs["BK"] == 64]

    configs = [
        triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s)
        for bk in (32, 64) for bv in (32, 16) for w in (4, 2) for s in (3, 2)
    ]

    @triton.autotune(configs=configs, key=["n"], prune_configs_by={"early_config_prune": keep_bk_64})
    @triton.jit
    def kernel(x, n, BK: tl.constexpr, BV: tl.constexpr):
        pass

    kernel.nargs = {"x": None, "n": 8}  # what Autotuner.run sets before it prunes
    assert len(kernel.prune_configs({})) == 8
    tune_lightest_config_only(monkeypatch)
    [chosen] = kernel.prune_configs({})
    assert (chosen.kwargs, chosen.num_warps, chosen.num_stages) == ({"BK": 64, "BV": 16}, 2, 2)
