"""pyprune.io: the files pyprune writes and reads.

* :mod:`pyprune.io.model_dir` — ``pyprune.save`` / ``pyprune.load`` of a pruned model's directory.
* :mod:`pyprune.io.manifest` — the ``pyprune.json`` that directory records (shapes, sparse layers, report).
* :mod:`pyprune.io.model_card` — the ``README.md`` model card written from it, for the Hugging Face hub.
* :mod:`pyprune.io.provenance` — what a saved model derives from (base model, revision, license).
* :mod:`pyprune.io.names` — checkpoint tensor names converted to the model's (transformers' conversions).
* :mod:`pyprune.io.offload` — decoder blocks kept on disk, one in memory at a time.
* :mod:`pyprune.io.memory` — the memory a load or a prune needs, estimated before it starts, and its check.
* :mod:`pyprune.io.storage` — run states and checkpoints as safetensors (atomic writes: :mod:`pyprune.files`).
"""
from .manifest import MANIFEST, read_config, read_manifest, read_tokenizer, write_report
from .model_dir import check_weights, config_compatible, load, model_layout, save

__all__ = ["save", "load", "check_weights", "model_layout", "config_compatible", "read_config", "read_tokenizer", "read_manifest",
           "write_report", "MANIFEST"]
