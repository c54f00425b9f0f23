"""Self-pretraining (``pretrain=mlm|causal``: ``lra.train.pretrain``, the runner's ``Pretrainer``) on CPU: each task's
masking rate, masks and targets that never touch padding, a causal form that never sees the token it predicts, a
phase that reads the training split only, a classifier that starts from exactly the pretrained encoder's weights with
its own head, resume in either phase, causal pretraining refused for a mixer without a causal form, and both phases
of every task end to end, in one row that names its pretraining."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

import lra.train.run as runner
from lra.config import validate
from lra.data import load_task
from lra.errors import ConfigError
from lra.provenance import config_hash
from lra.report.leaderboard import normalise
from lra.report.results import PRETRAIN_CURVE_COLUMNS, RUN_COLUMNS, curve_path
from lra.train import engine, pretrain
from lra.train.encoder import Encoder
from lra.train.pretrain import IGNORE
from tests.conftest import ROOT, compose_cfg, in_background
from tests.test_data_tasks import write_aan_release, write_cifar_parquet, write_imdb_parquet
from tests.test_run import stop_during_step

# the runner's behaviour, not the model's: short sequences, one narrow layer, few examples to evaluate, on one
# thread (ops this small gain nothing from a second, which waits on the first where other processes share the cores)
ONE_THREAD = "trainer.threads=1"
TINY = ("task.seq_len=256", "backbone.n_layers=1", "backbone.d_model=32", "backbone.d_qkv=32", "backbone.d_ff=64",
        "backbone.d_classifier=64", "data.limit.val=8", "data.limit.test=8", ONE_THREAD)
PHASES = (*TINY, "pretrain=mlm", "pretrain.steps=3", "schedule.steps=4", "schedule.eval_every=2",
          "trainer.ckpt_every=100")
RESULT = ("val_acc", "test_acc", "final_val_acc", "final_test_acc", "best_step", "steps", "config_hash",
          "pretrain_hash")
RATES = {"listops": 0.1, "text": 0.15, "retrieval": 0.15, "image": 0.5, "pathfinder": 0.5, "pathx": 0.5}


@pytest.fixture(autouse=True)
def no_stall_baseline(monkeypatch):
    """Rows here go without their stall baseline (lra.baseline's classifiers, tests/test_baseline.py): about the
    phases, not it, they save its seconds a row."""
    monkeypatch.setattr(runner.Trainer, "stall_baseline", lambda self: None)


def padded_batch(n: int = 64, length: int = 512, vocab: int = 257, seed: int = 0) -> torch.Tensor:
    """(n, length) ids 1..vocab-1, each row cut to a random real length (at least 1) and padded with 0 after it."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (n, length), generator=g)
    lengths = torch.randint(1, length + 1, (n, 1), generator=g)
    return tokens.masked_fill(torch.arange(length) >= lengths, 0)


@pytest.mark.parametrize("task", sorted(RATES))
def test_each_task_masks_the_papers_share_of_its_real_tokens_and_never_padding(task):
    """The rate lives in the task's yaml (Amos, Berant & Gupta 2024: 10% ListOps, 15% text, 50% images); on a batch
    the masked share of real tokens is that rate within 4 standard deviations, padding is never masked, and every
    example predicts at least one token."""
    cfg = validate(compose_cfg([f"task={task}", "pretrain=mlm", "run_dir=x"]))
    rate = cfg.pretrain.mask_rate
    assert rate == RATES[task]
    tokens = padded_batch()
    real = tokens != 0
    masked = pretrain.masked_positions(tokens, rate, pretrain.mask_noise(0, 7, tokens.shape))
    assert not (masked & ~real).any() and masked.any(-1).all()
    n = int(real.sum())
    assert abs(int(masked.sum()) / n - rate) < 4 * math.sqrt(rate * (1 - rate) / n) + tokens.shape[0] / n
    again = pretrain.masked_positions(tokens, rate, pretrain.mask_noise(0, 7, tokens.shape))
    other = pretrain.masked_positions(tokens, rate, pretrain.mask_noise(0, 8, tokens.shape))
    assert torch.equal(masked, again) and not torch.equal(masked, other)  # a function of (seed, step)


def test_targets_are_the_masked_or_next_tokens_and_never_padding_or_the_cls_slot():
    tokens = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    masked = torch.tensor([[False, True, False, False], [True, False, False, False]])
    assert pretrain.masked_targets(tokens, masked, cls_token=True).tolist() == \
        [[IGNORE, IGNORE, 6, IGNORE, IGNORE], [IGNORE, 8, IGNORE, IGNORE, IGNORE]]
    assert pretrain.masked_targets(tokens, masked, cls_token=False).tolist() == \
        [[IGNORE, 6, IGNORE, IGNORE], [8, IGNORE, IGNORE, IGNORE]]
    # with a CLS slot output p predicts token p (the slot predicts the first); without, output p predicts token p + 1
    assert pretrain.next_token_targets(tokens, cls_token=True).tolist() == \
        [[5, 6, 7, IGNORE, IGNORE], [8, 9, IGNORE, IGNORE, IGNORE]]
    assert pretrain.next_token_targets(tokens, cls_token=False).tolist() == \
        [[6, 7, IGNORE, IGNORE], [9, IGNORE, IGNORE, IGNORE]]


@pytest.mark.parametrize("model", ["transformer", "linear"])
@pytest.mark.parametrize("cls_token", [True, False])
def test_the_causal_form_never_sees_the_token_an_output_predicts(model, cls_token):
    """Next-token pretraining through a mixer in its causal form: changing token k changes no output that predicts
    token k or one before it, and does change a later one."""
    torch.manual_seed(0)
    encoder = Encoder(model, {}, vocab_size=20, seq_len=12, n_layers=2, d_model=16, n_heads=2, d_qkv=16, d_ff=32,
                      dropout=0.0, attn_dropout=0.0, positions="learned", cls_token=cls_token)
    net = pretrain.TokenModel(encoder, 16, 20, "causal").eval()
    tokens = torch.randint(1, 20, (1, 12))
    tokens[0, 10:] = 0  # padding at the end
    k = 5
    changed = tokens.clone()
    changed[0, k] = 1 + tokens[0, k] % 19
    before, after = (net(t).view(1, -1, 20) for t in (tokens, changed))  # (1, N', V)
    sees_up_to = k if cls_token else k - 1  # the outputs that predict tokens 0..k
    torch.testing.assert_close(before[:, : sees_up_to + 1], after[:, : sees_up_to + 1], rtol=0, atol=0)
    assert not torch.allclose(before[:, sees_up_to + 1 :], after[:, sees_up_to + 1 :])


def test_both_phases_make_one_row_from_the_training_split_only_starting_from_exactly_the_pretrained_encoder(
        smoke_cfg, tmp_path, monkeypatch):
    """One command: the pretraining phase (its curve, result and encoder weights in run_dir/pretrain), then the
    task's training, in one row that names the phase's config hash. The phase's every input row is a training row.
    The classifier starts from the encoder the phase ended with, every weight of it, and its head as freshly
    initialised: nothing of the token head or the mask vector."""
    inputs, built, real_forward, real_build = [], {}, pretrain.TokenModel.forward, runner.Trainer.build

    def forward(self, tokens, masked=None):
        inputs.append(tokens.detach().clone())
        return real_forward(self, tokens, masked)

    def build(self, checkpoint, pretrained=None):
        if isinstance(self, runner.Pretrainer):
            return real_build(self, checkpoint, pretrained)
        rng = torch.get_rng_state()
        built["fresh"] = self.make_model().state_dict()  # as build makes it, before loading the encoder
        torch.set_rng_state(rng)
        real_build(self, checkpoint, pretrained)
        built["start"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    monkeypatch.setattr(pretrain.TokenModel, "forward", forward)
    monkeypatch.setattr(runner.Trainer, "build", build)
    cfg = smoke_cfg(*PHASES)
    row = runner.run(cfg)
    folder = tmp_path / "run" / "pretrain"
    phase = json.loads((folder / "result.json").read_text())
    assert row["status"] == phase["status"] == "ok" and row["steps"] == 4 and phase["steps"] == 3
    assert row["pretrain"] == "mlm" and row["pretrain_hash"] == phase["config_hash"] != row["config_hash"]
    runs = pd.read_csv(tmp_path / "results" / "runs.csv")
    assert list(runs.columns) == RUN_COLUMNS and len(runs) == 1 and runs.pretrain[0] == "mlm"
    curve = pd.read_csv(curve_path(tmp_path / "results", phase))
    assert list(curve.columns) == PRETRAIN_CURVE_COLUMNS and curve["step"].tolist() == [2, 3]
    assert ((curve["token_acc"] >= 0) & (curve["token_acc"] <= 1)).all() and (curve["train_loss"] > 0).all()

    data = load_task(cfg)  # the same slice, from the cache
    rows = {tuple(r) for r in data.train.tokens.long().tolist()}
    others = {tuple(r) for split in (data.val, data.test) for r in split.tokens.long().tolist()} - rows
    seen = {tuple(r) for batch in inputs for r in batch.tolist()}
    assert len(inputs) == 3 and seen <= rows and others and not seen & others

    weights = torch.load(folder / pretrain.ENCODER, weights_only=True)["encoder"]
    ended = torch.load(folder / "checkpoint.pt", weights_only=True)["model"]
    assert set(weights) == {k.removeprefix("encoder.") for k in ended if k.startswith("encoder.")}
    assert set(ended) - {f"encoder.{k}" for k in weights} == {"mask_vector", "head.weight", "head.bias"}
    start, fresh = built["start"], built["fresh"]
    assert {k for k in start if k.startswith("encoder.")} == {f"encoder.{k}" for k in weights}
    for key, value in weights.items():
        assert torch.equal(start[f"encoder.{key}"], value), key
        assert torch.equal(value, ended[f"encoder.{key}"]), key
    assert any(not torch.equal(fresh[f"encoder.{k}"], v) for k, v in weights.items())  # it was trained
    heads = [k for k in start if not k.startswith("encoder.")]
    assert heads and all(torch.equal(start[k], fresh[k]) for k in heads)  # the classifier's own, as initialised

    board = normalise(pd.concat([runs, runs.assign(pretrain=float("nan"))], ignore_index=True))
    assert board["experiment"].tolist() == ["smoke+pretrain_mlm", "smoke"]  # kept apart from runs from scratch


def test_a_run_without_pretraining_keeps_the_hash_it_had_before_the_setting_existed():
    """pretrain=none leaves the section out of the config hash (runs recorded before it resume and are recognised);
    a pretrained run's hash includes it."""
    plain = OmegaConf.to_container(compose_cfg(["run_dir=x"]), resolve=True)
    mlm = OmegaConf.to_container(compose_cfg(["run_dir=x", "pretrain=mlm"]), resolve=True)
    older = {k: v for k, v in plain.items() if k != "pretrain"}
    assert config_hash(plain) == config_hash(older) != config_hash(mlm)
    assert config_hash(mlm) == config_hash({**mlm, "pretrain": {**mlm["pretrain"], "stop_at": 3}})  # where it stops


def interrupt_the_first_classifier_build(monkeypatch) -> None:
    """The process ends between the phases: the pretraining has ended, the task's training never began."""
    real_build, calls = runner.Trainer.build, []

    def build(self, checkpoint, pretrained=None):
        if not isinstance(self, runner.Pretrainer) and not calls:
            calls.append(1)
            raise runner.RunInterrupted("between the phases")
        return real_build(self, checkpoint, pretrained)

    monkeypatch.setattr(runner.Trainer, "build", build)


def test_a_run_stopped_in_either_phase_resumes_to_the_uninterrupted_result(smoke_cfg, tmp_path, monkeypatch):
    """Stopped during the pretraining (its checkpoint), between the phases (the pretraining ended, no classifier
    yet) or during the task's training: the same command with resume=true ends with the uninterrupted run's row,
    and a pretraining that ended is not run again."""
    reference = runner.run(smoke_cfg(*PHASES, f"run_dir={tmp_path / 'ref'}"))
    real_step = engine.train_step
    for where, stop in (("pretraining", 2), ("between", None), ("training", 3 + 2)):
        run_dir = tmp_path / where
        if stop is None:
            interrupt_the_first_classifier_build(monkeypatch)
        else:
            stop_during_step(monkeypatch, stop)
        with pytest.raises(runner.RunInterrupted):
            runner.run(smoke_cfg(*PHASES, f"run_dir={run_dir}"))
        assert (run_dir / "pretrain" / "checkpoint.pt").exists() and not (run_dir / "result.json").exists()
        assert (run_dir / "checkpoint.pt").exists() == (where == "training")
        monkeypatch.undo()
        calls = stop_during_step(monkeypatch, 0)  # counts the steps, stops none
        resumed = runner.run(smoke_cfg(*PHASES, f"run_dir={run_dir}", "resume=true"))
        monkeypatch.setattr(engine, "train_step", real_step)
        assert calls["n"] == {"pretraining": 1 + 4, "between": 4, "training": 4 - 2}[where], where
        for key in RESULT:
            assert resumed[key] == reference[key], (where, key)
    assert len(pd.read_csv(tmp_path / "results" / "runs.csv")) == 4  # one row a finished run


def test_pretrain_stop_at_ends_the_run_in_its_pretraining_and_it_goes_on_from_there(smoke_cfg, tmp_path):
    """pretrain.stop_at: a `stopped` row without accuracies, naming the phase; the same command adds nothing; without
    it the run goes on from the phase's checkpoint."""
    stopped = runner.run(smoke_cfg(*PHASES, "pretrain.stop_at=2"))
    assert stopped["status"] == "stopped: at pretraining step 2 of 3" and stopped["test_acc"] is None
    assert runner.run(smoke_cfg(*PHASES, "pretrain.stop_at=2"))["timestamp"] == stopped["timestamp"]
    finished = runner.run(smoke_cfg(*PHASES))
    assert finished["status"] == "ok" and finished["pretrain_hash"] == stopped["pretrain_hash"]
    assert pd.read_csv(tmp_path / "results" / "runs.csv")["status"].tolist() == [stopped["status"], "ok"]


@pytest.mark.parametrize("model", ["fnet", "performer"])
def test_causal_pretraining_of_a_mixer_without_a_causal_form_is_refused_in_one_line(smoke_cfg, tmp_path, model):
    """FNet cannot decode causally; the performer can, but its mixer here is bidirectional only: next-token targets
    through it would be read off its input."""
    with pytest.raises(ConfigError) as refused:
        runner.run(smoke_cfg(*TINY, f"model={model}", "pretrain=causal"))
    assert f"pretrain=causal needs a causal mixer: model {model}" in str(refused.value)
    assert "\n" not in str(refused.value) and not (tmp_path / "run").exists()


@in_background(lambda folder, environ: subprocess.run(
    [sys.executable, "-m", "lra", "task=listops", "model=fnet", "pretrain=causal", "experiment=smoke",
     f"hydra.run.dir={folder / 'run'}", f"results.dir={folder / 'results'}"], cwd=ROOT, env=environ,
    capture_output=True, text=True, timeout=600))
def test_the_command_refuses_causal_pretraining_of_fnet_with_one_line_and_code_2(ran_in_background):
    proc, folder = ran_in_background()
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: pretrain=causal needs a causal mixer") and not (folder / "run").exists()


def task_data(task: str, root) -> tuple[str, ...]:
    """The data option of ``task`` (small files in its original format), and a short sequence where it has no
    fixed length."""
    if task == "text":
        return f"data.path={write_imdb_parquet(root)}", "task.seq_len=256"
    if task == "retrieval":
        return f"data.root={write_aan_release(root)}", "task.seq_len=256"
    if task == "image":
        return (f"data.path={write_cifar_parquet(root)}",)
    if task == "pathfinder":
        return "data.limit.train=16", "data.limit.val=4", "data.limit.test=4"
    return ("task.seq_len=256",)


@pytest.mark.heavy  # CI's second tier: both phases on every task
@pytest.mark.parametrize("task,objective", [("listops", "causal"), ("text", "mlm"),
                                            ("retrieval", "mlm"), ("image", "mlm"), ("image", "causal"),
                                            ("pathfinder", "mlm")])
def test_both_phases_of_every_task(smoke_cfg, tmp_path, task, objective):
    """The smoke preset's backbone, one layer, two steps of each phase (ListOps with mlm: the test above)."""
    row = runner.run(smoke_cfg(f"task={task}", *task_data(task, tmp_path / "sources"), "backbone.n_layers=1",
                               "data.limit.val=4", "data.limit.test=4", f"pretrain={objective}", "pretrain.steps=2",
                               "schedule.steps=2", "schedule.eval_every=2", ONE_THREAD))
    phase = json.loads((tmp_path / "run" / "pretrain" / "result.json").read_text())
    assert row["status"] == phase["status"] == "ok" and row["task"] == task and row["pretrain"] == objective
    assert row["pretrain_hash"] == phase["config_hash"] and 0 <= row["test_acc"] <= 1
    assert phase["token_acc"] is not None and 0 <= phase["token_acc"] <= 1 and math.isfinite(phase["train_loss"])
