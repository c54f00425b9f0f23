"""``python -m lra.baseline task=<task> [key=value ...] [--results DIR]``: a task's stall baseline
(``lra.report.baseline``), measured on its data as a run with the same overrides would load it, into
``DIR/baselines.csv``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lra.config import one_line_config_errors
from lra.data import load_task
from lra.prepare import compose_run
from lra.report.baseline import Baseline, measure, write_baseline
from lra.report.leaderboard import DEFAULT_RESULTS


def main(argv: list[str] | None = None) -> Baseline:
    ap = argparse.ArgumentParser(prog="python -m lra.baseline", description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=DEFAULT_RESULTS,
                    help="folder of baselines.csv, the row written there (the project's: results)")
    args, overrides = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    with one_line_config_errors(overrides):  # a bad value, missing data, an unknown config option
        cfg = compose_run(overrides)
        row = measure(load_task(cfg))
    row.data = row.data.replace(str(Path(cfg.data.cache_dir).expanduser()), "<cache_dir>")  # not this machine's path
    path = Path(args.results) / "baselines.csv"
    write_baseline(path, row)
    print(f"{row.task}: validation majority {100 * row.val_majority:.2f}, bag of tokens "
          f"{100 * row.val_bag_of_tokens:.2f}, first token {100 * row.val_first_token:.2f}: stall baseline "
          f"{100 * row.val_baseline:.2f} ({row.how}), {row.seconds:.1f} s; written to {path}")
    return row


if __name__ == "__main__":
    main()
