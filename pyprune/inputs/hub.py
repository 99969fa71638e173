"""Models named by a Hugging Face hub id: ``org/name``, or ``org/name@REV`` for a branch, tag or commit.

:func:`parse` says whether a name is a hub id; :func:`resolve` returns the local snapshot directory
of one through ``huggingface_hub.snapshot_download`` and its cache, so a model any earlier
``from_pretrained`` fetched is found where it is, and a missing one is downloaded once. The
revision rides in the id (``@REV``, as pip and uv write a git revision) rather than in a flag of its
own, so the one ``--model`` string names the model exactly in every tool, report and recipe; ``@``
is never part of a repository id, so the split is unambiguous.

The environment is read at each call, as ``huggingface_hub`` reads it at start-up: the cache is
``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else huggingface_hub's default (``~/.cache/huggingface/hub``);
``HF_HUB_OFFLINE=1`` reads the cache alone and never opens a connection. The token is
huggingface_hub's own (``HF_TOKEN``, or the file ``hf auth login`` writes). Only the files pyprune
reads are fetched: the config, safetensors weights (nothing pickled), the tokenizer, the model card
and, for a model pyprune wrote, its ``pyprune.json``. Every failure (a missing or gated model, a
revision that is not there, no network and no cached copy) is a :class:`HubError`: one line naming
the id and what to do.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["HubId", "HubError", "parse", "resolve", "hub_cache", "offline", "cache_folder"]

#: the files a model's directory needs before its weights: config, tokenizer, card, pyprune's manifest
METADATA = ["config.json", "generation_config.json", "pyprune.json", "README.md", "*.safetensors.index.json",
            "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.tiktoken",
            "chat_template.*"]
#: and the weights, safetensors only: pyprune unpickles nothing it reads
WEIGHTS = ["*.safetensors"]
#: (cache, repo, revision) -> the commit a first resolution found: later ones in the process (the CLI's
#: checks, then the load) read that same commit, with no second question to the hub
_COMMITS: dict = {}


class HubError(ValueError):
    """A hub id that cannot be resolved to a local snapshot; the message is one line."""


@dataclass(frozen=True)
class HubId:
    repo_id: str
    revision: Optional[str] = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse(name: str) -> Optional[HubId]:
    """The hub id ``name`` spells (``org/name`` or ``org/name@REV``), or None when it is not one:
    a path (``/``, ``.`` or ``~`` first), one word (an alias), or a repository id the hub would refuse."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    repo_id, at, revision = name.partition("@")
    if (at and not revision) or repo_id.count("/") != 1 or repo_id[:1] in ("/", ".", "~"):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return HubId(repo_id, revision or None)


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set true now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_cache() -> str:
    """The Hugging Face hub cache as the environment names it now."""
    from huggingface_hub import constants
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return constants.HF_HUB_CACHE


def cache_folder(hub_id: HubId) -> str:
    """The folder of ``hub_id``'s repository in the cache (``models--org--name``), there or not."""
    from huggingface_hub.file_download import repo_folder_name
    return os.path.join(hub_cache(), repo_folder_name(repo_id=hub_id.repo_id, repo_type="model"))


def _cached_revisions(hub_id: HubId) -> str:
    folder = cache_folder(hub_id)
    refs = sorted(os.listdir(os.path.join(folder, "refs"))) if os.path.isdir(os.path.join(folder, "refs")) else []
    snapshots = sorted(os.listdir(os.path.join(folder, "snapshots"))) \
        if os.path.isdir(os.path.join(folder, "snapshots")) else []
    return ", ".join(refs + [commit[:12] for commit in snapshots]) or "none"


def _missing_locally(hub_id: HubId, reason: str) -> HubError:
    """The error for an id the cache cannot serve and the hub may not be asked for (``reason``)."""
    cache = hub_cache()
    if os.path.isdir(cache_folder(hub_id)) and hub_id.revision:
        return HubError(f"hub model {hub_id}: revision {hub_id.revision!r} is not in the Hugging Face cache {cache} "
                        f"(cached: {_cached_revisions(hub_id)}) and {reason}; give a cached revision, or fetch it "
                        f"with network access")
    how = "unset HF_HUB_OFFLINE to download it" if offline() else "download it with network access"
    return HubError(f"hub model {hub_id} is not in the Hugging Face cache {cache} and {reason}; {how}, or point "
                    f"HF_HUB_CACHE at a cache that holds it")


def _explain(hub_id: HubId, error: Exception) -> HubError:
    from huggingface_hub.errors import (GatedRepoError, IncompleteSnapshotError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    if isinstance(error, GatedRepoError):
        return HubError(f"hub model {hub_id} is gated: accept its terms on https://huggingface.co/{hub_id.repo_id} "
                        f"and log in (hf auth login, or set HF_TOKEN)")
    if isinstance(error, RepositoryNotFoundError):
        return HubError(f"hub model {hub_id} was not found on the Hugging Face hub: check the id, or log in "
                        f"(hf auth login, or set HF_TOKEN) if it is private")
    if isinstance(error, RevisionNotFoundError):
        return HubError(f"hub model {hub_id}: the repository has no revision {hub_id.revision!r}; give a branch, "
                        f"tag or commit it has (org/name@REV)")
    if isinstance(error, IncompleteSnapshotError):
        return HubError(f"hub model {hub_id}: its snapshot in {hub_cache()} is incomplete and the hub cannot be "
                        f"reached; rerun with network access to complete it")
    if isinstance(error, LocalEntryNotFoundError):
        cause = error.__cause__
        reason = ("HF_HUB_OFFLINE=1 forbids downloading it" if offline()
                  else f"the hub could not be reached ({type(cause).__name__ if cause else 'no connection'})")
        return _missing_locally(hub_id, reason)
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return HubError(f"hub model {hub_id}: the Hugging Face hub answered {first}; retry, or set HF_HUB_OFFLINE=1 "
                    f"to use a cached copy")


def resolve(hub_id: HubId, *, weights: bool = True) -> str:
    """The local snapshot directory of ``hub_id`` (downloaded into the cache when missing and allowed):
    its config, tokenizer and card, and with ``weights`` its safetensors weights. :class:`HubError`
    (one line) when it cannot be had or holds no config or, with ``weights``, no safetensors."""
    from huggingface_hub import snapshot_download
    from .. import __version__
    key = (hub_cache(), hub_id.repo_id, hub_id.revision)
    try:
        directory = snapshot_download(hub_id.repo_id, revision=_COMMITS.get(key, hub_id.revision), cache_dir=key[0],
                                      local_files_only=offline(), library_name="pyprune", library_version=__version__,
                                      allow_patterns=METADATA + (WEIGHTS if weights else []))
    except OSError as error:  # huggingface_hub's errors: HfHubHTTPError, LocalEntryNotFoundError (no network)
        raise _explain(hub_id, error) from None
    _COMMITS[key] = os.path.basename(directory)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise HubError(f"hub model {hub_id}: its snapshot {directory} holds no config.json"
                       + ("; it is not a Hugging Face model, or the cache holds only part of it" if offline()
                          else "; it is not a Hugging Face model repository"))
    if weights and not any(name.endswith(".safetensors") for name in os.listdir(directory)):
        raise HubError(f"hub model {hub_id}: its snapshot {directory} holds no safetensors weights"
                       + (" (HF_HUB_OFFLINE=1: the cache holds only part of it)" if offline()
                          else "; pyprune reads safetensors only (it unpickles nothing it reads)"))
    return directory
