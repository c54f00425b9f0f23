"""Which of lra's Hydra launchers (``hydra/launcher=gpus|slurm``) can run here. Their plugin
(hydra_plugins/lra_launchers) records in ``UNAVAILABLE``, as Hydra loads it, why it could not register one (the
``[sweep]`` extra missing, or a package it needs), so that the CLI names what to install where Hydra would only list
the launchers it has (``lra.config.check_launcher``). Nothing in lra imports the plugin: Hydra does. A leaf: it
imports nothing of the project."""
from __future__ import annotations

import sys

from hydra.core.plugins import Plugins

PLUGIN = "hydra_plugins.lra_launchers.lra_launchers"
UNAVAILABLE: dict[str, str] = {}  # launcher -> why the plugin could not register it (filled by the plugin)


def unavailable(name: str) -> str | None:
    """Why launcher ``name`` is not registered, or None where it is."""
    Plugins.instance()  # Hydra loads every plugin once in a process (ours fills UNAVAILABLE), as it would at start
    if PLUGIN not in sys.modules:  # our own plugin folder missing: a broken install
        return f"No module named {PLUGIN!r}"
    return UNAVAILABLE.get(name)
