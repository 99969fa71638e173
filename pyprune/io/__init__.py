"""pyprune.io: the files pyprune writes and reads.

* :mod:`pyprune.io.model_dir` — ``pyprune.save`` / ``pyprune.load`` of a pruned model's directory.
* :mod:`pyprune.io.manifest` — the ``pyprune.json`` that directory records (shapes, sparse layers, report).
* :mod:`pyprune.io.offload` — decoder blocks kept on disk, one in memory at a time.
* :mod:`pyprune.io.storage` — atomic writes, run states and checkpoints as safetensors.
"""
from .manifest import MANIFEST, read_manifest, write_report
from .model_dir import check_weights, load, model_layout, save

__all__ = ["save", "load", "check_weights", "model_layout", "read_manifest", "write_report", "MANIFEST"]
