"""python -m lra.taxonomy: the survey's table from the registry, with exponents fitted from the bench; the README's
copy is the generated one."""
from __future__ import annotations

import math
import subprocess
import sys

import pandas as pd
import pytest

from lra.report import taxonomy
from models import list_models
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
    assert exps["transformer"] == (pytest.approx(2.0), pytest.approx(2.0), "H100")
    assert exps["fnet"][0] == pytest.approx(math.log(3, 2)) and exps["fnet"][2] == "H200"
    assert taxonomy.measured_exponents(rows, device="H200")["transformer"][2] == "H200"
    text = taxonomy.markdown(taxonomy.taxonomy_table(rows))
    assert text.endswith("Exponents timed on the H100, except fnet on the H200.")


def test_the_table_covers_the_registry_and_the_readme_holds_the_generated_one():
    results = ROOT / "results"
    table = taxonomy.taxonomy_table(pd.read_csv(results / "bench.csv"), pd.read_csv(results / "leaderboard.csv"))
    assert list(table.model) == list_models() and set(table.complexity) <= set(COMPLEXITIES)
    readme = (ROOT / "README.md").read_text()
    block = readme.split(taxonomy.BEGIN, 1)[1].split(taxonomy.END, 1)[0].strip()
    assert block == taxonomy.markdown(table), "README's model table is stale: python -m lra.taxonomy --results " \
                                               "results --readme README.md"


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
