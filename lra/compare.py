"""``python -m lra.compare``: two result sets side by side. A thin entry: the command is ``lra.report.compare.main``
(``--help`` lists its options)."""
from lra.errors import one_line_errors
from lra.report.compare import main

if __name__ == "__main__":
    with one_line_errors():  # a missing file: one line, exit code 2
        main()
