"""The configuration's schema and its validation: every bad value fails at start, in one line that names the
key, the value and what is allowed, before any data is read or any model is built.

Types come from the dataclasses below, registered with Hydra's ConfigStore as ``lra_schema`` and put first in
``conf/config.yaml``'s defaults list, so Hydra refuses a wrong type (``schedule.steps=abc``) or an unknown key
(``+trainer.nonsense=1``) while composing. Choices and ranges are checked by :func:`validate` (a string field
rather than an Enum, because the command line turns ``true`` into a bool); ``model.*`` is checked against the
model's constructor through the registry (the constructor is the schema).
"""
from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from lra.data import get_task, image_tasks
from lra.errors import ConfigError, exit_with, one_line_errors, wants_tracebacks
from lra.launchers import unavailable
from lra.provenance import NOT_HASHED, NOT_HASHED_PRETRAIN, NOT_HASHED_SCHEDULE, NOT_HASHED_TRAINER
from models.base import checked_setting, execution_settings
from models.registry import get_model_class, invalid_options, list_models, model_defaults


@dataclass
class TaskConfig:
    name: str = MISSING
    seq_len: int = MISSING
    resolution: Optional[int] = None  # image tasks drawn at a resolution (Pathfinder, Path-X)
    difficulty: Optional[str] = None  # Pathfinder: easy | intermediate | hard


@dataclass
class BackboneConfig:
    """The shared encoder around the mixer (``lra.train.encoder``)."""

    n_layers: int = MISSING
    d_model: int = MISSING
    n_heads: int = MISSING
    d_qkv: int = MISSING  # total width of queries / keys / values over all heads (LRA's qkv_dim)
    d_ff: int = MISSING
    d_classifier: int = MISSING  # hidden width of the classifier head (LRA's mlp_dim); unused by head=linear
    dropout: float = MISSING
    attn_dropout: float = MISSING
    positions: str = "learned"  # learned | sinusoidal | none
    pooling: str = "cls"  # cls | mean (over real tokens) | last (each example's last real position)
    cls_token: Optional[bool] = None  # null: a CLS slot exactly when pooling is cls
    # Options of published recipes (experiment= presets); the defaults are LRA's backbone.
    norm: str = "layernorm"  # layernorm | batchnorm (statistics over real tokens only)
    prenorm: bool = True  # false: post-norm blocks x = norm(x + Drop(mixer(x))), no final norm
    mlp: bool = True  # false: blocks of the mixer alone (the S4 family's)
    head: str = "mlp"  # mlp (LRA's Dense-ReLU-Dense) | linear (one Linear after pooling: the S4 family's decoder)
    embedding: str = "tokens"  # tokens | pixels (image tasks: gray values through Linear(1, d_model))
    pixel_mean: float = 0.5  # embedding=pixels: the input is ((id - 1) / 255 - pixel_mean) / pixel_std
    pixel_std: float = 0.5
    tie_dropout: bool = False  # true: the backbone's dropouts draw one mask per example and channel (S4's tie_dropout)
    embedding_dropout: Optional[float] = None  # dropout on the embeddings; null: backbone.dropout (LRA's)


def backbone_defaults() -> dict:
    """The backbone keys that have a default, with it: what a backbone section saved before a key existed takes."""
    return {f.name: f.default for f in fields(BackboneConfig) if f.default is not MISSING}


@dataclass
class OptimConfig:
    lr: float = MISSING
    lr_schedule: str = MISSING  # the learning-rate curve; the training budget is `schedule.*`
    warmup_steps: int = MISSING
    betas: List[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-9
    weight_decay: float = 0.0
    grad_clip: Optional[float] = None


@dataclass
class ScheduleConfig:
    """The training budget: the task owns it (``conf/task/<task>.yaml``)."""

    steps: int = MISSING
    batch_size: int = MISSING  # the global batch, whatever the number of devices
    eval_every: int = MISSING
    # random: LRA's shuffled batches | length_grouped: batches of similar lengths (not LRA's protocol: faster with
    # trainer.trim; the leaderboard keeps such runs apart)
    batching: str = "random"
    # end the run at this step, the learning-rate schedule still spanning `steps`: for a recipe longer than the
    # device time it gets (its row says `stopped: at step N of M`, never `ok`); relaunched without it (or with a
    # later step) the run resumes from its checkpoint. null: all `steps`
    stop_at: Optional[int] = None


@dataclass
class TrainerConfig:
    """How a run executes; never what it computes."""

    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32
    compile: str = "auto"  # torch.compile the model: auto (on CUDA only) | true | false
    # torch.compile's mode: default | reduce-overhead (CUDA graphs: one launch per graph, for models whose step is
    # launch-bound, e.g. Pathfinder's) | max-autotune | max-autotune-no-cudagraphs
    compile_mode: str = "default"
    # before the first step, a few training rows' gradients through the compiled model against the eager model's:
    # auto (wherever the model is compiled) | true | false. Where they differ, compile=auto trains eagerly
    # and compile=true stops (lra.train.run's check_compiled_gradients)
    compile_check: str = "auto"
    # how the model's mixers run: their ``backend`` attribute (e.g. flex, dense, explicit, sdpa: each mixer's
    # docstring names its own); null: each mixer's auto. Never what they compute, so a run resumes under another
    mixer_backend: Optional[str] = None
    # every other setting of how the mixers run (models.base.execution_settings: scan, chunk_size, recompute, ...),
    # attribute -> value, set on each mixer built: +trainer.mixer.scan=fla. Out of the config hash as mixer_backend
    mixer: Dict[str, Any] = field(default_factory=dict)
    pack: str = "false"  # several examples per row (lra.train.packing): false | auto (where possible) | true (or fail)
    trim: bool = False  # cut each batch after its longest example (exact: padding never changes real outputs)
    profile_steps: int = 0  # torch.profiler over this many steps after timing_warmup: profile.txt in the run folder
    devices: int = 1  # processes of one data-parallel run (DistributedDataParallel)
    threads: Optional[int] = None  # CPU threads of each process; null: this process's share of the host's cores
    eval_batch_size: Optional[int] = None  # null: the training batch, at least 128 (see eval_batch_size())
    ckpt_every: int = 500
    # minutes of training (this process's loop) after which the run ends at that step as schedule.stop_at would:
    # evaluated, checkpointed, tested, a `stopped: at step N of M` row; the same command goes on from there
    time_limit: Optional[float] = None
    timing_warmup: int = 20
    progress: bool = True
    # torch's deterministic kernels (docs/protocol.md): the same command and seed give the same weights on the same
    # kind of GPU and software, more slowly; an op with no deterministic kernel stops the run, naming it
    deterministic: bool = False


@dataclass
class LimitConfig:
    train: Optional[int] = None
    val: Optional[int] = None
    test: Optional[int] = None


@dataclass
class GenerateConfig:
    """Settings of the generators (ListOps: seed and split sizes; Pathfinder: seed and image count)."""

    seed: int = 0
    train: int = 96_000
    val: int = 2_000
    test: int = 2_000
    n: int = 200_000


@dataclass
class DataConfig:
    """Every loader's settings; a task's loader reads only its own (see ``lra/data/<task>.py``)."""

    cache_dir: str = "${oc.env:LRA_CACHE_DIR,'~/.cache/lra'}"  # generated data and tokenised tensors
    limit: LimitConfig = field(default_factory=LimitConfig)
    root: Optional[str] = None  # a release folder (ListOps, retrieval, Pathfinder)
    path: Optional[str] = None  # a Hugging Face id or local parquet (text, image)
    split_seed: int = 42
    pixel_zero_is_pad: bool = False
    workers: Optional[int] = None
    truncate_bytes: int = 10_000
    generate: GenerateConfig = field(default_factory=GenerateConfig)


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb (logger=wandb)
    project: str = "lra"
    entity: Optional[str] = None
    mode: str = "online"  # online | offline | disabled
    tags: List[str] = field(default_factory=list)


@dataclass
class PretrainConfig:
    """Self-pretraining on the task's own training split before the task's training (``pretrain=<objective>``,
    ``conf/pretrain/``; ``lra.train.pretrain``). The masking rate is the task's (``conf/task/<task>.yaml``); each
    setting of the schedule left null is the task's own (``schedule.*``, ``optim.*``)."""

    objective: str = "none"  # none | mlm (masked tokens) | causal (the next token; causal mixers only)
    mask_rate: Optional[float] = None  # mlm: the chance that each real token is masked (its task sets it)
    steps: Optional[int] = None  # pretraining steps; null: schedule.steps
    lr: Optional[float] = None  # null: optim.lr, under the task's optim.lr_schedule
    warmup_steps: Optional[int] = None  # null: optim.warmup_steps
    # end the pretraining at this step, its learning-rate schedule still spanning `steps` (as schedule.stop_at):
    # the row says `stopped: at pretraining step N of M`; relaunched without it the pretraining resumes
    stop_at: Optional[int] = None


@dataclass
class ResultsConfig:
    # runs.csv is appended here (the project's published rows: results.dir=results)
    dir: str = "${oc.env:LRA_RESULTS_DIR,outputs/results}"


@dataclass
class RunConfig:
    experiment: str = "lra"  # the preset that ran (conf/experiment/<name>.yaml); recorded in every row
    sweep: Optional[str] = None  # a multirun's folder under outputs/multirun (null: named after its overrides)
    seed: int = 0
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    # auto: continue an unfinished run in run_dir, report a finished one; false: start over; true: require a checkpoint
    resume: str = "auto"
    run_dir: str = MISSING
    task: TaskConfig = field(default_factory=TaskConfig)
    model: Dict[str, Any] = field(default_factory=dict)
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    results: ResultsConfig = field(default_factory=ResultsConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    # the experiment's settings per task, per model and per task/model (conf/experiment/<name>.yaml), which compose
    # through ``register_protocols``; emptied by ``validate`` once checked
    protocol: Dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchSettings:
    """``python -m lra.bench``: LRA Table 2's protocol. Each default lives here; ``conf/bench.yaml`` picks the task."""

    # null: every registered model; a listed transformer runs first (relative figures divide by it; without it, by
    # the latest transformer row of the same shape in ``out``)
    models: Optional[List[str]] = None
    # more rows with model options changed, labelled by them: [{model: bigbird, block: 64}] -> bigbird(block=64);
    # how a mixer runs (``backend``, ``scan``, ...: models.base.execution_settings) is set the same way, on every
    # layer: {model: synthesizer, backend: explicit}, {model: gla, scan: fla}
    variants: List[Dict[str, Any]] = field(default_factory=list)
    # attention dropout of every mixer: 0 = none for all (like with like: the kernel, low-rank and block-sparse mixers
    # have no attention matrix to drop); null = the task's (LRA's 0.1, which only the mixers with an attention matrix
    # pay: SDPA then leaves its fastest kernels)
    attn_dropout: Optional[float] = 0.0
    lengths: List[int] = field(default_factory=lambda: [1024, 2048, 3072, 4096])
    batch_size: int = 32  # LRA Table 2: 32 (the global batch)
    # per-length batch (8 at 8K and 16K, where 32 does not fit); add one with +bench.batch_sizes.2048=16
    batch_sizes: Dict[int, int] = field(default_factory=lambda: {8192: 8, 16384: 8})
    warmup: int = 5  # untimed steps first (compilation, allocator, cuDNN autotuning)
    steps: int = 20  # timed steps; steps/s = 1 / median step time, the 10th and 90th percentiles beside it
    compile: str = "auto"  # torch.compile the model: auto = on CUDA only
    compile_mode: str = "default"  # torch.compile's mode (trainer.compile_mode's choices)
    # trainer.compile_check's, before a compiled case is timed: auto (= true) | true | false. A model it rejects is
    # timed eagerly, as training would run it (compiled False, compile_note why); with compile=true its row is an error
    compile_check: str = "auto"
    precision: str = "auto"  # auto = bf16 autocast on CUDA, fp32 on CPU | bf16 | fp32
    vocab_size: int = 257  # byte ids 1..256, 0 = pad (never drawn: the inputs have no padding)
    # appended to; relative figures may use its earlier transformer rows
    out: str = "${oc.env:LRA_RESULTS_DIR,outputs/results}/bench.csv"
    progress: bool = True  # tqdm progress bar


@dataclass
class BenchRunConfig(RunConfig):
    bench: BenchSettings = field(default_factory=BenchSettings)


def execution_keys() -> list[str]:
    """The override keys of every setting that ``config_hash`` leaves out: where a run lives, how it executes and
    logs (``trainer.devices``, ``trainer.progress``, ``logger=wandb``, ...), and where it stops
    (``schedule.stop_at``, ``trainer.time_limit``). They name no folder, so a run continued with other devices or
    threads, without its progress bar, or past the step it stopped at, lands in its own folder again and resumes
    there."""
    keys = ["data.cache_dir"]
    for name in NOT_HASHED:
        section = child_schema(RunConfig, name)
        keys += [name, *(f"{name}.{f.name}" for f in fields(section))] if section else [name]
    settings = sorted({key for name in list_models() for key in execution_settings(get_model_class(name))})
    return keys + [f"trainer.{name}" for name in NOT_HASHED_TRAINER] + [f"trainer.mixer.{key}" for key in settings] \
        + [f"schedule.{name}" for name in NOT_HASHED_SCHEDULE] + [f"pretrain.{name}" for name in NOT_HASHED_PRETRAIN]


def swept_keys(argv: list[str]) -> list[str]:
    """The keys a multirun's command sweeps (``trainer.devices=1,2``, ``seed=range(3)``), as Hydra parses them."""
    overrides = [a for a in argv if not a.startswith("-") and "=" in a]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - a malformed override: Hydra itself reports it when it composes
        return []
    return [o.key_or_group for o in parsed if o.is_sweep_override()]


def unnamed_keys() -> list[str]:
    """The overrides left out of a run's folder name (Hydra's ``override_dirname``): the choice of task, model and
    preset, which the folder's path already says, and the settings of ``execution_keys``, except those the command
    sweeps (``LRA_SWEPT_KEYS``, set by the CLI and inherited by the launcher's processes): the jobs of
    ``trainer.devices=1,2`` are two runs, which need two folders."""
    swept = set(filter(None, os.environ.get("LRA_SWEPT_KEYS", "").split(",")))
    return ["task", "model", "experiment", *(k for k in execution_keys() if k not in swept)]


HYDRA_FLAGS_WITH_VALUES = {"-cp", "-cn", "-cd", "--config-path", "--config-name", "--config-dir",
                           "--experimental-rerun"}


def sweep_slug(argv: list[str]) -> str:
    """A multirun's stable folder name from its command-line overrides: the same command, the same folder, so
    relaunching it finds the jobs already done. What does not change what the sweep computes (``execution_keys``)
    does not name it either."""
    keep, skip_next, skips = [], False, set(execution_keys())
    for arg in argv:
        if skip_next or arg.startswith("-"):
            skip_next = not skip_next and arg in HYDRA_FLAGS_WITH_VALUES
            continue
        key = arg.lstrip("+~").split("=", 1)[0]
        if not (key.startswith("hydra") or key in skips):  # hydra/launcher=..., hydra.launcher.gpus=...
            keep.append(arg)
    slug = re.sub(r"[^A-Za-z0-9=,._-]+", "-", "__".join(keep)) or "default"
    return slug if len(slug) <= 100 else f"{slug[:80]}-{hashlib.sha1(slug.encode()).hexdigest()[:8]}"


LAUNCHER_PLUGIN = {"gpus": "hydra-joblib-launcher", "slurm": "hydra-submitit-launcher"}  # the package each needs


def check_launcher(argv: list[str]) -> None:
    """A ``hydra/launcher=gpus|slurm`` whose plugin cannot be imported (not installed, or a package it needs
    missing): a ConfigError naming what to install, where Hydra would say only that the launcher is unknown,
    listing the ones it has. The reason is the one the launchers' plugin met (``lra.launchers.UNAVAILABLE``)."""
    for arg in argv:
        key, _, name = arg.lstrip("+~").partition("=")
        if key == "hydra/launcher" and name in LAUNCHER_PLUGIN:
            why = unavailable(name)
            if why is not None:
                dist = LAUNCHER_PLUGIN[name]
                raise ConfigError(f"hydra/launcher={name} needs {dist}, which cannot be imported ({why}): "
                                  f"pip install 'lra[sweep]' (or pip install {dist})")


def sweep_folder(name: str | None) -> str:
    """``sweep`` if given, else the name the CLI derived from the command (``LRA_SWEEP_NAME``, inherited by the
    launcher's worker processes and Slurm jobs, so every job of a sweep agrees)."""
    return str(name) if name else os.environ.get("LRA_SWEEP_NAME", "default")


OmegaConf.register_new_resolver("lra.sweep_folder", sweep_folder, replace=True)
OmegaConf.register_new_resolver("lra.unnamed_keys", unnamed_keys, replace=True)
# Hydra 1.3 deep-copies its config repository for every composition (CachingConfigRepository), and with it the
# ConfigStore singleton holding every registered schema (the run's, the bench's, each model's): most of a command's
# start, and of --help, which composes once per config group. The copy protects nothing, since the store's load()
# hands out a deep copy of the node it serves; so a copy of the store is the store (later Hydra refetches the
# singleton instead of copying it: facebookresearch/hydra pull request 2928).
ConfigStore.__deepcopy__ = lambda self, memo: self
ConfigStore.instance().store(name="lra_schema", node=RunConfig)

TASK_NAMES = tuple(sorted(p.stem for p in (Path(__file__).parent / "conf" / "task").glob("*.yaml")))
PROTOCOL_GROUPS = ("experiment_task", "experiment_model", "experiment_task_model")  # config.yaml's defaults list


def experiment_protocols(folder: Path) -> dict[str, dict]:
    """Each experiment's ``protocol`` (``folder/<name>.yaml``), with the entries of the experiments its defaults
    list names (``- lra``: a preset that changes a few of LRA's settings inherits the rest). An entry of its own
    replaces the inherited one of that name whole, so each entry reads complete where it stands; one set to null
    drops it."""
    files = {f.stem: OmegaConf.load(f) for f in sorted(folder.glob("*.yaml"))}

    def merged(name: str, seen: tuple[str, ...] = ()) -> dict:
        if name in seen:
            raise ValueError(f"conf/experiment/{name}.yaml: its defaults list leads back to itself ({seen})")
        cfg, out = files[name], {}
        for parent in cfg.get("defaults", []):
            if isinstance(parent, str) and parent in files:
                out.update(merged(parent, (*seen, name)))
        for key, entry in (cfg.get("protocol") or {}).items():
            if entry is None:
                out.pop(key, None)
            else:
                out[key] = entry
        return out

    return {name: merged(name) for name in files}


def register_protocols(folder: Path = Path(__file__).parent / "conf" / "experiment") -> None:
    """Each experiment's protocol entries as the configs config.yaml's defaults list picks by name after the
    experiment itself: ``<task>`` as experiment_task/<experiment>_<task>, ``<model>`` as
    experiment_model/<experiment>_<model>, ``<task>/<model>`` as experiment_task_model/<experiment>_<task>_<model>.
    So a protocol lives in one readable file, and still composes as Hydra composes files: over the task, the model
    and the experiment, under the command line."""
    store = ConfigStore.instance()
    for experiment, entries in experiment_protocols(folder).items():
        for key, entry in entries.items():
            group = PROTOCOL_GROUPS[2 if "/" in key else 0 if key in TASK_NAMES else 1]
            store.store(group=group, name=f"{experiment}_{key.replace('/', '_')}", node=entry, package="_global_")


register_protocols()


def check_protocol(cfg: DictConfig) -> None:
    """Every entry of the composed experiment's protocol names a task, a model, or a task/model pair: a misspelt
    one would never apply. Then the protocol leaves the config (its entries are applied, and the run's saved config
    holds their values)."""
    models = set(list_models())
    for key in cfg.get("protocol") or {}:
        task, _, model = str(key).rpartition("/")
        if not ((not task and (model in TASK_NAMES or model in models)) or (task in TASK_NAMES and model in models)):
            raise ConfigError(f"experiment={cfg.experiment}: its protocol entry {key!r} names no task, model or "
                              f"task/model (tasks: {', '.join(TASK_NAMES)}; models: python -m lra.taxonomy)")
    with open_dict(cfg):
        cfg.protocol = {}


ConfigStore.instance().store(name="lra_bench_schema", node=BenchRunConfig)

CHOICES = {
    "experiment": None,  # any preset name (checked by Hydra: it must be a file of conf/experiment/)
    "trainer.precision": ("auto", "bf16", "fp32"),
    "trainer.compile": ("auto", "true", "false"),
    "trainer.compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    "trainer.compile_check": ("auto", "true", "false"),
    "trainer.pack": ("false", "auto", "true"),
    "schedule.batching": ("random", "length_grouped"),
    "resume": ("auto", "true", "false"),
    "backbone.positions": ("learned", "sinusoidal", "none"),
    "backbone.pooling": ("cls", "mean", "last"),
    "backbone.norm": ("layernorm", "batchnorm"),
    "backbone.head": ("mlp", "linear"),
    "backbone.embedding": ("tokens", "pixels"),
    "optim.lr_schedule": ("rsqrt", "cosine", "constant"),
    "logger.name": ("none", "wandb"),
    "logger.mode": ("online", "offline", "disabled"),
    "pretrain.objective": ("none", "mlm", "causal"),
}
AT_LEAST_ONE = ("schedule.steps", "schedule.batch_size", "schedule.eval_every", "trainer.eval_batch_size",
                "trainer.ckpt_every", "trainer.devices", "backbone.n_layers", "backbone.d_model", "backbone.n_heads",
                "backbone.d_qkv", "backbone.d_ff", "backbone.d_classifier", "task.seq_len")
DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def eval_batch_size(cfg: DictConfig) -> int:
    """``trainer.eval_batch_size``, or with null the training batch (at least 128): a model small enough for
    Pathfinder's batch of 512 evaluates in batches as large, where 128 would leave the GPU waiting on launches."""
    size = cfg.trainer.get("eval_batch_size")
    return int(size) if size is not None else max(128, int(cfg.schedule.batch_size))


def _get(cfg: DictConfig, key: str):
    return OmegaConf.select(cfg, key, throw_on_missing=True)


def _set(cfg: DictConfig, key: str, value) -> None:
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, merge=False)


def not_a_setting(key: str, schema: type = RunConfig, prefix: str = "") -> str:
    """One line for ``prefix + key``, a key the section ``schema`` (at ``prefix``) does not have: its keys."""
    where = prefix.rstrip(".") or "the top level"
    return f"{prefix}{key} is not a setting of {where}: its keys are {', '.join(f.name for f in fields(schema))}"


def child_schema(schema: type, name: str) -> type | None:
    """The schema dataclass of the section ``name`` of ``schema`` (RunConfig's ``trainer`` -> TrainerConfig); None
    where ``name`` is no such section (a plain value, a dict such as ``model``, whose keys are the model's, or a key
    outside the schema)."""
    spec = schema.__dataclass_fields__.get(name)
    factory = spec.default_factory if spec is not None else None
    sub = factory() if callable(factory) else None
    return type(sub) if is_dataclass(sub) else None


def section_schema(path: list[str]) -> type | None:
    """The schema dataclass of the section at ``path`` (["trainer"] -> TrainerConfig); None where there is none."""
    schema = RunConfig
    for name in path:
        schema = child_schema(schema, name)
        if schema is None:
            return None
    return schema


def unknown_keys(node: DictConfig, schema: type, prefix: str = "") -> None:
    """Hydra's ``+key=value`` adds keys even to a typed node; refuse any key the schema does not have."""
    known = {f.name for f in fields(schema)}
    for key in node:
        if key not in known:
            raise ConfigError(not_a_setting(key, schema, prefix))
        sub = child_schema(schema, key)
        if isinstance(node[key], DictConfig) and sub is not None:
            unknown_keys(node[key], sub, f"{prefix}{key}.")


def chosen_model(argv: list[str]) -> str:
    """The model a command line composes: its last ``model=<name>``, else config.yaml's default."""
    chosen = [a.split("=", 1)[1] for a in argv if a.lstrip("+~").startswith("model=")]
    if chosen:
        return chosen[-1]
    defaults = OmegaConf.load(Path(__file__).parent / "conf" / "config.yaml").defaults
    return next(str(d["model"]) for d in defaults if isinstance(d, DictConfig) and "model" in d)


def composition_error(error: Exception, argv: list[str]) -> str:
    """One line for what Hydra refused to compose from the command line ``argv``: ``task=foo`` (the choices),
    ``model.foo=1`` (the model's options, as ``+model.foo=1`` is told), ``trainer.foo=1`` (the section's keys),
    ``schedule.steps=abc`` (the key, the value and the type it needs)."""
    cause = error.__cause__
    options = getattr(error, "options", None)  # hydra.errors.MissingConfigException: a group's choices
    missing = getattr(error, "missing_cfg_file", None)
    if missing and options is not None:
        group, _, name = str(missing).rpartition("/")
        return f"{group}={name} is not valid: choose one of {', '.join(sorted(options))}"
    key = str(getattr(cause, "full_key", "") or "")
    if isinstance(cause, ConfigAttributeError | ConfigKeyError) and key:
        section, _, name = key.rpartition(".")
        if section == "model":  # a model's options are its constructor's: say which it has
            value = next((a.split("=", 1)[1] for a in argv if a.lstrip("+~").split("=", 1)[0] == key), None)
            try:
                return invalid_options(chosen_model(argv), {name: value}) or first_lines(error, cause)
            except ValueError:  # not a registered model: Hydra's own words
                return first_lines(error, cause)
        schema = section_schema(section.split(".") if section else [])
        return not_a_setting(name, schema, f"{section}." if section else "") if schema else first_lines(error, cause)
    if isinstance(cause, ValidationError) and key:
        return f"{key}={getattr(cause, 'value', '')} is not valid: {str(cause).splitlines()[0]}"
    override = getattr(error, "override", None)  # hydra.errors.OverrideParseException: one it cannot parse
    return f"{override}: {first_lines(error)}" if override else first_lines(error, cause)


@contextmanager
def one_line_config_errors(argv: list[str]) -> Iterator[None]:
    """A command that composes the config from ``argv`` (``python -m lra``, ``lra.prepare``, ``lra.baseline``): what
    Hydra cannot compose, a ConfigError or a DataError ends it in one line with exit code 2 (``HYDRA_FULL_ERROR=1``:
    the traceback)."""
    try:
        with one_line_errors():
            yield
    except (HydraException, OmegaConfBaseException) as e:  # an unknown group choice or key, a value of a wrong type
        if wants_tracebacks():
            raise
        exit_with(composition_error(e, argv))


def first_lines(*errors: BaseException | None) -> str:
    """The first line of each error's message, joined: Hydra's message and OmegaConf's cause under it."""
    return ": ".join(str(e).strip().splitlines()[0].rstrip(".") for e in errors if e is not None and str(e).strip())


def validate(cfg: DictConfig) -> DictConfig:
    """Check a composed run config; normalise choice values (``True`` -> ``"true"``). Raises ConfigError."""
    unknown_keys(cfg, RunConfig)
    check_protocol(cfg)
    for key, allowed in CHOICES.items():
        value = str(_get(cfg, key)).lower()
        if allowed is not None and value not in allowed:
            raise ConfigError(f"{key}={_get(cfg, key)!r} is not valid: choose one of {', '.join(allowed)}")
        _set(cfg, key, value)
    for key in AT_LEAST_ONE:
        if _get(cfg, key) is not None and _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} is not valid: it must be at least 1")
    for key in ("data.limit.train", "data.limit.val", "data.limit.test"):
        value = _get(cfg, key)
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} is not valid: a split needs at least one example (null = all)")
    for key in ("backbone.dropout", "backbone.attn_dropout", "backbone.embedding_dropout"):
        if _get(cfg, key) is not None and not 0.0 <= _get(cfg, key) < 1.0:
            raise ConfigError(f"{key}={_get(cfg, key)} is not valid: a dropout rate is in [0, 1)")
    if not cfg.optim.lr > 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} is not valid: the learning rate must be positive")
    for key in ("optim.warmup_steps", "trainer.timing_warmup", "trainer.profile_steps", "seed"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}={_get(cfg, key)} is not valid: it must be >= 0")
    stop_at = cfg.schedule.stop_at
    if stop_at is not None and not 1 <= stop_at <= cfg.schedule.steps:
        raise ConfigError(f"schedule.stop_at={stop_at} is not valid: a step from 1 to schedule.steps="
                          f"{cfg.schedule.steps}, or null to run them all")
    if cfg.optim.grad_clip is not None and cfg.optim.grad_clip <= 0:
        raise ConfigError(f"optim.grad_clip={cfg.optim.grad_clip} is not valid: a positive norm, or null for none")
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas={list(cfg.optim.betas)} is not valid: two numbers in [0, 1)")
    if not DEVICE.match(str(cfg.device)):
        raise ConfigError(f"device={cfg.device!r} is not valid: choose auto, cpu, cuda or cuda:N")
    limit = cfg.trainer.get("time_limit")
    if limit is not None and not limit > 0:
        raise ConfigError(f"trainer.time_limit={limit} is not valid: minutes of training (> 0), or null for no limit")
    if cfg.trainer.threads is not None and cfg.trainer.threads < 1:
        raise ConfigError(f"trainer.threads={cfg.trainer.threads} is not valid: at least 1, or null for a share")
    b = cfg.backbone
    if b.d_qkv % b.n_heads:
        raise ConfigError(f"backbone.d_qkv={b.d_qkv} is not valid: it must be a multiple of backbone.n_heads="
                          f"{b.n_heads}")
    if b.pooling == "cls" and b.cls_token is False:
        raise ConfigError("backbone.pooling=cls needs the CLS slot: set backbone.cls_token=null or true")
    if not b.pixel_std > 0:
        raise ConfigError(f"backbone.pixel_std={b.pixel_std} is not valid: it must be positive")
    validate_task(cfg)
    validate_embedding(cfg)
    validate_head(cfg)
    validate_model(cfg)
    validate_pretrain(cfg)
    return cfg


def validate_task(cfg: DictConfig) -> None:
    try:
        spec = get_task(cfg.task.name)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    spec.check(cfg.task)


def validate_embedding(cfg: DictConfig) -> None:
    """``embedding=pixels`` reads gray values: only image tasks have them, and only as ids = pixel + 1."""
    if cfg.backbone.embedding != "pixels":
        return
    if not get_task(cfg.task.name).image:
        raise ConfigError(f"backbone.embedding=pixels is not valid for task {cfg.task.name}: its tokens are "
                          f"symbols, not pixels; choose tokens, or an image task ({', '.join(image_tasks())})")
    if cfg.data.pixel_zero_is_pad:
        raise ConfigError("backbone.embedding=pixels is not valid with data.pixel_zero_is_pad=true: black pixels "
                          "would be masked as padding; set data.pixel_zero_is_pad=false")


def validate_head(cfg: DictConfig) -> None:
    """``head=linear`` maps one pooled sequence to the classes: a pair task combines two through the MLP head."""
    if cfg.backbone.head == "linear" and get_task(cfg.task.name).pair:
        raise ConfigError(f"backbone.head=linear is not valid for task {cfg.task.name}: its two documents are "
                          f"combined by the MLP head; use backbone.head=mlp")


def validate_model(cfg: DictConfig) -> None:
    if "name" not in cfg.model:
        raise ConfigError("model.name is missing: choose a model with model=<name>")
    options = model_options(cfg)
    try:
        get_model_class(cfg.model.name)
    except ValueError as e:
        raise ConfigError(f"model.name={cfg.model.name!r}: {e}") from None
    cls = get_model_class(cfg.model.name)
    for key in sorted(set(options) & set(execution_settings(cls))):  # an option that became a setting of how it runs
        raise ConfigError(f"model.{key} is how {cfg.model.name} runs, not what it computes: set it with "
                          f"+trainer.mixer.{key}={options[key]} (left out of the config hash)")
    error = invalid_options(cfg.model.name, options)
    if error:
        raise ConfigError(error)
    given = mixer_settings(cfg)
    if "trainer.mixer_backend" in given and "backend" in given.get("trainer.mixer", {}):
        raise ConfigError("the backend is given twice: set trainer.mixer_backend or trainer.mixer.backend, not both")
    for source, settings in given.items():
        for key, value in settings.items():
            try:
                checked_setting(cls, key, value, cfg.model.name)
            except ValueError as e:
                name = source if source == "trainer.mixer_backend" else f"{source}.{key}"
                raise ConfigError(f"{name}={value}: {e}") from None
    why = task_mismatch(cfg.model.name, cfg.task.name)
    if why:
        raise ConfigError(f"model={cfg.model.name} task={cfg.task.name}: {why}")


def mixer_settings(cfg: DictConfig) -> dict[str, dict]:
    """The settings of how the model's mixers run, by the key that gives them: ``trainer.mixer_backend`` (the
    ``backend``) and ``trainer.mixer`` (any of ``models.base.execution_settings``); a key left unset is left out."""
    trainer = cfg.trainer
    out = {}
    if trainer.get("mixer_backend") is not None:
        out["trainer.mixer_backend"] = {"backend": trainer.mixer_backend}
    if trainer.get("mixer"):
        out["trainer.mixer"] = OmegaConf.to_container(trainer.mixer, resolve=True)
    return out


def task_mismatch(model: str, task: str) -> str | None:
    """Why registered ``model`` cannot take registered ``task``, or None if it can: a 2-D mixer (``needs_grid``)
    mixes over the pixel grid, which only image tasks' sequences have. The runner refuses such a pair before any
    data is read; the leaderboard names it in the cell instead of leaving it blank."""
    if getattr(get_model_class(model), "needs_grid", False) and not get_task(task).image:
        return (f"a 2-D mixer over the pixel grid takes image tasks only ({', '.join(image_tasks())}); "
                f"{task}'s tokens form no grid")
    return None


def has_causal_form(model: str) -> bool:
    """Whether registered ``model`` decodes causally (its taxonomy's ``decode``) and its mixer has that form here
    (``supports_causal``, models/base.py: a module outside ``MultiHeadMixer`` may not declare it)."""
    cls = get_model_class(model)
    return bool(cls.taxonomy.decode and getattr(cls, "supports_causal", False))


def validate_pretrain(cfg: DictConfig) -> None:
    """``pretrain.*``: a masking rate in (0, 1) for mlm, a schedule of positive values, and for causal a model whose
    mixer has a causal form here (``supports_causal``: next-token targets through a bidirectional mixer would be
    read off the input)."""
    p = cfg.pretrain
    if p.objective == "none":
        return
    if p.objective == "mlm" and (p.mask_rate is None or not 0.0 < p.mask_rate < 1.0):
        raise ConfigError(f"pretrain.mask_rate={p.mask_rate} is not valid for pretrain=mlm: the chance that a token "
                          f"is masked, in (0, 1) (conf/task/{cfg.task.name}.yaml sets the task's)")
    for key in ("steps", "warmup_steps"):
        if p[key] is not None and p[key] < (1 if key == "steps" else 0):
            raise ConfigError(f"pretrain.{key}={p[key]} is not valid: it must be at least {int(key == 'steps')}, or "
                              f"null for the task's")
    if p.lr is not None and not p.lr > 0:
        raise ConfigError(f"pretrain.lr={p.lr} is not valid: the learning rate must be positive, or null for the "
                          f"task's optim.lr")
    steps = p.steps if p.steps is not None else cfg.schedule.steps
    if p.stop_at is not None and not 1 <= p.stop_at <= steps:
        raise ConfigError(f"pretrain.stop_at={p.stop_at} is not valid: a step from 1 to the {steps} pretraining "
                          f"steps, or null to run them all")
    if p.objective == "causal" and not has_causal_form(cfg.model.name):
        able = [n for n in list_models() if has_causal_form(n)]
        raise ConfigError(f"pretrain=causal needs a causal mixer: model {cfg.model.name} has no causal form here "
                          f"(models that have one: {', '.join(able)}); use pretrain=mlm")


def register_model_configs() -> None:
    """Every registered model's constructor options and their defaults as ``model_defaults/<name>``, which
    ``conf/model/<name>.yaml`` takes first (the constructor is the schema and the one home of each default); a model
    registered from outside the package (entry point ``lra.models`` or ``LRA_MODEL_MODULES``) has no yaml and gets
    ``model/<name>`` made of the same, so that ``model=<name>`` composes. Call before composing (the CLI, lra.prepare
    and the tests do)."""
    store = ConfigStore.instance()
    shipped = {p.stem for p in (Path(__file__).parent / "conf" / "model").glob("*.yaml")}
    for name in list_models():
        store.store(group="model_defaults", name=name, node=model_defaults(name))
        if name not in shipped:
            store.store(group="model", name=name, node={"name": name, **model_defaults(name)})


def model_options(cfg: DictConfig) -> dict:
    """The model's own options from ``cfg.model`` (everything but ``name``), as plain Python values."""
    options = OmegaConf.to_container(cfg.model, resolve=True)
    options.pop("name", None)
    return options
