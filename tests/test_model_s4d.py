"""S4D: the kernel against the unrolled recurrence (discretised here independently, by matrix exponential /
dense solves on the full conjugate-pair system), the FFT convolution against direct O(L^2) sums, each
initialisation against its formula (LegS against an eigen-decomposition done here), the ``_optim`` groups,
the recurrent ``step`` against ``forward``, and the fp32 kernel path under bf16 autocast."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import models.base as base
from models import create_model
from models.s4d import fft_conv, legs_diagonal, vandermonde

BACKBONE = {"n_heads": 2, "d_qkv": 8, "dropout": 0.0, "max_len": 512}
SSM_PARAMS = {"log_dt", "log_A_real", "A_imag", "B"}


def make(d_model=4, **options):
    torch.manual_seed(0)
    return create_model("s4d", d_model=d_model, **BACKBONE, **options).eval()


def system(model):
    """The model's continuous system in complex128: dt (H,), A (H, n), B (H, n), C (c, H, n)."""
    dt = model.log_dt.detach().double().exp()
    A = torch.complex(-model.log_A_real.detach().double().exp(), model.A_imag.detach().double())
    B = torch.view_as_complex(model.B.detach().double())
    C = torch.view_as_complex(model.C.detach().double())
    return dt, A, B, C


def discretise_dense(dt: float, A: torch.Tensor, B: torch.Tensor, method: str):
    """Ab (M, M), Bb (M,) of x' = A x + B u, A dense. ZOH from the exponential of the augmented matrix
    [[A, B], [0, 0]] dt (no closed form involved); bilinear by dense solves."""
    M = A.shape[0]
    if method == "zoh":
        aug = torch.zeros(M + 1, M + 1, dtype=A.dtype)
        aug[:M, :M], aug[:M, M] = A * dt, B * dt
        E = torch.linalg.matrix_exp(aug)  # [[Ab, Bb], [0, 1]]
        return E[:M, :M], E[:M, M]
    eye = torch.eye(M, dtype=A.dtype)
    back = eye - dt / 2 * A
    return torch.linalg.solve(back, eye + dt / 2 * A), torch.linalg.solve(back, dt * B)


def unroll(model, u: torch.Tensor, channel: int = 0) -> torch.Tensor:
    """x_k = Ab x_{k-1} + Bb u_k, y_k = C x_k over the full (2n-dim, conjugate pairs) state; u (H, L) -> (H, L)."""
    dt, A, B, C = system(model)
    H, L = u.shape
    y = torch.zeros(H, L, dtype=torch.float64)
    for h in range(H):
        full_A = torch.diag(torch.cat([A[h], A[h].conj()]))  # (2n, 2n)
        Ab, Bb = discretise_dense(dt[h].item(), full_A, torch.cat([B[h], B[h].conj()]), model.discretization)
        Cf = torch.cat([C[channel, h], C[channel, h].conj()])  # (2n,)
        x = torch.zeros(Ab.shape[0], dtype=torch.complex128)
        for k in range(L):
            x = Ab @ x + Bb * u[h, k]
            out = Cf @ x
            assert abs(out.imag) < 1e-9 * (1 + abs(out.real))  # conjugate pairs: the output is real
            y[h, k] = out.real
    return y


def causal_conv(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """O(L^2): y_t = sum_{s<=t} k_{t-s} u_s. u (..., H, L), k (H, L)."""
    L = u.shape[-1]
    lag = torch.arange(L)[:, None] - torch.arange(L)[None, :]  # (L, L): t - s
    T = torch.where(lag >= 0, k[:, lag.clamp(min=0)], torch.zeros(()))  # (H, L, L)
    return torch.einsum("hts,...hs->...ht", T.to(u.dtype), u)


@pytest.mark.parametrize("init", ["legs", "lin", "inv"])
@pytest.mark.parametrize("discretization", ["zoh", "bilinear"])
def test_kernel_equals_the_unrolled_recurrence(init, discretization):
    model = make(d_model=3, d_state=8, init=init, discretization=discretization, dt_min=0.01, dt_max=0.3)
    with torch.no_grad():  # move off the symmetric init: random decay, frequency and B per mode
        model.log_A_real.add_(0.5 * torch.randn_like(model.log_A_real))
        model.A_imag.add_(torch.randn_like(model.A_imag))
        model.B.add_(0.3 * torch.randn_like(model.B))
    L = 50
    u = torch.randn(3, L, dtype=torch.float64)
    K = model.kernel(L).double()  # (2, 3, L), computed in complex64
    for channel in (0, 1):  # the future kernel is the same system with the second C
        want = unroll(model, u, channel)
        got = causal_conv(u, K[channel])
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_factored_vandermonde_equals_the_real_part_of_the_table_of_powers():
    torch.manual_seed(1)
    log_z = torch.complex(-torch.rand(3, 5, dtype=torch.float64), 3 * torch.randn(3, 5, dtype=torch.float64))
    CB = torch.randn(2, 3, 5, dtype=torch.complex128)
    for L in (1, 2, 3, 16, 17, 37, 100):
        powers = torch.exp(log_z[..., None] * torch.arange(L, dtype=torch.float64))  # (H, n, L)
        want = torch.einsum("chn,hnl->chl", CB, powers)
        torch.testing.assert_close(vandermonde(log_z, CB, L), want.real, rtol=1e-12, atol=1e-12)


def test_fft_convolution_equals_direct_sums():
    torch.manual_seed(2)
    L = 33
    u, k, kf = torch.randn(2, 3, L, dtype=torch.float64), torch.randn(3, L, dtype=torch.float64), torch.randn(
        3, L, dtype=torch.float64)
    torch.testing.assert_close(fft_conv(u, k, None), causal_conv(u, k))
    future = torch.zeros(2, 3, L, dtype=torch.float64)
    for t in range(L):
        for s in range(t + 1, L):
            future[..., t] += kf[:, s - t - 1] * u[..., s]
    torch.testing.assert_close(fft_conv(u, k, kf), causal_conv(u, k) + future)


@pytest.mark.parametrize("L", [1, 2, 7, 33])
def test_fft_convolution_backward_equals_autograd_of_its_transforms(L):
    """The written-out backward (the adjoint convolution, the kernel's correlation) gives what autograd gives through
    rfft and irfft, for u and for both kernels, and passes gradcheck."""
    torch.manual_seed(3)
    u, k, kf = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((2, 3, L), (3, L), (3, L)))

    def through_autograd(u, k, kf):
        kernel = torch.nn.functional.pad(k, (0, L)) + torch.nn.functional.pad(kf.flip(-1), (L, 0))  # (H, 2L)
        return torch.fft.irfft(torch.fft.rfft(u, n=2 * L) * torch.fft.rfft(kernel, n=2 * L), n=2 * L)[..., :L]

    y, want = fft_conv(u, k, kf), through_autograd(u, k, kf)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    grad_y = torch.randn_like(y)
    for got, expected in zip(torch.autograd.grad(y, (u, k, kf), grad_y), torch.autograd.grad(want, (u, k, kf), grad_y)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(fft_conv, (u, k, kf))
    assert torch.autograd.gradcheck(lambda u, k: fft_conv(u, k, None), (u, k))


def test_bidirectional_output_is_forward_plus_reversed_convolution():
    model = make(d_model=4, d_state=8).double()
    L = 40
    x = torch.randn(2, L, 4, dtype=torch.float64)
    K = model.kernel(L)  # (2, H, L)
    u = x.transpose(1, 2)  # (B, H, L)
    forward = causal_conv(u, K[0])
    # the future: run the causal convolution over the reversed sequence, one step behind, and reverse back
    delayed = torch.nn.functional.pad(causal_conv(u.flip(-1), K[1]), (1, 0))[..., :L]
    backward = delayed.flip(-1)
    want = (forward + backward + u * model.D[:, None]).transpose(1, 2)
    with torch.no_grad():
        torch.testing.assert_close(model.ssm(x, None), want)


def test_masked_positions_reach_no_real_output_even_inside_the_sequence():
    model = make(d_model=8, d_state=16).double()
    x = torch.randn(2, 60, 8, dtype=torch.float64)
    mask = torch.rand(2, 60) > 0.3
    x2 = x.clone()
    x2[~mask] = 1e3 * torch.randn(int((~mask).sum()), 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(x2, mask)[mask], model(x, mask)[mask])


def test_lin_and_inv_give_their_documented_A_and_B():
    N, n = 16, torch.arange(8, dtype=torch.float64)
    for init, imag in [("lin", math.pi * n), ("inv", N / math.pi * (N / (2 * n + 1) - 1))]:
        _, A, B, _ = system(make(d_model=3, d_state=N, init=init))
        torch.testing.assert_close(A.real, torch.full((3, 8), -0.5, dtype=torch.float64))
        torch.testing.assert_close(A.imag, imag.expand(3, 8), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(B, torch.ones(3, 8, dtype=torch.complex128))


def test_legs_is_the_spectrum_of_the_normal_part_of_hippo_legs():
    N = 64
    legs = np.zeros((N, N))  # HiPPO-LegS, written out entry by entry
    for i in range(N):
        for j in range(N):
            legs[i, j] = -math.sqrt((2 * i + 1) * (2 * j + 1)) if i > j else (-(i + 1) if i == j else 0.0)
    p = np.sqrt(np.arange(N) + 0.5)
    normal = legs + np.outer(p, p)
    b = np.sqrt(2 * np.arange(N) + 1.0)
    eig = np.linalg.eigvals(normal)
    eig = eig[eig.imag > 0]
    eig = eig[np.argsort(eig.imag)]
    _, A, B, _ = system(make(d_model=2, d_state=N, init="legs"))
    assert A.shape == (2, N // 2)
    np.testing.assert_allclose(A[0].real.numpy(), -0.5, atol=1e-6)
    np.testing.assert_allclose(np.sort(A[0].imag.numpy()), eig.imag, rtol=1e-5)
    np.testing.assert_allclose(eig.real, -0.5, atol=1e-8)
    # the unclipped B = V^* b: the diagonal system must reproduce b^T exp(S t) b = 2 Re sum_n |B_n|^2 exp(A_n t) of
    # the dense one (the w < 0 half S4 keeps: conjugate modes, the same sum)
    w, hippo_b = legs_diagonal(N)
    for t in (0.0, 0.003, 0.02, 0.1):
        dense = b @ torch.linalg.matrix_exp(torch.from_numpy(normal * t)).numpy() @ b
        diagonal = 2 * (hippo_b.abs() ** 2 * torch.exp(torch.complex(torch.full_like(w, -0.5), w) * t)).sum().real
        assert abs(diagonal.item() - dense) <= 1e-5 * abs(b @ b), t
    # the model's B: S4's clip of its imaginary part to [-2, 2] (in eigh's phases), on the conjugate modes
    clipped = torch.complex(hippo_b.real, hippo_b.imag.clamp(-2, 2)).conj().flip(0)
    torch.testing.assert_close(B[0], clipped.to(B.dtype), rtol=1e-6, atol=1e-6)
    assert (hippo_b.imag.abs() > 2).sum() == 11 and hippo_b.abs().max() > 40  # what the clip bounds (N = 64)
    assert B[0].abs().max() < 2.01 and torch.allclose(B[0].abs()[:4], hippo_b.abs().flip(0)[:4], rtol=1e-6)


def test_b_clip_null_leaves_legs_b_as_s4_v3_did():
    """b_clip: null keeps V^* B_LegS whole (S4 v3, the S4D paper's code; v4 clips its imaginary part to [-2, 2]):
    the same B where the clip does not reach, the HiPPO projection's own size (|B| to 40.75 at N = 64) elsewhere."""
    clipped, whole = make(d_model=3, init="legs"), make(d_model=3, init="legs", b_clip=None)
    B, B_whole = (torch.view_as_complex(m.B.detach())[0] for m in (clipped, whole))  # (n,): copies alike at init
    inside = B_whole.imag.abs() <= 2
    assert 0 < inside.sum() < len(B) and torch.equal(B[inside], B_whole[inside])
    assert B_whole.abs().max() > 40 and B.imag.abs().max() <= 2
    torch.testing.assert_close(whole.A_imag, clipped.A_imag)
    with pytest.raises(ValueError, match="b_clip must be > 0"):
        make(b_clip=0.0)


def test_c_times_b_starts_c_as_s4_v3_did():
    """c_times_b: C starts as the same random draw times B (S4 v3's diagonal mode), so the kernel's C B starts as
    C B^2; B itself and everything else are unchanged."""
    plain, v3 = make(d_model=3, init="legs"), make(d_model=3, init="legs", c_times_b=True)  # make seeds both alike
    C, C_v3 = (torch.view_as_complex(m.C.detach()) for m in (plain, v3))
    B = torch.view_as_complex(plain.B.detach())[0]  # (n,): every copy alike at init
    torch.testing.assert_close(C_v3, C * B)
    torch.testing.assert_close(v3.B, plain.B)
    assert not torch.allclose(C_v3, C)


def test_ssm_lr_puts_optim_exactly_on_the_ssm_parameters():
    model = make(ssm_lr=0.002)
    tagged = {name: p._optim for name, p in model.named_parameters() if hasattr(p, "_optim")}
    assert set(tagged) == SSM_PARAMS
    assert all(o == {"lr": 0.002, "weight_decay": 0.0} for o in tagged.values())
    assert not any(hasattr(p, "_optim") for p in make(ssm_lr=None).parameters())


def test_dt_lr_base_trains_dt_at_the_optimisers_lr_without_weight_decay():
    """S4's ``lr: {dt: null, A: 0.001, B: 0.001}``: dt in a group of its own at the base lr, undecayed."""
    model = make(ssm_lr=0.002, dt_lr="base")
    tagged = {name: p._optim for name, p in model.named_parameters() if hasattr(p, "_optim")}
    assert tagged.pop("log_dt") == {"weight_decay": 0.0}
    assert set(tagged) == SSM_PARAMS - {"log_dt"} and all(o == {"lr": 0.002, "weight_decay": 0.0}
                                                          for o in tagged.values())
    groups = torch.optim.AdamW(
        [{"params": [p], **getattr(p, "_optim", {})} for p in model.parameters()], lr=0.01, weight_decay=0.05
    ).param_groups
    by_name = dict(zip((n for n, _ in model.named_parameters()), groups))
    assert (by_name["log_dt"]["lr"], by_name["log_dt"]["weight_decay"]) == (0.01, 0.0)
    assert (by_name["B"]["lr"], by_name["C"]["weight_decay"]) == (0.002, 0.05)
    with pytest.raises(ValueError, match="dt_lr must be ssm .* or base"):
        make(dt_lr="global")


def test_n_ssm_shares_a_and_b_over_channels_as_s4s_repeat():
    """n_ssm copies of (A, B), channel h on copy h mod n_ssm: the layer equals a per-channel one whose A and B are
    those copies repeated, and a shared copy's gradient is the sum over the channels that use it."""
    shared = make(d_model=6, n_ssm=2)
    assert shared.log_A_real.shape == shared.A_imag.shape == (2, 32) and shared.B.shape == (2, 32, 2)
    with torch.no_grad():  # copies that differ, so a wrong channel-to-copy map shows
        shared.log_A_real.add_(torch.randn_like(shared.log_A_real) * 0.3)
        shared.A_imag.mul_(1 + torch.rand_like(shared.A_imag))
        shared.B.normal_()
    state = shared.state_dict()
    for name in ("log_A_real", "A_imag", "B"):  # the two copies repeated over the six channels: 0, 1, 0, 1, 0, 1
        state[name] = state[name].repeat(3, *[1] * (state[name].dim() - 1))
    full = make(d_model=6)
    full.load_state_dict(state)
    x = torch.randn(2, 40, 6)
    torch.testing.assert_close(shared(x), full(x), rtol=1e-5, atol=1e-6)
    shared(x).square().sum().backward()
    full(x).square().sum().backward()
    want = full.B.grad.view(3, 2, 32, 2).sum(0)  # channels 0, 2, 4 on copy 0; 1, 3, 5 on copy 1
    torch.testing.assert_close(shared.B.grad, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="n_ssm must divide d_model=6"):
        make(d_model=6, n_ssm=4)


@pytest.mark.parametrize("discretization", ["zoh", "bilinear"])
def test_step_decodes_like_the_causal_forward(discretization):
    model = make(d_model=4, d_state=8, bidirectional=False, discretization=discretization)
    x = torch.randn(2, 30, 4)
    state, outs = None, []
    with torch.no_grad():
        for t in range(30):
            out, state = model.step(x[:, t], state)
            outs.append(out)
        torch.testing.assert_close(torch.stack(outs, 1), model(x), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="bidirectional=False"):
        make(bidirectional=True).step(x[:, 0])


def test_bf16_autocast_keeps_the_kernel_path_fp32():
    model = make(d_model=16, d_state=32)
    x = torch.randn(2, 300, 16)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[1, 200:] = False
    with torch.no_grad():
        ref_ssm, ref = model.ssm(x, mask), model(x, mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            k = model.kernel(300)
            y = model.ssm(x, mask)
            out = model(x, mask)
            y_half = model.ssm(x.bfloat16(), mask)  # a bf16 input is upcast, not the SSM downcast
    assert k.dtype == torch.float32 and y.dtype == torch.float32 and y_half.dtype == torch.float32
    torch.testing.assert_close(y_half, model.ssm(x.bfloat16().float(), mask), rtol=0, atol=0)
    torch.testing.assert_close(y, ref_ssm, rtol=0, atol=0)  # the SSM is untouched by autocast
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out.float() - ref)[mask].abs().max() <= 0.05 * ref[mask].abs().max()


def test_options_are_checked_and_glu_off_is_a_plain_projection():
    with pytest.raises(ValueError, match="even"):
        make(d_state=7)
    model = make(d_model=4, glu=False)
    assert model.out.out_features == 4 and model(torch.randn(1, 10, 4)).shape == (1, 10, 4)


def test_tie_dropout_drops_whole_channels_of_each_example_in_training_only():
    """S4's tie_dropout: the mask is one per (example, channel), the same at every position; the kept channels are
    scaled by 1 / (1 - p); evaluation and p = 0 leave the input as it is."""
    torch.manual_seed(0)
    tied = base.TiedDropout(0.5).train()
    x = torch.rand(4, 50, 32) + 0.5  # no zeros of its own
    ratio = tied(x) / x  # (B, N, D): the mask at each position
    torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio))  # constant along the sequence
    assert set(ratio.unique().tolist()) == {0.0, 2.0}
    assert 0 < (ratio[:, 0] == 0).sum() < 4 * 32  # some channels dropped, not all
    assert not torch.equal(ratio[0, 0], ratio[1, 0])  # examples draw their own masks
    element = torch.nn.Dropout(0.5).train()(x) / x  # what it replaces varies along the sequence
    assert not torch.equal(element, element[:, :1].expand_as(element))
    assert torch.equal(tied.eval()(x), x) and torch.equal(base.TiedDropout(0.0).train()(x), x)
    assert isinstance(base.make_dropout(0.1, tied=False), torch.nn.Dropout)
    assert not isinstance(base.make_dropout(0.1, tied=False), base.TiedDropout)


def test_tie_dropout_ties_the_layers_dropout():
    torch.manual_seed(0)
    model = create_model("s4d", **{**BACKBONE, "d_model": 8, "dropout": 0.5}, tie_dropout=True).train()
    assert isinstance(model.dropout, base.TiedDropout) and not isinstance(make(d_model=8).dropout, base.TiedDropout)
    seen = {}
    model.dropout.register_forward_hook(lambda m, i, o: seen.update(inp=i[0], out=o))
    model(torch.randn(2, 30, 8))
    inp, out = seen["inp"], seen["out"]  # (2, 30, 8)
    dropped = ((out == 0) & (inp != 0)).any(1, keepdim=True)  # (2, 1, 8): the channels dropped somewhere
    assert dropped.any() and not dropped.all()
    torch.testing.assert_close(out, inp * (~dropped) * 2.0)  # ... are dropped everywhere, the rest kept everywhere


@pytest.mark.gpu
def test_cuda_forward_and_backward_match_the_cpu_reference():
    """No separate CUDA path: the same code on cuFFT / CUDA complex matmuls, plain and under bf16 autocast,
    and through torch.compile as the runner uses it (inductor falls back to eager for the complex ops)."""
    model = make(d_model=16, d_state=64).train()
    x = torch.randn(2, 1000, 16)
    mask = torch.ones(2, 1000, dtype=torch.bool)
    mask[1, 700:] = False
    ref = model(x, mask)
    ref.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    gpu = model.cuda()
    gpu.zero_grad()
    out = gpu(x.cuda(), mask.cuda())
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    out.square().sum().backward()
    for name, p in gpu.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), grads[name], atol=1e-3 * grads[name].abs().max().item(), rtol=1e-3)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert gpu.kernel(1000).dtype == torch.float32
        half = torch.compile(gpu)(x.cuda(), mask.cuda()).float().cpu()
    assert torch.isfinite(half).all() and (half - ref)[mask].abs().max() <= 0.05 * ref[mask].abs().max()
