"""``python -m lra.taxonomy``: the survey's taxonomy of every registered model, beside its measured growth in N. A thin
entry: the command is ``lra.report.taxonomy.main`` (``--help`` lists its options)."""
from lra.report.taxonomy import main

if __name__ == "__main__":
    main()
