"""The model registry: ``register_model`` beside each class, ``create_model`` / ``list_models`` for users.

A registered model is a *token mixer*: ``forward(x: (B, N, D), mask: (B, N) bool, True = real token)
-> (B, N, D)``. Everything else (embeddings, norms, MLPs, pooling, heads) is the harness's shared encoder,
so comparing two models compares two mixers.
"""
from __future__ import annotations

import inspect
from typing import Callable

from torch import nn

_REGISTRY: dict[str, type[nn.Module]] = {}

# Every mixer receives these from the task's backbone; a model config holds only the options after them.
BACKBONE_ARGS = ("d_model", "n_heads", "d_qkv", "dropout", "max_len")


def register_model(cls: type[nn.Module] | None = None, *, name: str | None = None) -> Callable | type:
    """Class decorator: ``@register_model`` registers under the module's file stem (``models/local.py`` ->
    ``local``), ``@register_model(name="x")`` under an explicit name. The name is also the
    ``conf/model/<name>.yaml`` stem and the leaderboard label."""

    def add(c: type[nn.Module]) -> type[nn.Module]:
        key = name or c.__module__.rsplit(".", 1)[-1]
        if key in _REGISTRY and _REGISTRY[key] is not c:
            raise ValueError(f"model {key!r} is registered twice: {_REGISTRY[key].__module__} and {c.__module__}")
        missing = [a for a in BACKBONE_ARGS if a not in inspect.signature(c).parameters]
        if missing:
            raise TypeError(f"{c.__name__}.__init__ must accept the backbone arguments {missing}")
        c.registry_name = key
        _REGISTRY[key] = c
        return c

    return add(cls) if cls is not None else add


def list_models() -> list[str]:
    """Sorted names of every registered model."""
    return sorted(_REGISTRY)


def get_model_class(name: str) -> type[nn.Module]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(list_models())}") from None


def model_options(name: str) -> dict[str, object]:
    """The model's own options (not the backbone's) and their defaults, read off its constructor."""
    sig = inspect.signature(get_model_class(name))
    return {k: p.default for k, p in sig.parameters.items() if k not in BACKBONE_ARGS}


def unknown_options(name: str, options, backbone: bool = True) -> str | None:
    """None when model ``name`` accepts every key of ``options`` (its own options, plus the backbone arguments
    when ``backbone``), else a message naming its own options."""
    accepted = inspect.signature(get_model_class(name)).parameters if backbone else model_options(name)
    unknown = sorted(set(options) - set(accepted))
    if not unknown:
        return None
    own = ", ".join(f"{k}={v!r}" for k, v in model_options(name).items()) or "none"
    return f"model {name!r} has no option(s) {unknown}; its options are: {own}"


def create_model(name: str, **options) -> nn.Module:
    """Build the mixer ``name``. Unknown options fail, naming the ones the model accepts."""
    error = unknown_options(name, options)
    if error:
        raise TypeError(error)
    return get_model_class(name)(**options)
