"""The performer's Triton kernels (models/_favor_triton.py) against its PyTorch path: on the CPU through Triton's
interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets before triton is imported), or on a GPU."""
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton; CI installs it with .[dev])")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter is off (tests/conftest.py sets TRITON_INTERPRET=1 on machines "
                "without nvidia-smi)", allow_module_level=True)

from models._favor import favor_attention
from models._favor_triton import favor_attention_triton, favor_forward_op
from models.registry import create_model
from tests.conftest import compiles_for_hopper
from tests.mixer_checks import out_and_grads, relative_errors

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parent.parent


def inputs(B, H, N, D, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(B, H, N, D, generator=g) * s for s in (0.8, 1.0, 1.0, 1.0))
    keep = torch.ones(B, 1, N, 1, dtype=torch.bool)
    keep[0, :, N - 7:] = False  # the first example is padded
    if B > 2:
        keep[2] = False  # and the third has no real key at all
    w = torch.randn(m, D, generator=g) * D**-0.25
    return [t.to(DEVICE) for t in (q, k, v, keep, w, grad)]


# (B, H, N, Dh, m): head sizes and feature counts that are not powers of two, or under tl.dot's 16 (padded in
# the kernels); lengths that end mid-tile; m 256 in chunks of features; one head and a long sequence, so that the
# sums over the sequence are split among programs; LRA's ListOps performer, with 2 features
SHAPES = [(3, 2, 70, 12, 24), (1, 1, 200, 64, 256), (2, 2, 33, 4, 40), (1, 1, 300, 12, 24), (3, 1, 50, 64, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernels_equal_the_pytorch_path_in_fp32(shape):
    q, k, v, keep, w, grad = inputs(*shape)
    reference = out_and_grads(lambda *x: favor_attention(*x, keep, w.double()), q, k, v, grad, torch.float64)
    ours = out_and_grads(lambda *x: favor_attention_triton(*x, keep, w), q, k, v, grad, torch.float32)
    assert max(relative_errors(ours, reference)) < 1e-5, relative_errors(ours, reference)
    if shape[0] > 2:  # an example without real keys reads nothing: output 0, finite gradients
        assert ours[0][2].abs().max() == 0 and all(torch.isfinite(t).all() for t in ours)


# each length spans at least two blocks of positions, the last one ragged (the interpreter's time grows with the
# number of programs: 40 positions at the 16 x 16 tiles, not 150, are 3 blocks, not 10, at a third of the time)
@pytest.mark.heavy  # CI's second tier: Triton's interpreter over several tilings
@pytest.mark.parametrize("block,chunk,n", [(16, 16, 40), (32, 64, 150), (128, 32, 150)])
def test_any_tile_setting_gives_the_same_answer(monkeypatch, block, chunk, n):
    """The tiles (positions and features per program) are a speed setting, tuned per card: none changes the
    answer (m 96 in chunks of 16, 32 or 64, the last of them ragged at 64)."""
    from models import _favor_triton

    monkeypatch.setattr(_favor_triton, "BLOCK", block)
    monkeypatch.setattr(_favor_triton, "CHUNK", chunk)
    q, k, v, keep, w, grad = inputs(3, 1, n, 32, 96)
    reference = out_and_grads(lambda *x: favor_attention(*x, keep, w.double()), q, k, v, grad, torch.float64)
    ours = out_and_grads(lambda *x: favor_attention_triton(*x, keep, w), q, k, v, grad, torch.float32)
    assert max(relative_errors(ours, reference)) < 1e-5, relative_errors(ours, reference)


def test_bf16_values_cost_no_more_accuracy_than_in_the_pytorch_path():
    """Products with bf16 operands, fp32 elsewhere, as the PyTorch path: against fp64, errors of the same size
    (both round q, k, v to bf16 first, which is most of it)."""
    q, k, v, keep, w, grad = inputs(2, 2, 100, 64, 256)
    reference = out_and_grads(lambda *x: favor_attention(*x, keep, w.double()), q, k, v, grad, torch.float64)
    ours = relative_errors(out_and_grads(lambda *x: favor_attention_triton(*x, keep, w), q, k, v, grad,
                                         torch.bfloat16), reference)
    pytorch = relative_errors(out_and_grads(lambda *x: favor_attention(*x, keep, w), q, k, v, grad,
                                            torch.bfloat16), reference)
    assert max(ours) < 0.02, ours
    assert all(a < 1.5 * b for a, b in zip(ours, pytorch)), (ours, pytorch)


def test_the_ops_are_registered_for_autograd_and_compilation():
    q, k, v, keep, w, _ = inputs(1, 2, 40, 12, 24)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    keep = keep.reshape(1, 40).to(torch.int8)
    report = torch.library.opcheck(favor_forward_op, (q, k, v, keep, w))
    assert set(report.values()) == {"SUCCESS"}, report


def test_the_performer_takes_the_kernels_when_told_and_computes_the_same(monkeypatch):
    torch.manual_seed(0)
    mixer = create_model("performer", d_model=32, n_heads=2, d_qkv=32, dropout=0.0, max_len=64).to(DEVICE)
    x = torch.randn(2, 50, 32, device=DEVICE)
    mask = torch.ones(2, 50, dtype=torch.bool, device=DEVICE)
    mask[1, 30:] = False
    results = {}
    for backend in ("triton", "torch"):
        mixer.backend = backend
        xb = x.clone().requires_grad_()
        out = mixer(xb, mask)
        out[mask].sum().backward()
        results[backend] = (out[mask].detach(), xb.grad)
    for a, b in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    mixer.backend = "triton"
    with pytest.raises(ValueError, match="unpacked rows only"):
        mixer(x, mask, segments=mask.long())
    if DEVICE.type == "cpu":  # without the interpreter, a CPU tensor cannot reach the kernels
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="runs on CUDA"):
            mixer(x, mask)


HOPPER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import models._favor_triton as kernels

IN_DTYPE = {"Q", "K", "V", "G", "OUT", "DQ", "DK", "DV"}  # tensors in the inputs' dtype; KEEP int8; the rest fp32
SIZES = {"H", "N", "D", "M"}  # the other upper-case arguments, integers
for meta in (dict(BLOCK=kernels.BLOCK, DP=64, MP=256, MC=kernels.CHUNK, BF16=1, F32="tf32"),
             dict(BLOCK=kernels.BLOCK, DP=16, MP=32, MC=32, BF16=0, F32="ieee")):
    value = "*bf16" if meta["BF16"] else "*fp32"
    for fn in (kernels._keys_forward, kernels._queries_forward, kernels._queries_backward,
               kernels._summaries_backward, kernels._keys_backward):
        signature = {name: "constexpr" if name in meta else value if name in IN_DTYPE else "*i8" if name == "KEEP"
                     else "*fp32" if name.isupper() and name not in SIZES else "fp32" if name == "inv_sqrt_d" else "i32"
                     for name in fn.arg_names}
        triton.compile(ASTSource(fn, signature, constexprs=meta), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": kernels.WARPS})
print("compiled")
"""


test_the_kernels_compile_for_a_hopper_gpu = compiles_for_hopper(HOPPER_COMPILE, """
    The interpreter runs what the GPU compiler may refuse (a global that is not constexpr did): compile every
    kernel for sm_90 here, with the ptxas that comes with triton, at the default tiles and at small sizes.""")
