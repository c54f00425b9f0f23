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


@pytest.mark.parametrize("name", FLEX_MODELS)
def test_a_second_shape_compiles_the_flex_path_with_lowerable_captures(name):
    """A second length (a trimmed batch) for the sequence models; for the 2-D ones, whose tasks are never trimmed
    (the grid is the task's), a second batch size (evaluation's)."""
    grid = getattr(get_model_class(name), "needs_grid", False)
    dropout = 0.0 if grid else 0.1  # image_local's flex path takes no attention dropout (nor a key mask)
    model = flex_mixer(name, dropout)
    captured = []
    run = model if grid else WithClsSlot(model)
    compiled = torch.compile(run, backend=captured_values_backend(captured))  # dynamic=None, as the runner's
    with torch.no_grad():  # the forward's graph (the CPU's FlexAttention has no backward to run)
        if grid:
            for batch in (2, 3):
                compiled(torch.randn(batch, 256, 32), None, grid=Grid(16, 16))
        else:
            for x, mask in two_lengths():
                compiled(x, mask)
    assert captured, f"{name}: no FlexAttention call was traced"
    bad = [value for call in captured for value in call if not lowerable(value)]
    assert not bad, f"{name}: captured {[str(v) for v in bad]}"


def flex_backward_subgraphs(graph: torch.fx.GraphModule) -> list[torch.fx.Graph]:
    """The score_mod and mask_mod subgraphs of each FlexAttention backward in an AOT backward graph."""
    return [getattr(graph, arg.target).graph for node in graph.graph.nodes
            if node.op == "call_function" and "flex_attention_backward" in str(node.target)
            for arg in node.args if isinstance(arg, torch.fx.Node) and arg.op == "get_attr"]


SEQUENCE_FLEX_MODELS = [name for name in FLEX_MODELS if not getattr(get_model_class(name), "needs_grid", False)]


@pytest.mark.parametrize("name", SEQUENCE_FLEX_MODELS)
def test_no_flex_backward_sizes_a_buffer_by_a_symbol(name, flex_backward_on_cpu):
    """Training at a first length, then a second (trimmed batches): each FlexAttention backward traced has no
    ``sym_size`` in its subgraphs, and the first length's training step did go through FlexAttention."""
    backward_graphs = []  # per compiled graph: its flex backwards' subgraphs

    class NotRun(Exception):
        """The backward graphs are inspected, not run (eager flex backwards on the CPU are not all implemented)."""

    def record(graph, example_inputs):
        backward_graphs.append(flex_backward_subgraphs(graph))

        def not_run(*args):
            raise NotRun
        return not_run

    torch._dynamo.reset()
    model = flex_mixer(name, 0.1)
    compiled = torch.compile(WithClsSlot(model), backend=aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=record))
    for x, mask in two_lengths(requires_grad=True):
        with pytest.raises(NotRun):
            compiled(x, mask).sum().backward()
    assert backward_graphs and backward_graphs[0], f"{name}: the first length's backward has no FlexAttention"
    sized = [str(node) for graphs in backward_graphs for graph in graphs for node in graph.nodes
             if node.op == "call_function" and node.target == torch.ops.aten.sym_size.int]
    assert not sized, f"{name}: a flex backward sizes a buffer by a symbol: {sized}"


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


@pytest.mark.parametrize("training", [True, False], ids=["training", "evaluation"])
@pytest.mark.parametrize("name", TABLE_MODELS)
def test_every_table_a_score_mod_reads_is_a_buffer_of_its_own(name, training, flex_backward_on_cpu):
    """At a second length (trimmed batches), every floating-point tensor that a FlexAttention call's mods read is an
    input or the output of ``patterns.realized``, in the ATen graph that Inductor lowers. Otherwise Inductor inlines
    its last operation into the kernel's score_mod: DeBERTa's table, zero-padded to its bound (a masked load), failed
    the lowering of its trimmed training run on an H200 ("'function' object has no attribute 'graph'")."""
    read = []  # (op, target) of the producer of each floating-point tensor a forward flex call captures

    def record(graph, example_inputs):
        for arg in (arg for call in flex_captures(graph) for arg in call):  # the mods' captured values
            value = arg.meta["val"] if isinstance(arg, torch.fx.Node) else None
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                source = producer(arg)
                read.append((source.op, str(source.target)))
        return graph

    torch._dynamo.reset()
    model = flex_mixer(name, 0.1).train(training)
    compiled = torch.compile(WithClsSlot(model), backend=aot_autograd(fw_compiler=record))
    with torch.set_grad_enabled(training):
        for x, mask in two_lengths(requires_grad=training):
            compiled(x, mask)  # training: the joint graph is traced here; its backward is not run
    assert read, f"{name}: no FlexAttention call read a floating-point table"
    inlined = [source for source in read if source[0] != "placeholder" and "realized" not in source[1]]
    assert not inlined, f"{name}: a mod reads a tensor computed in the graph, not realised: {sorted(set(inlined))}"
