"""pyprune.studies: experiments built from methods and evaluation.

* :mod:`pyprune.studies.continual` — continual pruning over a sequence of datasets (COPAL's BWT).
* :mod:`pyprune.studies.robustness` — how a structured method's choice moves under 16-bit weights.
* :mod:`pyprune.studies.compare` — tables and figures across reports.
* :mod:`pyprune.studies.verdict` — the one rule for comparing two arms over seeds (ahead, behind, unsettled).
"""
