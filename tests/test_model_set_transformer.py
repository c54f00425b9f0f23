"""Method-specific tests for set_transformer (CPU, small sizes)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models import create_model

D, H = 32, 2
DH = D // H


def build(**options):
    torch.manual_seed(0)
    model = create_model("set_transformer", d_model=D, n_heads=H, d_qkv=D, dropout=0.0, max_len=64, **options)
    if model.mab:  # away from LayerNorm's (1, 0) initialisation, so the reference must get them right
        with torch.no_grad():
            for p in (*model.norm0.parameters(), *model.norm1.parameters()):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def lengths_mask(lengths: list[int], n: int) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, n)


def summary(model, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """H = MAB(I, X), (B, m, D)."""
    _, k, v = model.project(x)  # (B, H, N, Dh)
    return model.induce(k, v, mask)


def multihead(queries, keys, key_mask, w_q, w_k, w_v, w_o) -> torch.Tensor:
    """Multihead(Q, K, K) one head at a time: queries (B, Nq, D), keys (B, Nk, D), key_mask (B, Nk) or None."""
    heads = []
    for h in range(H):
        rows = slice(h * DH, (h + 1) * DH)  # head h's rows of each projection
        q = queries @ w_q[rows].t()  # (B, Nq, Dh)
        k, v = keys @ w_k[rows].t(), keys @ w_v[rows].t()  # (B, Nk, Dh)
        scores = q @ k.transpose(1, 2) / math.sqrt(DH)  # (B, Nq, Nk)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, :], float("-inf"))
        heads.append(scores.softmax(-1) @ v)  # (B, Nq, Dh)
    return torch.cat(heads, dim=-1) @ w_o.t()  # (B, Nq, D)


def reference(model, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """ISAB written out: H = MAB(I, X) (or Multihead(I, X, X) without mab), out = Multihead(X, H, H)."""
    B = x.shape[0]
    w_q, w_k, w_v = model.qkv.weight.split(D)  # (D, D) each: rows of queries, keys, values
    inducing = model.inducing.expand(B, -1, -1)  # (B, m, D)
    h = multihead(inducing, x, mask, model.inducing_q.weight, w_k, w_v, model.inducing_out.weight)  # (B, m, D)
    if model.mab:
        n0, n1 = model.norm0, model.norm1
        h = F.layer_norm(inducing + h, (D,), n0.weight, n0.bias, n0.eps)
        h = F.layer_norm(h + torch.relu(h @ model.rff.weight.t() + model.rff.bias), (D,), n1.weight, n1.bias, n1.eps)
    w_hk, w_hv = model.summary_kv.weight.split(D)  # (D, D) each
    return multihead(x, h, None, w_q, w_hk, w_hv, model.out.weight)  # (B, N, D)


@pytest.mark.parametrize("mab", [True, False])
@pytest.mark.parametrize("n_inducing", [1, 7])
def test_equals_the_isab_written_out(mab, n_inducing):
    model = build(n_inducing=n_inducing, mab=mab)
    x = torch.randn(2, 30, D)
    mask = lengths_mask([30, 17], 30)
    torch.testing.assert_close(model(x, mask)[mask], reference(model, x, mask)[mask], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(model(x, None), reference(model, x, None), atol=1e-5, rtol=1e-4)


def test_permuting_the_real_tokens_permutes_the_outputs():
    """No positions of its own: H is a sum over tokens (invariant), each output reads its own token and H."""
    model = build(n_inducing=5)
    lengths = [24, 15]
    x = torch.randn(2, 24, D)
    mask = lengths_mask(lengths, 24)
    x_perm = x.clone()
    perms = [torch.randperm(n) for n in lengths]
    for b, perm in enumerate(perms):
        x_perm[b, : lengths[b]] = x[b, perm]
    y, y_perm = model(x, mask), model(x_perm, mask)
    for b, perm in enumerate(perms):
        torch.testing.assert_close(y_perm[b, : lengths[b]], y[b, perm], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(summary(model, x_perm, mask), summary(model, x, mask), atol=1e-5, rtol=1e-4)


def test_padded_tokens_never_affect_the_summary():
    """H is the same with junk in the padding, with more padding appended, and for each row alone without any."""
    model = build(n_inducing=6)
    lengths = [20, 11]
    x = torch.randn(2, 20, D)
    mask = lengths_mask(lengths, 20)
    h = summary(model, x, mask)  # (B, m, D)
    x_junk = torch.cat([x, torch.randn(2, 13, D)], dim=1)  # (B, 33, D): appended padding
    x_junk[1, lengths[1]:] = torch.randn(33 - lengths[1], D) * 10  # and junk in the old padding
    torch.testing.assert_close(summary(model, x_junk, lengths_mask(lengths, 33)), h, atol=1e-5, rtol=1e-4)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(summary(model, x[b : b + 1, :n], None)[0], h[b], atol=1e-5, rtol=1e-4)
    x_pad_changed = x.clone()
    x_pad_changed[1, lengths[1]:] += 1.0
    assert not torch.allclose(summary(model, x_pad_changed, None)[1], h[1], atol=1e-3)  # unmasked, it would move


def test_rows_of_only_padding_stay_finite():
    model = build()
    x = torch.randn(2, 12, D)
    assert torch.isfinite(model(x, lengths_mask([3, 0], 12))).all()


def test_invalid_inducing_count_is_refused():
    with pytest.raises(ValueError, match="n_inducing"):
        build(n_inducing=0)
