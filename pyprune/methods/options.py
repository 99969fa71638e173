"""The methods' option declarations: the machinery of :mod:`pyprune.options` (``option``, its
checks, ``collect`` and ``resolve``, which every method imports from here) and the checks and
options only methods need (a directory a method writes; the block-wise methods' ``checkpoint``),
and ``shard_training``, which LoRA recovery declares too.
"""
from __future__ import annotations

from typing import Any, Optional

from ..options import (TYPES, Option, at_least_one, collect, fraction, nonnegative, option, positive, resolve,
                       shard_training)

__all__ = ["TYPES", "Option", "option", "collect", "resolve", "positive", "nonnegative", "at_least_one", "fraction",
           "written_directory", "block_checkpoint", "shard_training"]


def written_directory(value) -> Optional[str]:
    """Check of an option naming a directory the method writes: a place pyprune may write
    (:func:`pyprune.files.check_destination`: not empty, a link, a file or a device; creatable)."""
    from ..files import DestinationError, check_destination
    try:
        check_destination(value, "the directory", directory=True)
    except DestinationError as error:
        return f"must be a directory pyprune can write ({error})"
    return None


def block_checkpoint() -> Any:
    """The ``checkpoint`` option of a block-wise method (:class:`pyprune.runtime.engine.BlockCheckpoint`)."""
    return option(None, "block-wise methods (wanda, sparsegpt, copal, safe): directory where every finished "
                  "block is saved; a rerun with the same settings, calibration and model resumes after the last one",
                  written_directory)
