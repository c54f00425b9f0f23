"""The task registry: each module of this package that loads a task declares it with ``@register_task`` beside
its ``load`` function, and every such module is imported here, so a new task is one module plus one
``conf/task/<name>.yaml``. ``load_task(cfg)`` is what the runner calls.

A loader is ``load(task, data, *, seed, progress) -> TaskData``: ``task`` and ``data`` are the config's
``task.*`` and ``data.*`` sections (a loader reads only its own keys of ``data``), ``seed`` draws any limited
subset, ``progress`` shows bars on long generation. A task may also read one file of its test split's format
(``read_file(path, task, data) -> TaskData``, the file as every split): ``lra.evaluate``'s ``data.path=FILE``,
through ``load_file``.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lra.errors import ConfigError, DataError

from .common import BatchOrder, Split, TaskData

_REGISTRY: dict[str, TaskSpec] = {}
_NOT_TASKS = {"common", "pathfinder_gen"}  # shared code and the Pathfinder generator, not loaders


@dataclass(frozen=True)
class TaskSpec:
    """A registered task: its loader, its number of classes, whether it is a pair task (two documents per
    example) or an image (its tokens lie on a pixel grid), an optional ``check(task_cfg)`` that refuses
    impossible settings before any data is read (raising ``ValueError`` with a one-line reason), and an optional
    ``read_file`` that reads one file of the task's test format (``load_file``)."""

    name: str
    load: Callable[..., TaskData]
    n_classes: int
    pair: bool = False
    image: bool = False
    validate: Callable | None = None
    read_file: Callable[..., TaskData] | None = None

    def check(self, task_cfg) -> None:
        if self.validate is not None:
            try:
                self.validate(task_cfg)
            except (ValueError, DataError) as e:
                raise ConfigError(f"task {self.name}: {e}") from None


def register_task(name: str, *, n_classes: int, pair: bool = False, image: bool = False,
                  check: Callable | None = None, read_file: Callable[..., TaskData] | None = None) -> Callable:
    """Decorator for a loader function: ``@register_task("listops", n_classes=10)``. Stack it to serve
    several tasks with one loader (Pathfinder and Path-X)."""

    def add(load: Callable) -> Callable:
        if name in _REGISTRY and _REGISTRY[name].load is not load:
            raise ValueError(f"task {name!r} is registered twice: {_REGISTRY[name].load.__module__} and "
                             f"{load.__module__}")
        _REGISTRY[name] = TaskSpec(name, load, n_classes, pair, image, check, read_file)
        return load

    return add


def list_tasks() -> list[str]:
    """Names of every registered task, sorted."""
    return sorted(_REGISTRY)


def image_tasks() -> list[str]:
    return sorted(n for n, s in _REGISTRY.items() if s.image)


def get_task(name: str) -> TaskSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(list_tasks())}") from None


def load_task(cfg) -> TaskData:
    """Load ``cfg.task`` with its loader; every split must hold at least one example."""
    spec = get_task(cfg.task.name)
    spec.check(cfg.task)
    data = spec.load(cfg.task, cfg.data, seed=int(cfg.seed), progress=bool(cfg.trainer.progress))
    data.info.setdefault("task", spec.name)
    for split in ("train", "val", "test"):
        if len(getattr(data, split)) == 0:
            raise DataError(f"{spec.name}: the {split} split is empty ({data.info.get('source', 'no source')}); "
                            f"check data.limit.{split} and the source files")
    return data


def load_file(cfg, path: str | Path, limit: int | None = None) -> TaskData:
    """One file of ``cfg.task``'s test format (its ``read_file``: ListOps' TSV, IMDb's or CIFAR-10's parquet, ...)
    as every split: all its examples, or the first ``limit``."""
    spec = get_task(cfg.task.name)
    spec.check(cfg.task)
    if spec.read_file is None:
        able = ", ".join(n for n in list_tasks() if _REGISTRY[n].read_file is not None)
        raise DataError(f"task {spec.name} reads no single file (tasks that do: {able}); give its source with "
                        f"data.root or data.path as a run does")
    path = Path(path).expanduser()
    data = spec.read_file(path, cfg.task, cfg.data)
    if len(data.test) == 0:
        raise DataError(f"{path} holds no examples")
    data.info.setdefault("task", spec.name)
    split = data.test.head(limit)
    return dataclasses.replace(data, train=split, val=split, test=split)


for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in _NOT_TASKS and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")

__all__ = ["BatchOrder", "DataError", "Split", "TaskData", "TaskSpec", "get_task", "image_tasks", "list_tasks",
           "load_file", "load_task", "register_task"]
