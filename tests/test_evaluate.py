"""``python -m lra.evaluate``: a saved run's weights on its own data reproduce its row exactly, on other data give
that data's result (named), refuse overrides that would change the model, and fail in one line on a missing run
folder or checkpoint."""
from __future__ import annotations

import dataclasses
import io
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from PIL import Image

import lra.evaluate as ev
import lra.train.run as runner
from lra.config import model_options, validate
from lra.data import TaskData, load_file
from lra.data.common import Split
from lra.data.listops import generate
from lra.errors import ConfigError, DataError
from lra.train import engine
from lra.train.checkpoint import RunFiles
from models import get_model_class, list_models
from tests.conftest import ROOT, compose_cfg, in_background
from tests.test_run import SHORT


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny finished ListOps run (12 steps, evaluated at 6 and 12), shared by the tests: (run_dir, its row)."""
    tmp = tmp_path_factory.mktemp("evaluate")
    cfg = compose_cfg(["experiment=smoke", f"run_dir={tmp / 'run'}", f"results.dir={tmp / 'results'}",
                       f"data.cache_dir={tmp / 'cache'}", *SHORT])
    return tmp / "run", runner.run(cfg)


def unfinished_copy(run_dir, dest):
    """The run as it was before any checkpoint: only its config and best-validation weights."""
    dest.mkdir()
    for name in ("config.yaml", "best.pt"):
        shutil.copy(run_dir / name, dest / name)
    return dest


@pytest.mark.parametrize("checkpoint, split, key", [("best", "test", "test_acc"), ("final", "test", "final_test_acc"),
                                                    ("best", "val", "val_acc"), ("final", "val", "final_val_acc")])
def test_the_runs_own_data_reproduces_its_row(trained, checkpoint, split, key):
    run_dir, row = trained
    assert row["status"] == "ok" and row["best_step"] < row["steps"]  # best.pt and checkpoint.pt hold other weights
    got = ev.evaluate_run(run_dir, checkpoint=checkpoint, split=split)
    assert got["accuracy"] == row[key] == got["run_acc"]
    assert got["step"] == (row["best_step"] if checkpoint == "best" else row["steps"])
    assert got["n_examples"] == 32 and got["config_hash"] == row["config_hash"] and got["data_source"] == row["data"]
    assert (got["task"], got["model"], got["seed"], got["checkpoint"], got["split"]) == \
        ("listops", "transformer", 0, checkpoint, split)
    assert list(got) == ev.EVAL_COLUMNS


def test_another_listops_generation_gives_its_own_result(trained, tmp_path):
    run_dir, row = trained
    other = ev.evaluate_run(run_dir, ["data.generate.seed=5"])
    assert "/seed5-160-32-32/" in other["data_source"] and other["data_source"] != row["data"]
    assert other["n_examples"] == 32 and 0.0 <= other["accuracy"] <= 1.0
    assert other["overrides"] == "data.generate.seed=5" and other["run_acc"] == row["test_acc"]

    # a release folder holding the very trees the run was tested on: its accuracy, read from that folder
    same = generate(tmp_path / "copy", seed=0, train=160, val=32, test=32, workers=1, progress=False)
    got = ev.evaluate_run(run_dir, [f"data.root={tmp_path / 'copy'}"])
    assert got["data_source"] == str(same) and got["accuracy"] == row["test_acc"]

    smaller = generate(tmp_path / "small", seed=9, train=8, val=8, test=16, workers=1, progress=False)
    got = ev.evaluate_run(run_dir, [f"data.root={tmp_path / 'small'}"], checkpoint="final")
    assert got["data_source"] == str(smaller) and got["n_examples"] == 16 and got["step"] == row["steps"]


@pytest.mark.parametrize("override, message", [
    ("backbone.d_model=128", "backbone.d_model cannot change in an evaluation: it changes the model"),
    ("model.n_heads=4", "model.n_heads cannot change"),
    ("task.seq_len=512", "task.seq_len cannot change"),
    ("task.name=text", "task.name cannot change"),
    ("optim.lr=0.1", "optim.lr is not an evaluation setting"),
    ("seed=3", "seed is not an evaluation setting"),
    ("data.nonsense=1", "data.nonsense is not a setting of the run's config"),
    ("data.generate.seed=abc", "data.generate.seed=abc: Value 'abc'"),
    ("data.root", "'data.root' is not an override: write key=value"),
    ("device=gpu", "device='gpu' is not valid"),
])
def test_overrides_outside_the_data_are_refused_naming_the_key(trained, override, message):
    with pytest.raises(ConfigError, match=message) as info:
        ev.evaluate_run(trained[0], [override])
    assert "\n" not in str(info.value)


def test_data_that_does_not_fit_the_checkpoint_is_named(trained, monkeypatch):
    shape = engine.TaskShape(vocab_size=16, seq_len=256, n_classes=10)
    backbone = compose_cfg(["experiment=smoke", *SHORT]).backbone
    model = engine.build_model("transformer", {}, backbone, shape)
    weights = model.state_dict()
    split = Split(tokens=model.head[0].weight.new_zeros(4, 256).long(), labels=model.head[0].weight.new_zeros(4).long())
    data = TaskData(split, split, split, vocab_size=16, n_classes=10, seq_len=256)
    assert ev.fit_error(model, weights, data, 256, "best.pt") is None
    # sinusoidal positions hold no tensor: only the run's task.seq_len tells the length the weights were trained for
    longer = dataclasses.replace(data, seq_len=300)
    assert "length 300 (the model's: 256)" in ev.fit_error(model, weights, longer, 256, "best.pt")

    # through evaluate_run: the loader's data has another vocabulary than the run's
    real_load = ev.load_task
    monkeypatch.setattr(ev, "load_task", lambda cfg: dataclasses.replace(real_load(cfg), vocab_size=20))
    with pytest.raises(DataError, match=r"does not fit the model in best.pt: vocabulary 20 \(the model's: 16\)"):
        ev.evaluate_run(trained[0])


def test_cli_an_unfinished_run_a_missing_checkpoint_and_the_csv(trained, tmp_path, capsys):
    run_dir, row = trained
    partial = unfinished_copy(run_dir, tmp_path / "partial")
    out = tmp_path / "evals" / "evaluations.csv"
    got = ev.main([str(partial), "--out", str(out), "--split", "val"])
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"listops/transformer seed 0, best weights (step {row['best_step']}), val split of ")
    assert f"accuracy {row['val_acc']:.4f} on 32 examples" in line and "\n" not in line
    # without result.json the run's hash comes from its config.yaml: the same one the runner recorded
    assert got["run_acc"] is None and got["config_hash"] == row["config_hash"]
    ev.main([str(run_dir), "data.generate.seed=5", "--out", str(out)])
    table = pd.read_csv(out)
    assert list(table.columns) == ev.EVAL_COLUMNS and len(table) == 2
    assert table.overrides.fillna("").tolist() == ["", "data.generate.seed=5"]
    assert table.accuracy.iloc[0] == pytest.approx(row["val_acc"]) and table.run_dir.iloc[0] == str(partial)

    with pytest.raises(SystemExit) as exit_info:
        ev.main([str(partial), "--checkpoint", "final"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err
    assert err.startswith(f"error: {partial} holds no checkpoint.pt") and "it holds best.pt, config.yaml" in err
    (partial / "best.pt").unlink()
    with pytest.raises(SystemExit):
        ev.main([str(partial)])
    assert "holds no best.pt" in capsys.readouterr().err


@in_background(lambda folder, environ: subprocess.run([sys.executable, "-m", "lra.evaluate", str(folder / "nowhere")],
                                                      cwd=ROOT, env=environ, capture_output=True, text=True,
                                                      timeout=120))
def test_cli_a_missing_run_folder_is_one_line_and_exit_code_2(ran_in_background):
    proc, tmp_path = ran_in_background()
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: no run folder at {tmp_path / 'nowhere'}: pass the folder "
                                                f"of a run (it holds config.yaml and best.pt)"]


# -- one file of a task's test format (data.path=FILE), for every registered model ---------------------------------
IMAGE = ("task=image", "task.seq_len=1024")  # a 2-D mixer's task: the pixel grid


def listops_file(folder: Path, n: int = 20) -> Path:
    """A ListOps TSV of ``n`` examples as the release writes them (its own seed: not the runs' data)."""
    return generate(folder / "listops", seed=7, train=1, val=1, test=n, workers=1, progress=False) / "basic_test.tsv"


def parquet_file(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def png(value: int, side: int) -> bytes:
    out = io.BytesIO()
    Image.new("L", (side, side), value).save(out, format="PNG")
    return out.getvalue()


def image_file(folder: Path, n: int = 4) -> Path:
    """CIFAR-10's columns as the hub's parquet holds them: ``img`` ({bytes, path}), ``label``."""
    return parquet_file(folder / "cifar_test.parquet", {"img": [{"bytes": png(40 * i, 32), "path": None}
                                                                for i in range(n)], "label": list(range(n))})


def saved_run(folder: Path, overrides: tuple, shape: engine.TaskShape) -> Path:
    """A run folder as the runner leaves it (config.yaml, best.pt, checkpoint.pt), its weights freshly built: what
    the evaluation reads, without training."""
    cfg = compose_cfg(["experiment=smoke", "backbone.n_layers=1", f"run_dir={folder}",
                       f"results.dir={folder.parent / 'results'}", *overrides])
    validate(cfg)
    model = engine.build_model(cfg.model.name, model_options(cfg), cfg.backbone, shape)
    files = RunFiles(folder)
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    files.save_best(model.state_dict(), 1, 0.5)
    files.save_checkpoint({"model": model.state_dict(), "state": {"step": 2}})
    return folder


@pytest.mark.heavy  # CI's second tier: a run and two evaluations per model
@pytest.mark.parametrize("name", list_models())
def test_every_model_scores_one_file_with_its_best_and_final_weights(name, tmp_path):
    """A checkpoint holds more than tensors for some mixers (the performer's redraw counters, a dict: an AttributeError
    once, for best and final weights alike); every model's weights score a whole file, ListOps' TSV or, for a 2-D
    mixer, CIFAR-10's parquet."""
    grid = getattr(get_model_class(name), "needs_grid", False)
    if grid:
        file, task, shape = image_file(tmp_path), IMAGE, engine.TaskShape(257, 1024, 10, padded=False, grid=(32, 32))
    else:
        file, task, shape = listops_file(tmp_path), ("task=listops", "task.seq_len=256"), engine.TaskShape(16, 256, 10)
    run_dir = saved_run(tmp_path / "run", (*task, f"model={name}"), shape)
    for checkpoint, step in (("best", 1), ("final", 2)):
        row = ev.evaluate_run(run_dir, [f"data.path={file}"], checkpoint=checkpoint)
        assert row["n_examples"] == (4 if grid else 20) and 0.0 <= row["accuracy"] <= 1.0 and row["step"] == step
        assert row["data_source"] == str(file) and row["data_version"].startswith(f"{file.name} sha256 ")


def text_file(folder: Path) -> Path:
    return parquet_file(folder / "imdb_test.parquet", {"text": ["great film", "dull", "<br />fine"] * 2,
                                                       "label": [1, 0, 1] * 2})


def retrieval_file(folder: Path) -> Path:
    path = folder / "new_aan_pairs.test.tsv"
    path.write_text("".join(f"{i % 2}.0\tid{i}\tid{i + 1}\tb'paper {i}'\tb'paper {i + 1}'\n" for i in range(5)))
    return path


def pathfinder_file(folder: Path) -> Path:
    """The release layout: metadata/<k>.npy listing images under imgs/<k>/ (one listed image is missing: dropped)."""
    (folder / "imgs" / "0").mkdir(parents=True)
    for i in range(3):
        (folder / "imgs" / "0" / f"sample_{i}.png").write_bytes(png(60 * i, 32))
    (folder / "metadata").mkdir()
    lines = [f"imgs/0 sample_{i}.png {i} {i % 2} 0 0" for i in range(4)]
    (folder / "metadata" / "0.npy").write_text("\n".join(lines) + "\n")
    return folder / "metadata" / "0.npy"


@pytest.mark.parametrize("task, overrides, make, n", [
    ("text", ("task.seq_len=256",), text_file, 6),
    ("retrieval", ("task.seq_len=256",), retrieval_file, 5),
    ("pathfinder", (), pathfinder_file, 3),
])
def test_one_file_of_each_tasks_test_format_is_scored_whole(task, overrides, make, n, tmp_path):
    """docs/cli.md names each task's file: IMDb's parquet, the AAN pairs' TSV, a Pathfinder metadata file."""
    data = load_file(compose_cfg(["experiment=smoke", f"task={task}", *overrides]), make(tmp_path))
    file = Path(data.info["source"])
    run_dir = saved_run(tmp_path / "run", (f"task={task}", *overrides), runner.task_shape(data))
    row = ev.evaluate_run(run_dir, [f"data.path={file}"])
    assert row["n_examples"] == n and row["data_version"].startswith(f"{file.name} sha256 ") and row["split"] == "test"


def test_a_file_is_scored_whole_unless_this_command_limits_it(trained, tmp_path, caplog):
    """The run's data.limit.test (32 in the smoke preset) is the run's: a file of 50 examples is scored on all 50, or
    on data.limit.test given here. On the run's own data its limit stays, and the evaluation says it cut the split."""
    run_dir, row = trained
    file = listops_file(tmp_path, 50)
    assert ev.evaluate_run(run_dir, [f"data.path={file}"])["n_examples"] == 50
    assert ev.evaluate_run(run_dir, [f"data.path={file}", "data.limit.test=7"])["n_examples"] == 7
    with caplog.at_level(logging.WARNING, logger="lra"):
        own = ev.evaluate_run(run_dir)
    assert own["n_examples"] == 32 and "the run's data.limit.test=32 applies" in caplog.text
    assert own["data_version"] == row["data"]  # as the run's row records its data
    with pytest.raises(ConfigError, match="is the data to score, one split: drop --split val"):
        ev.evaluate_run(run_dir, [f"data.path={file}"], split="val")
    with pytest.raises(DataError, match="data.path=.*missing.tsv: no such file; for task listops data.path is one"):
        ev.evaluate_run(run_dir, [f"data.path={tmp_path / 'missing.tsv'}"])
