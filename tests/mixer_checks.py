"""Checks several model test files share: one implementation each, called with each model's own settings."""
from __future__ import annotations

import copy

import torch


def lengths_mask(lengths: list[int], n: int) -> torch.Tensor:
    """(B, n) bool, True for the first ``lengths[b]`` positions of row b."""
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


def assert_appended_padding_changes_nothing(model, lengths: list[int], n: int, extra: int, d: int) -> None:
    """Real outputs stay the same when padding (with junk in it) is appended and the old padding holds other junk."""
    x = torch.randn(len(lengths), n, d)
    y = model(x, lengths_mask(lengths, n))
    x_long = torch.cat([x, torch.randn(len(lengths), extra, d)], dim=1)  # new padding with junk in it
    x_long[1, lengths[1]:] = torch.randn(n + extra - lengths[1], d) * 10  # and other junk in the old padding
    y_long = model(x_long, lengths_mask(lengths, n + extra))
    for b, length in enumerate(lengths):
        torch.testing.assert_close(y_long[b, :length], y[b, :length], atol=1e-5, rtol=1e-4)


def assert_fully_masked_rows_are_zero_with_finite_gradients(model, x, mask, masked_row: int, **inputs) -> None:
    """A row that sees no key at all (all masked) outputs 0 (no bias downstream), and no NaN reaches any gradient."""
    x = x.clone().requires_grad_()
    out = model(x, mask, **inputs)
    out.sum().backward()
    assert out.isfinite().all() and x.grad.isfinite().all()
    assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    assert (out[masked_row] == 0).all()


def assert_fast_scan_matches_chunked(model, d: int, ragged) -> None:
    """On CUDA: the model's fla kernels against its fp32 chunked form, outputs and every gradient, then bf16."""
    import pytest

    from models._scan import fla_refused

    reason = fla_refused(torch.cuda.current_device())
    if reason is not None:
        pytest.skip(reason)
    ref = copy.deepcopy(model)
    ref.scan = "chunked"
    x = torch.randn(2, 300, d, device="cuda", requires_grad=True)
    mask = ragged([300, 170], 300).cuda()
    cot = torch.randn(2, 300, d, device="cuda") * mask[..., None]
    outs, grads = [], []
    for m in (model, ref):
        out = m(x, mask)
        grads.append(torch.autograd.grad((out * cot).sum(), [x, *m.parameters()]))
        outs.append(out[mask])

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(outs[0], outs[1]) < 1e-2
    for name, a, b in zip(["x", *(n for n, _ in model.named_parameters())], *grads):
        assert rel(a, b) < 2e-2, name
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert rel(model(x, mask)[mask].float(), outs[1]) < 5e-2


def dense_masked_attention(mixer, x: torch.Tensor, mask: torch.Tensor | None, allowed: torch.Tensor) -> torch.Tensor:
    """Full softmax attention with ``mixer``'s projections (``project``, ``out``) under ``allowed`` (N, N) and the
    key mask: the dense reference of a sparse pattern. A row with no key gives 0."""
    B, N, _ = x.shape
    q, k, v = mixer.project(x)  # each (B, H, N, Dh)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, N, N)
    see = allowed[None, None] if mask is None else allowed[None, None] & mask[:, None, None, :]  # (B or 1, 1, N, N)
    weights = scores.masked_fill(~see, float("-inf")).softmax(-1).nan_to_num(0.0)  # (B, H, N, N)
    return mixer.out((weights @ v).transpose(1, 2).reshape(B, N, -1))  # (B, N, D)
