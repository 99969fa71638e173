"""pyprune.runtime: running a model while a method prunes it.

* :mod:`pyprune.runtime.engine` — the layer-wise calibration engine (block inputs, hooks, resume).
* :mod:`pyprune.runtime.distributed` — data-parallel runs on torch.distributed (shards, reductions, failures).
* :mod:`pyprune.runtime.checkpoint` — resumable runs: keyed safetensors states (blocks, training).
* :mod:`pyprune.runtime.training` — training loops for a whole model and for one block.
* :mod:`pyprune.runtime.optim` — SAFE's ADMM optimiser over a block's weights.
* :mod:`pyprune.runtime.layer_solver` — ALPS's layer-wise reconstruction solver (ADMM support, then PCG).
* :mod:`pyprune.runtime.recovery` — LoRA fine-tuning after pruning.
* :mod:`pyprune.runtime.decode` — timed greedy decoding with the KV cache.
"""
