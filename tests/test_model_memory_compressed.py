"""Method-specific tests for memory_compressed (CPU, small sizes)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models import create_model

D, H = 32, 2
DH = D // H


def build(max_len: int = 96, **options):
    torch.manual_seed(0)
    return create_model("memory_compressed", d_model=D, n_heads=H, d_qkv=D, dropout=0.0, max_len=max_len,
                        **options).eval()


def lengths_mask(lengths: list[int], n: int) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, n)


def set_kernel(model, tap_weight: float) -> None:
    """Every tap of the K and V kernels = tap_weight * identity: 1 with c = 1 is the identity, 1/c the slot mean."""
    with torch.no_grad():
        model.kernel.copy_(torch.eye(D) * tap_weight)  # (2, c, D, D): [K | V, tap, in, out]


def attention(model, q, k, v, key_mask) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh)) v over the unmasked keys, then the out projection; key_mask (B, 1, Nq or 1, Nk)."""
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(DH)  # (B, H, Nq, Nk)
    o = scores.masked_fill(~key_mask, float("-inf")).softmax(-1) @ v  # (B, H, Nq, Dh)
    B, _, N, _ = o.shape
    return model.out(o.transpose(1, 2).reshape(B, N, D))  # (B, N, D)


def assert_padding_invariant(model, n: int = 41, extra: int = 29):
    """Appending padding and changing padded content leave outputs at real positions unchanged."""
    torch.manual_seed(1)
    lengths = [n, n - 12]  # 41 and 29: neither a multiple of 3 or 4, so the last slot is partial
    x = torch.randn(2, n, D)
    y = model(x, lengths_mask(lengths, n))
    x_long = torch.cat([x, torch.randn(2, extra, D)], dim=1)  # appended padding with arbitrary content
    x_long[1, lengths[1]:] = torch.randn(n + extra - lengths[1], D) * 10  # and other junk in the old padding
    y_long = model(x_long, lengths_mask(lengths, n + extra))
    for b, length in enumerate(lengths):
        torch.testing.assert_close(y_long[b, :length], y[b, :length], atol=1e-5, rtol=1e-4)


def test_compression_1_with_identity_conv_is_full_attention():
    """c = 1 and identity kernels: every key is its own slot, so the output is the transformer's formula (padded
    queries included: they see the same real keys)."""
    model = build(compression=1)
    set_kernel(model, 1.0)
    x = torch.randn(2, 37, D)
    mask = lengths_mask([37, 22], 37)
    q, k, v = model.project(x)  # (B, H, N, Dh)
    expected = attention(model, q, k, v, mask[:, None, None, :])
    torch.testing.assert_close(model(x, mask), expected, atol=1e-5, rtol=1e-4)


def test_compression_1_with_identity_conv_and_blocks_is_local_attention():
    """The same with local_block = 8: attention restricted to each token's block (the paper's L layer)."""
    model = build(compression=1, local_block=8)
    set_kernel(model, 1.0)
    x = torch.randn(2, 37, D)
    mask = lengths_mask([37, 22], 37)
    q, k, v = model.project(x)  # (B, H, N, Dh)
    block = torch.arange(37) // 8  # (N,)
    same_block = block[:, None] == block[None, :]  # (N, N)
    expected = attention(model, q, k, v, mask[:, None, None, :] & same_block)
    torch.testing.assert_close(model(x, mask)[mask], expected[mask], atol=1e-5, rtol=1e-4)


def test_mean_kernels_give_attention_over_slot_means():
    """c = 3 with kernels I/3: a slot is the mean of its 3 keys (values), the last partial slot is zero-extended
    ([k, k', 0] / 3), and slots of only padding are masked."""
    model = build(compression=3)
    set_kernel(model, 1.0 / 3)
    n, lengths = 41, [41, 26]
    x = torch.randn(2, n, D)
    mask = lengths_mask(lengths, n)
    q, k, v = model.project(x)  # (B, H, N, Dh)
    keep = mask[:, None, :, None]  # (B, 1, N, 1)
    k, v = (F.pad(t * keep, (0, 0, 0, 1)) for t in (k, v))  # (B, H, 42, Dh): zero-extended to 14 whole slots
    k, v = (t.view(2, H, 14, 3, DH).mean(3) for t in (k, v))  # (B, H, 14, Dh)
    slot_real = torch.arange(14)[None, :] * 3 < torch.tensor(lengths)[:, None]  # (B, 14): first token is real
    expected = attention(model, q, k, v, slot_real[:, None, None, :])
    torch.testing.assert_close(model(x, mask)[mask], expected[mask], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("local_block", [41, 45, 96])
def test_one_block_covering_everything_is_the_global_version(local_block):
    glob = build(compression=3)
    local = build(compression=3, local_block=local_block)
    local.load_state_dict(glob.state_dict())
    x = torch.randn(2, 41, D)
    mask = lengths_mask([41, 29], 41)
    torch.testing.assert_close(local(x, mask), glob(x, mask), atol=1e-5, rtol=1e-4)
    smaller = build(compression=3, local_block=12)  # and the test can tell: smaller blocks differ
    smaller.load_state_dict(glob.state_dict())
    assert not torch.allclose(smaller(x, mask)[mask], glob(x, mask)[mask], atol=1e-3)


def test_slot_mask_marks_slots_of_only_padding():
    model = build(compression=3, local_block=9)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]], dtype=torch.bool)  # (1, 20)
    _, real = model.compress_kv(torch.randn(1, 20, 2 * D), mask, 9)  # blocks of 3 slots; the last is zero-extended
    # block 0: [real, pad, partial]; block 1: only padding (its padded queries see all slots, never none);
    # block 2: tokens 18, 19 and 7 zeros: [partial, zeros, zeros]
    assert real.tolist() == [[True, False, True], [True, True, True], [True, False, False]]


@pytest.mark.parametrize("local_block", [None, 18])
def test_a_slot_of_only_padding_gets_no_weight(local_block):
    """A whole slot of padding (junk inside) in the middle of the sequence: deleting it leaves every real output
    unchanged. If it took any weight (its key and value are 0, so exp(0) / Z of it), the outputs would move,
    as they do once the slot mask is bypassed."""
    model = build(compression=3, local_block=local_block)
    a, hole, b = torch.randn(1, 6, D), torch.randn(1, 3, D) * 10, torch.randn(1, 7, D)
    x_hole = torch.cat([a, hole, b], dim=1)  # (1, 16, D): slots [a a][hole][b b b]
    mask_hole = torch.tensor([[True] * 6 + [False] * 3 + [True] * 7])  # (1, 16)
    x_gone = torch.cat([a, b], dim=1)  # (1, 13, D): slots [a a][b b b]
    y_hole = model(x_hole, mask_hole)[mask_hole]
    y_gone = model(x_gone, torch.ones(1, 13, dtype=torch.bool))[0]
    if local_block is None:
        torch.testing.assert_close(y_hole, y_gone, atol=1e-5, rtol=1e-4)
    else:  # blocks of 6 slots: a and b share the first block either way, the hole only adds a masked slot
        torch.testing.assert_close(y_hole[:6], y_gone[:6], atol=1e-5, rtol=1e-4)
    compress_kv = model.compress_kv

    def every_slot_real(kv, mask, block):
        kv, real = compress_kv(kv, mask, block)
        return kv, torch.ones_like(real)

    model.compress_kv = every_slot_real
    assert not torch.allclose(model(x_hole, mask_hole)[mask_hole][:6], y_hole[:6], atol=1e-4)


@pytest.mark.parametrize("compression,local_block", [(3, None), (3, 16), (4, 10), (1, 7)])
def test_appended_padding_changes_nothing_with_partial_slots_and_blocks(compression, local_block):
    assert_padding_invariant(build(compression=compression, local_block=local_block))


def test_blocks_do_not_see_each_other():
    model = build(compression=3, local_block=12)
    x = torch.randn(1, 36, D)
    mask = torch.ones(1, 36, dtype=torch.bool)
    x2 = x.clone()
    x2[:, 12:24] = torch.randn(1, 12, D)  # new content in block 1 only
    y, y2 = model(x, mask), model(x2, mask)
    torch.testing.assert_close(y2[:, :12], y[:, :12])
    torch.testing.assert_close(y2[:, 24:], y[:, 24:])
    assert not torch.allclose(y2[:, 12:24], y[:, 12:24], atol=1e-3)


def test_rows_and_blocks_of_only_padding_stay_finite():
    model = build(compression=3, local_block=8)
    x = torch.randn(2, 40, D)
    mask = lengths_mask([5, 0], 40)  # row 0: blocks 1-4 all padding; row 1: nothing real at all
    assert torch.isfinite(model(x, mask)).all()
    assert torch.isfinite(build(compression=3)(x, mask)).all()


@pytest.mark.parametrize("options", [{"compression": 0}, {"local_block": 0}])
def test_invalid_options_are_refused(options):
    with pytest.raises(ValueError, match="memory_compressed"):
        build(**options)
