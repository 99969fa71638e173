"""pyprune.evaluation: how good and how big a pruned model is.

* :mod:`pyprune.evaluation.perplexity` — perplexity.
* :mod:`pyprune.evaluation.zeroshot` — zero-shot accuracy through lm-evaluation-harness.
"""
