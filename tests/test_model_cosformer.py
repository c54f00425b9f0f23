"""cosFormer: the linear (cos/sin decomposed) form against the explicit quadratic formula, with padding, for
both choices of M; the M -> infinity limit; zero-kernel queries; autocast."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models import create_model

BACKBONE = {"d_model": 32, "n_heads": 2, "d_qkv": 32, "dropout": 0.0, "max_len": 64}


def ragged_mask(N: int, lengths: list[int]) -> torch.Tensor:
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]  # (B, N)


def quadratic_cosformer(q, k, v, mask, m):
    """out_i = sum_j relu(q_i).relu(k_j) cos(pi/2 (i - j)/M) v_j / max(sum_j (...), 1e-6) over real keys j,
    one example at a time, M = m[b]; (B, H, N, Dh)."""
    B, _, N, _ = q.shape
    out = torch.empty_like(v)
    i = torch.arange(N, dtype=q.dtype)
    for b in range(B):
        w = F.relu(q[b]) @ F.relu(k[b]).transpose(-1, -2)  # (H, N, N)
        w = w * torch.cos(math.pi / 2 * (i[:, None] - i[None, :]) / m[b])  # (H, N, N)
        w = w * mask[b][None, None, :]  # (H, N, N): padded keys out
        out[b] = (w @ v[b]) / w.sum(-1, keepdim=True).clamp_min(1e-6)  # (H, N, Dh)
    return out


@pytest.mark.parametrize("reweight_length", ["real", "max_len"])
def test_linear_form_equals_the_quadratic_formula_with_padding(reweight_length):
    torch.manual_seed(0)
    model = create_model("cosformer", **BACKBONE, reweight_length=reweight_length).double()
    x = torch.randn(3, 40, 32, dtype=torch.float64)
    lengths = [40, 23, 5]
    mask = ragged_mask(40, lengths)
    m = lengths if reweight_length == "real" else [64] * 3
    q, k, v = model.project(x)  # (B, H, N, Dh)
    o = quadratic_cosformer(q, k, v, mask, m)  # (B, H, N, Dh)
    want = model.out(o.transpose(1, 2).reshape(3, 40, 32))  # (B, N, D)
    got = model(x, mask)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(got[b, :n], want[b, :n], rtol=1e-10, atol=1e-10)


def test_m_is_the_last_real_position_so_holes_do_not_shorten_it():
    """With holes in the mask M is the position of the last real token, not the count of real ones: the
    weights stay positive for every pair of real tokens."""
    torch.manual_seed(0)
    model = create_model("cosformer", **BACKBONE).double()
    x = torch.randn(1, 30, 32, dtype=torch.float64)
    mask = torch.rand(1, 30) > 0.5
    mask[0, 25:] = False
    mask[0, 24] = True
    q, k, v = model.project(x)
    want = quadratic_cosformer(q, k, v, mask, [25])
    real = mask[0]  # (N,)
    torch.testing.assert_close(model.attend(q, k, v, mask)[0][:, real], want[0][:, real], rtol=1e-10, atol=1e-10)


def test_without_decay_it_is_relu_linear_attention():
    """M -> infinity: cos -> 1, the plain ReLU-kernel linear attention (and with M = N the decay matters)."""
    torch.manual_seed(0)
    far = create_model("cosformer", **{**BACKBONE, "max_len": 10**7}, reweight_length="max_len").double()
    x = torch.randn(2, 50, 32, dtype=torch.float64)
    mask = ragged_mask(50, [50, 31])
    q, k, v = far.project(x)
    w = (F.relu(q) @ F.relu(k).transpose(-1, -2)) * mask[:, None, None, :]  # (B, H, N, N)
    plain = (w @ v) / w.sum(-1, keepdim=True).clamp_min(1e-6)  # (B, H, N, Dh)
    real = mask[:, None, :, None].expand_as(plain)  # (B, H, N, Dh)
    torch.testing.assert_close(far.attend(q, k, v, mask)[real], plain[real], rtol=1e-6, atol=1e-8)
    near = create_model("cosformer", **BACKBONE).double()
    assert (near.attend(q, k, v, mask)[real] - plain[real]).abs().max() > 1e-3


def test_a_query_with_no_positive_feature_gives_zero_not_nan():
    model = create_model("cosformer", **BACKBONE)
    q, k, v = (torch.randn(1, 2, 10, 16) for _ in range(3))
    q[:, :, 3] = -q[:, :, 3].abs()  # relu(q_3) = 0: numerator and normaliser are both 0
    out = model.attend(q, k, v, torch.ones(1, 10, dtype=torch.bool))
    assert torch.isfinite(out).all() and (out[:, :, 3] == 0).all()


def test_bf16_autocast_keeps_the_sums_in_fp32():
    torch.manual_seed(0)
    model = create_model("cosformer", **BACKBONE)
    x = torch.randn(2, 60, 32)
    mask = ragged_mask(60, [60, 9])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float()[mask], model(x, mask)[mask], atol=0.05, rtol=0.05)
    assert (out[~mask] == 0).all()  # padded queries output exactly 0 (the projections have no bias)


def test_max_len_mode_refuses_longer_inputs():
    model = create_model("cosformer", **BACKBONE, reweight_length="max_len")
    with pytest.raises(ValueError, match="at most 64"):
        model(torch.randn(1, 65, 32), torch.ones(1, 65, dtype=torch.bool))
