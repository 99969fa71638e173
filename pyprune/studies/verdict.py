"""The one verdict rule for comparing two arms over seeds.

A comparison of arm A against arm B is made on the paired differences ``A − B``, one per seed both
arms ran (the seed cancels what its calibration windows or minibatch order do to both arms). A is
**ahead** (or **behind**) only when the differences clear a stated test:

* every difference has the same sign (none is zero), and
* the mean is more than two standard errors from zero: ``|mean| > 2 · std / √n`` with the sample
  standard deviation (``n − 1``).

Anything else is **unsettled**: the signs differ, the mean is within two standard errors, or only
one seed ran. Which sign is "ahead" depends on the metric: for perplexity lower is better, so a
negative mean difference puts A ahead.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

AHEAD, BEHIND, UNSETTLED = "ahead", "behind", "unsettled"
#: the test a comparison must clear, as the results files and docs state it
RULE = "same sign on every seed and |mean| > 2·sem"


@dataclass(frozen=True)
class Verdict:
    """The outcome of one comparison: ``word`` is ``"ahead"``, ``"behind"`` or ``"unsettled"``,
    ``reason`` says which part of the test decided it."""
    word: str
    mean: float
    std: float
    sem: float
    seeds: int
    reason: str

    def __str__(self) -> str:
        spread = f" ± {self.std:.3g}" if self.seeds > 1 else ""
        return f"{self.word} ({self.mean:+.3g}{spread} over {self.seeds} seed{'s' * (self.seeds != 1)}: {self.reason})"


def verdict(differences: Sequence[float], lower_is_better: bool = True) -> Verdict:
    """The verdict on paired differences ``A − B`` (one per seed): A ``ahead``, ``behind`` or
    ``unsettled``, by :data:`RULE`."""
    values = [float(d) for d in differences]
    if not values:
        raise ValueError("verdict needs at least one paired difference")
    n = len(values)
    mean = statistics.fmean(values)
    if n == 1:
        return Verdict(UNSETTLED, mean, math.nan, math.nan, 1, "one seed")
    std = statistics.stdev(values)
    sem = std / math.sqrt(n)
    if not (all(d > 0 for d in values) or all(d < 0 for d in values)):
        return Verdict(UNSETTLED, mean, std, sem, n, "signs differ across seeds")
    if abs(mean) <= 2 * sem:
        return Verdict(UNSETTLED, mean, std, sem, n, "|mean| ≤ 2·sem")
    better = mean < 0 if lower_is_better else mean > 0
    return Verdict(AHEAD if better else BEHIND, mean, std, sem, n, RULE)


def paired_verdict(ours: Mapping[object, float], theirs: Mapping[object, float],
                   lower_is_better: bool = True) -> Verdict:
    """The verdict on arm A (``ours``: seed → metric) against arm B (``theirs``), on the seeds both ran."""
    seeds = sorted(ours.keys() & theirs.keys(), key=str)
    if not seeds:
        raise ValueError("the two arms share no seed")
    return verdict([ours[s] - theirs[s] for s in seeds], lower_is_better)
