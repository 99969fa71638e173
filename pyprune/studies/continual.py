"""Continual pruning over a sequence of datasets and its backward-transfer metrics (COPAL §5).

For every order π of the datasets (the given one, or all permutations), the model starts dense
and is pruned on the datasets one at a time; after every step it is evaluated on every dataset,
giving P_π[i][j] = perplexity on dataset j after step i. A method prunes either from its own
continual state (COPAL: one method object per order, accumulating), or with

* global initialisation: each step re-prunes the dense model on that step's dataset only
  (the baselines of COPAL's Table 2; the result depends on the last dataset alone), or
* sequential initialisation: each step prunes the model the previous step left (Table 1's
  weight stasis), or
* cumulative initialisation: the statistics of a layer-wise method (Wanda's Σ‖x_j‖², SparseGPT's
  Hessian) summed over the datasets seen so far, the mask always taken from the dense weights
  (:meth:`~pyprune.methods.base.LayerwiseMaskMethod.accumulate_across_calls`): COPAL's
  accumulation without its sensitivity formula.

Metrics (Eqs. 13-14, with the pair sets the paper leaves open fixed as its tables imply):
BWT_π[j] = P_π[last][j] − P_π[step of j][j] for every dataset j not last in π (positive means
forgetting); per dataset the mean over orders; ``a_bwt`` the mean of the per-dataset means and
``m_bwt`` the largest single value. ``a_ppl`` is the mean over datasets of the mean perplexity
of the final models, ``m_ppl`` the largest final perplexity; ``a_ppl_steps`` (Eq. 13's other
reading, P^{i,j}_π over every step i and dataset j of every order) the mean of P over every
step, dataset and order, ``m_ppl_steps`` its largest value. ``a_ppl_std`` / ``a_bwt_std``: the
spread across orders (standard deviation of each order's own mean final perplexity / mean BWT).
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from torch import Tensor, nn
from tqdm.auto import tqdm

from .. import methods
from ..files import write_json
from ..evaluation.perplexity import perplexity
from ..patterns import parse
from ..methods.pruning import prune

INITS = ("global", "sequential", "cumulative")


@dataclass
class Task:
    """One dataset of the sequence: its calibration windows and evaluation token stream."""

    name: str
    calib: Tensor
    eval_tokens: Tensor


def orders(names: Sequence[str], permutations: str) -> List[tuple]:
    """The dataset orders to run: ``"given"`` (one) or ``"all"`` (every permutation)."""
    if permutations == "given":
        return [tuple(names)]
    if permutations == "all":
        return list(itertools.permutations(names))
    raise ValueError(f"permutations must be 'given' or 'all'; got {permutations!r}")


def run(model: nn.Module, method: str, pattern, tasks: Sequence[Task], *, init: str = "global",
        permutations: str = "given", eval_seqlen: int = 512, batch_size: int = 8, progress: bool = True,
        done: Optional[Dict[tuple, list]] = None, on_order: Optional[Callable[[tuple, list], None]] = None,
        method_options: Optional[dict] = None) -> Dict:
    """Run the continual sequence(s) and return the matrix, the dense perplexities and the metrics.

    ``done`` maps orders already run to their steps (a resumed run skips them); ``on_order`` is
    called with each finished order's steps. The model is left dense.
    """
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}; got {init!r}")
    method_options = dict(method_options or {})
    probe = methods.get(method, **method_options)  # options checked before anything runs
    if init == "cumulative" and (probe.keeps_state or not getattr(probe, "can_accumulate", False)):
        raise ValueError("init 'cumulative' needs a method whose calibration statistics add up across datasets "
                         f"(wanda, sparsegpt); got {method!r}")
    stateful = probe.keeps_state or init == "cumulative"
    scope = getattr(probe.resolve(parse(pattern)), "scope", None)
    probe.check_continual()
    names = [task.name for task in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"datasets must have distinct names; got {names}")
    by_name = {task.name: task for task in tasks}
    dense_state = {key: value.detach().clone() for key, value in model.state_dict().items()}

    def evaluate() -> Dict[str, float]:
        return {task.name: perplexity(model, task.eval_tokens, eval_seqlen, batch_size=batch_size,
                                      progress=False) for task in tasks}

    start = time.perf_counter()
    dense = evaluate()
    matrix = dict(done or {})
    memo: Dict[str, Dict[str, float]] = {}  # global init: a step's model depends on its dataset only
    todo = [order for order in orders(names, permutations) if order not in matrix]
    bar = tqdm(total=len(todo) * len(names), desc=f"continual {method}", unit="step", disable=not progress)
    try:
        for order in todo:
            model.load_state_dict(dense_state)
            runner = None
            if stateful:
                runner = methods.get(method, **method_options)
                if init == "cumulative":
                    runner.accumulate_across_calls()
            steps = []
            for name in order:
                if not stateful and init == "global" and name in memo:
                    steps.append({"pruned_on": name, "perplexity": memo[name]})
                    bar.update()
                    continue
                if not stateful and init == "global":
                    model.load_state_dict(dense_state)
                prune(model, runner or method, pattern, by_name[name].calib, batch_size=batch_size,
                      progress=False, **({} if stateful else method_options))
                result = evaluate()
                if not stateful and init == "global":
                    memo[name] = result
                steps.append({"pruned_on": name, "perplexity": result})
                bar.update()
            matrix[order] = steps
            if on_order is not None:
                on_order(order, steps)
    finally:
        bar.close()
        model.load_state_dict(dense_state)
    report = {"method": method, "pattern": str(pattern), "scope": scope,
              "init": "continual state" if stateful and init != "cumulative" else init,
              "datasets": names, "dense": dense,
              "matrix": [{"order": list(order), "steps": matrix[order]} for order in orders(names, permutations)],
              "time_s": round(time.perf_counter() - start, 1)}
    report.update(metrics(names, {order: matrix[order] for order in orders(names, permutations)}))
    return report


def resume(path: str, settings: Dict, label: str = "continual report") -> Dict[tuple, list]:
    """The orders (with their steps) that an interrupted run of the same ``settings`` recorded in its
    report at ``path``; {} when there is no report. A report of other settings, or not JSON, is a
    ValueError naming the file (as ``label``): it is never overwritten by another run."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            previous = json.load(f)
    except ValueError as error:
        raise ValueError(f"{label} {path} is not valid JSON ({error}); remove it or choose another path") from None
    if not isinstance(previous, dict) or previous.get("settings") != settings:
        raise ValueError(f"{label} {path} holds a run with other settings; remove it or choose another path")
    return {tuple(run["order"]): run["steps"] for run in previous["matrix"]}


def write_partial(path: str, settings: Dict, done: Dict[tuple, list]) -> None:
    """The report of an unfinished run: its settings and the orders done so far (see :func:`resume`)."""
    write_json(path, {"settings": settings, "partial": True,
                              "matrix": [{"order": list(order), "steps": steps} for order, steps in done.items()]})


def metrics(names: Sequence[str], matrix: Dict[tuple, list]) -> Dict:
    """Per-dataset and overall A-/M-PPL and A-/M-BWT (COPAL Eqs. 13-14) of the runs in ``matrix``
    (order -> steps, each ``{"pruned_on": name, "perplexity": {dataset: ppl}}``)."""
    per_dataset, final_all, bwt_all = {}, [], []
    by_order: Dict[tuple, List[float]] = {}  # each order's BWTs, for the spread across orders
    for name in names:
        finals, bwts = [], []
        for order, steps in matrix.items():
            final = steps[-1]["perplexity"][name]
            finals.append(final)
            if order[-1] != name:
                bwts.append(final - steps[order.index(name)]["perplexity"][name])
                by_order.setdefault(order, []).append(bwts[-1])
        per_dataset[name] = {
            "ppl": statistics.fmean(finals), "ppl_std": statistics.pstdev(finals),
            "bwt": statistics.fmean(bwts) if bwts else None,
            "bwt_std": statistics.pstdev(bwts) if bwts else None}
        final_all += finals
        bwt_all += bwts
    with_bwt = [entry["bwt"] for entry in per_dataset.values() if entry["bwt"] is not None]
    every_step = [step["perplexity"][name] for steps in matrix.values() for step in steps for name in names]
    # the spread across orders: each order's own A-PPL and A-BWT (with every order run, their mean
    # over orders is the A-PPL / A-BWT above)
    order_ppl = [statistics.fmean(steps[-1]["perplexity"][name] for name in names) for steps in matrix.values()]
    order_bwt = [statistics.fmean(values) for values in by_order.values()]
    return {"per_dataset": per_dataset,
            "a_ppl": statistics.fmean(entry["ppl"] for entry in per_dataset.values()),
            "a_ppl_std": statistics.pstdev(order_ppl),
            "m_ppl": max(final_all),
            "a_ppl_steps": statistics.fmean(every_step), "m_ppl_steps": max(every_step),
            "a_bwt": statistics.fmean(with_bwt) if with_bwt else None,
            "a_bwt_std": statistics.pstdev(order_bwt) if order_bwt else None,
            "m_bwt": max(bwt_all) if bwt_all else None}

