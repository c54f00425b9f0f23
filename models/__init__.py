"""Token mixers for the Long Range Arena, one method per file, behind one registry.

Every module in this package is imported here, so a new model is one file (with ``@register_model``)
plus one ``conf/model/<name>.yaml``; nothing else needs editing. This package never imports ``lra``.
"""
import importlib
import pkgutil

from .registry import BACKBONE_ARGS, create_model, get_model_class, list_models, model_defaults, register_model

_INFRASTRUCTURE = {"registry", "base", "patterns"}
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in _INFRASTRUCTURE and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")

__all__ = ["BACKBONE_ARGS", "create_model", "get_model_class", "list_models", "model_defaults", "register_model"]
