"""``python -m lra.plot``: the charts, drawn from the result CSVs alone. A thin entry: the command is
``lra.report.plot.main`` (``--help`` lists its options)."""
from lra.report.plot import main

if __name__ == "__main__":
    main()
