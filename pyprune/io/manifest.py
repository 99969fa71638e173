"""The ``pyprune.json`` manifest of a saved model directory (see :mod:`pyprune.io.model_dir`): its
name, the versions this pyprune reads, and reading it; :func:`write_report`, the one writer of
a run's report (into a saved directory's manifest and/or a JSON file); and the mark that keeps
plain transformers from misreading a directory only :func:`pyprune.load` reads as intended.

The mark (:func:`mark_config`, :func:`read_config`): when the saved blocks differ in size or hold
SparseLinear layers (``config_compatible`` false), ``config.json`` gets the ``model_type``
:data:`MARKED_MODEL_TYPE` and keeps the real one as ``pyprune_model_type``. Transformers' auto
classes look the ``model_type`` up before anything else, so ``AutoConfig`` /
``AutoModelForCausalLM.from_pretrained`` fail with an error quoting it ("... has model type
`pyprune-checkpoint: load it with pyprune.load(directory)` but Transformers does not recognize this
architecture"), instead of loading the wrong shapes or re-initialising the compressed layers at
random. pyprune's readers restore the real type."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Optional

import torch

from ..files import write_json
from . import model_card

#: Name of the file that records the pruned shapes inside a saved directory.
MANIFEST = "pyprune.json"
_FORMAT_VERSION = 5  # 2: sparse_layers; 3: residual_rotations; 4: sparse_experts; 5: residual_rotations.head_size
_READABLE_VERSIONS = (1, 2, 3, 4, 5)
#: the ``model_type`` of a saved config.json that plain transformers must refuse (see the module docstring)
MARKED_MODEL_TYPE = "pyprune-checkpoint: load it with pyprune.load(directory)"
_REAL_MODEL_TYPE = "pyprune_model_type"


def mark_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The config dict ``config`` marked so that transformers' auto classes refuse it."""
    return dict(config, model_type=MARKED_MODEL_TYPE, **{_REAL_MODEL_TYPE: config["model_type"]})


def read_config(directory: str):
    """The transformers config of the model directory ``directory`` (a marked one restored to its
    real ``model_type``); read from ``config.json`` alone, nothing is fetched."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config, _ = PretrainedConfig.get_config_dict(directory, local_files_only=True)
    if config.get("model_type") != MARKED_MODEL_TYPE:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    model_type = config.pop(_REAL_MODEL_TYPE, None)
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"cannot load {directory}: its config.json is marked as pyprune's but names no model type "
                         f"transformers knows ({_REAL_MODEL_TYPE}: {model_type!r})")
    config["model_type"] = model_type
    restored = CONFIG_MAPPING[model_type].from_dict(config)
    restored.name_or_path = directory  # as AutoConfig records it: where the model came from (its model card)
    return restored


def _json_safe(value):
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _json_safe(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def read_manifest(directory: str) -> Dict[str, Any]:
    """The ``pyprune.json`` of a saved directory ({} when it has none); ValueError naming the file
    when it is not valid JSON or not a pyprune manifest of a format this version reads."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except ValueError as error:
        raise ValueError(f"cannot load {directory}: {path} is not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "pyprune":
        raise ValueError(f"cannot load {directory}: {path} is not a pyprune manifest (its format is "
                         f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, expected 'pyprune')")
    if manifest.get("version") not in _READABLE_VERSIONS:
        raise ValueError(f"cannot load {directory}: {path} has version {manifest.get('version')!r}; this pyprune "
                         f"reads versions {', '.join(map(str, _READABLE_VERSIONS))}")
    return manifest


def write_report(report: Optional[Dict], *, model_dir: Optional[str] = None,
                 report_file: Optional[str] = None) -> None:
    """Write ``report`` where asked, each file atomically: into the ``pyprune.json`` of the saved
    directory ``model_dir`` (replacing the report it records) and its model card
    (:mod:`pyprune.io.model_card`), then as JSON to ``report_file`` (e.g. the CLI's ``--report``)."""
    if model_dir is not None:
        manifest = read_manifest(model_dir)
        if not manifest:
            raise FileNotFoundError(f"{model_dir} holds no {MANIFEST}: it was not written by pyprune.save")
        recorded = dict(manifest, report=_json_safe(report))
        model_card.write(model_dir, recorded)
        write_json(os.path.join(model_dir, MANIFEST), recorded, indent=1)
    if report_file is not None:
        write_json(report_file, report)


def read_tokenizer(directory: str):
    """The tokenizer of the model directory ``directory`` (its config read by :func:`read_config`,
    so a marked one is understood)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(directory, local_files_only=True, config=read_config(directory))


def shape_as_saved_(model, manifest: Dict[str, Any], directory: str, *, sparse_layers: bool = True):
    """Give ``model`` (built from the saved config, weights not read) the shapes ``manifest``
    records, in place: a sliced, rotated width (SliceGPT) with identity rotations the weights
    replace, each block's layout, and with ``sparse_layers`` the SparseLinear layers. The one reader
    of the format: :func:`pyprune.load` and every tool that sizes a saved model first
    (:func:`pyprune.io.offload.skeleton`) shape it here."""
    from ..nn import anatomy, compact, rotation, sparse
    rotations = manifest.get("residual_rotations")
    if rotations:
        k, dense = rotations["hidden_size"], rotations["dense_hidden_size"]
        head = rotations.get("head_size", k)  # before version 5 the head was always sliced
        if head not in (k, dense):
            raise ValueError(f"cannot load {directory}: {MANIFEST} records an LM head of width {head}, neither the "
                             f"sliced {k} nor the dense {dense}")
        compact.keep_hidden_channels_(model, torch.arange(k), slice_head=head == k)
        blocks = anatomy.decoder_blocks(model)
        identity = torch.eye(k)
        rotation.add_residual_rotations_(model, [identity] * len(blocks),
                                         [identity] * (len(blocks) - 1) + [torch.eye(k, head)], dense)
    layers = manifest.get("layers")
    if layers is not None:
        blocks = anatomy.decoder_blocks(model)
        if len(layers) != len(blocks):
            raise ValueError(f"cannot load {directory}: {MANIFEST} records {len(layers)} decoder blocks, "
                             f"the config builds {len(blocks)}")
        for block, layout in zip(blocks, layers):
            compact.resize_block_(block, layout)
    if sparse_layers:
        sparse.restore_sparse_layers_(model, manifest.get("sparse_layers") or {}, manifest.get("sparse_experts") or ())
    return model
