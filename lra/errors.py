"""The errors a user can fix and the exit codes the commands end with. A leaf: every layer imports it, and it
imports nothing of the project."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn


class ConfigError(ValueError):
    """A configuration value that cannot run; the message names the key, the value and what is allowed."""


class DataError(RuntimeError):
    """Missing or malformed data; the message says what was expected and how to get it."""


EXIT_USER_ERROR = 2  # the exit code of the commands for an error the user can fix (a bad value, missing data)
EXIT_INTERRUPTED = 75  # a run stopped by a signal; its checkpoint is saved (EX_TEMPFAIL: rerun to resume)
# The user's own HYDRA_FULL_ERROR, kept here by ``python -m lra``, which sets Hydra's to 1 so that Hydra raises what it
# cannot compose (to be said in one line) instead of printing it; the launchers' job processes inherit both.
FULL_ERROR = "LRA_FULL_ERROR"


def first_line(error: BaseException, width: int = 200) -> str:
    """The first line of ``error``'s message, cut at ``width`` characters; empty for an error without a message."""
    return (str(error).splitlines() or [""])[0][:width]


def wants_tracebacks() -> bool:
    """Whether the user asked for whole tracebacks rather than one line (``HYDRA_FULL_ERROR=1``)."""
    return os.environ.get(FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", "")) == "1"


def exit_with(message: object) -> NoReturn:
    """End a command on an error the user can fix: the message's first line on stderr as ``error: ...``, exit 2."""
    lines = str(message).strip().splitlines()
    print(f"error: {lines[0] if lines else type(message).__name__}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


@contextmanager
def one_line_errors() -> Iterator[None]:
    """A command's body: a ConfigError or DataError ends it in one line with exit code 2 (``exit_with``); with
    ``HYDRA_FULL_ERROR=1`` it is raised, traceback and all."""
    try:
        yield
    except (ConfigError, DataError) as e:
        if wants_tracebacks():
            raise
        exit_with(e)
