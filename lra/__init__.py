"""lra: the Long Range Arena harness (data, runner, bench, leaderboard, plots). Models live in ``models``."""
__version__ = "0.2.0"  # the package's version (pyproject.toml reads it here)
