"""Checks of the command line's arguments and of the files they name, made before a model loads;
each failure is a :class:`UsageError`: one line naming the argument or file, exit status 2."""
from __future__ import annotations

import json
import os
from typing import Iterable, Optional

import torch

from ..inputs import data
from .usage import UsageError

#: the --dtype choices
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def input_dirs(model: Optional[str]) -> list:
    """The directories holding the input ``--model`` (a directory, an alias's cache entry, or a hub
    id's repository in the Hugging Face cache), which no output may overwrite or contain; found
    without loading, building or downloading anything."""
    if model is None:
        return []
    from ..files import cache_root
    from ..inputs import hub
    from ..inputs.models import MODEL_ALIASES
    if os.fspath(model).lower() in MODEL_ALIASES:
        return [os.path.join(cache_root(), "models", os.fspath(model).lower())]
    if os.path.isdir(model):
        return [model]
    hub_id = hub.parse(os.fspath(model))
    return [hub.cache_folder(hub_id)] if hub_id is not None else []


def check_destination(path: Optional[str], flag: str, *, directory: bool, model: Optional[str] = None) -> None:
    """``path`` (given with ``flag``) is a place pyprune may write (:func:`pyprune.files.check_destination`):
    not empty, not a link, device or fifo, not inside or above the input ``model``, writable."""
    from ..files import DestinationError
    from ..files import check_destination as check
    if path is None:
        return
    try:
        check(path, flag, directory=directory, protect=input_dirs(model))
    except DestinationError as error:
        raise UsageError(str(error)) from None


def check_output(path: Optional[str], flag: str, model: Optional[str] = None, overwrite: bool = False) -> None:
    """``path`` can become a new output directory: absent or empty (with ``overwrite``, also a
    directory pyprune saved, the one kind :func:`pyprune.save` replaces), and a destination pyprune
    may write (:func:`check_destination`); missing parents are created when it is written."""
    from ..io import MANIFEST
    if path is None:
        return
    check_destination(path, flag, directory=True, model=model)
    if os.path.isdir(path) and os.listdir(path):
        if not overwrite:
            raise UsageError(f"{flag} {path} already exists and is not an empty directory (--overwrite replaces "
                             "a directory pyprune saved)")
        if not os.path.isfile(os.path.join(path, MANIFEST)):
            raise UsageError(f"{flag} {path} holds files pyprune did not write (no {MANIFEST}); --overwrite "
                             "replaces only a directory pyprune saved")


def check_report(path: Optional[str], model: Optional[str] = None, flag: str = "--report",
                 output: Optional[str] = None) -> None:
    """``path`` can become a JSON report: a regular file or nothing yet, and a destination pyprune
    may write (:func:`check_destination`); missing parents are created when it is written."""
    if path is None:
        return
    check_destination(path, flag, directory=False, model=model)
    if output is not None and os.path.abspath(path) == os.path.abspath(output):
        raise UsageError(f"{flag} {path} is also --output; give the report its own file")


def check_counts(args, flags: Iterable[str], optional: Iterable[str] = ()) -> None:
    """Every integer flag in ``flags`` (and in ``optional`` when given) is >= 1."""
    for flag in list(flags) + [f for f in optional if getattr(args, f) is not None]:
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}")


def check_sources(sources: Iterable[str]) -> None:
    """Every text source names an embedded corpus, a file, a directory or a known dataset."""
    for source in sources:
        data.check_source(source)


def check_device(device: str) -> None:
    """A device this torch build has (``--device cuda`` on a CPU build is refused before loading)."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    backend = getattr(torch, kind, None)
    if kind != "cpu" and not (hasattr(backend, "is_available") and backend.is_available()):
        raise UsageError(f"--device {device}: this torch build ({torch.__version__}) has no usable {kind} "
                         "device; use --device cpu")
    index = torch.device(device).index
    if index is not None and hasattr(backend, "device_count") and index >= backend.device_count():
        raise UsageError(f"--device {device}: there are {backend.device_count()} {kind} devices")


def check_model(model: str):
    """The model's config, read before its weights load, with its ``pyprune.json`` and the headers
    of its safetensors files checked: a broken file is named in one line."""
    from .. import io
    from ..inputs.models import resolve_model_dir
    directory = resolve_model_dir(model, weights=False)  # a hub id's weights come after the checks
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise UsageError(f"--model {model}: {directory} has no config.json, so it is not a Hugging Face model "
                         "directory")
    try:
        with open(config_path, encoding="utf-8") as handle:
            json.load(handle)
        config = io.read_config(directory)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"--model {model}: {config_path} is not a valid model config ({first_line(error)})") from None
    io.read_manifest(directory)
    io.check_weights(directory)
    return config


def check_lengths(args, config, flags: Iterable[str]) -> None:
    """Every sequence-length flag in ``flags`` (those given) is within the model's
    ``max_position_embeddings``: longer windows run, but on positions the model never learnt."""
    from ..runtime.tokens import position_limit
    limit = position_limit(config)
    for flag in flags:
        value = getattr(args, flag, None)
        if limit is not None and value is not None and value > limit:
            raise UsageError(f"--{flag.replace('_', '-')} {value} is longer than the model's {limit} positions "
                             f"(max_position_embeddings of --model {args.model})")


def check_offload(args, runner) -> None:
    """--offload's requirements: a method that prunes block by block, --output (the blocks are
    written there), the CPU, and no evaluation (it needs the whole model in memory)."""
    if runner.offload_refusal is not None:
        raise UsageError(f"--offload: method {args.method!r} cannot prune an offloaded model: {runner.offload_refusal}")
    if not args.output:
        raise UsageError("--offload needs --output (the pruned blocks are written there)")
    if args.eval or args.tasks:
        raise UsageError("--offload evaluates nothing (evaluation needs the whole model in memory); evaluate the "
                         "saved model with pyprune eval")
    if args.sparse_layers:
        raise UsageError("--offload cannot store --sparse-layers (offload writes dense blocks)")
    if torch.device(args.device).type != "cpu":
        raise UsageError(f"--offload works on the CPU; got --device {args.device}")
    from ..io import read_manifest
    from ..inputs.models import resolve_model_dir
    if read_manifest(resolve_model_dir(args.model, weights=False)).get("sparse_layers"):
        raise UsageError(f"--offload cannot read --model {args.model}: it stores SparseLinear layers (a --sparse-layers "
                         "output) and offload reads dense weights; prune it without --offload")


def check_memory(args, runner, offload: bool) -> None:
    """Refuse a prune on the CPU whose estimated peak memory (:func:`pyprune.io.memory.check_prune`,
    from the config alone) exceeds the memory available, saying what --offload would need."""
    from ..io import memory
    from ..inputs.models import resolve_model_dir
    from ..io.offload import skeleton
    if torch.device(args.device).type != "cpu":
        return
    model = skeleton(resolve_model_dir(args.model, weights=False), DTYPES[args.dtype])
    nsamples, seqlen = (args.nsamples, args.seqlen) if runner.needs_calibration else (0, 0)
    try:
        memory.check_prune(model, runner, nsamples, seqlen, args.batch_size,
                           f"--model {args.model} with {args.method}", offloaded=offload, offload_hint="--offload")
    except memory.NotEnoughMemory as error:
        raise UsageError(str(error)) from None


def check_method_directories(runner, model: str) -> None:
    """The directories the method writes (its options checked by ``written_directory``, e.g.
    ``--checkpoint``, COPAL's ``--state``) are not inside or above the input ``model``."""
    from ..methods.options import written_directory
    for declared in type(runner).options:
        value = runner.settings.get(declared.name)
        if declared.check is written_directory and value is not None:
            check_destination(value, declared.flag, directory=True, model=model)


def check_method_config(runner, args, config, pattern) -> None:
    """The method's checks that need only the model's config and files on disk (e.g. DReSS's channel
    rounding, a COPAL state's settings), then its checks of the model's structure
    (:meth:`pyprune.methods.Method.check`: the pattern against every layer, a block it cannot prune)
    on the model built from --model's config with no weight read."""
    from ..inputs.models import resolve_model_dir
    from ..io.offload import skeleton
    try:
        runner.check_config(config, pattern)
        model = skeleton(resolve_model_dir(args.model, weights=False), torch.float32)  # meta: the dtype is moot
        runner.check(model, pattern)
    except ValueError as error:
        raise UsageError(str(error)) from None
