"""The small-head attention kernels (models/_small_head.py) against float64 softmax attention in PyTorch with the same
dropout keep mask: on the CPU through Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets before
triton is imported), or on a GPU."""
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (pip install triton; CI installs it with .[dev])")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter is off (tests/conftest.py sets TRITON_INTERPRET=1 on machines "
                "without nvidia-smi)", allow_module_level=True)

from models import _small_head
from models._small_head import (
    dropout_keep_mask,
    kernel_keep_mask,
    small_head_attention,
    small_head_forward_op,
    threshold,
)
from models.registry import create_model
from models.transformer import small_heads_suit
from tests.conftest import compiles_for_hopper
from tests.mixer_checks import out_and_grads, relative_errors

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parent.parent
SEED = 0xC0FFEE


def reference(q, k, v, keep, p, seed):
    """softmax(q k^T / sqrt(D) + mask) v in float64, the kept scores (``dropout_keep_mask``) scaled by 1 / (1 - p);
    a query without a real key gives 0."""
    q, k, v = (t.double() for t in (q, k, v))
    B, H, NQ, D = q.shape
    NK = k.shape[2]
    s = q @ k.transpose(-1, -2) * D**-0.5  # (B, H, Nq, Nk)
    if keep is not None:
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    a = torch.softmax(s, -1).nan_to_num(0.0)
    if p > 0:
        z = torch.stack([dropout_keep_mask(seed, bh, NQ, NK, p) for bh in range(B * H)]).view(B, H, NQ, NK)
        a = a * z.to(a.device) / (1 - p)
    return a @ v


def inputs(B, H, NQ, NK, D, padded=(), seed=0):
    """q, k, v, the output's gradient (float32) and keep (B, Nk) bool: example b in ``padded`` has its last 9 keys
    padded, or all of them when b is negative (-b - 1 is then the example)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(B, H, n, D, generator=g) for n in (NQ, NK, NK, NQ))
    keep = None
    if padded:
        keep = torch.ones(B, NK, dtype=torch.bool)
        for b in padded:
            if b >= 0:
                keep[b, NK - 9:] = False
            else:
                keep[-b - 1] = False
    return [None if t is None else t.to(DEVICE) for t in (q, k, v, grad, keep)]


def errors_against_the_reference(shape, dtype, p, padded=()):
    B, H, NQ, NK, D = shape
    q, k, v, grad, keep = inputs(B, H, NQ, NK, D, padded)
    # the reference sees the inputs as rounded to the kernels' dtype
    rounded = [t.to(dtype).double() for t in (q, k, v)]
    theirs = out_and_grads(lambda *x: reference(*x, keep, p, SEED), *rounded, grad, torch.float64)
    ours = out_and_grads(lambda *x: small_head_attention(*x, keep, p, SEED), q, k, v, grad, dtype)
    return relative_errors(ours, theirs), ours


# fp32: the products are exact fp32 products, so the kernels meet fp64 to rounding (a single score kept or dropped
# otherwise than the reference moves the output by ~1 / N, far past this); 16-bit inputs: P and dS are rounded to
# the inputs' dtype before their products, as FlashAttention does
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}

# (B, H, Nq, Nk, D), dtype, p, padded examples: lengths that end mid-tile; LRA's head sizes; masks and dropout on
# and off; more keys than queries and the other way round
CASES = [
    ((2, 2, 70, 70, 4), torch.float32, 0.0, ()),
    ((2, 2, 130, 130, 4), torch.float32, 0.1, (0,)),
    ((2, 2, 97, 97, 2), torch.float32, 0.5, (1,)),
    ((2, 2, 77, 77, 16), torch.float32, 0.1, ()),
    ((2, 2, 50, 90, 8), torch.float32, 0.1, (0, 1)),
    ((2, 2, 64, 64, 8), torch.bfloat16, 0.1, ()),
    ((2, 2, 100, 100, 16), torch.bfloat16, 0.0, (0,)),
    ((2, 2, 130, 70, 4), torch.bfloat16, 0.5, (1,)),
    ((2, 2, 90, 90, 8), torch.float16, 0.1, (0,)),
]


@pytest.mark.heavy  # CI's second tier: Triton's interpreter over every case
@pytest.mark.parametrize("shape,dtype,p,padded", CASES,
                         ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else str(c).replace("torch.", ""))
def test_output_and_gradients_equal_float64_attention_with_the_same_mask(shape, dtype, p, padded):
    errors, _ = errors_against_the_reference(shape, dtype, p, padded)
    assert max(errors) < TOLERANCE[dtype], errors


def test_a_query_without_a_real_key_gives_zeros_and_the_others_are_exact():
    """Example 1 has no real key: its outputs and gradients are 0, not NaN, and example 0's are the reference's."""
    errors, ours = errors_against_the_reference((2, 2, 70, 70, 4), torch.float32, 0.1, padded=(0, -2))
    assert all(torch.isfinite(t).all() for t in ours)
    out, dq, dk, _ = ours
    assert out[1].abs().max() == 0 and dq[1].abs().max() == 0 and dk[1].abs().max() == 0
    assert max(errors) < 1e-5, errors


@pytest.mark.heavy  # CI's second tier: Triton's interpreter over several tilings
@pytest.mark.parametrize("tiles", [{"forward": (32, 16, 4), "dkdv": (16, 32, 4), "dq": (32, 16, 2)},
                                   {"forward": (16, 64, 2), "dkdv": (64, 16, 2), "dq": (16, 32, 4)}])
def test_any_tile_setting_gives_the_same_answer(monkeypatch, tiles):
    """The tiles are a speed setting: several tiles along both axes, each ragged at its end, change nothing, with dQ
    from the dK/dV kernel or (deterministic mode) from its own."""
    monkeypatch.setattr(_small_head, "TILES", tiles)
    for deterministic in (False, True):
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
        errors, _ = errors_against_the_reference((1, 2, 70, 45, 4), torch.float32, 0.3, padded=(0,))
        assert max(errors) < 1e-5, (deterministic, errors)


class Launches:
    """A kernel launcher that counts its launches (``kernel[grid](...)``) and hands them on."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def test_dq_comes_from_the_dkdv_kernels_atomic_adds_and_in_deterministic_mode_from_its_own_kernel(monkeypatch):
    """Which backward runs: by default the dK/dV kernel also sums dQ (one recomputation of P); under torch's
    deterministic mode, where atomic adds would land in no fixed order, the dQ kernel does. Both give the
    reference's gradients, and each other's to fp32 rounding."""
    spy = Launches(_small_head._backward_dq)
    monkeypatch.setattr(_small_head, "_backward_dq", spy)
    shape = (2, 2, 70, 90, 4)
    errors, fused = errors_against_the_reference(shape, torch.float32, 0.2, padded=(1,))
    assert spy.count == 0 and max(errors) < 1e-5, errors
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    errors, own = errors_against_the_reference(shape, torch.float32, 0.2, padded=(1,))
    assert spy.count == 1 and max(errors) < 1e-5, errors
    for a, b in zip(fused, own, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("seed,bh,n_q,n_k", [(0, 0, 40, 70), (SEED, 1, 33, 65), (2**32 - 1, 37, 70, 40),
                                             (2**31 + 7, 5, 64, 64)])
def test_the_kernels_hash_is_the_reference_bit_for_bit(seed, bh, n_q, n_k):
    for p in (0.1, 0.5, 0.9):
        ours = kernel_keep_mask(seed, bh, n_q, n_k, p, DEVICE).cpu()
        assert torch.equal(ours, dropout_keep_mask(seed, bh, n_q, n_k, p))


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_kept_fraction_is_1_minus_p_and_neighbours_and_seeds_are_uncorrelated(p):
    n = 1024
    z = dropout_keep_mask(SEED, 3, n, n, p)  # 2^20 draws
    sigma = (p * (1 - p) / z.numel()) ** 0.5
    assert abs(z.double().mean().item() - (1 - p)) < 4 * sigma
    bound = 4 / (z.numel() ** 0.5)  # 4 sigma of a correlation estimated from ~2^20 independent pairs
    assert abs(correlation(z[1:], z[:-1])) < bound  # adjacent queries
    assert abs(correlation(z[:, 1:], z[:, :-1])) < bound  # adjacent keys
    assert abs(correlation(z[1:, 1:], z[:-1, :-1])) < bound  # the diagonal neighbour
    assert abs(correlation(z, dropout_keep_mask(SEED + 1, 3, n, n, p))) < bound  # the next seed
    assert abs(correlation(z, dropout_keep_mask(SEED, 4, n, n, p))) < bound  # the next head
    # whole rows and columns keep their share too (no row or column pattern)
    rows, cols = z.double().mean(1), z.double().mean(0)
    row_sigma = (p * (1 - p) / n) ** 0.5
    assert (rows - (1 - p)).abs().max() < 5 * row_sigma and (cols - (1 - p)).abs().max() < 5 * row_sigma


def test_the_threshold_keeps_1_minus_p_of_all_uint32():
    assert threshold(0.0) == 0 and threshold(0.5) == 2**31 and threshold(1 - 2**-40) == 2**32 - 1


def test_the_op_is_registered_for_autograd_and_compilation():
    q, k, v, _, keep = inputs(1, 2, 40, 40, 4, padded=(0,))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    seed = torch.tensor([SEED], device=DEVICE)
    report = torch.library.opcheck(small_head_forward_op, (q, k, v, keep.to(torch.int8), seed, 0.1))
    assert set(report.values()) == {"SUCCESS"}, report


def test_the_seed_is_drawn_from_torchs_rng():
    q, k, v, _, _ = inputs(1, 1, 40, 40, 4)
    torch.manual_seed(1)
    a = small_head_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(1)
    b = small_head_attention(q, k, v, dropout_p=0.5)
    c = small_head_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def transformer_outputs(backend, x, mask, train=False):
    torch.manual_seed(0)
    mixer = create_model("transformer", d_model=32, n_heads=4, d_qkv=16, dropout=0.1, max_len=80).to(DEVICE)
    mixer.train(train)
    mixer.backend = backend
    xb = x.clone().requires_grad_()
    out = mixer(xb, mask)
    out[mask].sum().backward()
    return out[mask].detach(), xb.grad, mixer


def test_the_transformer_with_backend_small_head_computes_what_sdpa_does(monkeypatch):
    """Pathfinder's layer (d_model 32, 4 heads of 4) without dropout, padded keys in one example."""
    x = torch.randn(2, 70, 32, device=DEVICE)
    mask = torch.ones(2, 70, dtype=torch.bool, device=DEVICE)
    mask[1, 50:] = False
    *ours, mixer = transformer_outputs("small_head", x, mask)
    *sdpa, _ = transformer_outputs("dense", x, mask)
    for a, b in zip(ours, sdpa):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="unpacked rows only"):
        mixer(x, mask, segments=mask.long())
    if DEVICE.type == "cpu":  # "auto" keeps SDPA off CUDA; without the interpreter a CPU tensor cannot reach Triton
        mixer.backend = "auto"
        assert not mixer.takes_small_head(x[:, None], None)
        mixer.backend = "small_head"
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="runs on CUDA"):
            mixer(x, mask)


@pytest.mark.parametrize(("device", "dtype", "d_head", "takes"), [
    ("cuda", torch.bfloat16, 4, True), ("cuda", torch.float16, 12, True), ("cuda", torch.bfloat16, 32 + 4, False),
    ("cuda", torch.bfloat16, 8, False), ("cuda", torch.bfloat16, 16, False), ("cuda", torch.float32, 4, False),
    ("cuda", torch.float64, 4, False), ("cpu", torch.bfloat16, 4, False)])
def test_auto_takes_the_small_head_kernels_for_16_bit_cuda_heads_that_sdpa_would_pad(device, dtype, d_head, takes):
    """"auto"'s choice, pinned: the kernels where SDPA would pad the head (off a multiple of 8, up to 32), for the
    bf16/fp16 rows autocast gives on CUDA; SDPA for fp32 and float64 (the compile check's reference copy), on the
    CPU, and for packed rows."""
    q = SimpleNamespace(is_cuda=device == "cuda", dtype=dtype, shape=(2, 4, 10, d_head))
    assert small_heads_suit(q) is takes
    mixer = create_model("transformer", d_model=32, n_heads=4, d_qkv=16, dropout=0.0, max_len=10)
    assert mixer.takes_small_head(q, None) is takes and not mixer.takes_small_head(q, torch.zeros(2, 10))


def test_the_transformers_dropout_follows_the_run_seed():
    x = torch.randn(1, 40, 32, device=DEVICE)
    mask = torch.ones(1, 40, dtype=torch.bool, device=DEVICE)
    a, _, mixer = transformer_outputs("small_head", x, mask, train=True)
    b, _, _ = transformer_outputs("small_head", x, mask, train=True)  # the same torch seed: the same mask
    torch.manual_seed(1)
    c = mixer(x, mask)[mask].detach()
    assert torch.equal(a, b) and not torch.allclose(a, c)


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
def test_at_pathfinders_shape_in_bf16_the_kernels_meet_sdpa(masked):
    """LRA's Pathfinder layer shape (batch 512, 4 heads of 4, N 1024) in bf16 without dropout, against SDPA (the
    transformer's path, head padded to 8), both against float32 SDPA from the same bf16 inputs: the kernels' error is
    no more than 1.5x SDPA's plus bf16's rounding."""
    B, H, N, D = 512, 4, 1024, 4
    q, k, v, grad, keep = inputs(B, H, N, N, D, padded=(0, 3) if masked else ())

    def sdpa(q, k, v):
        q, k, v = (F.pad(t, (0, 4)) for t in (q, k, v))
        mask = None if keep is None else keep[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5)[..., :D]

    exact = out_and_grads(sdpa, *(t.bfloat16().float() for t in (q, k, v)), grad, torch.float32)
    ours = relative_errors(out_and_grads(lambda *x: small_head_attention(*x, keep), q, k, v, grad, torch.bfloat16),
                           exact)
    theirs = relative_errors(out_and_grads(sdpa, q, k, v, grad, torch.bfloat16), exact)
    assert all(a < 1.5 * b + 4e-3 for a, b in zip(ours, theirs)), (ours, theirs)


@pytest.mark.gpu
def test_on_the_gpu_dropout_is_the_references():
    """The GPU's hash is the reference's bit for bit, and with dropout the kernels meet float64 attention with that
    mask at N 1024 (bf16 inputs, 4 heads of 4)."""
    for p in (0.1, 0.5):
        assert torch.equal(kernel_keep_mask(SEED, 7, 1024, 1024, p, DEVICE).cpu(),
                           dropout_keep_mask(SEED, 7, 1024, 1024, p))
    errors, _ = errors_against_the_reference((2, 4, 1024, 1024, 4), torch.bfloat16, 0.1, padded=(1,))
    assert max(errors) < TOLERANCE[torch.bfloat16], errors


HOPPER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import models._small_head as kernels

IN_DTYPE = {"Q", "K", "V", "OUTPUT", "DO", "DQ", "DK", "DV"}
TYPES = {"KEEP": "*i8", "SEED": "*i64", "OUT": "*i8", "c": "fp32", "scale": "fp32", "inv_keep": "fp32",
         "thresh": "u32"}
for D, value, op, extras in ((4, "*bf16", 1, (True, True)), (32, "*bf16", 1, (False, True)),
                             (2, "*fp16", 2, (True, False)), (16, "*fp32", 0, (False, False))):
    for name, fn in (("forward", kernels._forward), ("dkdv", kernels._backward_dkdv), ("dq", kernels._backward_dq)):
        block_m, block_n, warps = kernels.TILES[name]
        meta = dict(D=D, DP=max(16, D), BLOCK_M=block_m, BLOCK_N=block_n, HAS_MASK=extras[0], DROPOUT=extras[1], OP=op)
        if "DL" in fn.arg_names:
            meta["DL"] = triton.next_power_of_2(D)
        signature = {arg: "constexpr" if arg in meta else value if arg in IN_DTYPE else TYPES.get(arg)
                     or ("*fp32" if arg in ("LSE", "DELTA") else "i32") for arg in fn.arg_names}
        triton.compile(ASTSource(fn, signature, constexprs=meta), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
fn = kernels._keep_mask
signature = {arg: "constexpr" if arg.startswith("BLOCK") else TYPES.get(arg, "i32") for arg in fn.arg_names}
triton.compile(ASTSource(fn, signature, constexprs=dict(BLOCK_M=32, BLOCK_N=32)), target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


test_the_kernels_compile_for_a_hopper_gpu = compiles_for_hopper(HOPPER_COMPILE, """
    The interpreter runs what the GPU compiler may refuse: compile every kernel for sm_90 here, with the ptxas
    that comes with triton, at the default tiles, for 16-bit and fp32 inputs, with and without mask and dropout.""")
