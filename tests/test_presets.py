"""experiment=lra's per-model settings for Image and Pathfinder-32: one protocol entry per (task, model) in
conf/experiment/lra.yaml, composed by Hydra for that task and model. Each composed config equals LRA's table
(LRA's released configs, transcribed once more below: the presets are the other transcription) except for the
departures its file names; experiment=defaults, and a model LRA did not run, keep the task's own backbone; every
preset builds a model that runs on a 32 x 32 image."""
from __future__ import annotations

import functools

import pytest
import torch
from omegaconf import OmegaConf

from lra.config import BackboneConfig, experiment_protocols, model_options, validate
from lra.train.engine import TaskShape, build_model
from models import model_defaults
from tests.conftest import CONF, compose_cfg

LRA_FILE = CONF / "experiment" / "lra.yaml"
PROTOCOL = experiment_protocols(CONF / "experiment")["lra"]


def entry_comment(key: str) -> str:
    """The comments of protocol entry ``key`` in lra.yaml: those above it (up to the blank line before) and those
    in its body."""
    lines = LRA_FILE.read_text().splitlines()
    start = end = lines.index(f"  {key}:")
    while start > 0 and lines[start - 1].strip():
        start -= 1
    end += 1
    while end < len(lines) and lines[end].startswith("    "):
        end += 1
    return " ".join(line.split("#", 1)[1] for line in lines[start:end] if "#" in line)
TASKS = ("image", "pathfinder")
LRA_MODELS = ("transformer", "local", "sparse", "longformer", "linformer", "reformer", "sinkhorn", "synthesizer",
              "bigbird", "linear", "performer")

# LRA's per-model Image (CIFAR-10) configs: layers/heads/emb/qkv/mlp/pool, then whatever else the model's
# config sets. Everything else is the Image base (below).
IMAGE_BASE = "dropout 0.3, attn_dropout 0.2, positions learned, wd 0"
IMAGE = {
    "transformer": "1/8/128/64/128/CLS",
    "local": "1/2/128/64/128/MEAN, block 64",
    "sparse": "1/8/128/64/128/CLS",
    "longformer": "4/4/128/64/128/MEAN",
    "linformer": "1/8/128/64/128/CLS",
    "reformer": "4/8/64/32/64/CLS",
    "sinkhorn": "1/1/32/32/64/CLS, block 64, wd 0.7, dropout 0.1",  # the base's 1 head, emb 32, qkv 32, mlp 64, CLS
    "synthesizer": "1/8/128/64/128/CLS, mode random",
    "bigbird": "1/1/128/64/128/CLS, block 64, num_head 4",  # num_heads: the base's 1; `num_head=4`, a typo key
    "linear": "1/8/128/64/128/CLS",
    "performer": "1/8/128/64/128/CLS",
}
# LRA's per-model Pathfinder-32 configs (all MEAN, sinusoidal): layers/heads/emb/qkv/mlp/dropout.
PATHFINDER_BASE = "pool MEAN, attn_dropout 0.1, positions sinusoidal, wd 0"
PATHFINDER = {
    "transformer": "4/4/32/16/32/0.2",
    "local": "2/4/64/32/64/0.1, block 64",
    "sparse": "1/8/32/16/32/0.2",
    "longformer": "2/2/32/16/32/0.1",
    "linformer": "1/2/32/16/32/0.2",
    "reformer": "2/8/64/32/64/0.2",
    "sinkhorn": "2/4/32/16/64/0.2, block 64",
    "synthesizer": "2/4/64/32/64/0.2, mode random",
    "bigbird": "4/2/64/32/64/0.2, block 64",
    "linear": "1/2/128/64/128/0.2",
    "performer": "4/8/32/16/32/0.2",
}
TABLES = {"image": (IMAGE_BASE, ("layers", "heads", "emb", "qkv", "mlp", "pool"), IMAGE),
          "pathfinder": (PATHFINDER_BASE, ("layers", "heads", "emb", "qkv", "mlp", "dropout"), PATHFINDER)}

# Where the grid departs from LRA's config, each explained in its preset's comment.
DEPARTURES = {
    # LRA's Sinkhorn encoder takes only MEAN; the config's CLS raises.
    ("image", "sinkhorn"): {"backbone.pooling": "mean"},
    # `num_head = 4` is a typo for num_heads (the released config probably errors): read as meant.
    ("image", "bigbird"): {"backbone.n_heads": 4},
    # LRA's Reformer attention ignores qkv_dim and runs at the input width, emb.
    ("image", "reformer"): {"backbone.d_qkv": 64},
    ("pathfinder", "reformer"): {"backbone.d_qkv": 64},
}
# What LRA's code does that its configs leave unsaid, per model, in our keys: its local attention groups positions
# congruent modulo N/block (lra_benchmarks/models/local/local_attention.py).
CODE = {"local": {"model.strided": True}}
# LRA's option names -> ours, per model.
MIXER_KEYS = {("local", "block"): "block", ("bigbird", "block"): "block", ("sinkhorn", "block"): "block_size",
              ("synthesizer", "mode"): "variant"}
PER_MODEL_BACKBONE = {"n_layers", "n_heads", "d_model", "d_qkv", "d_ff", "d_classifier", "pooling", "dropout"}
CASES = [(t, m) for t in TASKS for m in LRA_MODELS]


def lra_row(task: str, model: str) -> dict:
    """LRA's settings for (task, model) in LRA's words: the base, then the model's row."""
    base, columns, rows = TABLES[task]
    first, *rest = rows[model].split(", ")
    row = dict(item.split(" ") for item in base.split(", "))
    row.update(zip(columns, first.split("/"), strict=True))
    row.update(item.split(" ") for item in rest)
    return row


def expected(task: str, model: str) -> dict:
    """LRA's row in our keys, with the grid's departures."""
    lra = lra_row(task, model)
    want = {
        "backbone.n_layers": int(lra["layers"]), "backbone.n_heads": int(lra["heads"]),
        "backbone.d_model": int(lra["emb"]), "backbone.d_qkv": int(lra["qkv"]), "backbone.d_ff": int(lra["mlp"]),
        "backbone.d_classifier": int(lra["mlp"]),  # LRA's mlp_dim is also its classifier head's width
        "backbone.pooling": lra["pool"].lower(), "backbone.dropout": float(lra["dropout"]),
        "backbone.attn_dropout": float(lra["attn_dropout"]), "backbone.positions": lra["positions"],
        "optim.weight_decay": float(lra["wd"]),
    }
    for (m, key), ours in MIXER_KEYS.items():
        if m == model and key in lra:
            want[f"model.{ours}"] = int(lra[key]) if lra[key].isdigit() else lra[key]
    return {**want, **CODE.get(model, {}), **DEPARTURES.get((task, model), {})}


def flat(node, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def task_defaults(task: str) -> tuple[dict, float]:
    """The task's own backbone (the schema's defaults, then conf/task/<task>.yaml) and weight decay."""
    cfg = OmegaConf.merge(OmegaConf.structured(BackboneConfig), OmegaConf.load(CONF / "task" / f"{task}.yaml").backbone)
    return OmegaConf.to_container(cfg), OmegaConf.load(CONF / "task" / f"{task}.yaml").optim.weight_decay


@functools.cache
def composed(task: str, model: str, experiment: str = "lra"):
    """The validated run config (cached: several tests read the same one, none changes it)."""
    return validate(compose_cfg([f"task={task}", f"model={model}", f"experiment={experiment}", "run_dir=x"]))


def test_the_table_is_transcribed_whole():
    for task, (_, _, rows) in TABLES.items():
        assert set(rows) == set(LRA_MODELS), task
    assert lra_row("image", "sinkhorn") == {"layers": "1", "heads": "1", "emb": "32", "qkv": "32", "mlp": "64",
                                            "pool": "CLS", "block": "64", "wd": "0.7", "dropout": "0.1",
                                            "attn_dropout": "0.2", "positions": "learned"}


def test_one_entry_per_lra_model_on_image_and_pathfinder():
    found = {key for key in PROTOCOL if key.partition("/")[0] in TASKS and "/" in key}
    assert found == {f"{t}/{m}" for t, m in CASES}


@pytest.mark.parametrize("task,model", CASES)
def test_entry_says_where_it_comes_from_and_holds_lras_whole_row(task, model):
    comment = entry_comment(f"{task}/{model}")
    assert comment.lstrip().startswith("LRA's")
    assert "lra_benchmarks/" in comment  # the LRA config file it transcribes
    assert ("Departure" in comment) == ((task, model) in DEPARTURES), "a departure must be explained, and only one"
    own = flat(OmegaConf.to_container(PROTOCOL[f"{task}/{model}"]))
    assert {f"backbone.{k}" for k in PER_MODEL_BACKBONE} <= set(own), "the entry restates LRA's whole row"
    assert set(own) <= set(expected(task, model)), "the entry sets a value the table does not hold"


@pytest.mark.parametrize("task,model", CASES)
def test_experiment_lra_composes_lras_settings_for_task_and_model(task, model):
    cfg = composed(task, model)
    assert cfg.experiment == "lra"
    got = {key: OmegaConf.select(cfg, key) for key in expected(task, model)}
    assert got == expected(task, model)
    assert cfg.backbone.d_qkv % cfg.backbone.n_heads == 0
    if model in ("local", "bigbird"):  # block-sparse patterns: blocks nest in the 128-wide FlexAttention tiles
        assert 128 % cfg.model.block == 0 or cfg.model.block % 128 == 0


@pytest.mark.heavy  # CI's second tier: a composition per task and model
@pytest.mark.parametrize("task,model", CASES)
def test_experiment_defaults_keeps_the_tasks_backbone_and_the_models_defaults(task, model):
    cfg = composed(task, model, "defaults")
    backbone, weight_decay = task_defaults(task)
    assert OmegaConf.to_container(cfg.backbone) == backbone
    assert cfg.optim.weight_decay == weight_decay
    assert OmegaConf.to_container(cfg.model) == {"name": model, **model_defaults(model)}


@pytest.mark.heavy  # CI's second tier: the registry per task
@pytest.mark.parametrize("task", TASKS)
def test_a_model_without_a_preset_gets_the_tasks_backbone(task):
    others = sorted({p.stem for p in (CONF / "model").glob("*.yaml")} - set(LRA_MODELS))
    assert others
    backbone, weight_decay = task_defaults(task)
    for model in others:
        assert f"{task}/{model}" not in PROTOCOL
        cfg = compose_cfg([f"task={task}", f"model={model}", "run_dir=x"])
        assert (cfg.experiment, cfg.model.name) == ("lra", model)
        assert OmegaConf.to_container(cfg.backbone) == backbone, model
        assert cfg.optim.weight_decay == weight_decay, model


@pytest.mark.parametrize("task", TASKS)
def test_lras_transformer_row_is_the_tasks_own_backbone(task):
    """LRA's Transformer config is each task's base here: its preset changes nothing but the experiment's name
    (so the published rows of the task's Transformer keep their config)."""
    backbone, _ = task_defaults(task)
    lra, ours = (OmegaConf.to_container(composed(task, "transformer", e)) for e in ("lra", "defaults"))
    assert lra.pop("experiment") == "lra" and ours.pop("experiment") == "defaults"
    assert lra == ours and lra["backbone"] == backbone


@pytest.mark.parametrize("task,model", CASES)
def test_every_preset_builds_and_runs_on_a_32x32_image(task, model):
    cfg = composed(task, model)
    b = cfg.backbone
    torch.manual_seed(0)
    net = build_model(model, model_options(cfg), b, TaskShape(257, 1024, 10, grid=(32, 32))).eval()
    blocks = net.encoder.blocks
    assert len(blocks) == b.n_layers
    assert all(blk.mixer.n_heads == b.n_heads and blk.mixer.n_heads * blk.mixer.d_head == b.d_qkv for blk in blocks)
    tokens = torch.randint(1, 257, (1, 1024))
    with torch.no_grad():
        logits = net(tokens)
    assert logits.shape == (1, 10) and torch.isfinite(logits).all()


# experiment=trainable: LRA's protocol and these changes alone (conf/experiment/trainable.yaml, docs/protocol.md)
TRAINABLE = {"listops": {"backbone.pooling": "mean"}, "pathfinder": {"backbone.positions": "learned"},
             "listops/performer": {"model.n_features": 256, "model.redraw_every": 1000}}


@pytest.mark.heavy  # CI's second tier: the registry composed twice per task
@pytest.mark.parametrize("task", ["listops", "text", "image", "pathfinder"])
def test_trainable_is_lra_with_only_its_named_changes(task):
    for model in LRA_MODELS:
        lra = flat(OmegaConf.to_container(composed(task, model)))
        trainable = flat(OmegaConf.to_container(composed(task, model, "trainable")))
        changed = {key: value for key, value in trainable.items() if lra.get(key) != value}
        want = {"experiment": "trainable", **TRAINABLE.get(task, {}), **TRAINABLE.get(f"{task}/{model}", {})}
        assert changed == {k: v for k, v in want.items() if lra.get(k) != v}, model
        assert set(trainable) == set(lra), model
