"""mkdocs hook: the API reference, generated at build time from the package's files.

Every public module of ``pyprune`` (no part of its name starts with ``_``), found with
:mod:`pkgutil` without importing it, gets one ``::: module`` block on the page of its top-level
package or module (``api/<name>.md``); ``api/index.md`` renders ``pyprune`` itself and lists the
pages, bottom layer first (the order of the ``layers`` contract in ``pyproject.toml``). Nothing here
is typed by hand, so a new module has its reference without a change to the docs.
"""
from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path

from mkdocs.structure.files import File

PACKAGE = "pyprune"


def _root(config) -> Path:
    return Path(config.config_file_path).parent


def public_modules(path: Path, prefix: str) -> list[str]:
    """The public modules under the package directory ``path`` (named ``prefix``), depth first, a
    package before its modules."""
    names = []
    for module in sorted(pkgutil.iter_modules([str(path)]), key=lambda m: m.name):
        if module.name.startswith("_"):
            continue
        name = f"{prefix}.{module.name}"
        names.append(name)
        if module.ispkg:
            names += public_modules(path / module.name, name)
    return names


def pages(root: Path) -> dict[str, list[str]]:
    """Top-level name (``ops``, ``files``, ...) -> the modules its page renders, bottom layer first;
    a name the contract does not list comes last."""
    modules = public_modules(root / PACKAGE, PACKAGE)
    layers = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    # a layer "a | b" holds independent siblings, listed in the order written
    order = [name.strip().removeprefix(f"{PACKAGE}.") for layer in reversed(layers["contracts"][0]["layers"])
             for name in layer.split("|")]
    grouped: dict[str, list[str]] = {}
    for module in modules:
        grouped.setdefault(module.split(".")[1], []).append(module)
    return dict(sorted(grouped.items(), key=lambda item: (order.index(item[0]) if item[0] in order else len(order),
                                                          item[0])))


def _page(top: str, modules: list[str]) -> str:
    return "\n\n".join([f"# {PACKAGE}.{top}"] + [f"::: {module}" for module in modules]) + "\n"


def _index(tops: list[str]) -> str:
    listed = "\n".join(f"- [{PACKAGE}.{top}]({top}.md)" for top in tops)
    return (f"# API reference\n\nOne page per top-level package or module, bottom layer first; each renders "
            f"every public module in it, generated from the package's files at build time.\n\n{listed}\n\n"
            f"::: {PACKAGE}\n")


def on_config(config):
    """The "API reference" entry of the navigation becomes the index and one page per top-level name."""
    entries = [i for i, item in enumerate(config.nav) if isinstance(item, dict) and "API reference" in item]
    if len(entries) != 1:
        raise ValueError("mkdocs.yml's nav needs exactly one 'API reference' entry for docs/hooks/api.py")
    section = [{"Overview": "api/index.md"}] + [{top: f"api/{top}.md"} for top in pages(_root(config))]
    config.nav[entries[0]] = {"API reference": section}
    return config


def on_files(files, config):
    grouped = pages(_root(config))
    for top, modules in grouped.items():
        files.append(File.generated(config, f"api/{top}.md", content=_page(top, modules)))
    files.append(File.generated(config, "api/index.md", content=_index(list(grouped))))
    return files
