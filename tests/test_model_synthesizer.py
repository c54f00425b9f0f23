"""The synthesizer's executions (``backend``) compute what its SDPA path computes: ``explicit`` (the N x N logits
formed) and ``flex`` (the synthesized logits added by a score_mod, padded keys left out by a BlockMask), outputs and
every gradient (flex: the table's summed over the batch by the kernel's backward), and each drops weights as it
should. The synthesizer's other tests are in test_model_learned.py."""
from __future__ import annotations

import pytest
import torch

from models import create_model
from models._flex_dropout import dense_draws
from tests.mixer_checks import lengths_mask

D = 32


def build(variant: str, dropout: float = 0.0, max_len: int = 300, n_heads: int = 2, d: int = D):
    torch.manual_seed(0)
    return create_model("synthesizer", d_model=d, n_heads=n_heads, d_qkv=d, dropout=dropout, max_len=max_len,
                        variant=variant, factor_rank=4)


def assert_backend_equals_sdpa(model, backend: str, x: torch.Tensor, mask: torch.Tensor | None) -> None:
    """``backend``'s outputs at real positions and every parameter's gradient equal the SDPA path's (padded queries'
    outputs are no result: flex gives 0, SDPA its own)."""
    results = {}
    for name in ("sdpa", backend):
        model.backend = name
        model.zero_grad()
        y = model(x, mask)  # (B, N, D)
        real = torch.ones_like(y, dtype=torch.bool) if mask is None else mask[..., None].expand_as(y)
        (y.square() * real).sum().backward()
        results[name] = y[real], {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(results[backend][0], results["sdpa"][0], atol=1e-5, rtol=1e-4)
    for n, grad in results["sdpa"][1].items():
        torch.testing.assert_close(results[backend][1][n], grad, atol=1e-4, rtol=1e-4, msg=n)


@pytest.mark.heavy  # CI's second tier: every variant, masked and not, against SDPA
@pytest.mark.parametrize("variant", ["random", "factorized_random", "dense"])
@pytest.mark.parametrize("masked", [True, False])
def test_explicit_equals_sdpa_and_drops_as_sdpa(variant, masked):
    """backend='explicit' (the N x N logits formed, fp32 softmax, then dropout and the product with V), with padding
    and without; its dropout drops weights as SDPA's (same keep rate, rescaled: the mean output over many draws is
    the output without dropout)."""
    model = build(variant, max_len=40).eval()
    x = torch.randn(2, 33, D)
    mask = lengths_mask([33, 20], 33) if masked else None
    assert_backend_equals_sdpa(model, "explicit", x, mask)
    dropped = build(variant, dropout=0.3, max_len=40)
    dropped.load_state_dict(model.state_dict())
    dropped.backend = "explicit"
    mean = torch.stack([dropped.train()(x, mask) for _ in range(2000)]).mean(0)
    reference = dropped.eval()(x, mask)
    assert not torch.allclose(dropped.train()(x, mask), reference)
    # outputs reach 0.26: weights kept at 0.7 without the 1/0.7 rescale would be off by up to 0.08
    torch.testing.assert_close(mean, reference, atol=0.005, rtol=0)


@pytest.mark.parametrize("variant", ["random", "factorized_random", "dense"])
@pytest.mark.parametrize("masked", [True, False])
def test_flex_equals_sdpa_with_gradients(variant, masked, flex_backward_on_cpu):
    """Over two 128-key tiles and a part (260 keys), the second example padded from 150 on."""
    assert_backend_equals_sdpa(build(variant).eval(), "flex", torch.randn(2, 260, D),
                               lengths_mask([260, 150], 260) if masked else None)


def test_flex_drops_weights_as_dense_attention_with_the_same_draws(flex_backward_on_cpu):
    """In training the flex path's dropout equals softmax(QK^T / sqrt(d) + S) dropped by ``_flex_dropout``'s draws
    and rescaled, in output and in the gradients of the table and the inputs."""
    model = build("random", dropout=0.3).train()
    model.backend = "flex"
    x = torch.randn(2, 150, D, requires_grad=True)
    mask = lengths_mask([150, 77], 150)
    q, k, v = model.project(x)  # each (B, H, N, Dh)
    torch.manual_seed(5)
    got = model(x, mask)  # (B, N, D)
    torch.manual_seed(5)  # the seed the flex call drew: its first use of the generator
    seed = torch.randint(0, 2**31 - 1, (1,))
    logits = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + model.synthesized(x)  # (B, H, N, N)
    weights = torch.softmax(logits.masked_fill(~mask[:, None, None, :], float("-inf")), -1)  # (B, H, N, N)
    o = (weights * dense_draws(seed, 0.3, weights.shape) / 0.7) @ v  # (B, H, N, Dh)
    want = model.out(o.transpose(1, 2).reshape(2, 150, -1))  # (B, N, D)
    real = mask[..., None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)
    loss = torch.randn_like(got) * real
    params = [x, model.R]
    grads = [torch.autograd.grad((out * loss).sum(), params, retain_graph=True) for out in (got, want)]
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("n, batch", [(1024, 32), (4096, 8)])
def test_on_cuda_compiled_flex_matches_sdpa_in_bf16_at_the_task_shapes(n, batch):
    """At Pathfinder's and Text's lengths and LRA's width (d 256, 4 heads), compiled as a run compiles it, under bf16
    autocast: outputs and gradients near the SDPA path's (bf16 rounding), and the compiled forward + backward finds
    kernel configurations that fit the card (DeBERTa's flex backward, with captured tables too, did not)."""
    device = torch.device("cuda")
    model = build("random", max_len=n, n_heads=4, d=256).to(device).train()
    torch.manual_seed(1)
    x = torch.randn(batch, n, 256, device=device)
    mask = torch.arange(n, device=device)[None] < torch.randint(n // 2, n + 1, (batch, 1), device=device)
    results = {}
    for backend in ("sdpa", "flex"):
        model.backend = backend
        model.zero_grad()
        step = torch.compile(model, dynamic=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = step(x, mask).float()  # (B, N, D)
        real = mask[..., None].expand_as(y)
        (y.square() * real).sum().backward()
        results[backend] = y[real], model.R.grad.clone(), model.qkv.weight.grad.clone()
    for got, want in zip(results["flex"], results["sdpa"]):
        assert (got - want).norm() <= 2e-2 * want.norm()



@pytest.mark.parametrize(("device", "shared_kib", "fits"), [
    ("cuda:0", 228, True),  # Hopper (H100, H200)
    ("cuda:0", 164, False),  # A100: the table's tiles (synthesizer.FLEX_SHARED_MEMORY) would not fit
    ("cpu", 228, False),
])
def test_flex_fits_only_a_gpu_whose_shared_memory_holds_its_tiles(monkeypatch, device, shared_kib, fits):
    from types import SimpleNamespace

    from models import synthesizer

    props = SimpleNamespace(shared_memory_per_multiprocessor=shared_kib * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert synthesizer.flex_fits(torch.device(device)) is fits


@pytest.mark.parametrize(("variant", "backend", "fits", "expected"), [
    ("random", "auto", True, "flex"), ("factorized_random", "auto", True, "flex"), ("random", "auto", False, "sdpa"),
    ("dense", "auto", True, "sdpa"), ("random", "sdpa", True, "sdpa"), ("dense", "flex", False, "flex"),
])
def test_auto_takes_flex_where_it_fits_and_a_named_backend_always(monkeypatch, variant, backend, fits, expected):
    from models import synthesizer

    model = build(variant)
    model.backend = backend
    taken = []
    monkeypatch.setattr(synthesizer, "flex_fits", lambda device: fits)
    monkeypatch.setattr(synthesizer, "flex_call", lambda fn, on_cuda, *args: taken.append("flex") or args[3])
    monkeypatch.setattr(synthesizer.F, "scaled_dot_product_attention", lambda q, k, v, **kw: taken.append("sdpa") or v)
    model(torch.randn(2, 16, D), None)
    assert taken == [expected]
