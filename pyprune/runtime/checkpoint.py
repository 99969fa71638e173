"""Resumable runs: the one mechanism behind every checkpoint pyprune writes.

A :class:`Checkpoint` is a directory of safetensors states (:func:`pyprune.io.storage.save_state`:
written atomically, nothing unpickled) whose metadata records the checkpoint's kind and format and
the ``key`` of the run that wrote it (its settings, :func:`model_fingerprint`, :func:`tokens_digest`);
reading a state checks all three and refuses another run's key before anything changes, naming
what differs (:func:`pyprune.io.storage.check_key`). A run that resumes in steps keeps a JSON index
beside its states (:meth:`Checkpoint.read_index`), keyed the same way.

Its users are thin: :class:`pyprune.runtime.engine.BlockCheckpoint` (the finished blocks of a
block-wise prune), :class:`pyprune.runtime.training.TrainingCheckpoint` (a training run every
``every`` steps, e.g. DReSS's regularisation) and the studies' runner
(:mod:`pyprune.studies.study`), whose results file is its own index: :func:`read_results`
reads it back keyed by the study's ``settings``.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Optional, Sequence, Tuple

from torch import Tensor, nn

from ..files import write_json
from ..io import storage

__all__ = ["Checkpoint", "model_fingerprint", "tokens_digest", "read_results"]


def model_fingerprint(model: nn.Module) -> str:
    """What identifies a model in a run's key, pruned or not: its architecture, dtype and input
    embeddings (never pruned)."""
    config = getattr(model, "config", None)
    fields = {key: getattr(config, key, None) for key in (
        "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "vocab_size")}
    embedding = model.get_input_embeddings().weight.detach()
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode() + str(embedding.dtype).encode())
    digest.update(embedding.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def tokens_digest(tokens: Tensor) -> str:
    """What identifies calibration tokens in a run's key: a SHA-256 prefix of their bytes."""
    return hashlib.sha256(tokens.cpu().numpy().tobytes()).hexdigest()[:16]


class Checkpoint:
    """The states of one run in ``directory``, each a safetensors file of ``kind`` (written in the
    last of ``formats``, read in any of them) recording the run's ``key``."""

    def __init__(self, directory: str, key: dict, kind: str, formats: Sequence[int] = (1,)):
        self.directory, self.key, self.kind, self.formats = directory, key, kind, tuple(formats)

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def meta(self, name: str, parts: Optional[Sequence[str]] = None) -> Optional[dict]:
        """The metadata of state ``name`` (its header alone), None when there is none; StateError
        for a file that is not a state of this kind, or one of another run (compared in ``parts``
        of the key if given, e.g. the settings alone, before the model is loaded)."""
        path = self.path(name)
        if not os.path.exists(path):
            return None
        meta = storage.read_state_meta(path, self.kind, self.formats)
        storage.check_key(f"checkpoint {path}", meta["key"], self.key, parts)
        return meta

    def load(self, name: str) -> Optional[Tuple[Dict[str, Tensor], dict]]:
        """(tensors, metadata) of state ``name``, checked as :meth:`meta` does; None when absent."""
        if self.meta(name) is None:
            return None
        return storage.load_state(self.path(name), self.kind, self.formats)

    def save(self, name: str, tensors: Dict[str, Tensor], meta: dict) -> None:
        """Write state ``name`` atomically: ``tensors`` and the JSON-serialisable ``meta`` with
        this checkpoint's kind, format and key."""
        storage.save_state(self.path(name), tensors,
                           dict(meta, kind=self.kind, format=self.formats[-1], key=self.key))

    def read_index(self, name: str, parts: Optional[Sequence[str]] = None) -> Optional[dict]:
        """The JSON index ``name`` of a run that resumes in steps (None when absent); StateError
        when it is not JSON or is another run's (compared in ``parts`` of the key if given)."""
        path = self.path(name)
        if not os.path.exists(path):
            return None
        try:
            with open(path, encoding="utf-8") as handle:
                index = json.load(handle)
        except ValueError as error:
            raise storage.StateError(f"checkpoint manifest {path} is not valid JSON ({error}); remove it") from None
        storage.check_key(f"checkpoint {self.directory}", index["key"], self.key, parts)
        return index

    def write_index(self, name: str, progress: dict) -> None:
        """Write the JSON index ``name`` atomically: this checkpoint's key and ``progress``."""
        os.makedirs(self.directory, exist_ok=True)
        write_json(self.path(name), dict({"key": self.key}, **progress))


def read_results(path: str, settings: dict) -> Optional[dict]:
    """The JSON results file a resumable run wrote at ``path`` with these ``settings`` (its
    ``"settings"`` entry is its key); None when there is none. StateError, naming the settings
    that differ, for a file of other settings: its rows were measured under another protocol and
    are never mixed with these nor overwritten."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            result = json.load(handle)
    except ValueError as error:
        raise storage.StateError(f"results file {path} is not valid JSON ({error}); remove it") from None
    stored = result.get("settings") if isinstance(result, dict) else None
    storage.check_key(f"results file {path}", {"settings": stored if isinstance(stored, dict) else {}},
                      {"settings": settings})
    return result
