"""Index brackets in prose stay text: ``P[i][j]`` or ``W[rows][:, cols]`` outside code spans would
read as Markdown reference links (``[text][ref]``), which autorefs then fails to resolve.

:func:`escape_brackets` escapes the second bracket (``]\\[``, rendered as ``][``); the docs hook
applies it to the results files and :class:`BracketsAsText`, a griffe extension registered in
``mkdocs.yml``, to every docstring. The sources are not changed.
"""
from __future__ import annotations

import re

import griffe

_CODE = re.compile(r"(``.*?``|`[^`]*`)")


def escape_brackets(text: str) -> str:
    """``text`` with every ``][`` outside code spans and fenced blocks written ``]\\[``."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced:
            line = "".join(part if part.startswith("`") else part.replace("][", "]\\[")
                           for part in _CODE.split(line))
        out.append(line)
    return "\n".join(out)


class BracketsAsText(griffe.Extension):
    """Applies :func:`escape_brackets` to each object's docstring as griffe loads it."""

    def on_object(self, *, obj, loader, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = escape_brackets(obj.docstring.value)
