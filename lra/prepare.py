"""``python -m lra.prepare task=<task> [key=value ...]``: a task's data, made and cached, without training.

Generates (ListOps, Pathfinder) or reads (Text, Image, Retrieval) the data and writes its tokenised splits into the
cache (``data.cache_dir``) exactly as ``python -m lra`` with the same overrides would, then prints their summary.
The runs that follow start from a cache hit: the jobs of a sweep on a GPU host, or of a Slurm array, do not each
wait on the first to generate 200,000 Pathfinder images, and the generation can run on a CPU node, or on a GPU
host's CPU while its GPUs train. Several tasks: ``task=listops,pathfinder`` (``-m`` is accepted, not needed).

Errors the user can fix (a bad value, missing data, an unknown option) print one line and exit with code 2.
"""
from __future__ import annotations

import sys

from hydra import compose, initialize_config_module
from omegaconf import DictConfig

import lra.config
from lra.config import validate
from lra.data import TaskData, load_task


def compose_run(overrides: list[str]) -> DictConfig:
    """The configuration ``python -m lra <overrides>`` runs with (no Hydra output folder is made)."""
    lra.config.register_model_configs()
    with initialize_config_module("lra.conf", version_base=None):
        # run_dir names Hydra's output folder, which only a run has: a placeholder, never created
        return validate(compose("config", overrides=["run_dir=outputs/prepare", *overrides]))


def prepare(overrides: list[str]) -> list[TaskData]:
    """Each task of ``task=a,b`` (or the one task) loaded into the cache; the loaded data, in that order."""
    overrides = [o for o in overrides if o not in ("-m", "--multirun")]  # no sweep here: task=a,b is enough
    tasks = next((o.split("=", 1)[1].split(",") for o in reversed(overrides) if o.startswith("task=")), [None])
    rest = [o for o in overrides if not o.startswith("task=")]
    return [load_task(compose_run(rest if task is None else [f"task={task}", *rest])) for task in tasks]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__.strip())
        return
    with lra.config.one_line_config_errors(argv):  # a bad value, missing data, an unknown config option
        for data in prepare(argv):
            print(data.summary())


if __name__ == "__main__":
    main()
