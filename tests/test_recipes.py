"""The backbone options of published recipes and the ``experiment=s4d_lra`` presets built on them.

Options: each changes what it should and nothing else (post-norm blocks equal their formula; BatchNorm's
statistics ignore padding, in training and in evaluation; ``mlp=false`` has no MLP; ``positions=none`` no
table; the pixel embedding maps a known image to the expected inputs, in fp32 under autocast); bad values
fail at start in one line; at their defaults they leave the config hash as it was. Presets: each of LRA's
six tasks composes with ``experiment=s4d_lra``, validates, builds, and sets the S4 repository's recipe (the
table below restates S4's v3 configs), including the SSM's own optimiser group; one runs through the runner.
"""
from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import lra.train.run as runner
from lra.config import model_options, validate
from lra.errors import ConfigError
from lra.provenance import config_hash
from lra.train import engine
from lra.train.encoder import Block, Classifier, Encoder, LayerNorm, MaskedBatchNorm, pool
from models import create_model
from models.base import TiedDropout
from tests.conftest import compose_cfg

D = 16


def mixer(d_model: int = D):
    return create_model("s4d", d_model=d_model, n_heads=2, d_qkv=d_model, dropout=0.0, max_len=64)


def encoder(**options) -> Encoder:
    """A small S4D encoder; ``options`` override the backbone's (defaults: LRA's)."""
    torch.manual_seed(0)
    kw = dict(vocab_size=20, seq_len=64, n_layers=2, d_model=D, n_heads=2, d_qkv=D, d_ff=32, dropout=0.0,
              attn_dropout=0.0, positions="learned", cls_token=False)
    return Encoder("s4d", {}, **{**kw, **options})


# -- the options ---------------------------------------------------------------------------------------------------
def test_post_norm_block_equals_its_formula():
    torch.manual_seed(0)
    block = Block(mixer(), D, 32, dropout=0.0, prenorm=False).eval()
    for p in block.parameters():  # not the identity init of the norms, so a misplaced norm shows
        p.data.normal_()
    x, mask = torch.randn(2, 10, D), torch.ones(2, 10, dtype=torch.bool)
    n1, n2, mlp = block.norm1, block.norm2, block.mlp
    with torch.no_grad():
        h = F.layer_norm(x + block.mixer(x, mask), (D,), n1.weight, n1.bias, n1.eps)
        want = F.layer_norm(h + mlp(h), (D,), n2.weight, n2.bias, n2.eps)
        torch.testing.assert_close(block(x, mask), want)


def test_pre_norm_block_is_unchanged_and_mlp_false_leaves_the_mixer_sub_block():
    torch.manual_seed(0)
    block = Block(mixer(), D, 32, dropout=0.0).eval()
    for p in block.parameters():
        p.data.normal_()
    x, mask = torch.randn(2, 10, D), torch.ones(2, 10, dtype=torch.bool)
    n1, n2 = block.norm1, block.norm2
    with torch.no_grad():
        h = x + block.mixer(F.layer_norm(x, (D,), n1.weight, n1.bias, n1.eps), mask)
        torch.testing.assert_close(block(x, mask), h + block.mlp(F.layer_norm(h, (D,), n2.weight, n2.bias, n2.eps)))
        block.mlp = block.norm2 = None  # what mlp=False builds
        torch.testing.assert_close(block(x, mask), h)


def test_mlp_false_has_no_mlp_parameters():
    with_mlp, without = encoder(), encoder(mlp=False)
    names = {n for n, _ in without.named_parameters()}
    assert not any(".mlp." in n or ".norm2." in n for n in names)
    extra = sum(p.numel() for n, p in with_mlp.named_parameters() if n not in names)
    assert extra == 2 * (D * 32 + 32 + 32 * D + D + 2 * D)  # two layers of MLP (D -> 32 -> D) + its LayerNorm
    assert all(b.mlp is None and b.norm2 is None for b in without.blocks)


def test_post_norm_encoder_has_no_final_norm_and_batchnorm_everywhere_else():
    enc = encoder(norm="batchnorm", prenorm=False, mlp=False)
    assert enc.norm is None
    assert all(isinstance(b.norm1, MaskedBatchNorm) for b in enc.blocks)
    pre = encoder(norm="batchnorm")
    assert isinstance(pre.norm, MaskedBatchNorm) and isinstance(pre.blocks[0].norm2, MaskedBatchNorm)
    assert isinstance(encoder().norm, LayerNorm)


def test_last_pooling_takes_each_examples_last_real_position():
    h = torch.randn(3, 7, 4)
    mask = torch.arange(7) < torch.tensor([7, 3, 1])[:, None]  # (3, 7): 7, 3 and 1 real positions
    torch.testing.assert_close(pool(h, mask, "last"), torch.stack([h[0, 6], h[1, 2], h[2, 0]]))
    torch.testing.assert_close(pool(h, None, "last"), h[:, -1])
    with pytest.raises(ValueError, match="pooling must be one of cls, mean, last"):
        pool(h, mask, "max")


def test_positions_none_has_no_table():
    enc = encoder(positions="none")
    assert enc.pos is None and not any("pos" in n for n in enc.state_dict())


def padded_batch(d: int = D):
    """(3, 12, d) hidden states of which the first 4, 9 and 12 positions are real."""
    torch.manual_seed(1)
    x = torch.randn(3, 12, d) * 3 + 1
    mask = torch.arange(12) < torch.tensor([4, 9, 12])[:, None]  # (3, 12)
    x[~mask] = 1e3  # junk in the padding: any of it in the statistics shows
    return x, mask


def test_batchnorm_statistics_are_those_of_the_real_tokens_in_training():
    x, mask = padded_batch()
    bn, ref = MaskedBatchNorm(D).train(), torch.nn.BatchNorm1d(D).train()
    with torch.no_grad():
        for p, q in zip(bn.parameters(), ref.parameters()):
            p.normal_()
            q.copy_(p)
    for _ in range(3):  # the running statistics follow over several batches, as BatchNorm1d's
        out, want = bn(x, mask), ref(x[mask])  # BatchNorm1d over the real tokens alone: (n_real, D)
    torch.testing.assert_close(out[mask], want)
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 3
    assert torch.isfinite(out).all()


def test_batchnorm_without_a_mask_is_plain_batchnorm():
    x = torch.randn(3, 12, D)
    bn, all_real, ref = MaskedBatchNorm(D).train(), MaskedBatchNorm(D).train(), torch.nn.BatchNorm1d(D).train()
    out = bn(x, None)
    torch.testing.assert_close(out, ref(x.reshape(-1, D)).view_as(x))
    torch.testing.assert_close(all_real(x, torch.ones(3, 12, dtype=torch.bool)), out)  # the masked path agrees
    torch.testing.assert_close(all_real.running_var, bn.running_var)


def test_batchnorm_in_evaluation_uses_the_running_statistics():
    x, mask = padded_batch()
    bn = MaskedBatchNorm(D)
    bn(x, mask)
    bn.eval()
    want = (x - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias
    with torch.no_grad():
        torch.testing.assert_close(bn(x, mask), want)


@pytest.mark.parametrize("prenorm", [True, False])
def test_batchnorm_classifier_ignores_appended_padding_in_training_and_evaluation(prenorm):
    """The end-to-end property: a batch and the same batch with padding appended give the same logits, in
    training (the batch statistics count real tokens only) and in evaluation, and leave the same running
    statistics behind."""
    tokens = torch.randint(1, 20, (3, 40))
    tokens[0, 25:] = 0  # one example shorter than the others
    padded = torch.cat([tokens, torch.zeros(3, 24, dtype=torch.long)], dim=1)  # (3, 64)
    models = []
    for batch in (tokens, padded):
        torch.manual_seed(0)
        enc = encoder(norm="batchnorm", prenorm=prenorm, mlp=False, positions="none")
        model = Classifier(enc, D, D, 10, "mean").train()
        logits = model(batch)
        models.append((model, logits))
    (short, short_logits), (long, long_logits) = models
    torch.testing.assert_close(long_logits, short_logits, atol=1e-5, rtol=1e-4)
    for a, b in zip(short.buffers(), long.buffers()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(long.eval()(padded), short.eval()(tokens), atol=1e-5, rtol=1e-4)


def test_pixel_embedding_maps_a_known_image_to_its_normalised_values():
    pixels = torch.tensor([[0, 255, 128, 64]])  # one 2 x 2 image
    enc = encoder(seq_len=4, grid=(2, 2), embedding="pixels", pixel_mean=0.25, pixel_std=0.5, positions="none")
    assert isinstance(enc.embed, torch.nn.Linear) and enc.embed.in_features == 1
    want = (torch.tensor([[0.0, 1.0, 128 / 255, 64 / 255]]) - 0.25) / 0.5
    torch.testing.assert_close(enc.pixel_values(pixels + 1), want)  # ids are pixel + 1
    w, b = enc.embed.weight[:, 0], enc.embed.bias  # (D,), (D,)
    with torch.no_grad():
        torch.testing.assert_close(enc.embed_tokens(pixels + 1), want[..., None] * w + b)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # 256 gray levels need more than bf16's 8 bits
            under_autocast = enc.embed_tokens(pixels + 1)
    assert under_autocast.dtype == torch.float32
    torch.testing.assert_close(under_autocast, want[..., None] * w + b)


def test_pixel_embedding_keeps_padding_masked():
    """Id 0 is still padding (masked by the classifier): junk at it changes no logit."""
    torch.manual_seed(0)
    enc = encoder(seq_len=16, grid=(4, 4), embedding="pixels", positions="none", norm="batchnorm", mlp=False)
    model = Classifier(enc, D, D, 10, "mean").eval()
    image = torch.randint(1, 257, (2, 16))
    holes = image.clone()
    holes[:, 10:] = 0
    with torch.no_grad():
        torch.testing.assert_close(model(holes), model(image[:, :10]), atol=1e-5, rtol=1e-4)


def test_pixel_embedding_needs_an_image_task():
    with pytest.raises(ValueError, match="needs an image task"):
        encoder(embedding="pixels")


BAD_VALUES = [
    (["backbone.norm=rmsnorm"], r"backbone.norm='rmsnorm' is not valid: choose one of layernorm, batchnorm"),
    (["backbone.embedding=patches"], r"backbone.embedding='patches' is not valid: choose one of tokens, pixels"),
    (["backbone.positions=rotary"], r"backbone.positions='rotary' is not valid: choose one of learned, "
                                    r"sinusoidal, none"),
    (["backbone.embedding=pixels"], r"backbone.embedding=pixels is not valid for task listops"),
    (["task=image", "backbone.embedding=pixels", "data.pixel_zero_is_pad=true"],
     r"backbone.embedding=pixels is not valid with data.pixel_zero_is_pad=true"),
    (["task=image", "backbone.embedding=pixels", "backbone.pixel_std=0"], r"backbone.pixel_std=0.0 is not valid"),
    (["backbone.head=conv"], r"backbone.head='conv' is not valid: choose one of mlp, linear"),
    (["backbone.embedding_dropout=1.0"], r"backbone.embedding_dropout=1.0 is not valid: a dropout rate is in \[0, 1\)"),
    (["task=retrieval", "backbone.head=linear"], r"backbone.head=linear is not valid for task retrieval"),
]


@pytest.mark.parametrize("overrides,message", BAD_VALUES)
def test_bad_recipe_options_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose_cfg([*overrides, "run_dir=x"]))
    assert "\n" not in str(e.value)


def test_a_boolean_option_takes_only_booleans():
    with pytest.raises(ConfigCompositionException):
        compose_cfg(["backbone.prenorm=sometimes", "run_dir=x"])


def test_choices_are_normalised_and_pixels_validate_on_image_tasks():
    cfg = validate(compose_cfg(["task=pathfinder", "backbone.embedding=PIXELS", "backbone.norm=BatchNorm",
                                "run_dir=x"]))
    assert (cfg.backbone.embedding, cfg.backbone.norm) == ("pixels", "batchnorm")


def test_the_options_at_their_defaults_leave_the_config_hash_as_it_was():
    """Runs recorded or checkpointed before the options existed keep their hash (they resume and are
    recognised as finished); a changed option changes it."""
    cfg = OmegaConf.to_container(compose_cfg(["run_dir=x"]), resolve=True)
    before = {**cfg, "backbone": {k: v for k, v in cfg["backbone"].items()
                                  if k not in ("norm", "prenorm", "mlp", "head", "embedding", "pixel_mean",
                                               "pixel_std", "tie_dropout", "embedding_dropout")}}
    assert config_hash(cfg) == config_hash(before)
    for key, value in (("norm", "batchnorm"), ("prenorm", False), ("mlp", False), ("head", "linear"),
                       ("pixel_std", 0.25), ("tie_dropout", True), ("embedding_dropout", 0.0)):
        assert config_hash({**cfg, "backbone": {**cfg["backbone"], key: value}}) != config_hash(cfg)
    s4d = OmegaConf.to_container(compose_cfg(["model=s4d", "run_dir=x"]), resolve=True)  # a mixer's option too
    added = {"tie_dropout": False, "dt_lr": "ssm", "n_ssm": None, "c_times_b": False, "b_clip": 2.0}
    assert {k: s4d["model"][k] for k in added} == added
    assert config_hash(s4d) == config_hash({**s4d, "model": {k: v for k, v in s4d["model"].items()
                                                             if k not in added}})
    for key, value in (("tie_dropout", True), ("dt_lr", "base"), ("n_ssm", 2), ("c_times_b", True), ("b_clip", None)):
        assert config_hash({**s4d, "model": {**s4d["model"], key: value}}) != config_hash(s4d)


def test_tie_dropout_ties_every_backbone_dropout_and_keeps_rows_unpacked():
    enc = encoder(dropout=0.1, tie_dropout=True)
    drops = [m for n, m in enc.named_modules() if isinstance(m, torch.nn.Dropout) and ".mixer" not in n]
    assert len(drops) == 1 + 2 * 3 and all(isinstance(m, TiedDropout) for m in drops)  # embeddings; per block 3
    assert not isinstance(enc.blocks[0].mixer.dropout, TiedDropout)  # the mixer's is its own option (model.*)
    assert not any(isinstance(m, TiedDropout) for m in encoder(dropout=0.1).modules())
    assert not enc.supports_segments  # one mask a row: a packed row's examples would share it
    assert encoder(tie_dropout=True).tied_dropout is False  # no dropout, nothing tied


def test_embedding_dropout_is_the_backbones_unless_set():
    assert encoder(dropout=0.1).drop.p == 0.1  # LRA's: one rate for all
    enc = encoder(dropout=0.1, embedding_dropout=0.0)
    assert enc.drop.p == 0.0 and enc.blocks[0].drop.p == 0.1
    assert encoder(embedding_dropout=0.2, tie_dropout=True).tied_dropout  # a tied mask on the embeddings alone


def test_pack_true_refuses_tied_dropout(smoke_cfg):
    with pytest.raises(ConfigError, match="backbone.tie_dropout draws one dropout mask per row"):
        runner.run(smoke_cfg("task.seq_len=1000", "backbone.n_layers=1", "backbone.dropout=0.1",
                             "backbone.tie_dropout=true", "trainer.pack=true"))


# -- the S4D presets -----------------------------------------------------------------------------------------------
# S4's v3 configs (state-spaces/s4 configs/experiment/lra/old/v3-s4-<task>.yaml, the S4D paper's table):
# layers, width, norm, prenorm, dropout, lr, weight decay, batch, epochs, warm-up steps, SSM lr, dt_min,
# input, and the training examples that make an epoch (S4's loader drops the last partial batch). Path-X as the
# S4D paper ran it (lr 5e-4, one epoch of warm-up; the file's comments say so).
RECIPES = {
    "listops": (8, 128, "batchnorm", False, 0.0, 0.01, 0.05, 50, 40, 1000, 0.001, 0.001, "tokens", 96_000),
    "text": (6, 256, "batchnorm", True, 0.0, 0.01, 0.05, 16, 32, 1000, 0.001, 0.001, "tokens", 25_000),
    "retrieval": (6, 256, "batchnorm", True, 0.0, 0.01, 0.05, 64, 20, 2500, 0.001, 0.001, "tokens", 147_086),
    "image": (6, 512, "layernorm", False, 0.1, 0.01, 0.05, 50, 200, 900, 0.001, 0.001, "pixels", 45_000),
    "pathfinder": (6, 256, "batchnorm", True, 0.0, 0.004, 0.03, 64, 200, 2500, 0.001, 0.001, "pixels", 160_000),
    "pathx": (6, 256, "batchnorm", True, 0.0, 5e-4, 0.05, 16, 50, 10_000, 5e-4, 1e-4, "pixels", 160_000),
}
SSM_PARAMS = {"log_dt", "log_A_real", "A_imag", "B"}


def preset(task: str, *overrides: str):
    return validate(compose_cfg([f"task={task}", "experiment=s4d_lra", "run_dir=x", *overrides]))


def shape(cfg) -> engine.TaskShape:
    """What the task's data would tell the model, without reading any."""
    task, side = cfg.task.name, int(cfg.task.seq_len ** 0.5)
    grid = (side, side) if task in ("image", "pathfinder", "pathx") else None
    return engine.TaskShape(257, cfg.task.seq_len, 2, pair=task == "retrieval", padded=grid is None, grid=grid)


@pytest.mark.parametrize("task", sorted(RECIPES))
def test_s4d_preset_sets_the_published_recipe(task):
    layers, d, norm, prenorm, dropout, lr, wd, batch, epochs, warmup, ssm_lr, dt_min, embedding, n_train = \
        RECIPES[task]
    cfg = preset(task)
    b, o, s = cfg.backbone, cfg.optim, cfg.schedule
    assert (cfg.experiment, cfg.model.name) == ("s4d_lra", "s4d")  # every row says which recipe it ran
    assert (b.n_layers, b.d_model, b.norm, b.prenorm, b.dropout, b.attn_dropout) == (layers, d, norm, prenorm,
                                                                                     dropout, dropout)
    pooling = "last" if task == "pathfinder" else "mean"  # v3-s4-pathfinder's decoder `mode: last`
    assert (b.mlp, b.positions, b.pooling, b.embedding) == (False, "none", pooling, embedding)
    assert b.head == ("mlp" if task == "retrieval" else "linear")  # S4's decoder; a pair meets in the MLP head
    assert (o.lr, o.weight_decay, o.lr_schedule, o.warmup_steps, o.grad_clip) == (lr, wd, "cosine", warmup, None)
    assert (list(o.betas), o.eps) == ([0.9, 0.999], 1e-8)
    assert (s.batch_size, s.steps, s.eval_every) == (batch, epochs * (n_train // batch), n_train // batch)
    m = cfg.model
    assert (m.d_state, m.init, m.discretization, m.bidirectional, m.glu) == (64, "legs", "zoh", True, True)
    assert (m.ssm_lr, m.dt_min, m.dt_max) == (ssm_lr, dt_min, 0.1)
    assert b.tie_dropout is m.tie_dropout is (task == "image")  # the one recipe with dropout ties it, as S4's
    assert b.embedding_dropout == 0.0  # S4 drops nothing before the first layer
    assert m.n_ssm == (2 if task == "image" else None)  # v3-s4-cifar shares A and B by 2 groups of channels
    assert m.dt_lr == ("ssm" if task in ("pathfinder", "pathx") else "base")  # where S4 says `lr.dt: null`


@pytest.mark.parametrize("task", sorted(RECIPES))
def test_s4d_preset_builds_with_the_ssm_optimiser_group(task):
    cfg = preset(task)
    layers, _, norm, *_ = RECIPES[task]
    model = engine.build_model(cfg.model.name, model_options(cfg), cfg.backbone, shape(cfg))
    assert not any(".mlp." in n or n.startswith("encoder.pos") for n, _ in model.named_parameters())
    if task != "retrieval":  # one Linear from the pooled features to the classes
        assert isinstance(model.head, torch.nn.Linear) and model.head.in_features == cfg.backbone.d_model
    assert isinstance(model.encoder.blocks[0].norm1, MaskedBatchNorm if norm == "batchnorm" else LayerNorm)
    groups = engine.parameter_groups(model, cfg.optim.weight_decay)
    dt_apart = cfg.model.dt_lr == "base"  # dt at the base lr, undecayed, in a group of its own
    assert len(groups) == 2 + dt_apart
    default = groups[0]
    ssm, = [g for g in groups if "lr" in g]
    dt = [g for g in groups[1:] if "lr" not in g]
    assert default["weight_decay"] == cfg.optim.weight_decay and "lr" not in default  # the base lr, decayed
    assert (ssm["lr"], ssm["weight_decay"]) == (cfg.model.ssm_lr, 0.0)
    ssm_names = {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if any(p is q for q in ssm["params"])}
    want = SSM_PARAMS - ({"log_dt"} if dt_apart else set())
    assert ssm_names == want and len(ssm["params"]) == len(want) * layers
    optimizer = engine.build_optimizer(model, cfg.optim, torch.device("cpu"))
    assert sorted(g["lr"] for g in optimizer.param_groups) == sorted([cfg.optim.lr, cfg.model.ssm_lr]
                                                                      + [cfg.optim.lr] * dt_apart)
    if dt_apart:
        assert dt[0]["weight_decay"] == 0.0 and len(dt[0]["params"]) == layers


def test_the_recipe_takes_another_mixer_without_the_s4d_settings():
    """``model=<other>`` puts another mixer into the same backbone: only the mixer changes."""
    cfg = preset("listops", "model=transformer")
    s4d = preset("listops")
    assert cfg.model.name == "transformer" and "d_state" not in cfg.model
    assert cfg.backbone == s4d.backbone and cfg.optim == s4d.optim and cfg.schedule == s4d.schedule
    engine.build_model("transformer", model_options(cfg), cfg.backbone, shape(cfg))


def tiny(tmp_path, task: str, *overrides: str):
    return preset(
        task, f"run_dir={tmp_path / task}", f"results.dir={tmp_path / 'results'}", f"data.cache_dir={tmp_path / 'c'}",
        "device=cpu", "trainer.compile=false", "trainer.progress=false", "trainer.timing_warmup=0",
        "trainer.eval_batch_size=8", "schedule.steps=2", "schedule.batch_size=4", "backbone.n_layers=2",
        "backbone.d_model=16", "model.d_state=8", "data.limit.train=8", "data.limit.val=4", "data.limit.test=4",
        *overrides)


def test_an_s4d_preset_trains_through_the_runner(tmp_path):
    row = runner.run(tiny(tmp_path, "listops", "task.seq_len=256"))
    assert (row["status"], row["experiment"], row["model"], row["steps"]) == ("ok", "s4d_lra", "s4d", 2)
    runs = pd.read_csv(tmp_path / "results" / "runs.csv")
    assert list(runs.experiment) == ["s4d_lra"]


def test_a_pixel_preset_trains_through_the_runner(tmp_path):
    """Pathfinder (generated, 32 x 32) with the pixel embedding and pre-norm BatchNorm, mask-free."""
    row = runner.run(tiny(tmp_path, "pathfinder"))
    assert (row["status"], row["experiment"]) == ("ok", "s4d_lra")


def test_the_s4_repositorys_image_ablation_preset_is_its_large_s4d_config():
    """`experiment=s4d_ablation`: state-spaces/s4's configs/experiment/mega/lra-image/large-s4d.yaml (88.28
    validation, 3.96M parameters in its README's table), on S4's backbone as the S4D paper's recipes."""
    cfg = validate(compose_cfg(["task=image", "experiment=s4d_ablation", "run_dir=x"]))
    paper = preset("image")
    b, o, s, m = cfg.backbone, cfg.optim, cfg.schedule, cfg.model
    assert (cfg.experiment, m.name) == ("s4d_ablation", "s4d")
    assert (b.n_layers, b.d_model, b.norm, b.prenorm, b.dropout, b.attn_dropout, b.tie_dropout) == (
        6, 512, "batchnorm", True, 0.1, 0.1, False)
    assert (b.embedding, b.pixel_mean, b.pixel_std) == ("pixels", paper.backbone.pixel_mean, paper.backbone.pixel_std)
    assert (b.mlp, b.positions, b.pooling, b.head, b.embedding_dropout) == (False, "none", "mean", "linear", 0.0)
    assert (o.lr, o.weight_decay, o.warmup_steps) == (0.01, 0.05, 9000)
    assert {k: v for k, v in o.items() if k not in ("warmup_steps",)} == {
        k: v for k, v in paper.optim.items() if k not in ("warmup_steps",)}  # S4's AdamW and cosine, as the paper's
    assert (s.batch_size, s.steps, s.eval_every) == (50, 180_000, 900)
    assert (m.init, m.discretization, m.bidirectional, m.glu, m.d_state, m.dt_min, m.dt_max) == (
        "lin", "zoh", True, True, 64, 0.001, 0.1)
    assert (m.ssm_lr, m.dt_lr, m.n_ssm, m.tie_dropout) == (0.001, "ssm", None, False)
    ten_classes = dataclasses.replace(shape(cfg), n_classes=10)
    model = engine.build_model(m.name, model_options(cfg), b, ten_classes)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 2) == 3.96
    groups = engine.parameter_groups(model, o.weight_decay)
    ssm, = [g for g in groups if "lr" in g]
    assert (ssm["lr"], ssm["weight_decay"], len(ssm["params"])) == (0.001, 0.0, len(SSM_PARAMS) * 6)  # dt too
