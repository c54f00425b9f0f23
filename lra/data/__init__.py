"""Task loaders. ``load_task(cfg)`` dispatches on ``cfg.task.name`` to one module per task family; each
returns a :class:`TaskData` of cached integer tensors."""
from __future__ import annotations

from importlib import import_module

from .common import BatchOrder, DataError, Split, TaskData

# task name -> module in this package with a ``load(cfg) -> TaskData``
TASK_MODULES = {
    "listops": "listops",
    "text": "text",
    "retrieval": "retrieval",
    "image": "image",
    "pathfinder": "pathfinder",
    "pathx": "pathfinder",
}


def load_task(cfg) -> TaskData:
    name = cfg.task.name
    if name not in TASK_MODULES:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASK_MODULES))}")
    data = import_module(f"{__name__}.{TASK_MODULES[name]}").load(cfg)
    data.info.setdefault("task", name)
    return data


__all__ = ["BatchOrder", "DataError", "Split", "TaskData", "load_task"]
