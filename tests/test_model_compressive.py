"""Compressive Transformer: Transformer-XL without compressed memory, the slots against explicit formulas (mean,
conv, padding), the whole layer against a per-segment dense reference, the compressed memory's span."""
from __future__ import annotations

import math

import pytest
import torch

from models import create_model

D, H, S, C = 32, 2, 8, 4  # width, heads, segment, compression rate


def build(name: str = "compressive", **options):
    torch.manual_seed(0)
    return create_model(name, d_model=D, n_heads=H, d_qkv=D, dropout=0.0, max_len=128, **options).eval()


def lengths_mask(lengths: list[int], n: int) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, n)


def paper_sinusoid(p: torch.Tensor, d: int) -> torch.Tensor:
    angle = p[..., None].double() / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    return torch.cat([angle.sin(), angle.cos()], dim=-1).float()  # (..., d)


def explicit_slots(model, x, mask):
    """Slot s of f_c over states s c ... s c + c - 1, written out: the mean of the real ones, or
    bias + sum_tap W[:, :, tap] x_tap with padded states zero. (B, N, D) -> (B, N / c, D), (B, N / c)."""
    B, N, _ = x.shape
    groups = (x * mask[..., None]).view(B, N // C, C, D)  # (B, N / c, c, D)
    real = mask.view(B, N // C, C)  # (B, N / c, c)
    if model.compression == "mean":
        slots = groups.sum(2) / real.sum(-1, keepdim=True).clamp_min(1)
    else:
        slots = torch.einsum("oit,bsti->bso", model.conv.weight, groups) + model.conv.bias
    return slots, real.any(-1)


def segment_reference(model, x, mask):
    """Segment by segment (a loop, for the test only): queries of segment t over the explicit slots of the
    segments before t - M (the last n_cm of them), the M memory segments and the segment itself, all one
    sequence of positions, scored with the paper's relative terms. (B, N, D), N a multiple of S -> same."""
    B, N, _ = x.shape
    M, ncm = model.memory, model.compressed_memory
    slots, slot_keep = explicit_slots(model, x, mask)
    outs = []
    for t in range(N // S):
        first_slot = max(0, (t - M) * S // C - ncm)
        evicted = slice(first_slot, max(0, (t - M) * S // C))
        context = slice(max(0, t - M) * S, (t + 1) * S)
        states = torch.cat([slots[:, evicted], x[:, context]], dim=1)  # (B, L, D)
        keep = torch.cat([slot_keep[:, evicted], mask[:, context]], dim=1)  # (B, L)
        L = states.shape[1]
        q = model.project(x[:, t * S:(t + 1) * S])[0]  # (B, H, S, Dh)
        k, v = model.project_kv(states)  # (B, H, L, Dh)
        pos = torch.arange(L)
        dist = (L - S + torch.arange(S))[:, None] - pos[None, :]  # (S, L)
        r = model.r_net(paper_sinusoid(dist, D)).view(S, L, H, -1)  # (S, L, H, Dh)
        scores = (torch.einsum("bhid,bhjd->bhij", q + model.u[:, None, :], k)
                  + torch.einsum("bhid,ijhd->bhij", q + model.v[:, None, :], r)) / math.sqrt(D // H)
        p = scores.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(-1)
        outs.append(p @ v)  # (B, H, S, Dh)
    o = torch.cat(outs, dim=2)  # (B, H, N, Dh)
    return model.out(o.transpose(1, 2).reshape(B, N, -1))


@pytest.mark.parametrize("compression", ["conv", "mean"])
@pytest.mark.parametrize("n", [4 * S, 2 * S])  # with evicted segments; and too short for any
def test_without_compressed_memory_it_is_transformer_xl(compression, n):
    xl = build("transformer_xl", segment=S, memory=1)
    off = build(segment=S, memory=1, compressed_memory=0, compression_rate=C, compression=compression)
    unused = build(segment=S, memory=1, compressed_memory=4, compression_rate=C, compression=compression)
    for model in (off, unused):
        missing, unexpected = model.load_state_dict(xl.state_dict(), strict=False)
        assert not unexpected and all(key.startswith("conv.") for key in missing)
    x, mask = torch.randn(2, n, D), lengths_mask([n, n - 5], n)
    with torch.no_grad():
        torch.testing.assert_close(off(x, mask), xl(x, mask), rtol=0, atol=0)
        if n <= 2 * S:  # memory 1: no segment of two has evicted states yet, so the slots change nothing
            torch.testing.assert_close(unused(x, mask), xl(x, mask), rtol=0, atol=0)


def test_mean_slots_are_the_means_of_the_real_states_and_padding_only_slots_are_masked():
    model = build(segment=S, compression_rate=C, compression="mean")
    x = torch.randn(1, 4 * C, D)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    slots, keep = model.compress(x, mask)
    want = torch.stack([x[0, 0:4].mean(0), x[0, [4, 6]].mean(0), torch.zeros(D), x[0, 12:16].mean(0)])
    torch.testing.assert_close(slots[0], want)
    assert keep.tolist() == [[True, True, False, True]]  # the slot of padding only is masked


def test_conv_slots_see_zeros_for_padding_and_start_as_mean_pooling():
    model = build(segment=S, compression_rate=C, compression="conv")
    x = torch.randn(1, 2 * C, D)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 1]], dtype=torch.bool)
    with torch.no_grad():
        slots, keep = model.compress(x, mask)
        torch.testing.assert_close(slots[0], torch.stack([x[0, 0:4].mean(0), (x[0, 4] + x[0, 7]) / C]))  # init
        model.conv.weight.normal_()
        model.conv.bias.normal_()
        slots, keep = model.compress(x, mask)
        x_junk = x.clone()
        x_junk[0, 5:7] = 1e3  # junk in the padded states changes nothing
        torch.testing.assert_close(model.compress(x_junk, mask)[0], slots)
    torch.testing.assert_close(slots, explicit_slots(model, x, mask)[0], atol=1e-5, rtol=1e-5)
    assert keep.all()


@pytest.mark.parametrize("backend", ["explicit", "sdpa"])  # Transformer-XL's two executions of the window
@pytest.mark.parametrize("compression", ["conv", "mean"])
@pytest.mark.parametrize("memory,ncm", [(2, 3), (1, 6)])  # n_cm less than a segment's slots, more
def test_layer_equals_the_per_segment_dense_reference(compression, memory, ncm, backend):
    model = build(segment=S, memory=memory, compressed_memory=ncm, compression_rate=C, compression=compression)
    model.backend = backend
    with torch.no_grad():  # a conv that is not the mean pooling it starts as
        if model.conv is not None:
            model.conv.weight.mul_(torch.rand_like(model.conv.weight) + 0.5)
    x = torch.randn(2, 6 * S, D)
    mask = lengths_mask([6 * S, 4 * S + 3], 6 * S)
    mask[0, 1:3] = False  # holes in an evicted segment: a partly padded slot
    with torch.no_grad():
        got, want = model(x, mask), segment_reference(model, x, mask)
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-4)


def test_compressed_memory_reaches_back_exactly_its_span():
    """Memory 1 and n_cm = S / c slots: the segment 2 back is seen (compressed); 3 back is not."""
    model = build(segment=S, memory=1, compressed_memory=S // C, compression_rate=C)
    x = torch.randn(1, 4 * S, D)
    mask = torch.ones(1, 4 * S, dtype=torch.bool)
    with torch.no_grad():
        base = model(x, mask)[:, 3 * S:]
        for back, seen in ((2, True), (3, False)):
            x2 = x.clone()
            x2[:, (3 - back) * S:(4 - back) * S] = torch.randn(1, S, D)
            assert (not torch.allclose(model(x2, mask)[:, 3 * S:], base, atol=1e-6)) is seen


def test_compression_learns_from_the_task_loss_but_earlier_states_get_no_gradient():
    model = build(segment=S, memory=1, compressed_memory=S // C, compression_rate=C).train()
    x = torch.randn(1, 3 * S, D, requires_grad=True)
    model(x, torch.ones(1, 3 * S, dtype=torch.bool))[:, 2 * S:].sum().backward()  # the last segment only
    assert torch.equal(x.grad[:, :2 * S], torch.zeros_like(x.grad[:, :2 * S]))
    assert model.conv.weight.grad.abs().sum() > 0 and model.conv.bias.grad.abs().sum() > 0


def test_appended_padding_changes_nothing_with_compressed_memory():
    model = build(segment=S, memory=1, compressed_memory=4, compression_rate=C, compression="conv")
    x = torch.randn(2, 45, D)
    lengths = [45, 30]
    with torch.no_grad():
        y = model(x, lengths_mask(lengths, 45))
        x_long = torch.cat([x, torch.randn(2, 27, D) * 10], dim=1)
        x_long[1, 30:45] = torch.randn(15, D) * 10
        y_long = model(x_long, lengths_mask(lengths, 72))
    for b, n in enumerate(lengths):
        torch.testing.assert_close(y_long[b, :n], y[b, :n], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("options", [{"compression_rate": 3}, {"compression_rate": 0}, {"compressed_memory": -1},
                                     {"compression": "max"}])
def test_invalid_options_are_refused(options):
    with pytest.raises(ValueError):
        build(**{"segment": S, **options})
