"""``python -m lra.leaderboard``: the model x task leaderboard from runs.csv, beside the published LRA Table 1. A thin
entry: the command is ``lra.report.leaderboard.main`` (``--help`` lists its options)."""
from lra.errors import one_line_errors
from lra.report.leaderboard import main

if __name__ == "__main__":
    with one_line_errors():  # a missing file: one line, exit code 2
        main()
