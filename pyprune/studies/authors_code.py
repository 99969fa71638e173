"""What the cross-checks against the authors' code share: the checkout they run read-only, checked
before anything loads, and its record in the results (the repository, its commit and the sha256 of
the files that ran), so that a results file names the exact code it compared with.

Used by :mod:`pyprune.studies.crosscheck_wanda` (locuslab/wanda, run in another virtual
environment through :mod:`pyprune.studies._wanda_driver`) and :mod:`pyprune.studies.crosscheck_alps`
(mazumder-lab/ALPS, imported in this process).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
from typing import Dict, Iterable, Optional


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
