"""Checks several model test files share: one implementation each, called with each model's own settings."""
from __future__ import annotations

import copy
import itertools

import torch


def create(name: str, **options):
    """``create_model(name, **options)``, where ``options`` may also name settings of how the mixer runs (its
    ``execution_settings``: scan, chunk_size, recompute, backend, ...), set on the built mixer once checked, as a run
    sets them (they are attributes, not constructor options)."""
    from models import create_model, get_model_class
    from models.base import checked_setting, execution_settings

    known = execution_settings(get_model_class(name))
    settings = {key: options.pop(key) for key in list(options) if key in known}
    mixer = create_model(name, **options)
    for key, value in settings.items():
        setattr(mixer, key, checked_setting(mixer, key, value))
    return mixer


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


def fla_and_chunked(model):
    """``model`` set to run its scan on fla's kernels, and a copy set to the fp32 chunked form. fla's gated scan
    where it is known to be wrong skips, saying why."""
    import pytest

    from models._scan import fla_refused

    reason = fla_refused(torch.cuda.current_device())
    if reason is not None:
        pytest.skip(reason)
    model.scan = "fla"  # fla's kernels or an error: never a silent fallback to the form it is checked against
    ref = copy.deepcopy(model)
    ref.scan = "chunked"
    return model, ref


def assert_fast_scan_matches_chunked(model, d: int, ragged) -> None:
    """On CUDA: the model's fla kernels against its fp32 chunked form, outputs and every gradient, then bf16."""
    model, ref = fla_and_chunked(model)
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

    assert rel(outs[0], outs[1]) < 1e-2, f"outputs: rel. err {rel(outs[0], outs[1]):.2e}"
    for name, a, b in zip(["x", *(n for n, _ in model.named_parameters())], *grads):
        assert rel(a, b) < 2e-2, (f"{name}'s gradient: rel. err {rel(a, b):.2e} (|g| {a.norm():.3e} fla, "
                                  f"{b.norm():.3e} chunked)")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        err = rel(model(x, mask)[mask].float(), outs[1])
        assert err < 5e-2, f"bf16 outputs: rel. err {err:.2e}"


def assert_fast_scan_on_packed_rows_matches_chunked(model, d: int) -> None:
    """On CUDA: the model's fla kernels on packed rows (variable-length mode) against its fp32 chunked form with
    resets (exact on the CPU tests), outputs at real positions and the input's gradient."""
    model, ref = fla_and_chunked(model)
    segments = packed_layout(PACKED_ROWS, 29).cuda()
    real = segments != 0
    x = torch.randn(len(PACKED_ROWS), 29, d, device="cuda", requires_grad=True)
    outs, grads = [], []
    for m in (model, ref):
        out = m(x, real, segments=segments)[real]
        grads.append(torch.autograd.grad(out.sum(), x)[0])
        outs.append(out)
    for what, (a, b) in zip(("outputs", "the input's gradient"), (outs, grads)):
        err = ((a - b).norm() / b.norm()).item()
        assert err < 2e-2, f"{what} on packed rows: rel. err {err:.2e}"


def dense_masked_attention(mixer, x: torch.Tensor, mask: torch.Tensor | None, allowed: torch.Tensor) -> torch.Tensor:
    """Full softmax attention with ``mixer``'s projections (``project``, ``out``) under ``allowed`` (N, N) and the
    key mask: the dense reference of a sparse pattern. A row with no key gives 0."""
    B, N, _ = x.shape
    q, k, v = mixer.project(x)  # each (B, H, N, Dh)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, N, N)
    see = allowed[None, None] if mask is None else allowed[None, None] & mask[:, None, None, :]  # (B or 1, 1, N, N)
    weights = scores.masked_fill(~see, float("-inf")).softmax(-1).nan_to_num(0.0)  # (B, H, N, N)
    return mixer.out((weights @ v).transpose(1, 2).reshape(B, N, -1))  # (B, N, D)


# Packed rows of 29 positions, as runs of (example, length), 0 a padding gap: with chunks of 4, examples begin
# inside chunks and at their starts, two in one chunk (either pass); examples of length 1, examples ending
# exactly at the row's end, a gap between two examples, padding after the last.
PACKED_ROWS = [[(1, 7), (2, 1), (0, 3), (3, 18)], [(4, 20)], [(5, 1), (6, 28)], [(7, 8), (8, 12), (0, 2), (9, 4)]]


def packed_layout(rows: list[list[tuple[int, int]]], n: int) -> torch.Tensor:
    """(R, n) int64 segment ids from each row's runs of (example id, length), id 0 a padding gap; a row's rest is
    padding."""
    segments = torch.zeros(len(rows), n, dtype=torch.long)
    for r, runs in enumerate(rows):
        col = 0
        for example, length in runs:
            segments[r, col : col + length] = example
            col += length
        assert col <= n
    return segments


def assert_packed_rows_equal_each_example_alone(model, rows, n: int, d: int, dtype=torch.float64, tol=1e-10) -> None:
    """``model`` on packed rows (``packed_layout``) against each example alone in its own unpadded row: outputs
    at every real position, and the gradients of the input and of every parameter."""
    segments = packed_layout(rows, n)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(rows), n, d, generator=gen, dtype=dtype).requires_grad_()
    cot = torch.randn(len(rows), n, d, generator=gen, dtype=dtype) * (segments != 0)[..., None]  # real positions
    params = list(model.parameters())
    out = model(x, segments != 0, segments=segments)  # (R, n, d)
    assert out.isfinite().all()
    got = torch.autograd.grad((out * cot).sum(), [x, *params])
    loss = 0.0
    for r, runs in enumerate(rows):
        col = 0
        for example, length in runs:
            if example:
                alone = model(x[r, col : col + length][None], None)[0]  # (length, d): its own row, no padding
                torch.testing.assert_close(out[r, col : col + length], alone, rtol=tol, atol=tol)
                loss = loss + (alone * cot[r, col : col + length]).sum()
            col += length
    want = torch.autograd.grad(loss, [x, *params])
    for name, a, b in zip(["x", *(name for name, _ in model.named_parameters())], got, want):
        assert a.isfinite().all(), name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def assert_reset_scan_equals_separate_pieces(q, k, v, g, reset, chunk: int, scale: float, tol=1e-10) -> None:
    """``_scan``'s recurrent and chunked forms with ``reset`` (B, N) against the recurrence run on each piece
    between resets alone, from a zero state."""
    from models import _scan

    want = torch.zeros_like(v)
    for b in range(v.shape[0]):
        cuts = [0, *reset[b].nonzero()[:, 0].tolist(), v.shape[2]]
        for s, e in itertools.pairwise(cuts):
            if e > s:
                piece = (t[b : b + 1, :, s:e] for t in (q, k, v, g))
                want[b, :, s:e] = _scan.recurrent(*piece, scale)[0][0]
    torch.testing.assert_close(_scan.recurrent(q, k, v, g, scale, reset=reset)[0], want, rtol=tol, atol=tol)
    got = _scan.chunked(q, k, v, g, chunk, scale, reset)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def flex_captures(graph: torch.fx.GraphModule) -> list[tuple]:
    """For each FlexAttention forward call in ``graph`` (Dynamo's, or AOT autograd's), the arguments its score_mod
    and mask_mod capture: what Inductor's lowering receives as buffers."""
    return [(*node.args[7], *node.args[8]) for node in graph.graph.nodes
            if node.op == "call_function" and str(node.target) == "flex_attention"]


def captured_values_backend(captured: list, then=None):
    """A torch.compile backend that appends to ``captured``, for each flex_attention call in Dynamo's graph, the
    tuple of values it captures for its score_mod and mask_mod (``flex_captures``), then runs the graph as traced,
    or hands it to the backend ``then`` (e.g. AOT autograd with recording compilers)."""
    def backend(graph, example_inputs):
        captured.extend(tuple(arg.meta["example_value"] for arg in call) for call in flex_captures(graph))
        return graph if then is None else then(graph, example_inputs)

    torch._dynamo.reset()
    return backend


def out_and_grads(attention, q, k, v, grad, dtype) -> list[torch.Tensor]:
    """A kernel's output and its q, k, v gradients (for the output gradient ``grad``) with inputs in ``dtype``, all
    as float64 to compare against a reference."""
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = attention(q, k, v)
    (out.double() * grad.double()).sum().backward()
    return [out.detach().double(), q.grad.double(), k.grad.double(), v.grad.double()]


def relative_errors(ours, theirs) -> list[float]:
    """||a - b|| / ||b|| for each pair."""
    return [((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(ours, theirs)]
