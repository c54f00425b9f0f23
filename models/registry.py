"""The model registry: ``register_model`` beside each class, ``create_model`` / ``list_models`` for users.

A registered model is a *token mixer*: ``forward(x: (B, N, D), mask: (B, N) bool, True = real token)
-> (B, N, D)``. Everything else (embeddings, norms, MLPs, pooling, heads) is the harness's shared encoder,
so comparing two models compares two mixers.

The contract, read by the harness and covered by the registry-wide tests:

* ``__init__(self, d_model, n_heads, d_qkv, dropout, max_len, *, <own options with defaults>)``: the five
  backbone arguments come from the task; the keyword options are the model's schema (``conf/model/<name>.yaml``
  sets only those, and ``model.<option>=...`` is checked against the signature and its annotations).
* ``taxonomy``: a :class:`Taxonomy`, the model's row of the efficient-transformer survey's Table 1.
* ``accepts_no_mask = True``: ``forward`` also takes ``mask=None`` ("no padding anywhere") and gains from it.
* ``needs_grid = True``: a 2-D mixer; ``forward(x, mask, grid=Grid(...))`` receives the pixel grid of an image
  task (the encoder refuses tasks without one).
* ``padding_invariant = False``: the model documents why appended padding changes real outputs (default True).
* ``nondeterministic_backends``: those of a mixer's ``backends`` whose backward sums in no fixed order, with no
  deterministic kernel to take its place (FlexAttention's score-table gradient): under torch's deterministic mode
  (``trainer.deterministic``) ``auto`` keeps off them and naming one is refused (``models.base.checked_backend``).
* a parameter may carry ``_optim = {"lr": ..., "weight_decay": ...}``: the runner gives it its own optimiser
  group with those settings (the convention of the S4 code base, e.g. no weight decay on SSM parameters).

Models outside this package register the same way: a module that applies ``@register_model``, named in the
entry-point group ``lra.models`` of an installed distribution (imported on first use of the registry) or in
the environment variable ``LRA_MODEL_MODULES`` (comma-separated module names).
"""
from __future__ import annotations

import importlib
import inspect
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

from torch import nn

# The survey's classes (Tay, Dehghani, Bahri, Metzler 2020, "Efficient Transformers: A Survey",
# https://arxiv.org/abs/2009.06732, Table 1), plus the families that came after it.
CLASSES = {
    "FP": "fixed patterns", "M": "memory / global tokens", "LP": "learnable patterns", "LR": "low rank",
    "KR": "kernels", "RC": "recurrence", "DS": "downsampling", "SSM": "state space", "FT": "Fourier transform",
}
# Declared time complexity in the sequence length N, and the log-log slope it predicts for time over N.
COMPLEXITIES = {"N^2": 2.0, "N*sqrt(N)": 1.5, "N*log(N)": 1.0, "N": 1.0}


@dataclass(frozen=True)
class Taxonomy:
    """A model's entry in the survey's Table 1: its paper, time complexity in N (one of ``COMPLEXITIES``),
    its classes (codes of ``CLASSES``; none for exact attention) and whether the method can decode causally
    (token by token), whatever the bidirectional form registered here."""

    paper: str  # "Authors Year, arXiv XXXX.XXXXX"
    complexity: str
    classes: tuple[str, ...] = ()
    decode: bool = False

    def __post_init__(self):
        if self.complexity not in COMPLEXITIES:
            raise ValueError(f"complexity {self.complexity!r} is not one of {list(COMPLEXITIES)}")
        unknown = [c for c in self.classes if c not in CLASSES]
        if unknown:
            raise ValueError(f"unknown taxonomy class(es) {unknown}; known: {list(CLASSES)}")

    @property
    def exponent(self) -> float:
        """The log-log slope of time over N this complexity predicts (log factors count as 1)."""
        return COMPLEXITIES[self.complexity]


@dataclass(frozen=True)
class Grid:
    """The pixel grid of an image task as a 2-D mixer sees it: ``prefix`` non-grid tokens (the CLS slot) come
    first, then ``height * width`` pixels in row-major order."""

    height: int
    width: int
    prefix: int = 0

    @property
    def length(self) -> int:
        return self.prefix + self.height * self.width

_REGISTRY: dict[str, type[nn.Module]] = {}
ENTRY_POINT_GROUP = "lra.models"
_plugins_loaded = False

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
        if not isinstance(getattr(c, "taxonomy", None), Taxonomy):
            raise TypeError(f"{c.__name__} must declare `taxonomy = Taxonomy(...)` (paper, complexity, classes, "
                            f"decode): the survey's Table 1 is generated from the registry")
        c.registry_name = key
        _REGISTRY[key] = c
        return c

    return add(cls) if cls is not None else add


def load_plugins() -> None:
    """Import the modules of models that live outside this package (entry points ``lra.models`` and
    ``LRA_MODEL_MODULES``), once. A plugin that fails to import raises, naming it."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    names = [(ep.value.split(":")[0], f"entry point {ep.name!r} ({ep.value})")
             for ep in entry_points(group=ENTRY_POINT_GROUP)]
    names += [(m.strip(), "LRA_MODEL_MODULES") for m in os.environ.get("LRA_MODEL_MODULES", "").split(",") if m.strip()]
    for module, origin in names:
        try:
            importlib.import_module(module)
        except Exception as e:
            raise ImportError(f"model plugin {module!r} from {origin} failed to import: {type(e).__name__}: {e}") from e


def list_models() -> list[str]:
    """Sorted names of every registered model (plugins included)."""
    load_plugins()
    return sorted(_REGISTRY)


def get_model_class(name: str) -> type[nn.Module]:
    load_plugins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(list_models())}") from None


def model_defaults(name: str) -> dict[str, object]:
    """The model's own options (not the backbone's) and their defaults, read off its constructor."""
    sig = inspect.signature(get_model_class(name))
    return {k: p.default for k, p in sig.parameters.items() if k not in BACKBONE_ARGS}


def unknown_options(name: str, options, backbone: bool = True) -> str | None:
    """None when model ``name`` accepts every key of ``options`` (its own options, plus the backbone arguments
    when ``backbone``), else a message naming its own options."""
    accepted = inspect.signature(get_model_class(name)).parameters if backbone else model_defaults(name)
    unknown = sorted(set(options) - set(accepted))
    if not unknown:
        return None
    own = ", ".join(f"{k}={v!r}" for k, v in model_defaults(name).items()) or "none"
    return f"model {name!r} has no option(s) {unknown}; its options are: {own}"


def _accepts(hint, value) -> bool:
    """Whether ``value`` (as a config holds it) fits the annotation ``hint``; unknown hints accept anything."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return value in args
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_accepts(a, value) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " | ".join(map(repr, args))
    if args:
        return " or ".join(_describe(a) for a in args)
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def invalid_options(name: str, options: dict, prefix: str = "model.") -> str | None:
    """None when every option of ``options`` is one of model ``name``'s own and fits its annotation, else one
    line naming the key, the value and what is allowed (the constructor is the schema)."""
    error = unknown_options(name, options, backbone=False)
    if error:
        return error
    cls = get_model_class(name)
    hints = typing.get_type_hints(cls.__init__)
    defaults = model_defaults(name)
    for key, value in options.items():
        hint = hints.get(key)
        if hint is not None and not _accepts(hint, value):
            return (f"{prefix}{key}={value!r} is not valid for model {name!r}: expected {_describe(hint)} "
                    f"(default {defaults[key]!r})")
    return None


def create_model(name: str, **options) -> nn.Module:
    """Build the mixer ``name``. Unknown options fail, naming the ones the model accepts."""
    error = unknown_options(name, options)
    if error:
        raise TypeError(error)
    return get_model_class(name)(**options)
