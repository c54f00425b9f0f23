"""``python -m lra.evaluate RUN_DIR [key=value ...] [--checkpoint best|final] [--split test|val] [--out CSV]``: a
saved run's weights on other data, without retraining, so that a result can be checked on data from another
generator, seed or release.

The run's own ``config.yaml`` is loaded, the overrides are applied (data and task settings only: anything that
would change the model the checkpoint holds is refused, naming the key), the data is loaded with the task's loader
(``data.path=FILE``: that one file of the task's test format, every example of it) and the model is built as the
runner builds it; the data must give that model the vocabulary, length and number of classes of the checkpoint.
The accuracy comes from the runner's own ``lra.train.run.accuracy`` at the run's precision (bf16 autocast on CUDA,
fp32 on CPU), eagerly. One line is printed; ``--out`` appends a row (``EvalRow``) to a CSV.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from lra.config import RunConfig, eval_batch_size, model_options, validate
from lra.data import TaskData, load_file, load_task
from lra.errors import ConfigError, DataError, one_line_errors
from lra.provenance import config_hash
from lra.report.results import append_row, device_name, git_sha, now_iso
from lra.train import engine
from lra.train.checkpoint import RunFiles, why_unreadable
from lra.train.run import accuracy, check_writable, seed_everything, task_shape

log = logging.getLogger("lra")
CONFIG = "config.yaml"  # written by the runner into every run folder

# Settings that shape the model or say what its weights mean (a task's resolution is its length): never overridden.
MODEL_KEYS = ("backbone", "model", "task.name", "task.seq_len", "task.resolution")
# What an evaluation may change: which data, and where and in what batches it runs.
EVAL_KEYS = ("data", "task", "device", "trainer.eval_batch_size", "trainer.threads", "trainer.progress")
EVAL_KEYS_TEXT = "data.*, task.difficulty, device, trainer.eval_batch_size, trainer.threads, trainer.progress"
# The run's own accuracy (result.json) for each (checkpoint, split), shown beside the new one.
RUN_ACC_KEY = {("best", "test"): "test_acc", ("final", "test"): "final_test_acc", ("best", "val"): "val_acc",
               ("final", "val"): "final_val_acc"}


@dataclass
class EvalRow:
    """One evaluation of a saved run (``--out``; columns documented in ``docs/cli.md``)."""

    task: str
    model: str
    seed: int
    experiment: str
    checkpoint: str  # best (best.pt) | final (the latest checkpoint's weights)
    step: int  # the training step those weights are from
    split: str  # test | val
    accuracy: float  # fraction 0-1
    n_examples: int
    run_acc: float | None  # the run's own accuracy for these weights and split, on its own data (result.json)
    data_source: str  # the loader's info["source"]: a folder, a file, a dataset id
    data_version: str | None  # what a run's row records as its data (TaskData.version: pathfinder_gen v2 seed 0, a
    # file's hash, else the source)
    data_split: str | None  # the loader's split recipe
    overrides: str  # this evaluation's overrides
    precision: str
    device: str
    torch: str
    git_sha: str  # the code that evaluated
    config_hash: str  # the run's (result.json, else computed from its config.yaml)
    timestamp: str
    run_dir: str


EVAL_COLUMNS = [f.name for f in fields(EvalRow)]


def folder_contents(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    return ", ".join(names) if names else "nothing"


def load_run_config(run_dir: Path) -> DictConfig:
    """The run's config on the schema (so overrides are type-checked), its ``run_dir`` set to where it is now:
    a config written by ``python -m lra`` still holds Hydra's ``${hydra:...}``, which resolves only inside Hydra."""
    if not run_dir.is_dir():
        raise ConfigError(f"no run folder at {run_dir}: pass the folder of a run (it holds {CONFIG} and best.pt)")
    path = run_dir / CONFIG
    if not path.exists():
        raise ConfigError(f"{run_dir} holds no {CONFIG}, so it is not a run folder (it holds "
                          f"{folder_contents(run_dir)})")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(path))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path} does not fit this version's config schema ({str(e).splitlines()[0]})") from None
    cfg.run_dir = str(run_dir)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path} does not resolve here ({str(e).splitlines()[0]})") from None
    return cfg


def check_override_key(key: str) -> None:
    def under(prefixes):
        return any(key == p or key.startswith(p + ".") for p in prefixes)

    if under(MODEL_KEYS):
        raise ConfigError(f"{key} cannot change in an evaluation: it changes the model the checkpoint holds; "
                          f"evaluate takes {EVAL_KEYS_TEXT}")
    if not under(EVAL_KEYS):
        raise ConfigError(f"{key} is not an evaluation setting (the run's own value stays); evaluate takes "
                          f"{EVAL_KEYS_TEXT}")


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """``key=value`` items, type-checked against the schema; then the whole config validated."""
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"{item!r} is not an override: write key=value (e.g. data.root=/path/to/release)")
        check_override_key(key)
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except ConfigKeyError:
            raise ConfigError(f"{key} is not a setting of the run's config; evaluate takes {EVAL_KEYS_TEXT}") from None
        except OmegaConfBaseException as e:
            raise ConfigError(f"{item}: {str(e).splitlines()[0]}") from None
    return validate(cfg)


def load_weights(files: RunFiles, which: str, device: torch.device) -> tuple[dict, int]:
    """(state_dict, training step) of ``best.pt`` or of the latest checkpoint, never running code from the file."""
    if which == "best":
        if not files.best.exists():
            raise ConfigError(f"{files.dir} holds no best.pt (best-validation weights are saved at the first "
                              f"evaluation); it holds {folder_contents(files.dir)}; --checkpoint final uses the "
                              f"latest checkpoint")
        try:
            saved = files.load_best(device)
        except Exception as e:  # noqa: BLE001 - any unreadable file: name it, in one line
            raise DataError(f"{files.best} is unreadable ({why_unreadable(e)})") from None
        return saved["model"], int(saved["step"])
    if not files.has_checkpoint():
        raise ConfigError(f"{files.dir} holds no checkpoint.pt (nor checkpoint.prev.pt); it holds "
                          f"{folder_contents(files.dir)}; --checkpoint best uses best.pt")
    saved = files.load_checkpoint()  # the previous checkpoint when the latest is unreadable, saying so
    if saved is None:
        raise DataError(f"{files.checkpoint} and {files.previous} are both unreadable; --checkpoint best uses best.pt")
    return saved["model"], int(saved["state"]["step"])


def fit_error(model: torch.nn.Module, weights: dict, data: TaskData, run_seq_len: int, where: str) -> str | None:
    """Why the checkpoint's weights cannot serve ``data`` (None when they can). The model built for the new data
    has the checkpoint's tensors exactly when vocabulary, length and classes agree; sinusoidal positions hold no
    tensor, so the length is also compared with the run's ``task.seq_len``."""
    embed, head = "encoder.embed.weight", f"head.{len(model.head) - 1}.weight"
    ours = model.state_dict()
    wanted = {"vocabulary": data.vocab_size, "length": data.seq_len, "classes": data.n_classes}
    trained = {"vocabulary": weights[embed].shape[0] if embed in weights else None, "length": run_seq_len,
               "classes": weights[head].shape[0] if head in weights else None}
    differ = [f"{k} {wanted[k]} (the model's: {trained[k]})" for k in wanted if wanted[k] != trained[k]]
    # a module's extra state (the performer's redraw counters: a dict) is no tensor and has no shape
    tensors = sorted(k for k in set(ours) | set(weights) if k not in ours or k not in weights
                     or getattr(ours[k], "shape", None) != getattr(weights[k], "shape", None))
    if not differ and not tensors:
        return None
    what = ", ".join(differ) or f"tensors {', '.join(tensors[:3])} differ in shape"
    return (f"this data does not fit the model in {where}: {what}; evaluate needs data of the run's vocabulary, "
            f"length and classes")


def load_data(cfg: DictConfig, overrides: list[str], split: str, run_path: str | None) -> TaskData:
    """The data to score: with ``data.path=FILE`` on this command line, that file of the task's test format, every
    example of it (the first ``data.limit.test`` where this command line sets one; the run's limits are the
    run's); else the task's loader on the run's data settings after the overrides, the run's ``data.limit.*``
    included (said where it cuts the split). ``run_path`` is the run's own ``data.path``: a task that trained
    without one (ListOps: its loader reads ``data.root``) takes ``data.path`` only as such a file."""
    given = {o.partition("=")[0].lstrip("+~") for o in overrides}
    path = cfg.data.get("path")
    if "data.path" in given and path and Path(path).expanduser().is_file():
        if split != "test":
            raise ConfigError(f"data.path={path} is the data to score, one split: drop --split {split}")
        data = load_file(cfg, path, cfg.data.limit.test if "data.limit.test" in given else None)
        log.info("%s: %d examples of %s (%s)", path, len(data.test), cfg.task.name, data.version())
        return data
    if "data.path" in given and path and run_path is None:
        raise DataError(f"data.path={path}: no such file; for task {cfg.task.name} data.path is one file of its "
                        f"test format (docs/cli.md)")
    data = load_task(cfg)
    log.info(data.summary())
    limit = cfg.data.limit[split]
    if limit is not None and f"data.limit.{split}" not in given and len(getattr(data, split)) == limit:
        log.warning("the run's data.limit.%s=%d applies: %d examples scored; data.limit.%s=null scores the whole "
                    "split", split, limit, limit, split)
    return data


def evaluate_run(run_dir: str | Path, overrides: list[str] | tuple = (), checkpoint: str = "best",
                 split: str = "test") -> dict:
    """Evaluate the run in ``run_dir`` on ``split`` of the data its config names, after ``overrides``; returns
    the row (``EVAL_COLUMNS``). Raises ConfigError / DataError with a one-line message on anything a user can fix."""
    if checkpoint not in ("best", "final") or split not in ("test", "val"):
        raise ConfigError(f"checkpoint={checkpoint!r}, split={split!r}: choose best or final, and test or val")
    files = RunFiles(Path(run_dir))
    cfg = load_run_config(files.dir)
    run_seq_len, run_steps, run_path = int(cfg.task.seq_len), int(cfg.schedule.steps), cfg.data.get("path")
    done = files.finished() or {}
    chash = done.get("config_hash") or config_hash(OmegaConf.to_container(cfg))
    cfg = apply_overrides(cfg, list(overrides))
    device = engine.resolve_device(cfg.device)
    engine.configure(device, cfg.trainer.threads, cfg.trainer.deterministic)  # the mixers' paths the run took
    weights, step = load_weights(files, checkpoint, device)
    if done.get("status") != "ok":  # still running, stopped, diverged, ...: say what these weights are
        state = f"ended with status {done['status']}" if done else "not finished"
        log.warning("%s has %s: these are its %s weights, of step %d of %d", files.dir, state, checkpoint, step,
                    run_steps)

    seed_everything(cfg.seed)  # as the runner: load, then build
    data = load_data(cfg, list(overrides), split, run_path)
    model = engine.build_model(cfg.model.name, model_options(cfg), cfg.backbone, task_shape(data))
    where = files.best.name if checkpoint == "best" else "the latest checkpoint"
    error = fit_error(model, weights, data, run_seq_len, where)
    if error:
        raise DataError(error)
    model.load_state_dict(weights)
    model.to(device)
    precision = engine.resolve_precision(cfg.trainer.precision, device)
    examples = getattr(data, split)
    acc = accuracy(model, examples, eval_batch_size(cfg), device, engine.autocast(precision, device))

    row = EvalRow(
        task=cfg.task.name, model=cfg.model.name, seed=cfg.seed, experiment=cfg.experiment, checkpoint=checkpoint,
        step=step, split=split, accuracy=acc, n_examples=len(examples),
        run_acc=done.get(RUN_ACC_KEY[checkpoint, split]), data_source=str(data.info.get("source", "")),
        data_version=data.version(), data_split=data.info.get("split"), overrides=" ".join(overrides),
        precision=precision, device=device_name(device), torch=torch.__version__, git_sha=git_sha(),
        config_hash=chash, timestamp=now_iso(), run_dir=str(files.dir))
    return asdict(row)


def describe(row: dict) -> str:
    """The one line printed for an evaluation."""
    version = f" ({row['data_version']})" if row["data_version"] not in (None, row["data_source"]) else ""
    recorded = f"; the run recorded {row['run_acc']:.4f} on its own data" if row["run_acc"] is not None else ""
    return (f"{row['task']}/{row['model']} seed {row['seed']}, {row['checkpoint']} weights (step {row['step']}), "
            f"{row['split']} split of {row['data_source']}{version}: accuracy {row['accuracy']:.4f} on "
            f"{row['n_examples']:,} examples{recorded}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m lra.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run's folder (config.yaml, best.pt, checkpoint.pt)")
    ap.add_argument("overrides", nargs="*", help=f"key=value: {EVAL_KEYS_TEXT} (e.g. data.root=DIR)")
    ap.add_argument("--checkpoint", choices=("best", "final"), default="best",
                    help="best: best-validation weights (best.pt); final: the latest checkpoint's weights")
    ap.add_argument("--split", choices=("test", "val"), default="test")
    ap.add_argument("--out", default=None, help="append the result row to this CSV")
    return ap.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with one_line_errors():
        if args.out:
            check_writable(Path(args.out).parent)  # fail before loading data, not after
        row = evaluate_run(args.run_dir, args.overrides, args.checkpoint, args.split)
    print(describe(row))
    if args.out:
        append_row(args.out, row, EVAL_COLUMNS)
    return row


if __name__ == "__main__":
    main()
