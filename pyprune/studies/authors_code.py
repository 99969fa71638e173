"""What the cross-checks against the authors' code share: the checkout they run read-only, checked
before anything loads, and its record in the results (the repository, its commit and the sha256 of
the files that ran), so that a results file names the exact code it compared with.

Used by :mod:`pyprune.studies.crosscheck_wanda` (locuslab/wanda, run in another virtual
environment through :mod:`pyprune.studies._wanda_driver`), :mod:`pyprune.studies.crosscheck_alps`
(mazumder-lab/ALPS, imported in this process), :mod:`pyprune.studies.crosscheck_ria` and
:mod:`pyprune.studies.crosscheck_dsnot` (their block loops run in this process on a one-layer model,
:class:`OneLayerModel`).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import subprocess
import sys
import types
from typing import Dict, Iterable, List, Optional

import torch
from torch import Tensor, nn


def check_checkout(repo: str, files: Iterable[str], project: str, option: str, study: str) -> None:
    """ValueError naming option ``option`` of study ``study`` unless ``repo`` is a directory holding
    every one of ``files`` (a checkout of ``project``)."""
    where = f"option {option} of study {study!r}"
    if not repo:
        raise ValueError(f"{where} is required: a checkout of {project}")
    if not os.path.isdir(repo):
        raise ValueError(f"{where}: {repo!r} is not a directory")
    missing = [name for name in files if not os.path.isfile(os.path.join(repo, name))]
    if missing:
        raise ValueError(f"{where}: {repo!r} is not a checkout of {project} (no {', '.join(missing)})")


def git_commit(repo: str) -> Optional[str]:
    """The commit checked out in ``repo`` (None when it is no git checkout or git cannot run)."""
    try:
        done = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def file_digests(repo: str, files: Iterable[str]) -> Dict[str, str]:
    """sha256 of each of ``files`` (paths inside ``repo``): the exact code a cross-check ran."""
    digests = {}
    for name in files:
        with open(os.path.join(repo, name), "rb") as handle:
            digests[name] = hashlib.sha256(handle.read()).hexdigest()
    return digests


def record(repo: str, files: Iterable[str], project: str) -> dict:
    """The results' record of the authors' code: ``repository``, ``commit`` and ``files_sha256``."""
    return {"repository": project, "commit": git_commit(repo), "files_sha256": file_digests(repo, files)}


@contextlib.contextmanager
def cpu_for_cuda():
    """Map the authors' ``.to('cuda…')`` and ``.cuda()`` to the CPU and make ``torch.cuda.synchronize``
    and ``torch.cuda.empty_cache`` no-ops while their code runs; all are restored on exit, also after
    an exception."""
    original = torch.Tensor.to, torch.Tensor.cuda, torch.cuda.synchronize, torch.cuda.empty_cache

    def to(self, *args, **kwargs):
        args = tuple("cpu" if isinstance(a, str) and a.startswith("cuda") else a for a in args)
        return original[0](self, *args, **kwargs)

    torch.Tensor.to, torch.Tensor.cuda = to, lambda self, *a, **k: self
    torch.cuda.synchronize = torch.cuda.empty_cache = lambda *a, **k: None
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.cuda, torch.cuda.synchronize, torch.cuda.empty_cache = original


def import_package_module(repo: str, package: str, module: str, alias: str) -> types.ModuleType:
    """``repo/package/module.py`` imported read-only as ``alias.module``, its relative imports
    resolved inside ``repo/package`` (a directory without ``__init__.py`` too)."""
    root = types.ModuleType(alias)
    root.__path__ = [os.path.join(repo, package)]
    sys.modules[alias] = root
    return importlib.import_module(f"{alias}.{module}")


class _OneLayerBlock(nn.Module):
    """A decoder "block" holding one linear layer under its name inside the real block (so that the
    authors' ``find_layers`` and name rules see it as there); it returns its input unchanged."""

    def __init__(self, name: str, linear: nn.Linear):
        super().__init__()
        parent, _, leaf = name.rpartition(".")
        holder = self
        for part in parent.split(".") if parent else []:
            holder.add_module(part, nn.Module())
            holder = getattr(holder, part)
        holder.add_module(leaf, linear)
        self._linear = [linear]

    def forward(self, x, **kwargs):
        self._linear[0](x)
        return (x,)


class OneLayerModel(nn.Module):
    """The model the authors' block loop (``model.model.layers``, a catcher on the first layer, one
    calibration sequence per forward) sees: one block holding ``linear`` under ``name``, fed the
    layer's recorded inputs. ``loader`` gives them as the authors' calibration loader would."""

    def __init__(self, name: str, linear: nn.Linear, inputs: List[Tensor]):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_OneLayerBlock(name, linear)])
        sequences = torch.cat([x.reshape(-1, x.shape[-2], x.shape[-1]) for x in inputs])
        self.seqlen = sequences.shape[1]
        self.config = types.SimpleNamespace(use_cache=False, hidden_size=linear.in_features)
        self.hf_device_map: Dict[str, str] = {}
        self.loader = [(sequence[None], None) for sequence in sequences.float()]

    def forward(self, x):
        return self.model.layers[0](x, attention_mask=None, position_ids=None)
