"""``python -m lra task=<task> model=<model> [key=value ...]`` (or ``lra ...``): train, evaluate, record a row.

Errors the user can fix (a bad value, missing data, an unwritable folder) print one line and exit with code 2;
a run stopped by a signal prints where its checkpoint is and exits with code 75 (rerun the command to resume).
``HYDRA_FULL_ERROR=1`` shows the whole traceback instead.
"""
import logging
import os
import sys

import hydra
from omegaconf import DictConfig

import lra.config  # registers the config schema with Hydra's ConfigStore
from lra.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, ConfigError, DataError
from lra.train.run import RunInterrupted, run


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    try:
        return run(cfg)
    except (ConfigError, DataError) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        logging.getLogger("lra").error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except RunInterrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


def cli() -> None:
    """The ``lra`` console script."""
    try:
        lra.config.check_launcher(sys.argv[1:])  # a launcher whose extra is missing: say which to install
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    lra.config.register_model_configs()  # before Hydra composes `model=<name>`
    os.environ.setdefault("LRA_SWEEP_NAME", lra.config.sweep_slug(sys.argv[1:]))  # a multirun's stable folder
    os.environ.setdefault("LRA_SWEPT_KEYS", ",".join(lra.config.swept_keys(sys.argv[1:])))  # its jobs' folders
    main()


if __name__ == "__main__":
    cli()
