"""``python -m lra.results``: result rows (and their curves) merged in from another results folder. A thin entry: the
command is ``lra.report.results.main`` (``--help`` lists its options)."""
from lra.report.results import main

if __name__ == "__main__":
    main()
