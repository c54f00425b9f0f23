"""``python -m lra task=<task> model=<model> [key=value ...]``: train, evaluate, append a row to runs.csv."""
import hydra
from omegaconf import DictConfig

from lra.run import run


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    return run(cfg)


if __name__ == "__main__":
    main()
