"""``trainer.deterministic``: the same command and seed give the same weights and validation curve (bit for bit on
the CPU here, on CUDA in the GPU test), another seed other weights; the switch is how a run executes, so it names
neither the config hash nor the run's folder, and the row records it. Mixers keep off backends without a
deterministic backward, and an op torch has no deterministic kernel for stops the run, naming it."""
from __future__ import annotations

import json
import os

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import lra.train.run as runner
from lra.config import sweep_slug
from lra.errors import ConfigError
from lra.provenance import config_hash, departures
from lra.train import engine
from lra.train.checkpoint import RunFiles
from models import create_model, list_models
from models._scan import scan
from models.base import checked_backend, ordered_cumsum, takes_fused_path
from models.registry import get_model_class
from tests.conftest import CONF, compose_cfg

# short and shallow, with the task's dropout on: the runs differ by seed in their initial weights, dropout masks and
# batches
SHORT = ("task.seq_len=256", "backbone.n_layers=1", "schedule.steps=4", "schedule.eval_every=2", "data.limit.val=8",
         "data.limit.test=8", "trainer.deterministic=true")


@pytest.fixture(autouse=True)
def torch_left_as_found():
    """Deterministic mode is process-wide: each test leaves torch (and the cuBLAS variable) as it found them."""
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    engine.set_deterministic(False)
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


def trained(cfg) -> tuple[dict, dict, list]:
    """Runs ``cfg``: (its row, its final weights, its validation curve)."""
    row = runner.run(cfg)
    files = RunFiles(cfg.run_dir)
    return row, files.load_checkpoint()["model"], json.loads(files.history.read_text())


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def test_one_seed_twice_gives_the_same_weights_and_curve_bit_for_bit(smoke_cfg, tmp_path, monkeypatch):
    modes = []
    step = engine.train_step
    monkeypatch.setattr(engine, "train_step", lambda *a, **k: modes.append(
        (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()))
        or step(*a, **k))
    row, weights, curve = trained(smoke_cfg(*SHORT, f"run_dir={tmp_path / 'a'}"))
    again, weights_again, curve_again = trained(smoke_cfg(*SHORT, f"run_dir={tmp_path / 'b'}"))
    assert row["status"] == again["status"] == "ok" and len(curve) == 2
    assert same_weights(weights, weights_again)
    assert curve == curve_again  # step, training loss, validation accuracy, learning rate at each evaluation
    assert row["test_acc"] == again["test_acc"] and row["final_test_acc"] == again["final_test_acc"]
    assert set(modes) == {(True, False)}  # every step in torch's strict deterministic mode
    assert row["deterministic"] is True
    assert list(pd.read_csv(tmp_path / "results" / "runs.csv")["deterministic"]) == [True, True]


def test_another_seed_gives_other_weights(smoke_cfg, tmp_path):
    """The comparison above can fail: what the seed draws (initial weights, dropout, batch order) reaches them."""
    _, weights, curve = trained(smoke_cfg(*SHORT, f"run_dir={tmp_path / 'a'}"))
    _, other, other_curve = trained(smoke_cfg(*SHORT, "seed=1", f"run_dir={tmp_path / 'b'}"))
    assert not same_weights(weights, other) and curve != other_curve


def test_the_switch_names_neither_the_config_hash_nor_the_run_folder():
    """How a run executes, not what it computes: a run continued with the switch flipped finds its folder and
    checkpoint, and a preset with it on is not a modified one."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        plain, switched = (compose("config", overrides=["seed=3", *extra], return_hydra_config=True)
                           for extra in ([], ["trainer.deterministic=true"]))
    assert switched.trainer.deterministic is True and plain.trainer.deterministic is False
    assert switched.hydra.job.override_dirname == plain.hydra.job.override_dirname == "seed=3"
    hashes = {config_hash(OmegaConf.to_container(compose_cfg(["run_dir=x", *extra]), resolve=True))
              for extra in ([], ["trainer.deterministic=true"])}
    assert len(hashes) == 1
    assert sweep_slug(["seed=0,1", "trainer.deterministic=true"]) == sweep_slug(["seed=0,1"])
    assert departures("task=listops trainer.deterministic=true") == []


def test_a_run_resumed_with_the_switch_flipped_goes_on_and_is_not_called_deterministic(smoke_cfg, monkeypatch):
    """The checkpoint of a run started without the switch is this run's (the same hash), so turning it on resumes
    it; the row says deterministic only when every step was."""
    step, calls = engine.train_step, []

    def stop_after_two(*args, **kwargs):
        calls.append(1)
        runner.STOP.requested = len(calls) == 2
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "train_step", stop_after_two)
    with pytest.raises(runner.RunInterrupted, match="stopped at step 2"):
        runner.run(smoke_cfg(*SHORT, "trainer.deterministic=false"))
    monkeypatch.setattr(engine, "train_step", step)
    row = runner.run(smoke_cfg(*SHORT))
    assert (row["status"], row["steps"], row["deterministic"]) == ("ok", 4, False)


def test_configure_turns_the_mode_on_and_off(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    engine.configure(torch.device("cpu"), 1, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert torch._inductor.config.deterministic
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in engine.DETERMINISTIC_CUBLAS  # before cuBLAS's first call
    engine.configure(torch.device("cpu"), 1)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert not torch._inductor.config.deterministic


def test_an_op_without_a_deterministic_kernel_stops_the_run_naming_model_and_op(smoke_cfg, tmp_path, monkeypatch):
    """torch raises at an op it has only a nondeterministic kernel for (put_ stands in for a CUDA one): the run stops
    as for a setting that cannot run, in one line naming the model and the op, with no row."""
    def step(*args, **kwargs):
        torch.zeros(2).put_(torch.tensor([0, 0]), torch.ones(2))  # two writes to one place, in no fixed order

    monkeypatch.setattr(engine, "train_step", step)
    with pytest.raises(ConfigError, match="model transformer calls put_, which has no deterministic implementation"):
        runner.run(smoke_cfg(*SHORT))
    assert not (tmp_path / "results" / "runs.csv").exists()


def test_mixers_keep_off_backends_without_a_deterministic_backward(smoke_cfg, tmp_path):
    """FlexAttention sums a score table's gradient by atomic adds: in deterministic mode ``auto`` takes the mixer's
    other path, and asking for flex is refused before the run starts."""
    synthesizer = create_model("synthesizer", d_model=32, n_heads=2, d_qkv=32, dropout=0.0, max_len=64)
    etc = create_model("etc", d_model=32, n_heads=2, d_qkv=32, dropout=0.0, max_len=64)
    assert takes_fused_path(synthesizer, "flex", on_cuda=True)
    engine.set_deterministic(True)
    assert not takes_fused_path(synthesizer, "flex", on_cuda=True)
    with pytest.raises(ValueError, match="etc: backend flex sums its gradients in no fixed order"):
        checked_backend(etc, "flex", "etc")
    assert checked_backend(etc, "sdpa") == "sdpa"
    with pytest.raises(ConfigError, match="trainer.mixer_backend=flex: etc: backend flex"):
        runner.run(smoke_cfg(*SHORT, "model=etc", "trainer.mixer_backend=flex"))
    assert not (tmp_path / "results" / "runs.csv").exists()


def test_a_scan_through_fla_is_refused_in_deterministic_mode():
    q = k = v = torch.zeros(1, 1, 4, 2)
    engine.set_deterministic(True)
    with pytest.raises(ValueError, match="does not cover: set scan=chunked"):
        scan(q, k, v, torch.zeros(1, 1, 4, 1), mode="fla", chunk=2)


@pytest.mark.parametrize("shape, dim", [((3, 5, 7), 1), ((2, 64), -1), ((2, 9, 3), 0), ((6,), 0), ((2, 1), 1)])
def test_the_ordered_cumsum_is_the_cumsum(shape, dim):
    """The fixed-order scan that replaces a floating CUDA cumsum in deterministic mode, against torch's, with its
    gradient."""
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    g = torch.randn(shape, dtype=torch.float64)
    ours = ordered_cumsum(x, dim)
    theirs = x.cumsum(dim)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours, x, g)[0], torch.autograd.grad(theirs, x, g)[0])


# every model the runner trains on ListOps (the 2-D mixers need an image task's grid), eagerly, and the transformer
# compiled as well, as runs on CUDA are by default
CUDA_RUNS = [("transformer", "auto"), *((name, "false") for name in list_models()
                                          if not getattr(get_model_class(name), "needs_grid", False))]


@pytest.mark.gpu
@pytest.mark.parametrize("model, compile", CUDA_RUNS)
def test_a_deterministic_run_on_cuda_repeats_bit_for_bit(smoke_cfg, tmp_path, model, compile):
    """On CUDA, under bf16 autocast: SDPA's fused backward in torch's strict mode, and the fallbacks of the models that
    need one (synthesizer: SDPA instead of FlexAttention; deberta, gla, mamba: the ordered cumsum), give the same
    weights and curve twice, and no op stops the run."""
    overrides = (*SHORT, "device=cuda", f"model={model}", f"trainer.compile={compile}")
    row, weights, curve = trained(smoke_cfg(*overrides, f"run_dir={tmp_path / 'a'}"))
    again, weights_again, curve_again = trained(smoke_cfg(*overrides, f"run_dir={tmp_path / 'b'}"))
    assert row["status"] == again["status"] == "ok" and row["device"] == torch.cuda.get_device_name()
    assert same_weights(weights, weights_again) and curve == curve_again
