"""pyprune: kernels for pruning large language models, and the pruning methods built on them.

The package is layered; a layer imports only the layers below it (checked by the import contract in
``pyproject.toml``), from the bottom up: ``files`` (cache root, atomic writes), ``ops`` (kernels, their implementations, reference), ``patterns``,
``nn`` (layers, model anatomy), ``io``, ``runtime``, ``inputs``, ``evaluation``, ``methods``,
``studies``, ``cli``. The names below load on first use, so ``import pyprune.ops`` loads the op
library alone.
"""
import importlib

__version__ = "0.1.0"

#: public name -> (module, attribute); attribute None means the module itself
_LAZY = {
    "ops": ("pyprune.ops", None),
    "use_implementation": ("pyprune.ops.implementations", "use_implementation"),
    "use_backend": ("pyprune.ops.implementations", "use_backend"),  # deprecated name of use_implementation
    "prune": ("pyprune.methods.pruning", "prune"),
    "load": ("pyprune.io.model_dir", "load"),
    "save": ("pyprune.io.model_dir", "save"),
    "run_recipe": ("pyprune.cli.run", "run_recipe"),
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'pyprune' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
