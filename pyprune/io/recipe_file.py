"""``recipe.yaml``: the file every output directory pyprune writes holds beside the model, the
recipe (:mod:`pyprune.recipes`) that reproduces it; read back by ``pyprune run``."""
from __future__ import annotations

import os
import re
from typing import Any, Dict

import yaml

from ..files import write_text

#: the recipe's file name in a saved directory
RECIPE = "recipe.yaml"


class _Loader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, except that ``1e-4`` is a number (YAML 1.2's reading, and what
    anyone writing a learning rate means), not the string PyYAML makes of it."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
                              list("-+0123456789."))


def dump_recipe(recipe: Dict[str, Any]) -> str:
    """``recipe`` (a plain dict of the recipe's fields) as YAML, fields in their declared order."""
    return yaml.safe_dump(recipe, sort_keys=False, default_flow_style=False, allow_unicode=True)


def write_recipe(directory: str, recipe: Dict[str, Any]) -> str:
    """Write ``recipe`` to ``directory/recipe.yaml`` atomically; returns the file's path."""
    path = os.path.join(directory, RECIPE)
    write_text(path, dump_recipe(recipe))
    return path


def read_recipe(path: str) -> Any:
    """The parsed YAML of the recipe file ``path`` (a saved directory: its ``recipe.yaml``);
    ValueError naming the file when it is missing or not YAML."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, RECIPE)
    if not os.path.isfile(path):
        raise ValueError(f"recipe {path}: no such file")
    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.load(handle, Loader=_Loader)
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        where = getattr(error, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(error, "problem", None) or type(error).__name__
        raise ValueError(f"recipe {path}: not valid YAML{at}: {problem}") from None
