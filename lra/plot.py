"""``python -m lra.plot``: the charts, drawn from the result CSVs alone. A thin entry: the command is
``lra.report.plot.main`` (``--help`` lists its options)."""
from lra.errors import one_line_errors
from lra.report.plot import main

if __name__ == "__main__":
    with one_line_errors():  # a missing file: one line, exit code 2
        main()
