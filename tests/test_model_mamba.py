"""``mamba``: the chunked SSD form against the sequential recurrence, the whole mixer against a step-by-step
selective SSM written from the papers' equations, the reversed pass over real tokens only, padded steps as
exact no-ops, packed rows against each example alone (convolution and scan, every CPU form, fast decays), and
the fla (CUDA) scan against the reference (its wrapper also on CPU, with a stand-in kernel, variable-length mode
included)."""
from __future__ import annotations

import itertools
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from models import _scan, create_model
from models._scan import orient
from models.mamba import causal_conv
from tests.mixer_checks import (
    PACKED_ROWS,
    assert_fast_scan_matches_chunked,
    assert_fast_scan_on_packed_rows_matches_chunked,
    assert_packed_rows_equal_each_example_alone,
    assert_reset_scan_equals_separate_pieces,
    create,
    packed_layout,
)

BACKBONE = {"d_model": 16, "n_heads": 2, "d_qkv": 16, "dropout": 0.0, "max_len": 128}


def make(**options):
    torch.manual_seed(0)
    m = create("mamba", **BACKBONE, **{"d_state": 8, **options}).double().eval()  # options may name scan, ...
    with torch.no_grad():  # spread dt, so the decays are far from 1 and mistakes in them show
        m.dt_bias.add_(torch.randn_like(m.dt_bias))
        m.D.normal_()
    return m


def ragged(lengths, N):
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]  # (B, N)


def keep_of(mask):
    return orient(mask[None, ..., None].double().expand(2, *mask.shape, 1))  # (2, B, N, 1), passes' order


def reference_mixer(m, u):
    """The mixer on one example's real tokens u (n, D), from the equations, one step at a time:
    h_t = exp(A dt_t) h_{t-1} + dt_t B_t x_t^T, y_t = C_t h_t + D x_t per head, the reversed pass the same
    over the reversed tokens, then out(RMSNorm((y_fwd + y_rev) * silu(z)))."""
    n = u.shape[0]
    E, S, H, P = m.d_inner, m.d_state, m.n_heads, m.headdim
    proj = u @ m.in_proj.weight.T  # (n, 2E + 2(2S + H))
    z, x = proj[:, :E], proj[:, E : 2 * E]
    total = torch.zeros(n, E, dtype=u.dtype)
    for d in (0, 1):
        b, c, dt = proj[:, 2 * E + d * (2 * S + H) :][:, : 2 * S + H].split([S, S, H], -1)
        seq = torch.cat([x, b, c], -1)  # (n, E + 2S); dt (n, H)
        if d == 1:
            seq, dt = seq.flip(0), dt.flip(0)
        K = m.conv_weight.shape[-1]
        conv = F.conv1d(seq.T[None], m.conv_weight[d][:, None], m.conv_bias[d], padding=K - 1, groups=E + 2 * S)
        xs, bs, cs = F.silu(conv[0, :, :n].T).split([E, S, S], -1)  # causal: the first n outputs
        dt = F.softplus(dt + m.dt_bias[d])  # (n, H)
        A = -torch.exp(m.A_log[d])  # (H,)
        h = torch.zeros(H, S, P, dtype=u.dtype)
        ys = []
        for t in range(n):
            xt = xs[t].view(H, P)
            h = torch.exp(A * dt[t])[:, None, None] * h + dt[t][:, None, None] * bs[t][None, :, None] * xt[:, None]
            ys.append((torch.einsum("s,hsp->hp", cs[t], h) + m.D[d][:, None] * xt).reshape(E))
        ys = torch.stack(ys)
        total = total + (ys.flip(0) if d == 1 else ys)
    y = total * F.silu(z)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight
    return y @ m.out_proj.weight.T  # (n, D)


def test_mixer_equals_the_selective_ssm_step_by_step():
    """SSD's mapping (q = C, k = B, v = x dt, g = A dt, scale 1), both passes, D, gate and norm, with padding."""
    m = make()
    u = torch.randn(2, 23, 16, dtype=torch.float64)
    mask = ragged([23, 14], 23)
    with torch.no_grad():
        out = m(u, mask)
        for b, n in enumerate((23, 14)):
            torch.testing.assert_close(out[b, :n], reference_mixer(m, u[b, :n]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_equals_the_recurrence_in_both_directions_with_padding(chunk):
    m = make(chunk_size=chunk)
    u = torch.randn(3, 37, 16, dtype=torch.float64)
    mask = ragged([37, 20, 9], 37)
    mask[0, 10:13] = False  # a hole, not only right padding
    with torch.no_grad():
        _, xbcdt = m.project(u)
        q, k, v, g, _ = m.scan_inputs(orient(xbcdt), keep_of(mask))  # (2B, ...): forward rows, then reversed
        want, _ = _scan.recurrent(q, k, v, g)
        torch.testing.assert_close(_scan.chunked(q, k, v, g, chunk), want, rtol=1e-10, atol=1e-10)
        out = m(u, mask)
        m.scan = "recurrent"
        torch.testing.assert_close(out, m(u, mask), rtol=1e-10, atol=1e-10)


def test_the_mixer_runs_over_whole_chunks_and_returns_its_own_length(monkeypatch):
    """Inductor's CUDA code gave wrong dt_bias gradients at an odd length (docs/gpu.md, compilation): the mixer pads a
    row to whole chunks (29 steps -> 32) and cuts its outputs back; the padded steps change no real output, on
    ragged and on packed rows (segments, no mask)."""
    lengths = []
    scan = _scan.scan
    monkeypatch.setattr(_scan, "scan", lambda q, *a, **kw: lengths.append(q.shape[2]) or scan(q, *a, **kw))
    m = make(chunk_size=8)
    u = torch.randn(4, 29, 16, dtype=torch.float64)
    segments = packed_layout(PACKED_ROWS, 29)  # padding gaps and a padded tail
    got = m(u, ragged([29, 20, 9, 29], 29)), m(u, None, segments)
    assert lengths == [32, 32] and all(out.shape == (4, 29, 16) for out in got)
    m.chunk_size = 1  # a whole number of chunks already: no padding
    torch.testing.assert_close(got[0], m(u, ragged([29, 20, 9, 29], 29)), rtol=1e-10, atol=1e-10)
    real = segments != 0
    torch.testing.assert_close(got[1][real], m(u, None, segments)[real], rtol=1e-10, atol=1e-10)
    assert lengths[2:] == [29, 29]


def test_reversed_pass_runs_over_real_tokens_only():
    """Flipping a padded row puts the padding first; the reversed pass must equal one over the reversed real
    tokens alone, and see the future only."""
    m = make()
    u = torch.randn(2, 30, 16, dtype=torch.float64)
    mask = ragged([30, 17], 30)
    with torch.no_grad():
        _, xbcdt = m.project(u)
        y = orient(m.ssm(orient(xbcdt), keep_of(mask)))  # (2, B, N, E): each pass's output, in place
        for b, n in enumerate((30, 17)):
            real = xbcdt[:, b : b + 1, :n]  # (2, 1, n, .): no padding at all
            alone = orient(m.ssm(orient(real), None))  # (2, 1, n, E)
            torch.testing.assert_close(y[:, b, :n], alone[:, 0], rtol=1e-10, atol=1e-10)
        u2 = u.clone()
        u2[:, 8] += 1.0
        y2 = orient(m.ssm(orient(m.project(u2)[1]), keep_of(mask)))
    assert torch.equal(y2[0, :, :8], y[0, :, :8]) and not torch.allclose(y2[0, :, 8:12], y[0, :, 8:12])
    assert torch.equal(y2[1, :, 9:], y[1, :, 9:]) and not torch.allclose(y2[1, :, 5:9], y[1, :, 5:9])


def test_padded_steps_leave_the_state_unchanged():
    m = make()
    u = torch.randn(1, 24, 16, dtype=torch.float64) * 3
    mask = torch.ones(1, 24, dtype=torch.bool)
    mask[0, 8:12] = False  # a hole
    mask[0, 18:] = False  # right padding (leading, in the reversed pass)
    with torch.no_grad():
        q, k, v, g, _ = m.scan_inputs(orient(m.project(u)[1]), keep_of(mask))  # rows: forward, reversed
    for row, pads in ((0, [*range(8, 12), *range(18, 24)]), (1, [*range(6), *range(12, 16)])):  # reversed: 23 - t
        assert not v[row, :, pads].any() and not g[row, :, pads].any()  # no write, decay exp(0) = 1

    def state(t):  # the state after the first t steps
        return _scan.recurrent(q[:, :, :t], k[:, :, :t], v[:, :, :t], g[:, :, :t])[1]

    assert torch.equal(state(12)[0], state(8)[0])  # through the hole
    assert torch.equal(state(24)[0], state(18)[0])  # through the right padding
    assert torch.equal(state(6)[1], torch.zeros_like(state(6)[1]))  # the reversed pass starts on padding
    assert state(9)[1].abs().sum() > 0


def test_junk_at_masked_positions_anywhere_changes_no_real_output():
    """Holes, not only right padding: a masked step enters the convolution as zeros and leaves the state as it
    was (dt = 0), in both passes."""
    m = make()
    u = torch.randn(2, 40, 16, dtype=torch.float64)
    mask = torch.rand(2, 40, generator=torch.Generator().manual_seed(1)) > 0.3
    u2 = u.clone()
    u2[~mask] = torch.randn(int((~mask).sum()), 16, dtype=torch.float64) * 10
    with torch.no_grad():
        torch.testing.assert_close(m(u2, mask)[mask], m(u, mask)[mask], rtol=1e-10, atol=1e-10)


def fake_chunk_simple_gla(q, k, v, g, scale, cu_seqlens=None):
    """fla's chunk_simple_gla per its documented semantics ((B, T, H, K) layout, g (B, T, H) log decay; with
    ``cu_seqlens``, B = 1 and each sequence from a zero state), from its naive recurrence, so the wrapper's
    layout, padding, scale and variable-length mode can be checked on CPU."""
    assert q.is_contiguous() and q.shape[-1] % 16 == 0 and v.shape[-1] % 16 == 0 and g.dim() == 3
    if cu_seqlens is not None:
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and cu_seqlens[0] == 0
        assert cu_seqlens[-1] == q.shape[1] and (cu_seqlens.diff() > 0).all()
        pieces = [fake_chunk_simple_gla(*(t[:, s:e] for t in (q, k, v, g)), scale)[0]
                  for s, e in itertools.pairwise(cu_seqlens.tolist())]
        return torch.cat(pieces, 1), None
    o, S = _scan.recurrent(*(t.transpose(1, 2) for t in (q, k, v)), g.transpose(1, 2)[..., None], scale)
    return o.transpose(1, 2), S


def test_fla_wrapper_layout_padding_and_scale_on_cpu(monkeypatch):
    monkeypatch.setattr(_scan, "fla_ops", lambda: (fake_chunk_simple_gla, None))
    m = make(headdim=8)  # head size 8, d_state 8: both padded to 16 for the kernel
    u = torch.randn(2, 21, 16, dtype=torch.float64)
    mask = ragged([21, 12], 21)
    with torch.no_grad():
        q, k, v, g, _ = m.scan_inputs(orient(m.project(u)[1]), keep_of(mask))
        torch.testing.assert_close(_scan.fla(q, k, v, g).double(), _scan.chunked(q, k, v, g, 8), rtol=1e-5, atol=1e-5)
        segments = orient(packed_layout(PACKED_ROWS, 29).expand(2, 4, 29))  # (2, R, N), each pass's order
        u = torch.randn(4, 29, 16, dtype=torch.float64)
        q, k, v, g, _ = m.scan_inputs(orient(m.project(u)[1]), keep_of(segments[0] != 0), segments)
        reset = _scan.segment_starts(segments).flatten(0, 1)  # (2R, N)
        want = _scan.chunked(q, k, v, g, 8, reset=reset)
        torch.testing.assert_close(_scan.fla(q, k, v, g, reset=reset).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fast", [False, True])  # decays per step down to exp(-500): exp(G_i - G_j) underflows
def test_scalar_scan_with_resets_equals_each_piece_alone(fast):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 1, 45, 8, generator=gen, dtype=torch.float64) for _ in range(2))  # shared by heads
    v = torch.randn(2, 3, 45, 6, generator=gen, dtype=torch.float64)
    g = -torch.rand(2, 3, 45, 1, generator=gen, dtype=torch.float64) * (500.0 if fast else 0.5)
    reset = torch.zeros(2, 45, dtype=torch.bool)
    reset[0, [0, 7, 15, 16, 30, 44]] = reset[1, [3, 34]] = True  # inside chunks of 15, at their starts, two in one
    assert_reset_scan_equals_separate_pieces(q, k, v, g, reset, 15, 1.0)
    got = _scan.chunked(*(t.float() for t in (q, k, v, g)), 15, 1.0, reset)  # fp32: finite, close
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _scan.chunked(q, k, v, g, 15, 1.0, reset), rtol=1e-3, atol=1e-4)


def test_the_convolution_reads_only_its_own_example():
    """Each example's taps as if it began its own row (zeros before it), in both passes' orders."""
    segments = orient(packed_layout(PACKED_ROWS, 29).expand(2, 4, 29))  # (2, R, N)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 29, 6, generator=gen, dtype=torch.float64)
    weight, bias = torch.randn(2, 6, 4, generator=gen, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)
    y = causal_conv(x, weight, bias, segments)  # (2, R, N, 6)
    for d, r in itertools.product(range(2), range(4)):
        for example in segments[d, r].unique().tolist():
            at = segments[d, r] == example  # contiguous positions of one example (or of padding)
            alone = causal_conv(x[:, r : r + 1, at], weight, bias)[d, 0]  # (n, 6): its own row
            if example:
                torch.testing.assert_close(y[d, r, at], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("scan", "chunk"), [("recurrent", 64), ("chunked", 1), ("chunked", 4), ("chunked", 64)])
def test_packed_rows_equal_each_example_alone(scan, chunk):
    """Convolution and scan of both passes keep to each example (the reversed pass starts at its last position)."""
    assert_packed_rows_equal_each_example_alone(make(chunk_size=chunk, scan=scan), PACKED_ROWS, 29, 16)


def test_packed_rows_with_decays_that_forget_fast_stay_finite_and_exact():
    """dt ~ 30 in one head, so A dt reaches -480 per step, in fp64 and fp32."""
    m = make(chunk_size=4)
    with torch.no_grad():
        m.dt_bias[:, 0] = 30.0
    assert_packed_rows_equal_each_example_alone(m, PACKED_ROWS, 29, 16)
    assert_packed_rows_equal_each_example_alone(m.float(), PACKED_ROWS, 29, 16, torch.float32, tol=1e-4)


def test_missing_fla_names_the_extra(monkeypatch):
    """As if fla-core were not installed, though a test before may have imported some of it."""
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")] + ["fla"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(_scan, "FLA_OPS", None)
    with pytest.raises(ImportError, match=r"pip install lra\[ssm\]"):
        _scan.fla_ops()


def test_a_compiled_model_takes_fla_s_kernels_without_dynamo_s_warning(monkeypatch):
    """fla_ops is called inside the compiled forward: no warning of Dynamo's (it warns at each trace of a
    functools-cached function) and no graph break."""
    monkeypatch.setattr(_scan, "FLA_OPS", ("simple", "gla"))

    def pick(x):
        return x * 2 if _scan.fla_ops()[1] == "gla" else x

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(pick)(torch.ones(3))
    assert explained.graph_break_count == 0
    assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"d_model": 64, "n_heads": 2}, {"d_model": 16, "n_heads": 4, "d_state": 8}])
def test_fla_path_equals_the_reference_on_cuda(options):
    """fla's chunk_simple_gla (TF32 dots inside) against the fp32 chunked form: outputs and every gradient."""
    pytest.importorskip("fla.ops.simple_gla")
    torch.manual_seed(0)
    d = options["d_model"]
    m = create_model("mamba", d_qkv=d, dropout=0.0, max_len=512, **options).cuda()
    assert_fast_scan_matches_chunked(m, d, ragged)


def test_scan_fla_off_cuda_and_a_misspelt_scan_are_refused():
    """scan="fla" asks for fla's kernels: on the CPU an error that says what to set instead, not the chunked form;
    a name that is no scan (set on the built model, past the config's check) is an error too."""
    m = make(scan="fla")
    x, mask = torch.randn(1, 12, 16, dtype=torch.float64), torch.ones(1, 12, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"scan=fla \(trainer.mixer.scan\) .* CUDA only: here set scan=auto"):
        m(x, mask)
    m.scan = "chunkd"
    with pytest.raises(ValueError, match="scan must be one of auto, fla, chunked, recurrent, got 'chunkd'"):
        m(x, mask)


@pytest.mark.gpu
def test_scan_fla_on_cuda_runs_fla_or_says_why_it_cannot():
    """On a card where fla's kernels are refused (Hopper with Triton < 3.7.1) scan="fla" raises with the reason;
    elsewhere it runs them."""
    m = create("mamba", d_model=32, n_heads=2, d_qkv=32, dropout=0.0, max_len=64, scan="fla").cuda()
    x, mask = torch.randn(2, 40, 32, device="cuda"), torch.ones(2, 40, dtype=torch.bool, device="cuda")
    reason = _scan.fla_refused(torch.cuda.current_device())
    if reason is not None:
        with pytest.raises(RuntimeError, match=r"scan=fla \(trainer.mixer.scan\): .*3.7.1"):
            m(x, mask)
    else:
        pytest.importorskip("fla.ops.simple_gla")
        assert torch.isfinite(m(x, mask)).all()


def test_a_triton_known_to_break_fla_on_hopper_falls_back_to_the_chunked_form(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    _scan.fla_refused.cache_clear()
    try:
        assert "3.7.1" in _scan.fla_refused(0)
        monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.7.1"))
        _scan.fla_refused.cache_clear()
        assert _scan.fla_refused(0) is None
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (10, 0))
        monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
        _scan.fla_refused.cache_clear()
        assert _scan.fla_refused(0) is None  # the bug is Hopper's
    finally:
        _scan.fla_refused.cache_clear()


def test_the_refusal_is_said_once_and_is_a_constant_to_a_compiled_model(monkeypatch):
    """Under torch.compile the check runs eagerly at each trace (three shapes here): one warning in all, and none of
    Dynamo's about tracing a cached function."""
    monkeypatch.setattr(_scan, "fla_refused", lambda index: "fla is wrong here")
    _scan.warn_once.cache_clear()

    def pick(x):
        return x * 3 if _scan.fla_refusal(0) is None else x + 1

    compiled = torch.compile(pick, backend="eager", dynamic=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [compiled(torch.ones(n)) for n in (3, 4, 5)]
    finally:
        _scan.warn_once.cache_clear()
    assert all(torch.equal(o, torch.full_like(o, 2.0)) for o in outs)  # the refused branch (x + 1)
    assert [str(w.message) for w in caught] == ["fla is wrong here: running the scan in its chunked PyTorch form "
                                                "(scan=chunked)"]


@pytest.mark.gpu
def test_fla_path_on_packed_rows_equals_the_reference_on_cuda():
    """fla's variable-length mode (one sequence per example) against the chunked form with resets."""
    pytest.importorskip("fla.ops.simple_gla")
    torch.manual_seed(0)
    m = create_model("mamba", d_model=32, n_heads=2, d_qkv=32, dropout=0.0, max_len=64).cuda()
    assert_fast_scan_on_packed_rows_matches_chunked(m, 32)


@pytest.mark.gpu
@pytest.mark.parametrize(("scan", "compiled"), [("chunked", False), ("chunked", True), ("auto", True)])
def test_on_cuda_the_gradients_where_steps_forget_fast_are_cpu_fp64s(scan, compiled):
    """Mamba's Image run on an H200 collapsed with its reversed pass's dt gradients ~1e8 times the exact ones (its
    Adam state at step 18,986), where dt had grown to thousands (A dt ~ -1e5 a step) and its input's RMS to 10; every
    CPU execution (eager or compiled, fp32 or bf16) gave the exact ones. Here that state, made up: the mixer on
    CUDA in bf16 autocast, as training runs it, against CPU fp64, a CLS-like loss on the first position."""
    torch.manual_seed(0)
    m = create("mamba", d_model=128, n_heads=8, d_qkv=128, dropout=0.0, max_len=1025, scan=scan)
    with torch.no_grad():
        m.dt_bias[1].fill_(7.0)  # the reversed pass: dt = softplus(raw + 7) up to thousands with the rows below
        rows = m.in_proj.weight[-m.n_heads :]  # the reversed pass's dt rows (the last of in_proj's outputs)
        rows.mul_(50 / rows.norm(dim=1, keepdim=True))
    u = torch.randn(4, 1025, 128, dtype=torch.float64) * 10  # (B, N, D)
    w = torch.randn(128, dtype=torch.float64)

    def grads(model, x, **autocast):
        model.zero_grad()
        x = x.clone().requires_grad_()
        fn = torch.compile(model) if compiled and x.is_cuda else model
        with torch.autocast(device_type=x.device.type, enabled=bool(autocast), **autocast):
            loss = (fn(x, None)[:, 0].float() @ w.to(x.device, torch.float32)).sum()  # the first position, as CLS
        loss.backward()
        # copies: the fp64 reference's grads would otherwise be the very tensors that .float().cuda() moves next
        grads = {"input": x.grad, **{n: p.grad for n, p in model.named_parameters()}}
        return {n: g.to("cpu", torch.float64, copy=True) for n, g in grads.items()}

    ref = grads(m.double(), u)
    got = grads(m.float().cuda(), u.float().cuda(), dtype=torch.bfloat16)
    # errors relative to each gradient, floored at 1e-4 of the largest: where the decays forget everything (A_log's
    # gradient is ~1e-30 here) bf16's rounding is all there is
    floor = 1e-4 * max(g.norm() for g in ref.values())
    for name, g in ref.items():
        err = (got[name] - g).norm() / max(g.norm(), floor)
        assert err < 0.3, f"{name}: |g| {got[name].norm():.3e} on CUDA, {g.norm():.3e} in fp64 (rel. err {err:.2e})"
