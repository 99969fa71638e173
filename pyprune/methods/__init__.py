"""Pruning methods, by name. Each is a :class:`~pyprune.methods.base.Method` subclass in a module of
this package; every module is imported here, so a subclass that sets ``name`` is registered
(:data:`~pyprune.methods.base.REGISTRY`) without an edit to this file."""
import importlib
import pkgutil

from .base import REGISTRY, Method, RunWarning
from .structured import StructuredMethod

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

METHODS = REGISTRY


def get(name: str, **options) -> Method:
    """The method called ``name``, built with its declared options (e.g. SparseGPT's blocksize);
    an unknown or invalid option raises ValueError naming it."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {', '.join(sorted(METHODS))}; got {name!r}")
    return METHODS[name](**options)


def serving(command: str) -> list:
    """The names of the methods that serve the CLI subcommand ``command``, sorted."""
    return sorted(name for name, cls in METHODS.items() if command in cls.commands)


__all__ = ["METHODS", "Method", "RunWarning", "StructuredMethod", "get", "serving"]
