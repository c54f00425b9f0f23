"""The errors a user can fix and the exit codes the commands end with. A leaf: every layer imports it, and it
imports nothing of the project."""


class ConfigError(ValueError):
    """A configuration value that cannot run; the message names the key, the value and what is allowed."""


class DataError(RuntimeError):
    """Missing or malformed data; the message says what was expected and how to get it."""


EXIT_USER_ERROR = 2  # the exit code of the commands for an error the user can fix (a bad value, missing data)
EXIT_INTERRUPTED = 75  # a run stopped by a signal; its checkpoint is saved (EX_TEMPFAIL: rerun to resume)
