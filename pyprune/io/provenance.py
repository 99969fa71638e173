"""What a model derives from, read where it was loaded (``config.name_or_path``), for the ``base_model``
that :func:`pyprune.save` records in ``pyprune.json`` and the model card states (:mod:`pyprune.io.model_card`).

A hub snapshot (``models--org--name/snapshots/<commit>``) is that repository at that commit; a directory
pyprune wrote names its own base (its manifest, or the card of an alias's cache entry); the license comes
from the source's card (``license``, and ``license_name`` / ``license_link`` for ``other``) or its
``config.json``. A local directory of unknown origin gives no ``base_model``: the hub wants an id, and a
local model's own card may name its ancestor rather than itself.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, Optional

from .manifest import read_manifest
from .model_card import CARD

__all__ = ["base_of"]

_LICENSE_KEYS = ("license", "license_name", "license_link")
_SNAPSHOT = re.compile(r"models--(?P<repo>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})$")


def _front_matter(directory: str) -> Dict[str, Any]:
    """The YAML front matter of ``directory``'s card ({} without one, or when it does not parse)."""
    import yaml
    from huggingface_hub.repocard import metadata_load
    path = os.path.join(directory, CARD)
    try:
        found = metadata_load(path) if os.path.isfile(path) else None
    except (ValueError, OSError, yaml.YAMLError):
        return {}
    return found if isinstance(found, dict) else {}


def _snapshot(directory: str) -> Optional[Dict[str, str]]:
    match = _SNAPSHOT.search(os.path.abspath(directory).replace(os.sep, "/"))
    if match is None:
        return None
    return {"id": match["repo"].replace("--", "/"), "revision": match["commit"]}


def base_of(model) -> Dict[str, Any]:
    """``{"id", "revision", "license", "license_name", "license_link"}`` (the keys known) of the model
    ``model`` derives from, read where it was loaded; {} when nothing is known."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    source = getattr(getattr(model, "config", None), "name_or_path", "") or ""
    if not os.path.isdir(source):
        try:
            validate_repo_id(source)  # from_pretrained("org/name") of transformers itself
        except HFValidationError:
            return {}
        return {"id": source} if "/" in source else {}
    card = _front_matter(source)
    try:
        recorded = read_manifest(source).get("base_model") or {}
    except ValueError:
        recorded = {}
    base = _snapshot(source) or {k: recorded[k] for k in ("id", "revision") if recorded.get(k)}
    if not base and card.get("library_name") == "pyprune" and isinstance(card.get("base_model"), str):
        base = {"id": card["base_model"]}  # an alias's cache entry
    licensed = recorded if recorded.get("license") else card
    if not licensed.get("license"):
        try:
            with open(os.path.join(source, "config.json"), encoding="utf-8") as handle:
                licensed = {"license": json.load(handle).get("license")}
        except (OSError, ValueError, AttributeError):
            licensed = {}
    base.update({key: licensed[key] for key in _LICENSE_KEYS if isinstance(licensed.get(key), str)})
    return base
