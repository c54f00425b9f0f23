"""Method-specific tests for linformer, reformer, sinkhorn and synthesizer (CPU, small sizes)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models import create_model
from models.reformer import PAD_LOGIT, SELF_LOGIT
from models.sinkhorn import sinkhorn

D, H = 32, 2
BACKBONE = {"d_model": D, "n_heads": H, "d_qkv": D, "dropout": 0.0}


def build(name: str, max_len: int, **options):
    torch.manual_seed(0)
    return create_model(name, **BACKBONE, max_len=max_len, **options).eval()


def lengths_mask(lengths: list[int], n: int) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, n)


def assert_padding_invariant(model, n: int = 40, extra: int = 29, atol: float = 1e-5):
    """Appending padding and changing padded content leave outputs at real positions unchanged."""
    torch.manual_seed(1)
    lengths = [n, n - 13]
    x = torch.randn(2, n, D)
    y = model(x, lengths_mask(lengths, n))
    x_long = torch.cat([x, torch.randn(2, extra, D)], dim=1)  # new padded tokens with arbitrary content
    x_long[1, lengths[1]:] = torch.randn(n + extra - lengths[1], D)  # and different content in old padding
    y_long = model(x_long, lengths_mask(lengths, n + extra))
    for b, length in enumerate(lengths):
        torch.testing.assert_close(y_long[b, :length], y[b, :length], atol=atol, rtol=1e-4)


# ---------------------------------------------------------------- reformer


def shared_qk_reference(model, x, mask):
    """Full shared-QK attention with the same conventions: unit keys, 1/sqrt(d), self logit SELF_LOGIT
    (seen only when nothing else is), padded keys PAD_LOGIT."""
    B, N, _ = x.shape
    qk, _, v = model.project(x)  # (B, H, N, Dh)
    dots = qk @ F.normalize(qk, dim=-1).transpose(-1, -2) * qk.shape[-1] ** -0.5  # (B, H, N, N)
    dots = dots.masked_fill(torch.eye(N, dtype=torch.bool), SELF_LOGIT)
    dots = dots.masked_fill(~mask[:, None, None, :], PAD_LOGIT)
    o = torch.softmax(dots, -1) @ v  # (B, H, N, Dh)
    return model.out(o.transpose(1, 2).reshape(B, N, -1))


@pytest.mark.parametrize("n_hashes", [1, 3])
def test_reformer_one_bucket_is_full_shared_qk_attention(n_hashes):
    model = build("reformer", max_len=80, n_buckets=1, n_hashes=n_hashes)
    x = torch.randn(2, 71, D)
    mask = lengths_mask([71, 50], 71)
    y, expected = model(x, mask), shared_qk_reference(model, x, mask)
    torch.testing.assert_close(y[mask], expected[mask], atol=1e-5, rtol=1e-4)  # padded queries: don't care


def test_reformer_lone_token_attends_to_itself():
    model = build("reformer", max_len=16, n_buckets=1)
    x = torch.randn(1, 5, D)
    mask = lengths_mask([1], 5)  # one real token: its only visible key is itself
    v = model.project(x)[2]  # (1, H, 5, Dh)
    expected = model.out(v[:, :, 0].reshape(1, -1))
    torch.testing.assert_close(model(x, mask)[0, 0], expected[0], atol=1e-5, rtol=1e-4)


def lsh_loop_reference(model, x, mask):
    """LSH attention written with Python loops over rounds and queries, from the hashes alone."""
    B, N, _ = x.shape
    L = model.chunk
    Np = math.ceil(N / L) * L
    xp, mp = F.pad(x, (0, 0, 0, Np - N)), F.pad(mask, (0, Np - N), value=False)
    qk, _, v = model.project(xp)
    buckets = model.hash(qk, mp)  # (B, H, R, Np)
    out = torch.zeros(B, H, N, qk.shape[-1])
    for b in range(B):
        for h in range(H):
            rounds_o, rounds_lse = [], []
            for r in range(model.n_hashes):
                order = sorted(range(Np), key=lambda i: (buckets[b, h, r, i].item(), i))
                slot = {pos: s for s, pos in enumerate(order)}
                o_r, lse_r = torch.zeros(N, qk.shape[-1]), torch.zeros(N)
                for i in range(N):
                    c = slot[i] // L
                    keys = order[c * L:(c + 1) * L] + (order[(c - 1) * L:c * L] if c > 0 else [])
                    kk = torch.stack([F.normalize(qk[b, h, j], dim=-1) for j in keys])
                    logits = kk @ qk[b, h, i] * qk.shape[-1] ** -0.5
                    for t, j in enumerate(keys):
                        if j == i:
                            logits[t] = SELF_LOGIT
                        if not mp[b, j]:
                            logits[t] = PAD_LOGIT
                    lse_r[i] = torch.logsumexp(logits, 0)
                    o_r[i] = torch.softmax(logits, 0) @ v[b, h, keys]
                rounds_o.append(o_r)
                rounds_lse.append(lse_r)
            w = torch.softmax(torch.stack(rounds_lse), 0)  # (R, N)
            out[b, h] = (w[..., None] * torch.stack(rounds_o)).sum(0)
    return model.out(out.transpose(1, 2).reshape(B, N, -1))


@pytest.mark.parametrize("n_hashes", [1, 2])  # 1: the fused SDPA path; 2: the explicit path with round weights
def test_reformer_matches_loop_reference(n_hashes):
    model = build("reformer", max_len=64, bucket_size=8, n_hashes=n_hashes)  # 8 buckets, chunks of 8
    x = torch.randn(2, 37, D)
    mask = lengths_mask([37, 22], 37)
    buckets = model.hash(model.project(x)[0], mask)
    assert buckets[mask[:, None, None, :].expand_as(buckets)].unique().numel() > 2  # hashing does split
    with torch.no_grad():
        y, expected = model(x, mask), lsh_loop_reference(model, x, mask)
    torch.testing.assert_close(y[mask], expected[mask], atol=1e-5, rtol=1e-4)


def test_reformer_hash_is_the_argmax_over_the_rotation_and_its_negation():
    """The paper's hash, argmax over [xR, -xR] (the first of equal entries), computed without building [xR, -xR]:
    the same buckets, ties included; padding takes the extra bucket."""
    model = build("reformer", max_len=64, bucket_size=8, n_hashes=2)
    qk = torch.randn(2, H, 20, model.d_head)
    qk[:, :, :3] = 0  # every entry of xR ties at 0: bucket 0
    mask = lengths_mask([20, 15], 20)
    rot = torch.einsum("bhnd,rhdc->bhrnc", qk, model.rotations)  # (B, H, R, N, nb/2)
    expected = torch.cat([rot, -rot], -1).argmax(-1).masked_fill(~mask[:, None, None, :], model.n_buckets)
    buckets = model.hash(qk, mask)
    assert torch.equal(buckets, expected) and (buckets[..., :3] == 0).all()
    assert buckets[0].unique().numel() > 4  # both halves are used


def test_reformer_padding_invariance_and_options():
    assert_padding_invariant(build("reformer", max_len=128, bucket_size=8, n_hashes=2))
    assert_padding_invariant(build("reformer", max_len=128, n_buckets=4))
    assert build("reformer", max_len=2001, n_buckets=10).chunk == 201  # LRA: 10 chunks at max_len
    with pytest.raises(ValueError, match="even"):
        build("reformer", max_len=64, n_buckets=3)


# ---------------------------------------------------------------- linformer


def test_linformer_identity_projection_is_full_attention():
    """With k = N and E = I the projected keys/values are the keys/values: plain softmax attention."""
    lin, ref = build("linformer", max_len=24, k=24), build("transformer", max_len=24)
    ref.load_state_dict({k: v for k, v in lin.state_dict().items() if k != "E"})
    with torch.no_grad():
        lin.E.copy_(torch.eye(24))
    x = torch.randn(2, 24, D)
    mask = torch.ones(2, 24, dtype=torch.bool)
    torch.testing.assert_close(lin(x, mask), ref(x, mask), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("share_kv", [True, False])
def test_linformer_shapes_slicing_and_padding(share_kv):
    model = build("linformer", max_len=100, k=8, share_kv=share_kv)
    assert model.E.shape == (100, 8)
    assert model(torch.randn(3, 37, D), torch.ones(3, 37, dtype=torch.bool)).shape == (3, 37, D)
    with pytest.raises(ValueError, match="at most 100"):
        model(torch.randn(1, 101, D), torch.ones(1, 101, dtype=torch.bool))
    assert_padding_invariant(model)


# ---------------------------------------------------------------- sinkhorn


def test_sinkhorn_operator_is_doubly_stochastic():
    P = sinkhorn(torch.randn(4, 7, 7), n_iters=30)
    torch.testing.assert_close(P.sum(-1), torch.ones(4, 7), atol=1e-4, rtol=0)
    torch.testing.assert_close(P.sum(-2), torch.ones(4, 7), atol=1e-4, rtol=0)
    assert (P >= 0).all()


def test_sinkhorn_sort_net_gets_gradients_and_balances_real_blocks():
    model = build("sinkhorn", max_len=64, block_size=8, sinkhorn_iters=30).train()
    x = torch.randn(2, 45, D)
    mask = lengths_mask([45, 30], 45)
    model(x, mask).square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # the soft permutation balances real blocks among themselves (sample 1: blocks 0-3 real, 4-5 padding)
    qkv = model.qkv(F.pad(x, (0, 0, 0, 3))).view(2, 6, 8, 3, H, D // H)
    real = F.pad(mask, (0, 3), value=False).view(2, 6, 8)
    P = model.sort_matrix(qkv[:, :, :, 1] * real[..., None, None], real)  # (B, H, 6, 6)
    torch.testing.assert_close(P.sum(-1), torch.ones(2, H, 6), atol=1e-3, rtol=0)
    torch.testing.assert_close(P.sum(-2), torch.ones(2, H, 6), atol=1e-3, rtol=0)
    assert P[1, :, :4, 4:].max() < 1e-6 and P[1, :, 4:, :4].max() < 1e-6


def test_sinkhorn_with_hard_permutation_matches_block_reference():
    """Force P to a permutation: each query block = local attention + attention to block perm[i]."""
    model = build("sinkhorn", max_len=32, block_size=8)
    perm = torch.tensor([2, 0, 3, 1])
    model.sort_matrix = lambda k, real: F.one_hot(perm, 4).float().expand(2, H, 4, 4)
    x = torch.randn(2, 32, D)
    mask = lengths_mask([32, 27], 32)
    q, k, v = model.project(x)  # (B, H, 32, Dh)
    k, v = k * mask[:, None, :, None], v * mask[:, None, :, None]
    o = torch.zeros_like(q)
    for i in range(4):
        blk, src = slice(8 * i, 8 * i + 8), slice(8 * perm[i], 8 * perm[i] + 8)
        for keys in (blk, src):
            logits = (q[:, :, blk] @ k[:, :, keys].transpose(-1, -2)) * (D // H) ** -0.5
            logits = logits.masked_fill(~mask[:, None, None, keys], float("-inf"))
            o[:, :, blk] += torch.softmax(logits, -1) @ v[:, :, keys]
    expected = model.out(o.transpose(1, 2).reshape(2, 32, D))
    torch.testing.assert_close(model(x, mask), expected, atol=1e-5, rtol=1e-4)


def test_sinkhorn_padding_invariance_and_empty_blocks():
    model = build("sinkhorn", max_len=128, block_size=8)
    assert_padding_invariant(model)
    y = model(torch.randn(2, 70, D), lengths_mask([70, 3], 70))  # sample 1: 8 of 9 blocks all padding
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("n", [64, 61], ids=["whole blocks", "a ragged last block"])
def test_sinkhorn_without_a_mask_equals_an_all_true_mask(n):
    """mask=None: whole blocks run unmasked, a ragged last block masks its internal padding; both as all-true."""
    model = build("sinkhorn", max_len=64, block_size=16, sinkhorn_iters=4)
    x = torch.randn(2, n, D, requires_grad=True)
    free = model(x, None)
    grads = torch.autograd.grad(free.square().sum(), [x, *model.parameters()])
    masked = model(x, torch.ones(2, n, dtype=torch.bool))
    torch.testing.assert_close(free, masked, atol=1e-6, rtol=1e-5)
    for g, r in zip(grads, torch.autograd.grad(masked.square().sum(), [x, *model.parameters()])):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_sinkhorn_on_cuda_without_a_mask_equals_an_all_true_mask():
    """On CUDA mask=None takes SDPA's unmasked (flash) kernels and the compiled Sinkhorn loop: same outputs."""
    model = build("sinkhorn", max_len=1024, block_size=64).cuda()
    x = torch.randn(4, 1024, D, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        free, masked = model(x, None), model(x, torch.ones(4, 1024, dtype=torch.bool, device="cuda"))
    torch.testing.assert_close(free.float(), masked.float(), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- synthesizer


def test_synthesizer_random_with_zero_R_is_transformer():
    syn, ref = build("synthesizer", max_len=40), build("transformer", max_len=40)
    ref.load_state_dict({k: v for k, v in syn.state_dict().items() if k != "R"})
    with torch.no_grad():
        syn.R.zero_()
    x = torch.randn(2, 33, D)
    mask = lengths_mask([33, 20], 33)
    torch.testing.assert_close(syn(x, mask), ref(x, mask), atol=1e-5, rtol=1e-4)


def test_synthesizer_random_without_dot_product_is_softmax_R_times_V():
    model = build("synthesizer", max_len=40, keep_dot_product=False)
    x = torch.randn(2, 33, D)
    mask = lengths_mask([33, 20], 33)
    v = model.qkv(x).view(2, 33, H, D // H).transpose(1, 2)
    logits = model.R[None, :, :33, :33].masked_fill(~mask[:, None, None, :], float("-inf"))
    expected = model.out((torch.softmax(logits, -1) @ v).transpose(1, 2).reshape(2, 33, D))
    torch.testing.assert_close(model(x, mask), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["dense", "random", "factorized_random"])
@pytest.mark.parametrize("keep_dot_product", [True, False])
def test_synthesizer_variants_padding_and_gradients(variant, keep_dot_product):
    model = build("synthesizer", max_len=80, variant=variant, keep_dot_product=keep_dot_product, factor_rank=4)
    assert_padding_invariant(model)
    model(torch.randn(2, 30, D), lengths_mask([30, 9], 30)).square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("variant", ["dense", "random", "factorized_random"])
@pytest.mark.parametrize("keep_dot_product", [True, False])
def test_synthesizer_without_a_mask_equals_an_all_true_mask(variant, keep_dot_product):
    model = build("synthesizer", max_len=40, variant=variant, keep_dot_product=keep_dot_product, factor_rank=4)
    x = torch.randn(3, 33, D)
    torch.testing.assert_close(model(x, None), model(x, torch.ones(3, 33, dtype=torch.bool)), atol=1e-6, rtol=1e-5)


def test_synthesizer_without_a_mask_drops_each_example_on_its_own():
    # without padding the random logits are one (1, H, N, N) tensor: dropout must still draw a mask per example
    torch.manual_seed(0)
    model = create_model("synthesizer", **{**BACKBONE, "dropout": 0.5}, max_len=40, keep_dot_product=False).train()
    out = model(torch.randn(1, 33, D).expand(2, -1, -1), None)  # two identical examples
    assert not torch.allclose(out[0], out[1])


def test_synthesizer_rejects_unknown_backend():
    model = build("synthesizer", max_len=8)
    model.backend = "flash"
    with pytest.raises(ValueError, match="backend"):
        model(torch.randn(1, 8, D), None)


def test_synthesizer_rejects_unknown_variant():
    with pytest.raises(ValueError, match="variant"):
        build("synthesizer", max_len=8, variant="mixture")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("options,n", [(dict(bucket_size=8), 37), (dict(bucket_size=64), 300),
                                       (dict(n_buckets=4), 200), (dict(n_buckets=1), 50)])
def test_reformer_flex_round_equals_the_sdpa_round(options, n):
    """One hash round as FlexAttention over the sorted sequence (CUDA's path without attention dropout; eager
    here, forward only) gives what the SDPA path over (chunk, 2 chunks) windows gives, padding, lone queries
    (a real token whose window holds no other real key) and chunk 0 included."""
    model = build("reformer", max_len=320, **options)
    x = torch.randn(3, n, D)
    mask = lengths_mask([n, n - 11, 1], n)  # the last sample is one real token: it can only see itself
    with torch.no_grad():
        model.backend = "sdpa"
        sdpa = model(x, mask)
        model.backend = "flex"
        flex = model(x, mask)
    torch.testing.assert_close(flex[mask], sdpa[mask], atol=1e-5, rtol=1e-5)
    model.backend, model.attn_dropout = "auto", 0.1  # on CUDA, unless attention dropout is on: FlexAttention has none
    assert model.flex_round_runs(on_cuda=True) and not model.flex_round_runs(on_cuda=False)
    assert not model.train().flex_round_runs(on_cuda=True)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend,n_hashes", [("sdpa", 1), ("flex", 1), ("sdpa", 2)])
@pytest.mark.parametrize("n", [64, 61], ids=["whole chunks", "a ragged last chunk"])
def test_reformer_without_a_mask_equals_an_all_true_mask(backend, n_hashes, n):
    """mask=None: whole chunks hash no padding and FlexAttention's mask reads no tensor; a ragged last chunk masks
    its internal padding. Both as an all-true mask (eager FlexAttention here: forward only)."""
    model = build("reformer", max_len=64, bucket_size=8, n_hashes=n_hashes)
    model.backend = backend
    x = torch.randn(2, n, D)
    with torch.no_grad():
        torch.testing.assert_close(model(x, None), model(x, torch.ones(2, n, dtype=torch.bool)), atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_reformer_lists_its_band_tiles_once_per_length(monkeypatch):
    """Without a mask the band's tiles depend on the length alone: FlexAttention's tile lists are made on the first
    call at a length and reused (each list is a few small eager kernels per call, host time the GPU waits for)."""
    from models import patterns

    made = []
    ordered = patterns.ordered_tiles
    monkeypatch.setattr(patterns, "ordered_tiles", lambda tiles: made.append(tiles.shape) or ordered(tiles))
    model = build("reformer", max_len=300, bucket_size=8)
    model.backend = "flex"
    x = torch.randn(2, 256, D)
    with torch.no_grad():
        first, again = model(x, None), model(x, None)
        assert len(made) == 4  # partial and full tiles, kv- and q-major: once
        torch.testing.assert_close(again, first, atol=0, rtol=0)
        model(torch.randn(2, 136, D), None)  # another length: its own lists
        assert len(made) == 8
        model(x, torch.ones(2, 256, dtype=torch.bool))  # a mask: the tiles depend on the batch, made every call
        assert len(made) == 12


@pytest.mark.gpu
def test_reformer_compiled_on_cuda_keeps_its_band_tiles_and_its_answer():
    """The model compiled as a whole, as lra trains it: the first call at a length lists the band's tiles inside
    the graph and keeps them, later calls read them; every call equals the SDPA round."""
    model = build("reformer", max_len=1024, bucket_size=64).cuda().eval()
    compiled_model = torch.compile(lambda x: model(x, None))
    with torch.no_grad():
        for n in (1024, 1024, 512):
            x = torch.randn(2, n, D, device="cuda")
            model.backend = "auto"
            flex = compiled_model(x)
            model.backend = "sdpa"
            torch.testing.assert_close(flex, model(x, None), atol=1e-4, rtol=1e-4)
    assert sorted(n for n, _ in model._band_tiles) == [512, 1024]
