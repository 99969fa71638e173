"""The one writer of a study's results, and the cells its tables share (``mean ± std``, a verdict).

A study's result is a JSON file and its markdown rendering beside it (``NAME.json``, ``NAME.md``),
both written atomically through :mod:`pyprune.files`; :func:`write` writes the pair.
"""
from __future__ import annotations

import os
import statistics
from typing import Callable, Iterable, Optional

from ..files import write_json, write_text
from .verdict import UNSETTLED, Verdict


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


def verdict_cell(result: Verdict, spec: str = ".4f") -> str:
    """A comparison over seeds as a table cell: the paired differences' mean (± their standard
    deviation) formatted by ``spec``, the seed count and the verdict word, with its reason when it is
    unsettled (``"+0.0123 ± 0.0040, 3 seeds: ahead"``)."""
    spread = f" ± {format(result.std, spec)}" if result.seeds > 1 else ""
    reason = f" ({result.reason})" if result.word == UNSETTLED else ""
    return (f"{format(result.mean, '+' + spec)}{spread}, {result.seeds} seed{'s' * (result.seeds != 1)}: "
            f"{result.word}{reason}")
