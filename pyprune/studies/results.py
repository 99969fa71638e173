"""The one writer of a study's results, and the cells its tables share.

A study's result is a JSON file and its markdown rendering beside it (``NAME.json``, ``NAME.md``),
both written atomically through :mod:`pyprune.files`; :func:`write` writes the pair.
"""
from __future__ import annotations

import os
import statistics
from typing import Callable, Iterable, Optional

from ..files import write_json, write_text


def markdown_path(path: str) -> str:
    """The markdown file beside the JSON results file ``path``."""
    return os.path.splitext(path)[0] + ".md"


def write(path: str, result: dict, markdown: Callable[[dict], str]) -> None:
    """Write ``result`` as JSON to ``path`` and ``markdown(result)`` beside it, each atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json(path, result)
    write_text(markdown_path(path), markdown(result))


def mean_std(values: Iterable[Optional[float]], spec: str = ".4f") -> str:
    """"mean ± std" (sample standard deviation) of the values that are not None, formatted by
    ``spec``; one value alone, or "–" for none."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return format(values[0], spec)
    return f"{format(statistics.fmean(values), spec)} ± {format(statistics.stdev(values), spec)}"
