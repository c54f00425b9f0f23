"""image_local (models/image_local.py): the gathered-block computation equals full softmax attention under the 2-D
block mask, built densely here as the reference."""
from __future__ import annotations

import pytest
import torch

from models import create_model
from models.registry import Grid
from tests.mixer_checks import assert_fully_masked_rows_are_zero_with_finite_gradients, dense_masked_attention

D, H = 32, 2


def make(max_len: int = 300, **options):
    torch.manual_seed(0)
    return create_model("image_local", d_model=D, n_heads=H, d_qkv=D, dropout=0.0, max_len=max_len, **options).eval()


def block_mask(grid: Grid, qh: int, qw: int, f: int) -> torch.Tensor:
    """(N, N) bool, True = query may see key: a pixel sees the pixels of its query block's memory block (the block
    grown by f on every side); the prefix tokens see and are seen by everything."""
    P = grid.prefix
    pos = torch.arange(grid.height * grid.width)
    row, col = pos // grid.width, pos % grid.width  # (HW,)
    top, left = row // qh * qh - f, col // qw * qw - f  # (HW,): the memory block's first row and column
    rows_in = (row[None, :] >= top[:, None]) & (row[None, :] < top[:, None] + qh + 2 * f)  # (HW, HW)
    cols_in = (col[None, :] >= left[:, None]) & (col[None, :] < left[:, None] + qw + 2 * f)  # (HW, HW)
    allowed = torch.ones(grid.length, grid.length, dtype=torch.bool)
    allowed[P:, P:] = rows_in & cols_in
    return allowed


reference = dense_masked_attention


def batch(grid: Grid, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Three samples: no padding, holes (30% of the pixels), every pixel masked (the prefix stays real)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, grid.length, D, generator=g)
    mask = torch.ones(3, grid.length, dtype=torch.bool)
    mask[1, grid.prefix:] = torch.rand(grid.length - grid.prefix, generator=g) > 0.3
    mask[2, grid.prefix:] = False
    return x, mask


# (grid, options): the defaults with and without the CLS slot; grids the block does not divide; no flange; a
# block and flange that divide the grid exactly (flange padding only); a flange wider than the block.
CASES = [
    (Grid(16, 16, prefix=1), {}),
    (Grid(16, 16, prefix=0), {}),
    (Grid(10, 13, prefix=1), {"query_height": 4, "query_width": 8, "memory_flange": 2}),
    (Grid(10, 13, prefix=0), {"query_height": 3, "query_width": 5, "memory_flange": 0}),
    (Grid(12, 12, prefix=0), {"query_height": 4, "query_width": 6, "memory_flange": 0}),
    (Grid(9, 7, prefix=2), {"query_height": 2, "query_width": 3, "memory_flange": 5}),
]
IDS = [f"{g.height}x{g.width}+{g.prefix}-" + ("-".join(f"{k}{v}" for k, v in o.items()) or "default") for g, o in CASES]


def settings(model) -> tuple[int, int, int]:
    return model.query_height, model.query_width, model.memory_flange


@pytest.mark.parametrize("grid,options", CASES, ids=IDS)
def test_equals_full_attention_under_the_block_mask(grid, options):
    """Outputs at every position (masked ones included) and input gradients match the dense reference, for a
    batch with no padding, holes and an all-masked image."""
    model = make(**options)
    allowed = block_mask(grid, *settings(model))
    x, mask = batch(grid)
    x_model, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = model(x_model, mask, grid=grid), reference(model, x_ref, mask, allowed)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    weight = torch.randn_like(out) * mask[..., None]  # a loss on the real positions, as the encoder's
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    torch.testing.assert_close(x_model.grad, x_ref.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("grid,options", CASES, ids=IDS)
def test_no_mask_equals_an_all_true_mask_and_the_reference(grid, options):
    """mask=None masks only the internal padding (flange, ragged edge)."""
    model = make(**options)
    x, _ = batch(grid)
    with torch.no_grad():
        free = model(x, None, grid=grid)
        torch.testing.assert_close(free, model(x, torch.ones(x.shape[:2], dtype=torch.bool), grid=grid),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(free, reference(model, x, None, block_mask(grid, *settings(model))),
                                   atol=1e-5, rtol=1e-5)


def test_a_block_covering_the_grid_is_the_transformer():
    """One query block over the whole grid, no flange: exact full attention, the transformer with the same weights."""
    grid = Grid(12, 10, prefix=1)
    model, transformer = make(query_height=12, query_width=10, memory_flange=0), make_transformer()
    transformer.load_state_dict(model.state_dict())
    x, mask = batch(grid)
    with torch.no_grad():
        torch.testing.assert_close(model(x, mask, grid=grid)[:2], transformer(x, mask)[:2], atol=1e-5, rtol=1e-5)


def make_transformer():
    torch.manual_seed(0)
    return create_model("transformer", d_model=D, n_heads=H, d_qkv=D, dropout=0.0, max_len=300).eval()


def test_each_pixel_sees_exactly_its_memory_block():
    """Without a prefix, perturbing one pixel changes exactly the pixels whose memory block holds it."""
    grid = Grid(16, 16, prefix=0)
    model = make()  # 8 x 8 query blocks, flange 4: block (i, j) remembers rows 8i-4..8i+11, cols 8j-4..8j+11
    x = torch.randn(1, grid.length, D)
    x2 = x.clone()
    x2[0, 3 * 16 + 9] += 1.0  # pixel (3, 9): in the memory of blocks (0, 0) and (0, 1), not of (1, *) (rows 4..)
    with torch.no_grad():
        changed = (model(x2, None, grid=grid) - model(x, None, grid=grid)).abs().amax(-1)[0] > 1e-6  # (N,)
    expected = torch.zeros(16, 16, dtype=torch.bool)
    expected[0:8, 0:16] = True
    assert torch.equal(changed.view(16, 16), expected)


def test_all_masked_memory_blocks_give_zero_and_finite_gradients():
    """Without a prefix, the queries of an all-masked memory block see no key: output 0, gradients finite."""
    grid = Grid(16, 16, prefix=0)
    model = make().train()  # dropout 0: deterministic, but the training path
    x, mask = batch(grid)
    assert_fully_masked_rows_are_zero_with_finite_gradients(model, x, mask, 2, grid=grid)


# flex (FlexAttention with the memory-block mask_mod): eagerly on the CPU, forward only (torch has no flex backward
# there); the GPU test below compares gradients. Grids over several 128-token tiles, one wider than a tile.
FLEX_CASES = CASES + [
    (Grid(20, 40, prefix=1), {}),
    (Grid(3, 150, prefix=0), {"query_height": 2, "query_width": 16, "memory_flange": 3}),
]
FLEX_IDS = [f"{g.height}x{g.width}+{g.prefix}-" + ("-".join(f"{k}{v}" for k, v in o.items()) or "default")
            for g, o in FLEX_CASES]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("grid,options", FLEX_CASES, ids=FLEX_IDS)
def test_flex_path_equals_full_attention_under_the_block_mask(grid, options):
    model = make(max_len=1000, **options)
    x, _ = batch(grid)
    expected = reference(model, x, None, block_mask(grid, *settings(model)))
    model.backend = "flex"
    with torch.no_grad():
        torch.testing.assert_close(model(x, None, grid=grid), expected, atol=1e-5, rtol=1e-5)
    assert model.kept_tiles  # made once for this length and grid, then kept


@pytest.mark.parametrize("grid,options", FLEX_CASES, ids=FLEX_IDS)
def test_flex_tiles_pool_the_dense_block_mask(grid, options):
    """A 128 x 128 tile is computed when it holds an allowed pair of the reference mask, and whole (no mask_mod)
    when every pair of it inside the sequence is allowed (the kernel bounds-checks the last tile)."""
    from models.image_local import memory_rule, memory_tiles

    model = make(max_len=1000, **options)
    partial, full = memory_tiles(memory_rule(grid.prefix, grid.width, *settings(model)), grid.length, "cpu")
    allowed = block_mask(grid, *settings(model))  # (n, n)
    nt = -(-grid.length // 128)
    some, every = torch.zeros(nt, nt, dtype=torch.bool), torch.zeros(nt, nt, dtype=torch.bool)
    for t in range(nt):
        for u in range(nt):
            tile = allowed[128 * t: 128 * (t + 1), 128 * u: 128 * (u + 1)]
            some[t, u], every[t, u] = tile.any(), tile.all()
    assert torch.equal(full[0, 0], every) and torch.equal(partial[0, 0], some & ~every)
    if grid.length > 700:  # 7 tiles: some are skipped, the others partial
        assert partial.any() and (~(partial | full)).any()


def test_flex_runs_when_asked_for_and_refuses_what_it_cannot_do():
    grid = Grid(16, 16, prefix=1)
    model = make()
    x, mask = batch(grid)
    assert not model.flex_runs(key_mask=False)  # auto: dense, until a GPU has measured flex
    model.backend = "sparse"
    with pytest.raises(ValueError, match="backend must be one of"):
        model(x, None, grid=grid)
    model.backend = "flex"
    assert model.flex_runs(key_mask=False)
    with pytest.raises(ValueError, match="no key mask"):
        model(x, mask, grid=grid)
    model.attn_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="no attention dropout"):
        model(x, None, grid=grid)


def test_bad_options_and_grids_are_refused():
    with pytest.raises(ValueError, match="query block"):
        make(query_height=0)
    with pytest.raises(ValueError, match="memory_flange"):
        make(memory_flange=-1)
    model = make()
    with pytest.raises(ValueError, match="grid 16x16"):
        model(torch.randn(1, 250, D), None, grid=Grid(16, 16, prefix=1))
    with pytest.raises(ValueError, match="2-D mixer"):
        model(torch.randn(1, 257, D), None)


@pytest.mark.gpu
@pytest.mark.parametrize("grid,options", FLEX_CASES[-3:], ids=FLEX_IDS[-3:])
def test_cuda_flex_path_equals_the_dense_path_forward_and_backward(grid, options):
    """On CUDA, the flex path (compiled FlexAttention) against the dense gather + SDPA path: outputs and the
    gradients of the input and every weight."""
    model = make(max_len=1000, **options).cuda()
    x, _ = batch(grid)
    x = x.cuda()
    results = []
    for backend in ("dense", "flex"):
        model.backend = backend
        model.zero_grad()
        xb = x.clone().requires_grad_()
        out = model(xb, None, grid=grid)
        out.square().sum().backward()
        results.append([out.detach(), xb.grad] + [p.grad.clone() for p in model.parameters()])
    for dense, flex in zip(*results):
        torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("grid,options", CASES[:3], ids=IDS[:3])
def test_cuda_equals_cpu(grid, options):
    """The same gather + SDPA code on CUDA (fused SDPA kernels over the batch of blocks) matches the CPU result."""
    model = make(**options)
    x, mask = batch(grid)
    with torch.no_grad():
        expected = model(x, mask, grid=grid)
        out = model.cuda()(x.cuda(), mask.cuda(), grid=grid).cpu()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
