"""``python -m lra.leaderboard``: the model x task leaderboard from runs.csv, beside the published LRA Table 1. A thin
entry: the command is ``lra.report.leaderboard.main`` (``--help`` lists its options)."""
from lra.report.leaderboard import main

if __name__ == "__main__":
    main()
