"""What a run computes, apart from where and how it runs: the config hash of every row, and the command-line
overrides that change a preset (the leaderboard keeps such rows apart). No torch: the leaderboard reads it."""
from __future__ import annotations

import hashlib
import json

from lra.errors import first_line

# Settings that change where or how a run executes, not what it computes; the trainer's too, except precision.
NOT_HASHED = ("run_dir", "results", "resume", "device", "hydra", "logger", "sweep", "protocol")
NOT_HASHED_TRAINER = ("compile", "compile_mode", "compile_check", "mixer_backend", "mixer", "pack", "trim", "devices",
                      "threads", "eval_batch_size", "ckpt_every", "time_limit", "timing_warmup", "progress",
                      "profile_steps", "deterministic")
# Where a run stops is not what it computes: the steps it does run are the full schedule's (its row says it stopped).
NOT_HASHED_SCHEDULE = ("stop_at",)
NOT_HASHED_PRETRAIN = ("stop_at",)  # the same of the pretraining phase (``pretrain.stop_at``)
STOPPED = "stopped"  # a run ended by schedule.stop_at or trainer.time_limit (``stopped_status``); a prefix to test for


def stopped_status(step: int, steps: int, phase: str = "") -> str:
    """The status of a run that ``schedule.stop_at`` or ``trainer.time_limit`` ended at ``step`` of its ``steps``
    (of its ``phase``: ``pretraining`` for one ended by ``pretrain.stop_at`` or the time limit in that phase)."""
    return f"{STOPPED}: at {phase + ' ' if phase else ''}step {step:,} of {steps:,}"


def is_stopped(status) -> bool:
    """Whether a row's ``status`` (any value, a missing one included) is that of a run ended early
    (``stopped_status``)."""
    return str(status).startswith(STOPPED)


def error_status(error: BaseException) -> str:
    """The status of a row whose run or bench case failed with ``error``: ``error: <type>: <first line>``, the
    message's first line cut at 200 characters (the log keeps the whole traceback)."""
    return f"error: {type(error).__name__}: {first_line(error)}"


# Keys added after runs were recorded (the backbone's, a mixer's options, the schedule's), with the values that
# computed what those runs computed: at these values they are left out of the hash, so a run recorded or
# checkpointed before they existed keeps its hash (it resumes, and a finished one is still recognised). Fixed
# values, not the schema's defaults. The model's are s4d's options; any mixer's option of one of those names is
# left out at that value too, so a new mixer gives such a name only that meaning.
HASHED_ONLY_IF_NOT = {
    "backbone": {"norm": "layernorm", "prenorm": True, "mlp": True, "head": "mlp", "embedding": "tokens",
                 "pixel_mean": 0.5, "pixel_std": 0.5, "tie_dropout": False, "embedding_dropout": None},
    "model": {"tie_dropout": False, "dt_lr": "ssm", "n_ssm": None, "c_times_b": False, "b_clip": 2.0},
    "schedule": {"batching": "random"},
}
# Mixer options that became settings of how the mixer runs (attributes set by ``trainer.mixer``, out of the hash):
# the values every recorded run of that model held in its model section, put back before hashing, so such a run
# keeps its hash whatever setting runs it now. Fixed values, not today's defaults: gla's and mamba's rows ran when
# their scan's default was auto.
MOVED_TO_EXECUTION = {
    "performer": {"recompute": True, "compile_core": True, "chunk_size": None},
    "linear": {"chunk_size": 64, "compile_core": True},
    "gla": {"chunk_size": 64, "scan": "auto"},
    "mamba": {"chunk_size": 64, "scan": "auto"},
    "sinkhorn": {"compile_sinkhorn": True},
}

PARTIAL_PRESETS = ("smoke", "scaling")  # short runs by design: overriding them is what they are for
# what a preset is applied to, not a change of it (a pretrained run's rows say so themselves: ``pretrain``)
PRESET_CHOICES = ("task", "model", "seed", "experiment", "pretrain")
DATA_SOURCE = ("cache_dir", "path", "root", "workers")  # where the data is read from and with how many processes
EVAL_CADENCE = ("schedule.eval_every", "train.eval_every")  # train.*: the key's name in rows before schedule.*


def departures(overrides: str, val_is_test: bool = False) -> list[str]:
    """The command-line overrides (a row's ``overrides``) that change what its preset computes: all but the choice
    of task, model, seed and preset, where the data and outputs live, and how the run executes (the settings
    ``config_hash`` leaves out). Where validation is the test set the headline is the final weights', so the
    evaluation cadence changes nothing reported either."""
    changed = []
    for token in str(overrides or "").split():
        key = token.split("=", 1)[0].lstrip("+~").replace("/", ".")  # hydra/launcher=gpus: a group choice
        top, _, sub = key.partition(".")
        trainer_key = sub.partition(".")[0]  # trainer.mixer.scan: a setting of trainer.mixer
        neutral = (key in PRESET_CHOICES or top in NOT_HASHED
                   or (top == "trainer" and trainer_key in NOT_HASHED_TRAINER)
                   or (top == "schedule" and sub in NOT_HASHED_SCHEDULE)
                   or (top == "pretrain" and sub in NOT_HASHED_PRETRAIN)
                   or (top == "data" and sub in DATA_SOURCE) or (val_is_test and key in EVAL_CADENCE))
        if not neutral:
            changed.append(token)
    return changed


def config_hash(cfg_dict: dict) -> str:
    """A short hash of everything that defines what a run computes (paths, logging and execution settings such as
    the number of devices or threads excluded): equal hashes, equal results up to floating-point order."""
    keep = {k: v for k, v in cfg_dict.items() if k not in NOT_HASHED}
    if isinstance(keep.get("trainer"), dict):
        keep["trainer"] = {k: v for k, v in keep["trainer"].items() if k not in NOT_HASHED_TRAINER}
    if isinstance(keep.get("schedule"), dict):
        keep["schedule"] = {k: v for k, v in keep["schedule"].items() if k not in NOT_HASHED_SCHEDULE}
    if isinstance(keep.get("pretrain"), dict):  # no pretraining: no section, as in runs recorded before it existed
        pretrain = keep.pop("pretrain")
        if pretrain.get("objective", "none") != "none":
            keep["pretrain"] = {k: v for k, v in pretrain.items() if k not in NOT_HASHED_PRETRAIN}
    if isinstance(keep.get("data"), dict):  # where the cache lives is not what the data is
        keep["data"] = {k: v for k, v in keep["data"].items() if k != "cache_dir"}
    model = keep.get("model")
    if isinstance(model, dict) and model.get("name") in MOVED_TO_EXECUTION:
        keep["model"] = {**model, **MOVED_TO_EXECUTION[model["name"]]}
    for section, old_values in HASHED_ONLY_IF_NOT.items():
        if isinstance(keep.get(section), dict):
            keep[section] = {k: v for k, v in keep[section].items() if k not in old_values or v != old_values[k]}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:12]
