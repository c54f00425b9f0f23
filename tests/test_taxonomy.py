"""python -m lra.taxonomy: the survey's table from the registry, with exponents fitted from the layer bench over the
lengths where a layer is compute-bound (the bench's whole step by the same rule); the README's copy is the generated
one."""
from __future__ import annotations

import math
import subprocess
import sys

import pandas as pd
import pytest

from lra.report import taxonomy
from models import get_model_class, list_models
from models.registry import COMPLEXITIES
from tests.conftest import ROOT, in_background


def test_slope_recovers_a_power_law():
    lengths = [4096, 8192, 16384]
    assert taxonomy.slope(lengths, [n**2 * 3e-7 for n in lengths]) == pytest.approx(2.0)
    assert taxonomy.slope(lengths, [n * 5e-3 for n in lengths]) == pytest.approx(1.0)
    assert math.isnan(taxonomy.slope([4096, 4096], [1.0, 2.0]))


def bench(model, ms, lengths=(4096, 8192, 16384), batch=8, device="GPU", status="ok"):
    return [dict(model=model, seq_len=n, batch_size=batch, ms_per_step=m, peak_mem_mb=m * 10, status=status,
                 device=device, timestamp=f"2026-01-01T00:00:{i:02d}Z") for i, (n, m) in enumerate(zip(lengths, ms))]


def layer(model, ms, shapes=((1024, 32), (4096, 32), (16384, 8)), device="GPU", implementation=None, compiled=True,
          sha="a", mb=None):
    """``layer_bench.csv`` rows of one sweep: ``ms`` per call at each (N, batch), memory ``mb`` (default 10 x ms)."""
    mb = mb or [m * 10 for m in ms]
    return [dict(model=model, seq_len=n, batch_size=b, status="ok", ms_fwd_bwd=m, peak_mb=v, precision="bf16",
                 device=device, git_sha=sha, implementation=implementation or f"lra {model}", compiled=compiled,
                 timestamp=f"2026-01-01T00:00:{i:02d}Z") for i, ((n, b), m, v) in enumerate(zip(shapes, ms, mb))]


def test_a_launch_bound_start_is_left_out_and_a_quadratic_layer_reads_2():
    """Flat times at short N (the layer waits on its launches: its time per token falls as 1/N), quadratic beyond:
    the fit starts where the time per token stops falling and recovers 2, where a fit over every length would not."""
    lengths = [1024, 2048, 4096, 8192, 16384, 32768]
    ms = [max(3.0, 3.0 * (n / 8192) ** 2) for n in lengths]  # launch-bound up to 8K, then c N^2
    rows = pd.DataFrame(bench("transformer", ms, lengths=lengths))
    exps = taxonomy.measured_exponents(rows)
    assert exps["transformer"].time == pytest.approx(2.0) and exps["transformer"].lengths == (8192, 32768)
    assert taxonomy.slope(lengths, ms) < 1.5  # what the launch-bound lengths would have made of it
    # the layer bench's shapes (batch 32 to 4K, 8 at 16K): per example, the 1K row launch-bound
    quad = pd.DataFrame(layer("transformer", [5.0, 5.0, 20.0]))
    assert taxonomy.measured_exponents(quad, source=taxonomy.LAYER)["transformer"].time == pytest.approx(2.0)


def test_fixed_costs_leave_a_linear_layer_near_1_and_a_launch_bound_one_without_an_exponent():
    """A linear layer with a fixed cost (F + b x tokens): the fit starts once the fixed cost is amortised and reads
    near 1; a layer whose time never grows (launch-bound at every length) has no exponent, not one near 0, nor does
    one with a single compute-bound length."""
    lengths = [1024, 2048, 4096, 8192, 16384]
    ms = [2.0 + 3.0 * n / 1024 for n in lengths]  # a fixed 2 ms, and 3 ms of work per 1K positions
    exps = taxonomy.measured_exponents(pd.DataFrame(bench("linear", ms, lengths=lengths)))
    assert exps["linear"].lengths == (4096, 16384) and exps["linear"].time == pytest.approx(1.0, abs=0.1)
    flat = pd.DataFrame(bench("axial", [2.0, 2.0, 2.1], lengths=(4096, 8192, 16384)))
    assert "axial" not in taxonomy.measured_exponents(flat)
    # the layer bench's shapes: a layer whose time falls from 4K x 32 to 16K x 8 (the same positions a call) is
    # still amortising fixed costs at 4K, and has one compute-bound length
    table = taxonomy.taxonomy_table(pd.DataFrame(layer("cosformer", [2.0, 4.0, 3.4])
                                                 + layer("linear", [2.0, 4.0, 4.0])))
    text = taxonomy.markdown(table)
    assert "| N |  | yes |" in text.split("| `cosformer` |")[1].split("\n")[0]
    assert "| N | 1.00 / 1.00 (4K-16K) |" in text.split("| `linear` |")[1].split("\n")[0]
    assert "time per token falls by less than 10% from each length to the next" in text


def test_the_table_reads_our_compiled_layers_only():
    """The packages' layers, bare SDPA, a variant's options, eager rows and another compile mode are other layers:
    the table's exponent is the registry model's own, compiled as lra trains it."""
    rows = (layer("linear", [2.0, 4.0, 4.0])
            + layer("linear", [2.0, 4.0, 64.0], implementation="linear-attention-transformer 0.19.1", sha="b")
            + layer("linear", [2.0, 4.0, 64.0], implementation="lra linear(feature=elu)", sha="c")
            + layer("linear", [2.0, 4.0, 64.0], compiled=False, sha="d")
            + layer("transformer", [2.0, 4.0, 64.0], implementation="SDPA exact (cuDNN flash)", sha="e"))
    mode = [dict(r, compile_mode="reduce-overhead", git_sha="f") for r in layer("linear", [2.0, 4.0, 64.0])]
    table = taxonomy.taxonomy_table(pd.DataFrame(rows + mode)).set_index("model")
    assert table.at["linear", "time_exponent"] == pytest.approx(1.0)
    assert pd.isna(table.at["transformer", "time_exponent"])


def test_measured_exponents_use_one_batch_size_from_4k_up():
    rows = pd.DataFrame(bench("transformer", [1.0, 4.0, 16.0]) + bench("linear", [1.0, 2.0, 4.0])
                        + bench("linear", [50.0], lengths=(1024,)) + bench("local", [1.0, 2.0], batch=32)
                        + bench("local", [1.0], lengths=(4096,), batch=8) + bench("sparse", [1.0, 9.0, 9.0],
                                                                                   status="oom"))
    exps = taxonomy.measured_exponents(rows)
    assert exps["transformer"][0] == pytest.approx(2.0) and exps["linear"][0] == pytest.approx(1.0)
    assert exps["local"][0] == pytest.approx(1.0)  # the batch with two lengths, not the one with one
    assert "sparse" not in exps  # failed rows measure nothing


def test_each_model_is_fitted_on_one_card_the_main_one_first_and_the_table_says_which():
    """The H100 timed three models; a later H200 call timed the transformer again and one new model: the
    transformer keeps its H100 slope, the new model gets its H200 one, and the note under the table names it."""
    rows = pd.DataFrame(bench("transformer", [1.0, 4.0, 16.0], device="H100") + bench("linear", [1.0, 2.0, 4.0],
                        device="H100") + bench("local", [1.0, 2.0, 4.0], device="H100")
                        + bench("transformer", [1.0, 2.0, 4.0], device="H200") + bench("fnet", [1.0, 3.0, 9.0],
                                                                                      device="H200"))
    exps = taxonomy.measured_exponents(rows)
    assert exps["transformer"][:3] == (pytest.approx(2.0), pytest.approx(2.0), "H100")
    assert exps["fnet"][0] == pytest.approx(math.log(3, 2)) and exps["fnet"][2] == "H200"
    assert taxonomy.measured_exponents(rows, device="H200")["transformer"][2] == "H200"
    shapes = ((4096, 8), (8192, 8), (16384, 8))
    layers = pd.DataFrame(layer("transformer", [1.0, 4.0, 16.0], shapes, "H100")
                          + layer("linear", [1.0, 2.0, 4.0], shapes, "H100")
                          + layer("local", [1.0, 2.0, 4.0], shapes, "H100")
                          + layer("transformer", [1.0, 2.0, 4.0], shapes, "H200")
                          + layer("fnet", [1.0, 3.0, 9.0], shapes, "H200"))
    text = taxonomy.markdown(taxonomy.taxonomy_table(layers))
    assert text.endswith("Exponents timed on the H100, except fnet on the H200.")


def test_the_table_covers_the_registry_and_docs_models_holds_the_generated_one():
    results = ROOT / "results"
    table = taxonomy.taxonomy_table(pd.read_csv(results / "layer_bench.csv"),
                                    pd.read_csv(results / "leaderboard.csv"))
    assert list(table.model) == list_models() and set(table.complexity) <= set(COMPLEXITIES)
    doc = (ROOT / "docs" / "models.md").read_text()
    block = doc.split(taxonomy.BEGIN, 1)[1].split(taxonomy.END, 1)[0].strip()
    assert block == taxonomy.markdown(table), "docs/models.md's model table is stale: python -m lra.taxonomy " \
                                               "--results results --doc docs/models.md"


def test_the_readme_names_every_registered_model():
    models = (ROOT / "README.md").read_text().split("## Models", 1)[1].split("\n## ", 1)[0]
    assert f"{len(list_models())} models" in models
    assert [name for name in list_models() if f"`{name}`" not in models] == []


def test_the_doc_option_rewrites_only_the_taxonomy_block(tmp_path):
    doc = tmp_path / "models.md"
    doc.write_text(f"# Models\n\nbefore\n\n{taxonomy.BEGIN}\nstale\n{taxonomy.END}\n\nafter\n")
    table = taxonomy.main(["--results", str(ROOT / "results"), "--doc", str(doc)])
    text = doc.read_text()
    assert text == f"# Models\n\nbefore\n\n{taxonomy.BEGIN}\n{taxonomy.markdown(table)}\n{taxonomy.END}\n\nafter\n"
    assert not taxonomy.update_doc(doc, table)  # a second pass changes nothing
    (tmp_path / "plain.md").write_text("# no block\n")
    with pytest.raises(SystemExit, match="no taxonomy block"):
        taxonomy.main(["--results", str(ROOT / "results"), "--doc", str(tmp_path / "plain.md")])


IMPORT_WITHOUT_PLOTTING = ("import sys, lra.report.taxonomy; assert 'matplotlib' not in sys.modules, "
                           "'lra.report.taxonomy imported matplotlib'")


@in_background(lambda folder, environ: subprocess.run([sys.executable, "-c", IMPORT_WITHOUT_PLOTTING], cwd=ROOT,
                                                      env=environ, capture_output=True, text=True))
def test_the_taxonomy_table_needs_no_plotting_library(ran_in_background):
    """The table is text: building it must not import matplotlib (the chart module's dependency)."""
    proc, _ = ran_in_background()
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_slope_never_joins_two_sweeps():
    """Rows of two calls (another commit, another attention dropout) are not one curve: a model whose 8K and 16K
    rows came from different sweeps has no slope from them. Of two sweeps with the same lengths the steadier
    counts (a call disturbed by jobs beside it spreads its steps), and more lengths beat fewer."""
    def sweep(model, ms, sha, backbone="drop0.1/0.0", spread=0.02, lengths=(4096, 8192, 16384)):
        return [dict(row, git_sha=sha, backbone=backbone, ms_p10=row["ms_per_step"] * (1 - spread / 2),
                     ms_p90=row["ms_per_step"] * (1 + spread / 2)) for row in bench(model, ms, lengths=lengths)]

    rows = pd.DataFrame(sweep("linear", [1.0], "a", lengths=(8192,))
                        + sweep("linear", [9.0], "b", backbone="drop0.1/0.1", lengths=(16384,))
                        + sweep("transformer", [1.0, 4.0, 16.0], "c")
                        + sweep("transformer", [1.0, 1.5, 5.0], "d", spread=0.8)  # later, disturbed
                        + sweep("local", [1.0, 2.0], "e", lengths=(8192, 16384))
                        + sweep("local", [1.0, 3.0, 9.0], "f", spread=0.5))
    exps = taxonomy.measured_exponents(rows)
    assert "linear" not in exps
    assert exps["transformer"][0] == pytest.approx(2.0)
    assert exps["local"][0] == pytest.approx(math.log(3, 2))


def test_rows_with_a_blank_protocol_column_form_a_sweep(tmp_path):
    """A column that older rows lack (compile_mode, blank for the default mode) reads back as missing: those rows
    are one sweep still, and a later row in another mode is not joined to them."""
    rows = pd.DataFrame(bench("transformer", [1.0, 4.0, 16.0]) + bench("linear", [1.0, 2.0, 4.0]))
    later = pd.DataFrame(bench("linear", [1.0], lengths=(8192,))).assign(compile_mode="reduce-overhead")
    pd.concat([rows, later]).to_csv(tmp_path / "bench.csv", index=False)
    exps = taxonomy.measured_exponents(pd.read_csv(tmp_path / "bench.csv"))
    assert exps["transformer"][0] == pytest.approx(2.0) and exps["linear"][0] == pytest.approx(1.0)


def test_the_eager_slowdown_compares_rows_of_one_card_where_one_card_timed_both():
    """Eager over compiled at 4K x 32: the latest card that timed both (here the H100, though the H200's compiled
    row is later); a model timed eagerly on one card and compiled on another only compares across them; a model
    without an eager row, or timed at other shapes only, has none."""
    rows = (layer("linear", [1.0, 2.0, 3.0], device="H100")
            + layer("linear", [1.0, 6.0, 3.0], device="H100", compiled=False, sha="b")
            + [dict(r, timestamp="2026-02-01T00:00:00Z") for r in layer("linear", [1.0, 1.5, 3.0], device="H200")]
            + layer("local", [1.0, 2.0, 3.0], device="H200")
            + layer("local", [1.0, 5.0, 3.0], device="H100", compiled=False)
            + layer("fnet", [1.0, 2.0, 3.0])
            + layer("axial", [1.0, 2.0], shapes=((1024, 32), (16384, 8)), compiled=False)
            + layer("axial", [1.0, 2.0], shapes=((1024, 32), (16384, 8))))
    slow = taxonomy.eager_slowdowns(pd.DataFrame(rows))
    assert slow == {"linear": pytest.approx(3.0), "local": pytest.approx(2.5)}


def test_a_model_that_runs_over_twice_slower_eagerly_says_why_in_its_docstring():
    """Users debug and run on CPUs eagerly: a mixer whose layer runs more than ``EAGER_LIMIT`` times slower eagerly
    than compiled (results/layer_bench.csv) states the reason in a paragraph of its module's docstring beginning
    ``Eager speed:``."""
    slow = {name: ratio for name, ratio in taxonomy.eager_slowdowns(pd.read_csv(ROOT / "results" / "layer_bench.csv"))
            .items() if ratio > taxonomy.EAGER_LIMIT}
    silent = [f"{name} ({ratio:.1f})" for name, ratio in slow.items()
              if "\nEager speed:" not in (sys.modules[get_model_class(name).__module__].__doc__ or "")]
    assert not silent, f"models/<name>.py's docstring says nothing of its eager speed: {', '.join(silent)}"
