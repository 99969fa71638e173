"""pyprune.inputs: what a prune starts from.

* :mod:`pyprune.inputs.data` — texts (the corpora shipped in ``corpora/``, files, hub datasets),
  calibration samples and evaluation token streams.
* :mod:`pyprune.inputs.models` — loading a causal LM from a directory or an alias (``smollm2-135m``).
"""
