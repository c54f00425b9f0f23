"""axial (models/axial.py): each step equals full softmax attention under its axis mask (a pixel sees its row, resp.
its column, and the global prefix), built densely here as the reference; the model is the column step applied to
the row step's output."""
from __future__ import annotations

import pytest
import torch

from models import create_model
from models.registry import Grid
from tests.mixer_checks import assert_fully_masked_rows_are_zero_with_finite_gradients, dense_masked_attention

D, H = 32, 2


def make(max_len: int = 300):
    torch.manual_seed(0)
    return create_model("axial", d_model=D, n_heads=H, d_qkv=D, dropout=0.0, max_len=max_len).eval()


def axis_mask(grid: Grid, axis: str) -> torch.Tensor:
    """(N, N) bool, True = query may see key: a pixel sees the pixels of its row (``rows``) or column
    (``columns``); the prefix tokens see and are seen by everything."""
    P = grid.prefix
    pos = torch.arange(grid.height * grid.width)
    line = pos // grid.width if axis == "rows" else pos % grid.width  # (HW,): the row (column) of each pixel
    allowed = torch.ones(grid.length, grid.length, dtype=torch.bool)
    allowed[P:, P:] = line[:, None] == line[None, :]
    return allowed


reference = dense_masked_attention


def composed_reference(model, x, mask, grid):
    """The two dense references in turn: rows, then columns on the rows' output."""
    y = reference(model.rows, x, mask, axis_mask(grid, "rows"))
    return reference(model.columns, y, mask, axis_mask(grid, "columns"))


def batch(grid: Grid, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Four samples: no padding, holes (30% of the pixels), a whole row and a whole column masked on top of holes,
    every pixel masked (the prefix stays real)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, grid.length, D, generator=g)
    mask = torch.ones(4, grid.length, dtype=torch.bool)
    for b in (1, 2):
        mask[b, grid.prefix:] = torch.rand(grid.length - grid.prefix, generator=g) > 0.3
    pixels = mask[2, grid.prefix:].view(grid.height, grid.width)  # a view: writes reach the mask
    pixels[1], pixels[:, 2] = False, False
    mask[3, grid.prefix:] = False
    return x, mask


GRIDS = [Grid(16, 16, prefix=1), Grid(16, 16, prefix=0), Grid(10, 13, prefix=1), Grid(7, 5, prefix=2)]
IDS = [f"{g.height}x{g.width}+{g.prefix}" for g in GRIDS]


def assert_same_with_gradients(run, run_reference, x, mask):
    """Outputs at every position (masked ones included) and the input gradient of a loss on the real positions."""
    x_model, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = run(x_model), run_reference(x_ref)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    weight = torch.randn_like(out) * mask[..., None]
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    torch.testing.assert_close(x_model.grad, x_ref.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("axis", ["rows", "columns"])
@pytest.mark.parametrize("grid", GRIDS, ids=IDS)
def test_each_step_equals_full_attention_under_its_axis_mask(grid, axis):
    model = make()
    step = getattr(model, axis)
    x, mask = batch(grid)
    assert_same_with_gradients(lambda t: step(t, mask, grid=grid),
                               lambda t: reference(step, t, mask, axis_mask(grid, axis)), x, mask)


@pytest.mark.parametrize("grid", GRIDS, ids=IDS)
def test_the_model_is_the_two_references_in_turn(grid):
    model = make()
    x, mask = batch(grid)
    assert_same_with_gradients(lambda t: model(t, mask, grid=grid),
                               lambda t: composed_reference(model, t, mask, grid), x, mask)


@pytest.mark.parametrize("grid", GRIDS, ids=IDS)
def test_no_mask_equals_an_all_true_mask_and_the_reference(grid):
    model = make()
    x, _ = batch(grid)
    with torch.no_grad():
        free = model(x, None, grid=grid)
        torch.testing.assert_close(free, model(x, torch.ones(x.shape[:2], dtype=torch.bool), grid=grid),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(free, composed_reference(model, x, None, grid), atol=1e-5, rtol=1e-5)


def test_a_row_step_reaches_its_row_and_the_model_the_whole_image():
    """Without a prefix, one pixel reaches its own row through the row step, and every pixel through the model."""
    grid = Grid(8, 6, prefix=0)
    model = make()
    x = torch.randn(1, grid.length, D)
    x2 = x.clone()
    x2[0, 3 * 6 + 4] += 1.0  # pixel (3, 4)
    with torch.no_grad():
        rows = (model.rows(x2, None, grid=grid) - model.rows(x, None, grid=grid)).abs().amax(-1)[0] > 1e-6  # (N,)
        both = (model(x2, None, grid=grid) - model(x, None, grid=grid)).abs().amax(-1)[0] > 1e-6  # (N,)
    expected = torch.zeros(8, 6, dtype=torch.bool)
    expected[3] = True
    assert torch.equal(rows.view(8, 6), expected) and both.all()


def test_all_masked_lines_give_zero_and_finite_gradients():
    """Without a prefix, the pixels of an all-masked image see no key in either step: output 0, gradients finite."""
    grid = Grid(16, 16, prefix=0)
    model = make().train()  # dropout 0: deterministic, but the training path
    x, mask = batch(grid)
    assert_fully_masked_rows_are_zero_with_finite_gradients(model, x, mask, 3, grid=grid)


def test_bad_grids_are_refused():
    model = make()
    with pytest.raises(ValueError, match="grid 16x16"):
        model(torch.randn(1, 250, D), None, grid=Grid(16, 16, prefix=1))
    with pytest.raises(ValueError, match="2-D mixer"):
        model(torch.randn(1, 257, D), None)


@pytest.mark.gpu
@pytest.mark.parametrize("grid", GRIDS[:3], ids=IDS[:3])
def test_cuda_equals_cpu(grid):
    """The same code on CUDA (fused SDPA kernels over the batch of rows and columns) matches the CPU result."""
    model = make()
    x, mask = batch(grid)
    with torch.no_grad():
        expected = model(x, mask, grid=grid)
        out = model.cuda()(x.cuda(), mask.cuda(), grid=grid).cpu()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
