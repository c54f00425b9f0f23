"""The block-sparse pattern models (local, sparse, longformer, bigbird) and models/patterns.py.

CPU only: the FlexAttention path runs eagerly here (forward only; torch has no flex backward on CPU), which
evaluates its mask_mod densely, so the tile structure that the compiled CUDA kernel relies on is checked
separately against ``create_block_mask``.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from models import create_model
from models.patterns import FLEX_BLOCK, dense_mask, flex_block_mask, listed_tiles, ordered_tiles, padded_length

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

D, H = 32, 2

# Defaults plus settings that exercise blocks below, at and above the 128 tile, and token-level globals.
CONFIGS = [
    ("local", {}), ("local", {"block": 64}), ("local", {"block": 256}),
    ("sparse", {}), ("sparse", {"pattern": "strided", "stride": 2}),
    ("sparse", {"block": 64, "stride": 3, "summary": 2}),
    ("longformer", {}), ("longformer", {"block": 64, "window": 1, "global_tokens": 130}),
    ("longformer", {"global_tokens": 0, "window": 0}),
    ("bigbird", {}), ("bigbird", {"block": 128, "n_random": 1}),
    ("bigbird", {"block": 32, "window": 2, "global_blocks": 2}),
]
IDS = [f"{name}-{'-'.join(f'{k}{v}' for k, v in opts.items()) or 'default'}" for name, opts in CONFIGS]


def make(name: str, max_len: int = 1024, d_model: int = D, n_heads: int = H, **options):
    return create_model(name, d_model=d_model, n_heads=n_heads, d_qkv=d_model, dropout=0.0, max_len=max_len,
                        **options).eval()


def batch(n: int, d_model: int = D, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Four samples: no padding, right padding, holes plus right padding, all padding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, n, d_model, generator=g)
    mask = torch.ones(4, n, dtype=torch.bool)
    mask[1, int(0.55 * n):] = False
    mask[2, int(0.8 * n):] = False
    mask[2, torch.randperm(n, generator=g)[: n // 4]] = False
    mask[3] = False
    return x, mask


def layout_and_keep(model, mask, n=None):
    """What ``attend`` lays out for a (B, n) key mask, or for no mask (None) at length n."""
    keep, layout, rule = model.lay_out(mask, mask.shape[1] if n is None else n, torch.device("cpu"))
    return layout, keep, rule


def tiles(count, index):  # (B, 1, nt) + (B, 1, nt, nt) -> (B, nt, nt) bool: the tiles a BlockMask lists
    return listed_tiles(count, index)[:, 0]


def expand(t, n):  # (B, nt, nt) tiles -> (B, n, n) positions
    return t.repeat_interleave(FLEX_BLOCK, 1).repeat_interleave(FLEX_BLOCK, 2)[:, :n, :n]


# Alternate between a length that needs internal padding and head dim 16, and one that does not with head
# dim 4 (below FlexAttention's minimum of 16, so the flex path pads it).
SIZES = [(300, 32, 2), (512, 16, 4)]


@pytest.mark.parametrize("name,options,n,d_model,n_heads",
                         [(*c, *SIZES[i % 2]) for i, c in enumerate(CONFIGS)], ids=IDS)
def test_flex_path_matches_dense_path(name, options, n, d_model, n_heads):
    torch.manual_seed(0)
    model = make(name, d_model=d_model, n_heads=n_heads, **options)
    x, mask = batch(n, d_model)
    with torch.no_grad():
        model.backend = "dense"
        dense = model(x, mask)
        model.backend = "flex"
        flex = model(x, mask)
    assert dense.isfinite().all()
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.heavy  # CI's second tier: every pattern model twice
@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
@pytest.mark.parametrize("n", [300, 512])  # with and without internal padding to the 128 tile
def test_no_mask_equals_an_all_true_mask(name, options, n):
    """mask=None (no padding in the batch) builds one (1, N) key mask and one set of tiles for all samples, which
    FlexAttention broadcasts; both paths must give what an all-true (B, N) mask gives."""
    torch.manual_seed(0)
    model = make(name, **options)
    x = torch.randn(3, n, D)
    every = torch.ones(3, n, dtype=torch.bool)
    with torch.no_grad():
        for backend in ("dense", "flex"):
            model.backend = backend
            torch.testing.assert_close(model(x, None), model(x, every), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_flex_tiles_match_create_block_mask(name, options):
    """What the compiled kernel computes: full tiles entirely, partial tiles through mask_mod, nothing else.
    That must equal the dense mask, and the tiles must agree with create_block_mask's."""
    torch.manual_seed(0)
    model = make(name, **options)
    _, mask = batch(700)
    layout, keep, rule = layout_and_keep(model, mask)
    B, N = keep.shape
    ours = flex_block_mask(layout, keep, model.block, model.global_tokens, rule)
    ref = create_block_mask(ours.mask_mod, B, 1, N, N, device="cpu", BLOCK_SIZE=FLEX_BLOCK)
    full, partial = tiles(ours.full_kv_num_blocks, ours.full_kv_indices), tiles(ours.kv_num_blocks, ours.kv_indices)
    ref_full, ref_partial = tiles(ref.full_kv_num_blocks, ref.full_kv_indices), tiles(ref.kv_num_blocks, ref.kv_indices)
    assert torch.equal(full, ref_full)
    assert not (ref_partial & ~partial).any()  # ours may list extra partial tiles, never miss one
    assert not (full & partial).any()
    # The q-major lists that the backward kernel walks are the same tiles, transposed.
    assert torch.equal(tiles(ours.q_num_blocks, ours.q_indices), partial.transpose(1, 2))
    assert torch.equal(tiles(ours.full_q_num_blocks, ours.full_q_indices), full.transpose(1, 2))
    for ordered in (ours.kv_indices, ours.q_indices):  # every row lists a permutation of the tiles
        assert torch.equal(ordered.sort(-1).values, torch.arange(ordered.shape[-1]).expand_as(ordered).int())

    by_mask_mod = create_mask(ours.mask_mod, B, 1, N, N, device="cpu")[:, 0]  # (B, N, N)
    kernel_view = expand(full, N) | (expand(partial, N) & by_mask_mod)
    assert torch.equal(kernel_view, dense_mask(layout, keep, model.block, model.global_tokens)[:, 0])


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
@pytest.mark.parametrize("padded", [True, False], ids=["key-padding", "no-mask"])
def test_flex_tiles_at_the_true_length(name, options, padded):
    """The kernel sees only the N real positions (it bounds-checks the last tile), so the tiles are laid out for
    N, not for the padded length: what they compute inside [0, N) must equal the dense mask there, tiles past
    the end are not listed, and without a key mask (no padding) the mask_mod reads no key mask."""
    torch.manual_seed(0)
    model = make(name, **options)
    n = 650
    layout, keep, rule = layout_and_keep(model, batch(n)[1] if padded else None, n)
    if not padded:
        assert keep.shape == (1, padded_length(n, model.block))  # one key mask for the whole batch
    bm = flex_block_mask(layout, keep, model.block, model.global_tokens, rule, n, key_padding=padded)
    B, nt = keep.shape[0], -(-n // FLEX_BLOCK)
    assert bm.seq_lengths == (n, n) and bm.kv_indices.shape == (B, 1, nt, nt)

    full, partial = tiles(bm.full_kv_num_blocks, bm.full_kv_indices), tiles(bm.kv_num_blocks, bm.kv_indices)
    assert not (full & partial).any()
    by_mask_mod = create_mask(bm.mask_mod, B, 1, n, n, device="cpu")[:, 0]  # (B, n, n)
    kernel_view = expand(full, n) | (expand(partial, n) & by_mask_mod)
    assert torch.equal(kernel_view, dense_mask(layout, keep, model.block, model.global_tokens)[:, 0, :n, :n])
    if not padded and model.block >= FLEX_BLOCK and not model.global_tokens:  # whole tiles: none left partial
        assert not partial.any() and full.any()


def test_ordered_tiles_is_a_stable_partition_and_an_opaque_op():
    """The tile lists are built by a custom op that Inductor calls instead of lowering (it miscompiled the
    same code inline at 129 x 129 tiles on an H200): its shapes, fake kernel and schema must hold up under
    ``torch.library.opcheck``, and a compiled caller must trace it without a graph break."""
    g = torch.Generator().manual_seed(0)
    for shape in [(2, 1, 5, 5), (3, 1, 129, 129)]:
        dense = torch.rand(shape, generator=g) < 0.3
        count, index = ordered_tiles(dense)
        assert torch.equal(count, dense.sum(-1, dtype=torch.int32))
        expected = torch.sort((~dense).to(torch.int8), dim=-1, stable=True).indices  # active first, in order
        assert torch.equal(index, expected.int())
        torch.library.opcheck(ordered_tiles, (dense,))

    def lists(dense):
        return ordered_tiles(dense & dense.transpose(-1, -2))

    dense = torch.rand(2, 1, 7, 7, generator=g) < 0.5
    traced = torch.compile(lists, backend="aot_eager", fullgraph=True)(dense)
    for got, want in zip(traced, lists(dense)):
        assert torch.equal(got, want)


def test_flex_tiles_are_sparse():
    """Block granularity is what makes FlexAttention skip work: at N = 2048 each default pattern computes
    only a fraction of the 16 x 16 tiles, and whole tiles (no mask_mod) unless a global token cuts through."""
    mask = torch.ones(1, 2048, dtype=torch.bool)
    expected = {  # name, options: (tiles computed, of which partial)
        ("local", ()): (16, 0), ("sparse", ()): (16 * 7, 0), ("longformer", ()): (16 * 5 - 6, 0),
        ("longformer", (("global_tokens", 1),)): (16 * 5 - 6 + 13 + 13, 13 + 13),  # + global row and column
        ("bigbird", ()): (None, 0), ("bigbird", (("block", 64),)): (None, None),
    }
    for (name, options), (computed, partial) in expected.items():
        model = make(name, max_len=2048, **dict(options))
        layout, keep, rule = layout_and_keep(model, mask)
        bm = flex_block_mask(layout, keep, model.block, model.global_tokens, rule)
        total = int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
        assert total == computed if computed else total < 0.8 * 16 * 16, (name, options, total)
        if partial is not None:
            assert int(bm.kv_num_blocks.sum()) == partial, (name, options)
        else:  # LRA's 64-blocks split the 128-tiles: most computed tiles are partial
            assert int(bm.kv_num_blocks.sum()) > 0.5 * total


# Settings under which each pattern covers a 300-token input (padded to 384 or 512) entirely.
FULL = [
    ("local", {"block": 512}), ("sparse", {"stride": 8}), ("sparse", {"pattern": "strided", "stride": 8}),
    ("longformer", {"window": 8}), ("longformer", {"window": 8, "global_tokens": 3}),
    ("bigbird", {"window": 16}), ("bigbird", {"block": 128, "window": 8, "n_random": 0}),
]


@pytest.mark.parametrize("name,options", FULL, ids=[f"{n}-{o}" for n, o in FULL])
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_full_pattern_equals_transformer(name, options, backend):
    torch.manual_seed(0)
    model, reference = make(name, **options), make("transformer")
    reference.qkv.load_state_dict(model.qkv.state_dict())
    reference.out.load_state_dict(model.out.state_dict())
    model.backend = backend
    x, mask = batch(300)
    x_model, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = backend == "dense"  # FlexAttention has no backward on CPU
    with torch.set_grad_enabled(grad):
        out, expected = model(x_model, mask), reference(x_ref, mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if grad:
        (out * mask[..., None]).square().sum().backward()
        (expected * mask[..., None]).square().sum().backward()
        torch.testing.assert_close(x_model.grad, x_ref.grad, atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_are_zero_not_nan():
    """Padded queries in blocks made only of padding see no key: output 0 and finite gradients."""
    model = make("local", block=64)
    x, mask = batch(300)
    x.requires_grad_()
    out = model(x, mask)
    out.sum().backward()
    assert out.isfinite().all() and x.grad.isfinite().all()
    assert all(p.grad.isfinite().all() for p in model.parameters())
    with torch.no_grad():
        attended = model.attend(*model.project(x), mask)  # (B, H, N, Dh), before the output projection
    assert (attended[3] == 0).all()  # the all-padding sample
    assert (attended[1, :, 192:] == 0).all()  # blocks 3 and 4 of sample 1 are all padding
    assert (attended[1, :, :165] != 0).any(-1).all()  # real queries always see their own block


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_appending_padding_leaves_real_positions_unchanged(name, options):
    torch.manual_seed(0)
    model = make(name, **options)
    x, mask = batch(300)
    longer_x = torch.cat([x, torch.randn(4, 333, D)], dim=1)
    longer_mask = torch.cat([mask, torch.zeros(4, 333, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        short, long = model(x, mask), model(longer_x, longer_mask)[:, :300]
    torch.testing.assert_close(long[mask], short[mask], atol=1e-5, rtol=1e-5)


def _changed_positions(model, n: int, position: int) -> torch.Tensor:
    x = torch.randn(1, n, D)
    mask = torch.ones(1, n, dtype=torch.bool)
    y = x.clone()
    y[0, position] += 3.0
    with torch.no_grad():
        return (model(x, mask) - model(y, mask)).abs().amax(-1)[0] > 1e-6  # (N,)


def test_local_sees_only_its_block():
    torch.manual_seed(0)
    changed = _changed_positions(make("local", block=64), 300, 150)
    assert changed[128:192].all() and not changed[:128].any() and not changed[192:].any()


@pytest.mark.parametrize("n", [256, 300])  # a multiple of the tile, and one with internal padding
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_strided_local_groups_positions_congruent_modulo_n_over_block(n, backend):
    """LRA's code's grouping: a query sees the real keys j with j = i (mod G), G = padded length / block; the same
    through FlexAttention, and not invariant to appended padding, which the classifier reports."""
    torch.manual_seed(0)
    model = make("local", max_len=n, block=64, strided=True)
    model.backend = backend
    x, mask = batch(n)
    q, k, v = model.project(x)  # (B, H, N, Dh)
    G = padded_length(n, 64) // 64
    pos = torch.arange(n)
    allowed = (pos[:, None] % G == pos[None, :] % G) & mask[:, None, None, :]  # (B, 1, N, N)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    with torch.no_grad():
        out = model.attend(q, k, v, mask)
    real = mask[:3]  # every real query sees itself; the fourth sample is all padding
    torch.testing.assert_close(out[:3].transpose(1, 2)[real], expected[:3].transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # no padding in the batch (mask None): the internal padding is masked all the same
        torch.testing.assert_close(model.attend(q[:1], k[:1], v[:1], None), out[:1], atol=1e-6, rtol=1e-6)
    assert not model.padding_invariant and make("local").padding_invariant


def test_longformer_window_and_global_tokens():
    torch.manual_seed(0)
    model = make("longformer", block=64, window=1, global_tokens=1)
    changed = _changed_positions(model, 600, 300)  # block 4: seen by blocks 3..5 and by the global token
    expected = torch.zeros(600, dtype=torch.bool)
    expected[0] = expected[192:384] = True
    assert torch.equal(changed, expected)
    assert _changed_positions(model, 600, 0).all()  # everyone attends to the global token


def test_sparse_fixed_and_strided_layouts():
    blocks = torch.arange(6)
    fixed = make("sparse", stride=2, summary=1).pattern(None, blocks[:, None], blocks[None, :])
    # segments {0,1} {2,3} {4,5}; the summary block of each segment is its last one: 1, 3, 5
    assert fixed[0].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert fixed[2].nonzero().flatten().tolist() == [1, 2, 3, 5]
    strided = make("sparse", pattern="strided", stride=3).pattern(None, blocks[:, None], blocks[None, :])
    assert strided[0].nonzero().flatten().tolist() == [0, 1, 2, 3]  # |q - k| < 3 or (q - k) % 3 == 0
    assert strided[4].nonzero().flatten().tolist() == [1, 2, 3, 4, 5]


def test_bigbird_random_plan_reproducible_and_per_layer():
    a, b = make("bigbird", seed=7), make("bigbird", seed=7)
    assert torch.equal(a.plan, b.plan)
    torch.manual_seed(3)
    first = [make("bigbird") for _ in range(2)]
    torch.manual_seed(3)
    second = [make("bigbird") for _ in range(2)]
    assert all(torch.equal(p.plan, q.plan) for p, q in zip(first, second, strict=True))
    assert not torch.equal(first[0].plan, first[1].plan)  # layers of one model get different plans
    # The layout: window, global first/last real block and exactly n_random distinct extra blocks.
    model = make("bigbird", block=64, seed=7)
    mask = torch.ones(2, 1024, dtype=torch.bool)
    mask[1, 700:] = False  # 11 real blocks of 64
    layout, _, _ = layout_and_keep(model, mask)
    for s, n_real in enumerate([16, 11]):
        assert layout[s, 0, :n_real].all() and layout[s, n_real - 1, :n_real].all()  # global rows
        for i in range(1, n_real - 1):
            row = layout[s, i]
            assert row[0] and row[n_real - 1] and row[i - 1: i + 2].all()
            extra = row.clone()
            extra[[0, n_real - 1, i - 1, i, i + 1]] = False
            assert int(extra.sum()) == 3 and not extra[n_real:].any()


def test_bad_settings_fail_in_init():
    with pytest.raises(ValueError, match="block=50"):
        make("local", block=50)
    with pytest.raises(ValueError, match="pattern"):
        make("sparse", pattern="diagonal")
    with pytest.raises(ValueError, match="summary"):
        make("sparse", stride=2, summary=3)
    with pytest.raises(ValueError, match="window"):
        make("longformer", window=-1)
    with pytest.raises(ValueError, match="at most 256"):
        make("bigbird", max_len=256)(*batch(300))


@pytest.mark.parametrize("name", ["local", "bigbird"])  # a static pattern and one read from per-sample context
def test_compiled_evaluation_with_padding_equals_the_dense_mask(name):
    """A model compiled whole and evaluated (no autograd) on a padded batch: the mask_mod's captured key mask and
    pattern context must be buffers of their own (``patterns.realized``), else Inductor fails to lower the
    FlexAttention call (every padded ListOps evaluation failed so before the fix)."""
    torch.manual_seed(0)
    m = create_model(name, d_model=32, n_heads=2, d_qkv=32, dropout=0.0, max_len=512).eval()
    x = torch.randn(3, 300, 32)
    mask = torch.ones(3, 300, dtype=torch.bool)
    mask[0, 200:] = False
    mask[2, ::3] = False
    torch._dynamo.reset()
    with torch.no_grad():
        m.backend = "flex"
        compiled = torch.compile(m)(x, mask)
        m.backend = "dense"
        dense = m(x, mask)
    torch.testing.assert_close(compiled * mask[..., None], dense * mask[..., None], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name,options,padded,small", [
    ("local", {}, False, False),  # full 128-tiles, no lookups: the kernel's default tile
    ("sparse", {}, False, False),
    ("local", {}, True, True),  # key padding: partial tiles read the key mask
    ("sparse", {"block": 64, "stride": 5}, False, True),  # 64-blocks: partial tiles by the pattern (LRA's preset)
    ("bigbird", {}, True, True),  # padded: partial tiles read the key mask and BigBird's per-sample blocks
    ("bigbird", {}, False, False),  # no padding, 128-blocks: only the last tile can be partial
])
def test_forward_tiles_shrink_where_partial_tiles_look_tensors_up(monkeypatch, name, options, padded, small):
    """The flex path asks for 64 x 64 forward tiles exactly where many tiles are partial and their mask_mod reads
    tensors (a 128 x 128 forward tile then ran 10x slower than the backward on the GPU, ``SMALL_FORWARD_TILES``)."""
    import models.patterns as patterns

    seen = []
    monkeypatch.setattr(patterns, "flex_attend", lambda q, k, v, block_mask, small_tiles=False: (
        seen.append(small_tiles), q)[1])
    m = create_model(name, d_model=D, n_heads=H, d_qkv=D, dropout=0.0, max_len=512, **options)
    q = torch.randn(2, H, 300, D // H)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[0, 200:] = False
    patterns._block_sparse_attend(m, q, q, q, mask if padded else None, use_flex=True)
    assert seen == [small]


def test_a_misspelt_backend_is_refused_not_read_as_the_reference_path():
    model = create_model("local", d_model=32, n_heads=2, d_qkv=32, dropout=0.0, max_len=256)
    model.backend = "flx"
    with pytest.raises(ValueError, match="backend must be one of auto, flex, dense, got 'flx'"):
        model(torch.randn(1, 256, 32), torch.ones(1, 256, dtype=torch.bool))


@pytest.mark.parametrize("name", ["local", "sparse", "longformer", "bigbird"])
def test_without_padding_a_pattern_lists_its_tiles_once_per_length(monkeypatch, name):
    """Without a mask a pattern's tiles depend on the length alone: FlexAttention's tile lists are made on the first
    call at a length and kept (each is a few small eager kernels per call). BigBird's random blocks follow each
    sample's real length, which without padding is the input's. Eager and compiled alike, the answer is the dense
    mask's."""
    from models import patterns

    made = []
    ordered = patterns.ordered_tiles
    monkeypatch.setattr(patterns, "ordered_tiles", lambda tiles: made.append(tiles.shape) or ordered(tiles))
    torch.manual_seed(0)
    model = make(name)
    x = torch.randn(2, 512, D)
    torch._dynamo.reset()
    with torch.no_grad():
        model.backend = "dense"
        dense = model(x, None)
        model.backend = "flex"
        eager = [model(x, None) for _ in range(2)]
        assert len(made) == 4  # partial and full tiles, kv- and q-major: once
        compiled = [torch.compile(model)(x, None) for _ in range(2)]
        model._tile_lists.clear()  # a compiled first call lists the tiles inside its graph and keeps them
        compiled += [torch.compile(model)(x, None) for _ in range(2)]
    for out in (*eager, *compiled):
        torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-4)
    assert (512, x.device) in model._tile_lists


def test_bigbird_drops_its_kept_tiles_when_its_random_plan_is_loaded():
    """BigBird's kept tiles follow from its random plan (a buffer): a state dict with another plan must not leave
    the old tiles in use. 16 blocks of 64: the random blocks matter (8 would be full attention). Compiled: eager
    FlexAttention evaluates the mask_mod everywhere, and only a compiled kernel follows the tile lists alone."""
    torch.manual_seed(0)
    model = make("bigbird", block=64)
    state = {**model.state_dict(), "plan": torch.rand_like(model.plan)}
    x = torch.randn(2, 1024, D)
    torch._dynamo.reset()
    with torch.no_grad():
        model.backend = "flex"
        before = torch.compile(model)(x, None)
        model.load_state_dict(state)
        after = torch.compile(model)(x, None)
        model.backend = "dense"
        torch.testing.assert_close(after, model(x, None), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(before, after, atol=1e-3)
