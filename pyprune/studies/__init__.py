"""pyprune.studies: experiments built from methods and evaluation, and the declared studies.

* :mod:`pyprune.studies.study` — a study declared with typed options, and the one runner
  (resume through :mod:`pyprune.runtime.checkpoint`, one writer: :mod:`pyprune.studies.results`).
* :mod:`pyprune.studies.continual` — continual pruning over a sequence of datasets (COPAL's BWT);
  studies ``continual`` and ``continual-seeds``.
* :mod:`pyprune.studies.robustness` — how a structured method's choice moves under 16-bit weights;
  study ``robustness``.
* :mod:`pyprune.studies.baselines` — prune, then evaluate: studies ``baselines``, ``owl``, ``zeroshot``;
  :mod:`pyprune.studies.owl_sweep` — study ``owl-sweep``: OWL's M and λ tuned on a held-out text, then
  over calibration seeds.
* :mod:`pyprune.studies.beside_dress` — SLEB and SliceGPT beside DReSS: studies ``sleb``, ``slicegpt``.
* :mod:`pyprune.studies.safe`, :mod:`~pyprune.studies.safe_sweep`, :mod:`~pyprune.studies.safe_controls` —
  SAFE / SAFE⁺ on the whole model, its settings on single blocks, its controls; studies ``safe``,
  ``safe-sweep``, ``safe-controls``.
* :mod:`pyprune.studies.crosscheck_wanda` — study ``crosscheck-wanda`` against the authors' code.
* :mod:`pyprune.studies.dress`, :mod:`~pyprune.studies.dress_lambda_sweep`,
  :mod:`~pyprune.studies.dress_channel_energy` — DReSS against its controls, its λ, where the
  residual-stream energy sits; studies ``dress``, ``dress-lambda-sweep``, ``dress-channel-energy``.
* :mod:`pyprune.studies.alps_layers` — study ``alps-layers``: ALPS and SparseGPT on the layer objective;
  :mod:`pyprune.studies.crosscheck_alps` — study ``crosscheck-alps`` against the authors' code
  (:mod:`pyprune.studies.authors_code`: the checkout the cross-checks share);
  :mod:`pyprune.studies.crosscheck_one_layer` — studies ``crosscheck-ria`` and ``crosscheck-dsnot``.
* :mod:`pyprune.studies.compare` — tables and figures across reports; :mod:`pyprune.studies.svg` — an SVG
  line chart.
* :mod:`pyprune.studies.verdict` — the one rule for comparing two arms over seeds (ahead, behind, unsettled).

Run a study with ``pyprune study NAME [options]`` or :func:`run`::

    pyprune.studies.run("robustness", methods=["moreau-gs"], seeds=[0], layers="middle")
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Type

from .alps_layers import AlpsLayers
from .baselines import Baselines, Owl, ZeroShot
from .beside_dress import Sleb, SliceGpt
from .continual import Continual, ContinualSeeds
from .crosscheck_alps import CrosscheckAlps
from .crosscheck_one_layer import CrosscheckDsnot, CrosscheckRia
from .crosscheck_wanda import CrosscheckWanda
from .dress import Dress
from .dress_channel_energy import DressChannelEnergy
from .dress_lambda_sweep import DressLambdaSweep
from .owl_sweep import OwlSweep
from .robustness import Robustness
from .safe import SafeTable
from .safe_controls import SafeControls
from .safe_sweep import SafeSweep
from .study import Study, run as _run

#: every declared study by name
STUDIES: Dict[str, Type[Study]] = {cls.name: cls for cls in (Robustness, Continual, ContinualSeeds, CrosscheckWanda,
                                                              Dress, DressLambdaSweep, DressChannelEnergy,
                                                              Baselines, Owl, OwlSweep, ZeroShot, Sleb, SliceGpt,
                                                              AlpsLayers, CrosscheckAlps, CrosscheckRia, CrosscheckDsnot,
                                                              SafeTable, SafeSweep,
                                                              SafeControls)}


def get(name: str, **settings: Any) -> Study:
    """Study ``name`` built with ``settings`` (converted and checked; ValueError naming the bad one)."""
    if name not in STUDIES:
        raise ValueError(f"study must be one of {', '.join(STUDIES)}; got {name!r}")
    return STUDIES[name](**settings)


def run(name: str, output: Optional[str] = None, *, progress: bool = True, **settings: Any) -> dict:
    """Run study ``name`` with ``settings`` into ``output`` (default: its results file in
    ``benchmarks/results``), resuming a stopped run of the same settings, with progress bars when
    ``progress``; returns the result."""
    return _run(get(name, **settings), output, progress)


__all__ = ["STUDIES", "Study", "get", "run"]
