"""notebooks/leaderboard.ipynb executes top to bottom on small CSVs and shows the tables and the charts."""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

pytestmark = pytest.mark.heavy  # CI's second tier (.ci/run): a Jupyter kernel running the whole notebook

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed")
pytest.importorskip("ipykernel", reason="ipykernel is not installed")
pytest.importorskip("jinja2", reason="pandas' Styler needs jinja2")


def test_notebook_executes(tmp_path, monkeypatch):
    from jupyter_client.kernelspec import KernelSpecManager
    from test_leaderboard import hand_made_runs
    from test_plot import bench_rows

    if "python3" not in KernelSpecManager().find_kernel_specs():
        pytest.skip("no python3 Jupyter kernel")
    hand_made_runs().to_csv(tmp_path / "runs.csv", index=False)
    bench_rows().to_csv(tmp_path / "bench.csv", index=False)  # no published.csv here: it falls back to results/
    monkeypatch.setenv("LRA_RESULTS_DIR", str(tmp_path))

    nb = nbformat.read(ROOT / "notebooks" / "leaderboard.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()  # raises CellExecutionError on any failing cell

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    html = "\n".join(o.get("data", {}).get("text/html", "") for o in outputs if "data" in o)
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert f"results from {tmp_path}" in text
    assert "mymodel" in html and "transformer" in html and "54.20" in html  # the leaderboard, with avg5
    assert "steps/s" in html and "NVIDIA H100" in html  # the bench tables
    assert "54.39" in html  # the published Table 1 (read from the repo's results/published.csv)
    assert len(images) == 3  # bubble chart, speed and memory vs length
    assert {p.name for p in (tmp_path / "charts").glob("*.png")} == {
        "lra_bubble_4K.png", "speed_vs_length.png", "memory_vs_length.png"}
    assert not (ROOT / "notebooks" / "charts").exists()
    assert pd.read_csv(tmp_path / "runs.csv").shape[0] == len(hand_made_runs())  # inputs untouched
