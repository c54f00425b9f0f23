"""Every FlexAttention path compiles with dynamic shapes: trimmed batches (``trainer.trim``) change the length from
batch to batch, so Dynamo compiles the model with a symbolic length, and a score_mod or mask_mod that closes over an
int computed from it (a padded length, min(g, N)) captures a SymInt expression, which Inductor's FlexAttention
lowering cannot take: it realises each captured value but a bare symbol, and fails on an expression ("'Shape
AsConstantBuffer' object has no attribute 'dtype'", pytorch/pytorch#182606; ETC's GPU test on an H200 failed so on a
p made dynamic). Dynamo's graph is checked here on the CPU, for each model with a flex backend, as the runner
compiles it (automatic dynamic shapes, after a second length, and with a CLS slot in front as the encoder adds one,
so that the mixer's length is an expression, s + 1, as in a run; trimmed ListOps on an H200 failed so in ETC's flex
path, whose mods closed over that length): every captured value is a tensor or a bare symbol. The backward's graphs
are checked too: a score_mod table's gradient buffer sized by a symbol is a ``sym_size`` in the kernel's backward
subgraph, which Inductor cannot lower (ETC's trimmed run on an H200), so such tables are padded to their mixer's
longest length under torch.compile (``patterns.score_table``)."""
from __future__ import annotations

import pytest
import sympy
import torch
from torch._dynamo.backends.common import aot_autograd

from models import create_model, get_model_class, list_models
from models.registry import Grid
from tests.mixer_checks import captured_values_backend, flex_captures

pytestmark = pytest.mark.heavy  # CI's second tier (.ci/run): Inductor compiles on the CPU, seconds per model


class WithClsSlot(torch.nn.Module):
    """The mixer behind a prepended token, as the encoder calls it: its length is the input's plus one."""

    def __init__(self, mixer: torch.nn.Module):
        super().__init__()
        self.mixer = mixer

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x[:, :1] * 0, x], dim=1)  # (B, N + 1, D)
        mask = torch.cat([mask[:, :1] | True, mask], dim=1)  # (B, N + 1)
        return self.mixer(x, mask)


FLEX_MODELS = [name for name in list_models() if "flex" in getattr(get_model_class(name), "backends", ())]
TABLE_MODELS = ["deberta", "etc", "synthesizer"]  # the flex paths whose score_mod reads a floating-point table


def flex_mixer(name: str, dropout: float) -> torch.nn.Module:
    """A small mixer in training mode on its flex path."""
    torch.manual_seed(0)
    model = create_model(name, d_model=32, n_heads=2, d_qkv=32, dropout=dropout, max_len=1024).train()
    model.backend = "flex"
    return model


def two_lengths(requires_grad: bool = False):
    """(x, mask) at two lengths, the second making the length symbolic, with key padding in the second example."""
    for n in (256, 400):
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, n - 60:] = False
        yield torch.randn(2, n, 32, requires_grad=requires_grad), mask


def lowerable(value) -> bool:
    """What Inductor's FlexAttention lowering takes among a mod's captured values: a tensor, or a SymInt that is a
    bare symbol (an input's size); an expression of symbols, or a constant, it cannot realise."""
    return isinstance(value, torch.Tensor) or isinstance(value.node.expr, sympy.Symbol)


def test_the_registry_has_flex_paths_to_check():
    assert {"local", "longformer", "sparse", "bigbird", "etc", "deberta", "reformer", "image_local"} <= set(FLEX_MODELS)
    assert set(TABLE_MODELS) <= set(FLEX_MODELS)


def captures_not_lowerable(name: str, captured: list) -> list[str]:
    """The values among ``captured`` (per flex call, its mods' captures) that Inductor's lowering cannot take."""
    assert captured, f"{name}: no FlexAttention call was traced"
    return [str(value) for call in captured for value in call if not lowerable(value)]


GRID_FLEX_MODELS = [name for name in FLEX_MODELS if getattr(get_model_class(name), "needs_grid", False)]
SEQUENCE_FLEX_MODELS = [name for name in FLEX_MODELS if name not in GRID_FLEX_MODELS]


@pytest.mark.parametrize("name", GRID_FLEX_MODELS)
def test_a_second_batch_size_compiles_the_2d_flex_path_with_lowerable_captures(name):
    """The 2-D models' tasks are never trimmed (the grid is the task's): a second batch size (evaluation's) is what
    makes their shapes symbolic. Their flex path takes no attention dropout (nor a key mask)."""
    model = flex_mixer(name, 0.0)
    captured = []
    compiled = torch.compile(model, backend=captured_values_backend(captured))  # dynamic=None, as the runner's
    with torch.no_grad():  # the forward's graph (the CPU's FlexAttention has no backward to run)
        for batch in (2, 3):
            compiled(torch.randn(batch, 256, 32), None, grid=Grid(16, 16))
    bad = captures_not_lowerable(name, captured)
    assert not bad, f"{name}: captured {bad}"


def flex_backward_subgraphs(graph: torch.fx.GraphModule) -> list[torch.fx.Graph]:
    """The score_mod and mask_mod subgraphs of each FlexAttention backward in an AOT backward graph."""
    return [getattr(graph, arg.target).graph for node in graph.graph.nodes
            if node.op == "call_function" and "flex_attention_backward" in str(node.target)
            for arg in node.args if isinstance(arg, torch.fx.Node) and arg.op == "get_attr"]


VIEWS = {"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "slice", "select", "unsqueeze",
         "squeeze", "alias", "as_strided"}


def producer(node: torch.fx.Node) -> torch.fx.Node:
    """The node that computes ``node``'s data: through views (a view of a buffer is that buffer to Inductor)."""
    def is_view(node: torch.fx.Node) -> bool:
        namespace, _, op = str(node.target).partition(".")
        return node.op == "call_function" and namespace == "aten" and op.split(".")[0] in VIEWS

    while is_view(node):
        node = node.args[0]
    return node


def table_reads(graph: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """(op, target) of the producer of each floating-point tensor a forward flex call of an ATen graph captures."""
    reads = []
    for arg in (arg for call in flex_captures(graph) for arg in call):  # the mods' captured values
        value = arg.meta["val"] if isinstance(arg, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            source = producer(arg)
            reads.append((source.op, str(source.target)))
    return reads


def not_realised(name: str, reads: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The tables among ``reads`` that are neither an input nor ``patterns.realized``'s output."""
    assert reads, f"{name}: no FlexAttention call read a floating-point table"
    return sorted({source for source in reads if source[0] != "placeholder" and "realized" not in source[1]})


@pytest.mark.parametrize("name", SEQUENCE_FLEX_MODELS)
def test_training_at_a_second_length_compiles_every_flex_path_lowerably(name, flex_backward_on_cpu):
    """Training at a first length, then a second (a trimmed batch), behind a CLS slot, compiled as the runner does
    (automatic dynamic shapes). One trace per model checks, at each level Inductor's FlexAttention lowering reads:
    - Dynamo's graph: every value a mod captures is a tensor or a bare symbol;
    - the AOT backward graphs: no flex backward sizes a buffer by a symbol (``sym_size``), and the first length's
      training step did go through FlexAttention;
    - the AOT forward graph (the models whose score_mod reads a floating-point table): every such table is an input
      or the output of ``patterns.realized``, not an operation Inductor would inline into the kernel's score_mod
      (DeBERTa's table, zero-padded to its bound, a masked load, failed the lowering of its trimmed training run
      on an H200: "'function' object has no attribute 'graph'")."""
    captured, reads, backward_graphs = [], [], []  # backward_graphs: per compiled graph, its flex backwards' subgraphs

    class NotRun(Exception):
        """The backward graphs are inspected, not run (eager flex backwards on the CPU are not all implemented)."""

    def record_forward(graph, example_inputs):
        reads.extend(table_reads(graph))
        return graph

    def record_backward(graph, example_inputs):
        backward_graphs.append(flex_backward_subgraphs(graph))

        def not_run(*args):
            raise NotRun
        return not_run

    backend = captured_values_backend(captured, aot_autograd(fw_compiler=record_forward, bw_compiler=record_backward))
    compiled = torch.compile(WithClsSlot(flex_mixer(name, 0.1)), backend=backend)
    for x, mask in two_lengths(requires_grad=True):
        with pytest.raises(NotRun):
            compiled(x, mask).sum().backward()
    bad = captures_not_lowerable(name, captured)
    assert not bad, f"{name}: captured {bad}"
    assert backward_graphs and backward_graphs[0], f"{name}: the first length's backward has no FlexAttention"
    sized = [str(node) for graphs in backward_graphs for graph in graphs for node in graph.nodes
             if node.op == "call_function" and node.target == torch.ops.aten.sym_size.int]
    assert not sized, f"{name}: a flex backward sizes a buffer by a symbol: {sized}"
    if name in TABLE_MODELS:
        inlined = not_realised(name, reads)
        assert not inlined, f"{name}: a mod reads a tensor computed in the graph, not realised: {inlined}"


@pytest.mark.parametrize("name", TABLE_MODELS)
def test_in_evaluation_every_table_a_score_mod_reads_is_a_buffer_of_its_own(name):
    """The same as training's last check, for the evaluation graph (no autograd: another forward graph), at a
    second length and with its captures lowerable."""
    captured, reads = [], []

    def record(graph, example_inputs):
        reads.extend(table_reads(graph))
        return graph

    compiled = torch.compile(WithClsSlot(flex_mixer(name, 0.1).eval()),
                             backend=captured_values_backend(captured, aot_autograd(fw_compiler=record)))
    with torch.no_grad():
        for x, mask in two_lengths():
            compiled(x, mask)
    bad = captures_not_lowerable(name, captured)
    assert not bad, f"{name}: captured {bad}"
    inlined = not_realised(name, reads)
    assert not inlined, f"{name}: a mod reads a tensor computed in the graph, not realised: {inlined}"
