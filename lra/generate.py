"""Generate the synthetic LRA tasks in the ``lra_release`` layout, so generated and downloaded data go
through the same loaders.

    python -m lra.generate listops --out DIR [--seed S --train N --val N --test N --workers W]
    python -m lra.generate pathfinder --resolution 32 --difficulty hard --n 200000 --out DIR [--seed S --workers W]
    python -m lra.generate pathfinder --resolution 128 --time results/generate.csv [--time-images N --warmup N]
    python -m lra.generate pathfinder --resolution 128 --time results/generate.csv --time-workers 16 --time-images 8000
"""
from __future__ import annotations

import argparse
import sys

from lra.data import pathfinder_gen
from lra.data.listops import generate
from lra.report.results import append_row, git_sha, now_iso


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lra.generate", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="task", required=True)

    p = sub.add_parser("listops", help="ListOps expressions (LRA: 96,000 / 2,000 / 2,000)")
    p.add_argument("--out", required=True, help="folder; writes OUT/listops-1000/basic_{train,val,test}.tsv")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=96_000)
    p.add_argument("--val", type=int, default=2_000)
    p.add_argument("--test", type=int, default=2_000)
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores, at most 16)")

    p = sub.add_parser("pathfinder", help="Pathfinder / Path-X images (Linsley et al. 2018, LRA parameters)")
    pathfinder_gen.add_arguments(p)
    p.add_argument("--time", metavar="CSV", help="instead of generating: time the generator against the canvas "
                   "algorithm (pathfinder_gen.time_generators) and append a row for each to CSV")
    p.add_argument("--time-images", type=int, default=40, help="images timed")
    p.add_argument("--warmup", type=int, default=200, help="images drawn first, untimed")
    p.add_argument("--time-runs", type=int, default=3, help="alternating runs; the fastest counts")
    p.add_argument("--time-workers", type=int, metavar="W", help="with --time: instead of the one-core comparison, "
                   "the wall time of writing --time-images images in W processes (pathfinder_gen.time_parallel)")

    args = parser.parse_args(argv)
    if args.task == "listops":
        folder = generate(args.out, seed=args.seed, train=args.train, val=args.val, test=args.test,
                          workers=args.workers)
        print(f"wrote {folder}")
    elif args.time:
        if args.time_workers:
            rows = [pathfinder_gen.time_parallel(args.resolution, args.difficulty, args.time_images,
                                                 args.time_workers, args.seed)]
        else:
            rows = pathfinder_gen.time_generators(args.resolution, args.difficulty, args.time_images, args.warmup,
                                                  args.seed, args.time_runs)
        for row in rows:
            append_row(args.time, {**row, "git_sha": git_sha(), "timestamp": now_iso()},
                       pathfinder_gen.TIMING_COLUMNS)
    else:
        pathfinder_gen.run_from_args(args)


if __name__ == "__main__":
    main(sys.argv[1:])
