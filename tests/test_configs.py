"""Every config composes and validates: each task with each model and experiment; bad values fail at start, in one
line naming the key, the value and what is allowed; overrides and multirun work."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf, open_dict

from lra.config import BenchRunConfig, RunConfig, eval_batch_size, experiment_protocols, validate
from lra.data import list_tasks
from lra.errors import ConfigError
from lra.provenance import MOVED_TO_EXECUTION, config_hash
from models import list_models, model_defaults
from tests.conftest import CONF, ROOT, compose_cfg, finish_all, in_background, started

TASKS = sorted(p.stem for p in (CONF / "task").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def test_every_registered_model_has_a_config_and_back():
    assert MODELS == list_models()


def test_every_registered_task_has_a_config_and_back():
    assert TASKS == list_tasks()


@pytest.mark.parametrize("model", MODELS)
def test_a_models_options_and_defaults_are_its_constructors_alone(model):
    """conf/model/<model>.yaml names the model and takes its options from the constructor (the one home of each
    default): it sets none itself, and the composed config holds exactly the constructor's."""
    own = OmegaConf.load(CONF / "model" / f"{model}.yaml")
    assert set(own) == {"defaults", "name"} and own.name == model
    cfg = compose_cfg([f"model={model}", "experiment=defaults", "run_dir=x"])
    assert OmegaConf.to_container(cfg.model) == {"name": model, **model_defaults(model)}


def schema_defaults(schema) -> dict:
    """Every leaf default of a schema dataclass, by dotted key."""
    out = {}
    for f in dataclasses.fields(schema):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if dataclasses.is_dataclass(default):
            out.update({f"{f.name}.{k}": v for k, v in schema_defaults(type(default)).items()})
        elif default is not None or f.default is None:
            out[f.name] = default
    return out


def leaves(node, prefix="") -> dict:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in leaves(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): node}


@pytest.mark.parametrize("path,schema", [("config.yaml", RunConfig), ("bench.yaml", BenchRunConfig),
                                         ("logger/none.yaml", RunConfig), ("logger/wandb.yaml", RunConfig)])
def test_each_default_is_defined_once(path, schema):
    """The schema (lra/config.py) holds the defaults of the trainer, data, logger, results and bench settings; the
    YAML that every run composes sets only what the schema cannot (the output folder, group choices) and never
    restates one of its defaults (two copies drift: the bench's per-length batches once did)."""
    text = yaml.safe_load((CONF / path).read_text()) or {}
    text.pop("defaults", None)
    text.pop("hydra", None)
    defaults = schema_defaults(schema)
    restated = {k: v for k, v in leaves(text).items() if k in defaults and str(defaults[k]).lower() == str(v).lower()}
    assert not restated, f"{path} restates the schema's defaults: {restated}"
    assert not (CONF / "trainer").exists(), "the trainer's settings are the schema's (TrainerConfig)"


@pytest.mark.heavy  # CI's second tier: every task with every preset
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_task_composes_and_validates_with_every_experiment(task, experiment):
    cfg = validate(compose_cfg([f"task={task}", f"experiment={experiment}", "run_dir=x"]))
    assert cfg.task.name == task and cfg.experiment == experiment
    assert cfg.schedule.steps > 0 and cfg.schedule.batch_size > 0
    if experiment == "smoke":
        assert cfg.device == "cpu" and all(v is not None for v in cfg.data.limit.values())


@pytest.mark.heavy  # CI's second tier: the registry with every task
@pytest.mark.parametrize("model", MODELS)
def test_every_model_composes_with_every_task(model):
    """A model's yaml or a task's composes with every partner or with none; what one (task, model) pair alone adds
    is its protocol entry, `<task>/<model>` in conf/experiment/lra.yaml (LRA's per-model settings, composed under
    the default experiment). So each model composes with ListOps and with every task it has such an entry for
    (composing all pairs took 17 s of the suite)."""
    protocol = experiment_protocols(CONF / "experiment")["lra"]
    paired = [task for task in TASKS if f"{task}/{model}" in protocol]
    for task in dict.fromkeys(["listops", *paired]):
        cfg = compose_cfg([f"task={task}", f"model={model}", "run_dir=x"])
        assert cfg.model.name == model and cfg.task.name == task


def test_every_protocol_entry_names_a_task_a_model_or_a_pair():
    """An experiment's protocol entries compose by name (lra.config.register_protocols): a misspelt one would never
    apply, so every entry of every preset names a task, a model or a task/model pair."""
    names = {*TASKS, *MODELS, *(f"{t}/{m}" for t in TASKS for m in MODELS)}
    protocols = experiment_protocols(CONF / "experiment")
    assert set(protocols) == set(EXPERIMENTS) and protocols["lra"]
    for experiment, entries in protocols.items():
        assert set(entries) <= names, f"{experiment}: entries that name nothing: {sorted(set(entries) - names)}"


def test_a_misspelt_protocol_entry_stops_the_run(tmp_path):
    """One that slipped past the test above (a preset of one's own) fails at start, naming the entry."""
    cfg = compose_cfg(["run_dir=x"])
    with open_dict(cfg):
        cfg.protocol = {"listop": {"optim": {"lr": 0.1}}}
    with pytest.raises(ConfigError, match="'listop' names no task, model or task/model"):
        validate(cfg)


def test_a_preset_inherits_the_protocol_of_the_one_it_extends(tmp_path):
    """`defaults: [lra]` takes lra's entries; the child's own replace them whole, and a null drops one."""
    (tmp_path / "lra.yaml").write_text("protocol:\n  listops: {optim: {lr: 0.1}, schedule: {steps: 9}}\n"
                                       "  performer: {model: {kernel: relu}}\n")
    (tmp_path / "child.yaml").write_text("defaults:\n  - lra\n  - _self_\nprotocol:\n"
                                         "  listops: {optim: {lr: 0.2}}\n  performer: null\n")
    child = experiment_protocols(tmp_path)["child"]
    assert OmegaConf.to_container(child["listops"]) == {"optim": {"lr": 0.2}}
    assert "performer" not in child


def test_the_command_line_wins_over_a_protocol_entry():
    cfg = compose_cfg(["task=listops", "model=performer", "model.n_features=7", "run_dir=x"])
    assert (cfg.model.kernel, cfg.model.n_features, cfg.model.redraw_every) == ("softmax", 7, 1)


def test_overrides_reach_the_config():
    cfg = compose_cfg(["model=transformer", "schedule.steps=7", "backbone.d_model=32", "seed=5", "run_dir=x"])
    assert (cfg.schedule.steps, cfg.backbone.d_model, cfg.seed) == (7, 32, 5)


def test_listops_task_is_the_lra_config():
    cfg = compose_cfg(["run_dir=x"])
    b, o, s = cfg.backbone, cfg.optim, cfg.schedule
    assert (b.n_layers, b.n_heads, b.d_model, b.d_ff, s.batch_size, s.steps) == (4, 8, 512, 1024, 32, 5000)
    assert (o.lr_schedule, o.warmup_steps, list(o.betas), o.eps) == ("rsqrt", 1000, [0.9, 0.98], 1e-9)
    assert (cfg.task.seq_len, cfg.experiment) == (2000, "lra")


def test_pathx_is_pathfinder_at_128_with_its_own_backbone():
    pf, px = compose_cfg(["task=pathfinder", "run_dir=x"]), compose_cfg(["task=pathx", "run_dir=x"])
    assert (px.task.resolution, px.task.seq_len, px.task.difficulty) == (128, 16384, pf.task.difficulty)
    assert (px.backbone.n_layers, px.optim.grad_clip, px.schedule.batch_size) == (1, 1.0, 64)
    assert px.backbone.d_model == pf.backbone.d_model and px.data.split_seed == pf.data.split_seed


BAD_VALUES = [
    (["trainer.precision=fp16"], "trainer.precision='fp16'.*auto, bf16, fp32"),
    (["trainer.compile=yes"], "trainer.compile='yes'.*auto, true, false"),
    (["+trainer.nonsense=1"], "trainer.nonsense is not a setting of trainer"),
    (["+nonsense=1"], "nonsense is not a setting of the top level"),
    (["model=bigbird", "+model.blok=3"], "no option.*blok.*block=128"),
    (["model=performer", "model.kernel=exp"], "model.kernel='exp'.*'softmax' \\| 'relu'"),
    (["model=bigbird", "model.block=big"], "model.block='big'.*expected int"),
    (["task=pathfinder", "task.difficulty=medium"], "task.difficulty='medium'.*easy, intermediate, hard"),
    (["task=image", "task.seq_len=512"], "set task.seq_len=1024"),
    (["data.limit.val=0"], "data.limit.val=0.*at least one example"),
    (["schedule.steps=0"], "schedule.steps=0.*at least 1"),
    (["optim.lr=-1"], "optim.lr=-1.0.*positive"),
    (["backbone.d_qkv=100"], "d_qkv=100.*multiple of backbone.n_heads=8"),
    (["device=gpu"], "device='gpu'"),
    (["resume=maybe"], "resume='maybe'"),
    (["task=text", "model=axial"], "model=axial task=text: a 2-D mixer.*image tasks only"),
]


@pytest.mark.parametrize("overrides,message", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_bad_values_fail_in_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        validate(compose_cfg([*overrides, "run_dir=x"]))
    assert "\n" not in str(error.value)


def test_a_wrong_type_fails_while_composing():
    with pytest.raises(ConfigCompositionException, match="schedule.steps=abc"):
        compose_cfg(["schedule.steps=abc", "run_dir=x"])


def test_choices_are_normalised():
    cfg = validate(compose_cfg(["trainer.compile=true", "resume=false", "run_dir=x"]))
    assert (cfg.trainer.compile, cfg.resume) == ("true", "false")


def start_cli(*args: str, cwd=ROOT, env=None) -> subprocess.Popen:
    return started([sys.executable, "-m", "lra", *args], cwd=cwd, env=env)


def cli(*args: str, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
    return finish_all(start_cli(*args, cwd=cwd, env=env))[0]


def two_user_errors(folder: Path, environ: dict[str, str]) -> list[subprocess.CompletedProcess]:
    return finish_all(  # two independent commands, side by side
        start_cli("trainer.precision=fp16", f"results.dir={folder}", f"hydra.run.dir={folder / 'run'}", env=environ),
        start_cli("task=text", "experiment=smoke", f"data.path={folder / 'no_such_imdb'}", f"results.dir={folder}",
                  f"hydra.run.dir={folder / 'run2'}", env=environ))


@in_background(two_user_errors)
def test_cli_user_errors_are_one_line_with_exit_code_2(ran_in_background):
    (proc, missing), _ = ran_in_background()
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("error: trainer.precision='fp16' is not valid: choose one of "
                                                   "auto, bf16, fp32")
    assert "Traceback" not in proc.stderr
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "no_such_imdb" in missing.stderr.strip().splitlines()[-1]


def test_a_launcher_without_its_extra_names_the_extra(monkeypatch):
    """`hydra/launcher=gpus` (or slurm) without the sweep extra: an error that says what to install and why, where
    Hydra would only list the launchers it knows."""
    import lra.config
    from hydra_plugins.lra_launchers import lra_launchers

    lra.config.check_launcher(["-m", "hydra/launcher=gpus", "hydra/launcher=slurm", "model=transformer"])  # installed
    for launcher, dist in (("gpus", "hydra-joblib-launcher"), ("slurm", "hydra-submitit-launcher")):
        monkeypatch.setitem(lra_launchers.UNAVAILABLE, launcher, "No module named 'joblib'")
        with pytest.raises(ConfigError,
                           match=rf"hydra/launcher={launcher} needs {dist}.*No module named 'joblib'.*lra\[sweep\]"):
            lra.config.check_launcher(["-m", f"hydra/launcher={launcher}", "model=transformer"])
    lra.config.check_launcher(["-m", "hydra/launcher=local", "model=transformer"])  # Hydra's own: nothing to check


@pytest.mark.heavy  # CI's second tier: a fresh interpreter per launcher
@pytest.mark.parametrize("missing, kept, gone", [("hydra_submitit_launcher", "gpus", "slurm"),
                                                  ("hydra_joblib_launcher", "slurm", "gpus")])
def test_each_launcher_needs_only_its_own_plugin(missing, kept, gone):
    """A host with hydra-joblib-launcher but not submitit (a GPU machine given only what `gpus` needs) still has
    `hydra/launcher=gpus`, and the other way round: the two register apart."""
    code = (f"import sys; sys.modules['hydra_plugins.{missing}'] = None  # as if not installed\n"
            "from hydra.core.config_store import ConfigStore\n"
            "import lra.config\n"
            "import hydra_plugins.lra_launchers.lra_launchers\n"
            "print(sorted(ConfigStore.instance().repo['hydra']['launcher']))\n"
            f"lra.config.check_launcher(['-m', 'hydra/launcher={kept}'])\n"
            f"lra.config.check_launcher(['-m', 'hydra/launcher={gone}'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert f"'{kept}.yaml'" in proc.stdout and f"'{gone}.yaml'" not in proc.stdout and "'local.yaml'" in proc.stdout
    assert proc.returncode == 1 and f"ConfigError: hydra/launcher={gone} needs" in proc.stderr, proc.stderr  # only


@in_background(lambda folder, environ: cli(
    "-m", "model=transformer,linear", "seed=1", "experiment=smoke", "schedule.steps=3", "task.seq_len=256",
    "schedule.eval_every=3", "data.limit.train=24", "data.limit.val=8", "data.limit.test=8",
    f"results.dir={folder / 'results'}", f"data.cache_dir={folder / 'cache'}", f"hydra.sweep.dir={folder / 'multirun'}",
    env=environ))
def test_multirun_sweeps_models(ran_in_background):
    """`-m model=a,b` runs both through the CLI and both rows land in one runs.csv."""
    proc, tmp_path = ran_in_background()
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (tmp_path / "results" / "runs.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 2 and {r.split(",")[1] for r in rows[1:]} == {"transformer", "linear"}
    assert len(list(Path(tmp_path / "multirun").glob("listops/*/*/result.json"))) == 2


def test_the_evaluation_batch_follows_the_training_batch_unless_set():
    assert eval_batch_size(validate(compose_cfg(["task=pathfinder", "run_dir=x"]))) == 512  # LRA's Pathfinder batch
    assert eval_batch_size(validate(compose_cfg(["task=listops", "run_dir=x"]))) == 128  # at least 128
    assert eval_batch_size(validate(compose_cfg(["task=listops", "trainer.eval_batch_size=64", "run_dir=x"]))) == 64
    with pytest.raises(ConfigError, match="trainer.eval_batch_size=0"):
        validate(compose_cfg(["trainer.eval_batch_size=0", "run_dir=x"]))


def documented_commands() -> list[list[str]]:
    """The overrides of every `lra ...` command in the README and docs/running.md code blocks ($M expanded)."""
    commands = []
    for doc in (ROOT / "README.md", ROOT / "docs" / "running.md"):
        text = doc.read_text()
        models = dict(line.split("=", 1) for line in text.splitlines() if line.startswith("M="))
        for line in text.splitlines():
            if line.startswith("lra "):
                words = line.split("#")[0].split()[1:]
                commands.append([w.replace("$M", models.get("M", "")) for w in words])
    return commands


@pytest.mark.parametrize("words", documented_commands(), ids=lambda w: " ".join(w)[:60])
def test_every_documented_command_composes_and_validates(words):
    """Each value of each swept key (the others at their first value) composes into a valid configuration."""
    import hydra_plugins.lra_launchers.lra_launchers as launchers

    for launcher in (w.split("=", 1)[1] for w in words if w.startswith("hydra/launcher=")):
        assert f"{launcher}.yaml" in launchers.store.list("hydra/launcher"), launcher
    overrides = [w for w in words if w != "-m" and not w.startswith(("hydra/", "hydra."))]
    swept = {o.split("=", 1)[0]: o.split("=", 1)[1].split(",") for o in overrides if "," in o}
    fixed = [o for o in overrides if "," not in o]
    first = {key: values[0] for key, values in swept.items()}
    assert overrides, words
    for key, values in swept.items():
        for value in values:
            job = {**first, key: value}
            validate(compose_cfg([*fixed, *(f"{k}={v}" for k, v in job.items()), "run_dir=x"]))
    if not swept:
        validate(compose_cfg([*fixed, "run_dir=x"]))


# Each model's config hash at its defaults (task=listops, experiment=lra), as the code before its execution options
# became settings of how it runs (trainer.mixer) computed it. gla's and mamba's are those of their recorded runs,
# which ran when their scan's default was auto; the code just before computed them with chunked instead.
HASH_AT_DEFAULTS = {
    "axial": "9422416ee3bf", "bigbird": "f8271434dc72", "compressive": "cfcbe42258a0", "cosformer": "b141883d49eb",
    "deberta": "bd1ecde0eda0", "etc": "1fde945f7318", "fnet": "35d41d919073", "gla": "373984cd8183",
    "image_local": "bd95ebbb25dd", "linear": "cc1a35d9fe0c", "linformer": "6683a55c4be4", "local": "9d4de8deebc5",
    "longformer": "5fd392e9ee11", "mamba": "a28291d633aa", "memory_compressed": "aee5f2e7893c",
    "nystromformer": "d90916567dc7", "performer": "c619b0c0d111", "reformer": "0e778d4f6183",
    "routing": "360359b02ca4", "s4d": "ca4cac3f4034", "set_transformer": "3979560e79e3", "sinkhorn": "f3c246397af8",
    "sparse": "dc557618cb23", "synthesizer": "d7bde5b09f4e", "transformer": "93aa70352b24",
    "transformer_xl": "d396bae560de",
}


def hash_of(overrides: list[str]) -> str:
    return config_hash(OmegaConf.to_container(compose_cfg([*overrides, "run_dir=x"]), resolve=True))


def test_every_models_config_hash_at_its_defaults_is_the_one_recorded_before():
    """Moving an option out of the constructor (into the settings of how a mixer runs) keeps every model's hash at
    its defaults: runs recorded or checkpointed before are still recognised and resume. A model added since has no
    entry yet; it gets one here."""
    assert set(HASH_AT_DEFAULTS) <= set(MODELS)
    assert {m: hash_of([f"model={m}"]) for m in HASH_AT_DEFAULTS} == HASH_AT_DEFAULTS


def committed_rows(models) -> pd.DataFrame:
    """The committed rows (runs.csv, ablation.csv) of ``models``, one per model, task and experiment."""
    rows = pd.concat([pd.read_csv(ROOT / "results" / f"{name}.csv") for name in ("runs", "ablation")])
    return rows[rows["model"].isin(models)].drop_duplicates(["model", "task", "experiment"])


def test_the_committed_runs_of_the_models_whose_options_moved_keep_their_hashes():
    """A recorded run of a model whose options became settings of how it runs (``MOVED_TO_EXECUTION``), composed
    again from its row's overrides, has the hash its row holds."""
    for row in committed_rows(MOVED_TO_EXECUTION).itertuples():
        overrides = ["schedule." + o[len("train."):] if o.startswith("train.") else o  # the key's name before
                     for o in str(row.overrides).split()]
        overrides += [f"{k}={getattr(row, k)}" for k in ("task", "model", "seed", "experiment")
                      if not any(o.startswith(f"{k}=") for o in overrides)]
        assert hash_of(overrides) == row.config_hash, (row.model, row.task, row.overrides)


@pytest.mark.parametrize("model", sorted(MOVED_TO_EXECUTION))
def test_a_setting_of_how_a_mixer_runs_leaves_the_hash_and_its_old_option_says_where_it_went(model):
    """Any value of such a setting hashes as the default (a run resumes under another); naming it as a model
    option fails at start, saying to set it with trainer.mixer."""
    key, value = next(iter(MOVED_TO_EXECUTION[model].items()))
    other = {True: False, None: 16, 64: 16, "auto": "chunked"}[value]
    assert hash_of([f"model={model}", f"+trainer.mixer.{key}={other}"]) == HASH_AT_DEFAULTS[model]
    with pytest.raises(ConfigError, match=rf"model.{key} is how {model} runs.*\+trainer.mixer.{key}="):
        validate(compose_cfg([f"model={model}", f"+model.{key}={other}", "run_dir=x"]))


def test_a_composition_shares_the_config_store_and_hands_out_its_own_copy():
    """Hydra deep-copies its repository for every composition; the ConfigStore inside it is shared (lra.config), which
    makes a composition several times cheaper and `--help` (a composition per group) seconds instead of tens. What
    the store serves is still a copy: a composed config changed in place leaves the next one as it was."""
    import copy

    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    assert copy.deepcopy(store) is store
    first = compose_cfg(["task=listops", "model=performer"])
    OmegaConf.set_struct(first, False)
    first.model.n_features = 3
    first.backbone.d_model = 5
    again = compose_cfg(["task=listops", "model=performer"])
    assert again.model.n_features != 3 and again.backbone.d_model != 5
    assert OmegaConf.is_missing(store.load("lra_schema.yaml").node.backbone, "d_model")  # the schema, untouched
