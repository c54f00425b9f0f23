"""ETC (models/etc.py): the blocked global-local attention against a dense N x N reference with the same relative
terms, the window's edge, and padding with global tokens. CPU, small sizes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import create_model
from models._flex_dropout import dense_draws
from models.etc import band_tiles
from models.patterns import FLEX_BLOCK
from tests.mixer_checks import assert_appended_padding_changes_nothing, lengths_mask

D, H = 32, 2
BACKENDS = ["explicit", "recompute", "sdpa", "flex"]


def build(max_len: int = 80, **options):
    torch.manual_seed(0)
    model = create_model("etc", d_model=D, n_heads=H, d_qkv=D, dropout=0.0, max_len=max_len, **options).eval()
    with torch.no_grad():
        model.rel.normal_()  # relative terms as large as the content ones, so that a wrong label shows
    return model




def dense_reference(model, x, mask, keep=None):
    """ETC's attention written densely from its definition: keys = learned globals then the N positions; query i
    may see key j iff either is global (learned, or one of the ``global_tokens`` leading positions) or
    |i - j| <= radius; logit = q_i . (k_j + a[label]) / sqrt(d), label = clip(j - i, +-k) + k between long tokens and
    the "global" label 2k + 1 for every pair with a global. Padded keys never contribute. ``keep`` (B, H, N, Gl+N):
    factors on the softmax weights (attention dropout's draws over 1 - p)."""
    B, N, _ = x.shape
    q, k, v = model.project(x)  # (B, H, N, Dh)
    Gl, g, r, kmax = model.learned_globals, min(model.global_tokens, N), model.radius, model.max_distance
    if Gl:
        lk, lv = model.qkv(model.globals).view(Gl, 3, H, -1).permute(1, 2, 0, 3)[1:]  # (H, Gl, Dh)
        k = torch.cat([lk.expand(B, -1, -1, -1), k], dim=2)  # (B, H, Gl+N, Dh)
        v = torch.cat([lv.expand(B, -1, -1, -1), v], dim=2)
    key_pos = torch.arange(-Gl, N)  # learned globals at negative positions
    i, j = torch.arange(N)[:, None], key_pos[None, :]  # (N, 1), (1, Gl+N)
    is_global = (i < g) | (j < g)  # (N, Gl+N): j < 0 are the learned globals
    allowed = is_global | ((i - j).abs() <= r)
    label = torch.where(is_global, 2 * kmax + 1, (j - i).clamp(-kmax, kmax) + kmax)  # (N, Gl+N)
    rel = model.rel[:, label]  # (H, N, Gl+N, Dh): a[label(i, j)] per head, N x N as the reference may be
    logits = (q @ k.transpose(-1, -2) + torch.einsum("bhid,hijd->bhij", q, rel)) * q.shape[-1] ** -0.5
    seen = allowed & torch.cat([torch.ones(B, Gl, dtype=torch.bool), mask], dim=1)[:, None, None, :]
    weights = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1)  # (B, H, N, Gl+N)
    o = (weights if keep is None else weights * keep) @ v  # (B, H, N, Dh)
    return model.out(o.transpose(1, 2).reshape(B, N, -1))  # (B, N, D)


CASES = {
    "window covers everything": {"radius": 80, "max_distance": 12, "global_tokens": 1},
    "two input + three learned globals": {"radius": 80, "max_distance": None, "global_tokens": 2, "learned_globals": 3},
    "real window, clipped labels": {"radius": 4, "max_distance": 2, "global_tokens": 1, "learned_globals": 2},
    "no globals, labels beyond the window": {"radius": 6, "max_distance": 12, "global_tokens": 0},
    "radius 0: self and globals only": {"radius": 0, "max_distance": 3, "global_tokens": 3},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_blocked_attention_equals_the_dense_reference(options, backend, flex_backward_on_cpu):
    model = build(**options)
    model.backend = backend
    x = torch.randn(2, 71, D)
    mask = lengths_mask([71, 50], 71)
    torch.testing.assert_close(model(x, mask)[mask], dense_reference(model, x, mask)[mask], atol=1e-5, rtol=1e-4)


def test_a_window_over_everything_is_full_attention_with_relative_keys():
    """With no clipping and a window longer than the input, long tokens see everything: the dense reference has no
    zero in its mask, so ETC is full softmax attention plus the relative key terms."""
    model = build(radius=80, max_distance=None, global_tokens=1)
    x = torch.randn(1, 60, D)
    mask = lengths_mask([60], 60)
    with torch.no_grad():
        model.rel.zero_()  # no relative terms: exactly full attention
    q, k, v = model.project(x)
    o = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v  # (1, H, N, Dh)
    full = model.out(o.transpose(1, 2).reshape(1, 60, -1))
    torch.testing.assert_close(model(x, mask), full, atol=1e-5, rtol=1e-4)


def test_long_tokens_outside_the_window_get_no_weight():
    model = build(radius=5, global_tokens=1, learned_globals=1)
    x = torch.randn(1, 64, D)
    mask = lengths_mask([64], 64)
    j = 40  # change one long token: every query within 5 of it, and the global, may change; no other one
    x2 = x.clone()
    x2[0, j] = torch.randn(D) * 5
    y, y2 = model(x, mask), model(x2, mask)
    far = (torch.arange(64) - j).abs() > 5
    far[0] = False  # the global CLS slot sees everything
    torch.testing.assert_close(y2[0, far], y[0, far], atol=1e-6, rtol=1e-5)
    near = ~far
    assert ((y2[0, near] - y[0, near]).abs().amax(-1) > 1e-4).all()


@pytest.mark.parametrize("options", [{"global_tokens": 2, "learned_globals": 2, "radius": 3},
                                     {"global_tokens": 1, "radius": 84}, {"global_tokens": 0, "radius": 7}])
def test_padding_with_global_tokens_leaves_real_outputs_unchanged(options):
    model = build(max_len=128, **options)
    assert_appended_padding_changes_nothing(model, [40, 23], 40, 37, D)


@pytest.mark.parametrize("other", ["sdpa", "recompute", "flex"])
@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_the_other_backends_have_the_explicit_gradients(options, other, flex_backward_on_cpu):
    """The relative terms and the mask as SDPA's float mask (sdpa), the weights recomputed in the backward
    (recompute), or the whole layer as one FlexAttention call (flex): the gradients of the input and of every
    weight (the relative embeddings included) equal the explicit path's, a loss on the real positions."""
    model = build(**options).train()  # dropout 0: deterministic, but the training path
    x = torch.randn(2, 71, D)
    mask = lengths_mask([71, 50], 71)
    weight = torch.randn(2, 71, D) * mask[..., None]
    grads = []
    for backend in ("explicit", other):
        model.backend = backend
        model.zero_grad()
        xb = x.clone().requires_grad_()
        (model(xb, mask) * weight).sum().backward()
        grads.append([xb.grad] + [p.grad.clone() for p in model.parameters()])
    for explicit, sdpa in zip(*grads):
        torch.testing.assert_close(sdpa, explicit, atol=1e-5, rtol=1e-4)


def test_backend_is_checked():
    model = build()
    model.backend = "fused"
    with pytest.raises(ValueError, match="backend must be one of"):
        model(torch.randn(1, 8, D), lengths_mask([8], 8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_padded_rows_stay_finite(backend, flex_backward_on_cpu):
    """A padded query whose window holds only padding, with no global token, must not make NaN (it would reach the
    next layer's values)."""
    model = build(radius=2, global_tokens=0)
    model.backend = backend
    x = torch.randn(1, 30, D)
    y = model(x, lengths_mask([5], 30))
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("options", [{"radius": 5, "global_tokens": 1}, {"radius": 130, "global_tokens": 2,
                                     "learned_globals": 1}, {"radius": 84, "global_tokens": 0}])
def test_flex_over_several_tiles_equals_the_dense_reference_with_the_explicit_gradients(options, flex_backward_on_cpu):
    """Over 300 positions, three of FlexAttention's 128-wide tiles: the band's diagonal tiles (and, at radius 130,
    the ones two apart), the globals' row and column, and the second row's padding-only key tile skipped."""
    model = build(max_len=300, **options).train()  # dropout 0: deterministic, but the training path
    x = torch.randn(2, 300, D)
    mask = lengths_mask([300, 90], 300)
    weight = torch.randn(2, 300, D) * mask[..., None]
    grads = {}
    for backend in ("explicit", "flex"):
        model.backend = backend
        model.zero_grad()
        xb = x.clone().requires_grad_()
        out = model(xb, mask)
        (out * weight).sum().backward()
        grads[backend] = [out.detach(), xb.grad] + [p.grad.clone() for p in model.parameters()]
    torch.testing.assert_close(grads["flex"][0][mask], dense_reference(model, x, mask)[mask].detach(), atol=1e-5,
                               rtol=1e-4)
    for flex, explicit in zip(grads["flex"][1:], grads["explicit"][1:]):
        torch.testing.assert_close(flex, explicit, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("radius", [0, 1, 84, 127, 128, 129, 300])
def test_band_tiles_are_the_tiles_that_hold_a_visible_pair(radius):
    n, g = 700, 3
    i = torch.arange(n)
    visible = ((i[:, None] - i[None, :]).abs() <= radius) | (i[:, None] < g) | (i[None, :] < g)  # (n, n)
    nt = -(-n // FLEX_BLOCK)
    pooled = F.pad(visible, (0, nt * FLEX_BLOCK - n, 0, nt * FLEX_BLOCK - n))
    pooled = pooled.view(nt, FLEX_BLOCK, nt, FLEX_BLOCK).any(3).any(1)  # (nt, nt)
    assert torch.equal(band_tiles(n, g, radius, "cpu"), pooled)


def test_flex_applies_attention_dropout_as_the_dense_reference_with_the_same_draws(flex_backward_on_cpu):
    """Training with attention dropout 0.3: the flex path equals the dense reference whose weights are dropped by
    the same draws (``_flex_dropout.kept`` over the flex call's [learned globals, positions] layout), in output and
    in every gradient."""
    torch.manual_seed(0)
    model = create_model("etc", d_model=D, n_heads=H, d_qkv=D, dropout=0.3, max_len=300, radius=5, global_tokens=1,
                         learned_globals=1).train()
    model.backend = "flex"
    x = torch.randn(2, 300, D, requires_grad=True)
    mask = lengths_mask([300, 90], 300)
    torch.manual_seed(5)
    got = model(x, mask)
    torch.manual_seed(5)  # the seed the flex call drew: its first use of the generator
    seed = torch.randint(0, 2**31 - 1, (1,))
    S = model.learned_globals + 300
    keep = dense_draws(seed, 0.3, (2, H, S, S))[:, :, model.learned_globals:]  # (2, H, N, S): the queries' rows
    want = dense_reference(model, x, mask, keep=keep / 0.7)
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-4)
    weight = torch.randn(2, 300, D) * mask[..., None]
    params = [x, *model.parameters()]
    grads = [torch.autograd.grad((out * weight).sum(), params) for out in (got, want)]
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_learned_globals_are_seen_and_dropped_from_the_output():
    model = build(radius=3, global_tokens=0, learned_globals=2)
    x = torch.randn(1, 20, D)
    mask = lengths_mask([20], 20)
    y = model(x, mask)
    assert y.shape == (1, 20, D)
    with torch.no_grad():
        model.globals.mul_(3.0)
    assert not torch.allclose(model(x, mask), y)  # every long token reads the learned globals


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_matches_cpu(backend, flex_backward_on_cpu):
    model = build(max_len=160, radius=9, global_tokens=1, learned_globals=2)
    model.backend = backend
    x = torch.randn(2, 150, D)
    mask = lengths_mask([150, 90], 150)
    expected = model(x, mask)
    got = model.cuda()(x.cuda(), mask.cuda()).cpu()
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-4, rtol=1e-3)


@pytest.mark.gpu
def test_flex_compiled_at_the_bench_shape_agrees_with_explicit():
    """One layer as layer_bench times it (d 256, 4 heads of 64, bf16 autocast, compiled), at N = 2048 with padding:
    the flex path's forward and backward compile and run (the kernel's tiles fit the card's shared memory) and its
    output and input gradient lie within bf16 rounding of the explicit path's; with attention dropout it compiles
    and trains too."""
    torch.manual_seed(0)
    model = create_model("etc", d_model=256, n_heads=4, d_qkv=256, dropout=0.0, max_len=2048).cuda().train()
    x = torch.randn(4, 2048, 256, device="cuda")
    mask = lengths_mask([2048, 1500, 700, 2048], 2048).cuda()
    results = {}
    for backend in ("explicit", "flex"):
        model.backend = backend
        xb = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = torch.compile(model)(xb, mask)
        (out.float() * mask[..., None]).square().sum().backward()
        results[backend] = (out.float()[mask], xb.grad[mask])
    for flex, explicit in zip(results["flex"], results["explicit"]):
        assert ((flex - explicit).norm() / explicit.norm()).item() < 2e-2
    model.attn_dropout = 0.1  # LRA's training: the flex path with its dropout (two calls, _flex_dropout) compiles too
    xb = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = torch.compile(model)(xb, mask)
    out.float().square().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(xb.grad).all()


def test_flex_compiled_for_evaluation_equals_eager():
    """The flex path through torch.compile without autograd (an evaluation graph, where Inductor would fuse the key
    mask and the relative table into the kernel's inputs unless they are buffers of their own) equals eager."""
    model = build(max_len=300, radius=5, global_tokens=1, learned_globals=1)
    model.backend = "flex"
    x = torch.randn(2, 300, D)
    mask = lengths_mask([300, 90], 300)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model)(x, mask)[mask], model(x, mask)[mask], atol=1e-5, rtol=1e-4)
