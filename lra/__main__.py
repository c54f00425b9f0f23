"""``python -m lra task=<task> model=<model> [key=value ...]`` (or ``lra ...``): train, evaluate, record a row.

Errors the user can fix (an unknown task, model or key, a bad value, missing data, an unwritable folder) print one
line and exit with code 2; a run stopped by a signal prints where its checkpoint is and exits with code 75 (rerun
the command to resume). ``HYDRA_FULL_ERROR=1`` shows the whole traceback instead.
"""
import logging
import os
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import lra.config  # registers the config schema with Hydra's ConfigStore
from lra.errors import EXIT_INTERRUPTED, FULL_ERROR, ConfigError, DataError, exit_with, wants_tracebacks
from lra.train.run import RunInterrupted, catch_signals, run


class JobStarted:
    """Whether this process's job has begun (``main`` runs): an OSError before it is Hydra's, making the folder."""

    started = False


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    JobStarted.started = True
    catch_signals()  # a command's run checkpoints and stops on Ctrl-C, SIGTERM or Slurm's SIGUSR2
    try:
        return run(cfg)
    except (ConfigError, DataError) as e:
        if wants_tracebacks():
            raise
        logging.getLogger("lra").error("%s", e)
        remove_if_hydras_alone(Path(HydraConfig.get().runtime.output_dir))
        exit_with(e)
    except RunInterrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


def remove_if_hydras_alone(folder: Path) -> None:
    """A run refused before it began (a setting the checks refuse) leaves no folder: the one Hydra made for it
    goes, with the parents that only held it, where it holds nothing but Hydra's own files (its saved config and
    this command's log). A folder with anything of a run's (config.yaml, checkpoints) stays."""
    hydra_cfg = HydraConfig.get()
    own = {hydra_cfg.output_subdir, f"{hydra_cfg.job.name}.log"}
    if not folder.is_dir() or any(p.name not in own for p in folder.iterdir()):
        return
    for handler in logging.getLogger().handlers[:]:  # the command's log file, closed before it goes
        if Path(getattr(handler, "baseFilename", "/")).parent == folder.resolve():
            logging.getLogger().removeHandler(handler)
            handler.close()
    shutil.rmtree(folder, ignore_errors=True)
    named = Path(hydra_cfg.run.dir)
    if hydra_cfg.mode == RunMode.RUN and not named.is_absolute():  # and the parents made for it here, now empty
        for parent in named.parents:
            if parent == Path(".") or not parent.is_dir() or any(parent.iterdir()):
                break
            parent.rmdir()


def with_run_folder(argv: list[str]) -> list[str]:
    """``run_dir=X`` names the run's folder: Hydra's own (its saved config and the command's log) goes there too,
    not under outputs/. A sweep's jobs each have their folder (hydra.sweep.*), which run_dir does not set."""
    if {"-m", "--multirun"} & set(argv) or any(a.startswith("hydra.run.dir=") for a in argv):
        return argv
    run_dir = next((a.split("=", 1)[1] for a in reversed(argv) if a.startswith("run_dir=")), None)
    return argv if run_dir is None else [*argv, f"hydra.run.dir={run_dir}"]


def cli() -> None:
    """The ``lra`` console script."""
    argv = sys.argv[1:]
    try:
        lra.config.check_launcher(argv)  # a launcher whose extra is missing: say which to install
    except ConfigError as e:
        exit_with(e)
    lra.config.register_model_configs()  # before Hydra composes `model=<name>`
    os.environ.setdefault("LRA_SWEEP_NAME", lra.config.sweep_slug(argv))  # a multirun's stable folder
    os.environ.setdefault("LRA_SWEPT_KEYS", ",".join(lra.config.swept_keys(argv)))  # its jobs' folders
    # Hydra prints what it cannot compose in many lines and exits 1 unless HYDRA_FULL_ERROR=1 has it raise; the
    # user's own choice is kept (FULL_ERROR) for the tracebacks they asked for
    os.environ.setdefault(FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", ""))
    os.environ["HYDRA_FULL_ERROR"] = "1"
    sys.argv = [sys.argv[0], *with_run_folder(argv)]
    try:
        with lra.config.one_line_config_errors(argv):
            main()
    except OSError as e:
        if JobStarted.started or e.filename is None or wants_tracebacks():
            raise
        # a file or folder Hydra makes before the job starts: the run's folder, its saved config, the log
        exit_with(f"cannot write the run folder {e.filename or ''} ({e.strerror or e}); choose a writable one: "
                  f"hydra.run.dir=DIR (or run_dir=DIR)")


if __name__ == "__main__":
    cli()
