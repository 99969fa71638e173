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
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .. import methods
from ..files import write_json
from ..evaluation.perplexity import perplexity
from ..inputs import data
from ..inputs.models import load_model
from ..methods.options import at_least_one, nonnegative, option, positive
from ..nn.dispatch import environment_record
from ..patterns import Unstructured, parse
from ..methods.pruning import prune
from .results import verdict_cell
from .study import Arm, Study, model_label
from .verdict import RULE, paired_verdict

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




# -- the studies: COPAL's continual table (Tables 2-3) on SmolLM2-135M, and its seeds summary -----

#: the table's rows, each ``method[:init][+perturbation][/scope]``
ROWS = ("copal", "copal/row", "copal+gaussian", "copal+gaussian/row", "wanda:global", "wanda:cumulative",
        "wanda:cumulative/tensor", "sparsegpt:global", "sparsegpt:cumulative", "wanda:sequential",
        "sparsegpt:sequential")
DEFAULT_ROWS = ROWS[:9]
DATASETS = ("austen", "moby_dick", "python")
DEFAULT_MODEL = "smollm2-135m"


def _fmt(value, digits=3):
    return "–" if value is None else f"{value:.{digits}f}"


def _spread(mean, std):
    """mean ± standard deviation across orders (– for no value, mean alone for one order)."""
    return "–" if mean is None else f"{mean:.3f}" + (f" ± {std:.2f}" if std else "")


def markdown(result) -> str:
    s = result["settings"]
    lines = [
        f"# Continual pruning on {model_label(s)} (COPAL Tables 2-3)", "",
        f"Datasets {', '.join(s['datasets'])} in {s['permutations']} order(s); calibration {s['calibration']}; "
        f"evaluation {s['evaluation']}. BWT = P[after the last dataset][j] − P[right after j][j], over every "
        "dataset j not last in its order (positive = forgetting); A- = mean over datasets of the per-dataset "
        "mean, M- = largest single value; PPL of the final models; A-PPL (steps) = mean of P over every step, "
        "dataset and order (Eq. 13 read over every step i). Spread: standard deviation across orders.", "",
        "Dense: " + ", ".join(f"{k} {v:.3f}" for k, v in result["dense"].items()), "",
        "| pattern | method | init | A-BWT | M-BWT | A-PPL | M-PPL | A-PPL (steps) | " +
        " | ".join(f"{d} BWT | {d} PPL" for d in s["datasets"]) + " | time (s) |",
        "|---|---|---|---:|---:|---:|---:|---:|" + "---:|---:|" * len(s["datasets"]) + "---:|"]
    for row in result["rows"]:
        if row.get("partial"):
            continue
        cells = [_spread(row['per_dataset'][d]['bwt'], row['per_dataset'][d]['bwt_std']) + " | " +
                 _spread(row['per_dataset'][d]['ppl'], row['per_dataset'][d]['ppl_std']) for d in s["datasets"]]
        lines.append(f"| {row['pattern']} | {row['method']} | {row['init']} | "
                     f"{_spread(row['a_bwt'], row['a_bwt_std'])} | {_fmt(row['m_bwt'])} | "
                     f"{_spread(row['a_ppl'], row['a_ppl_std'])} | {row['m_ppl']:.3f} | {row['a_ppl_steps']:.3f} | "
                     + " | ".join(cells)
                     + f" | {row['time_s']:.0f} |")
    if all(row.get("partial") for row in result["rows"]):  # no row for the summary table
        lines[-2:] = ["No row has run every order of the protocol: the table below gives each row over the orders "
                      "it finished."]
    return "\n".join(lines + _per_order(result)) + "\n"


def _per_order(result) -> list:
    """Each order's own A-BWT and mean final perplexity per row (where a row ran more than one order,
    or is still partial: the orders it finished), for paired comparisons between rows."""
    rows = [row for row in result["rows"] if row["matrix"] and (row.get("partial") or len(row["matrix"]) > 1)]
    if not rows:
        return []
    s = result["settings"]
    protocol = orders(s["datasets"], s["permutations"])
    lines = ["", "Per order: A-BWT / mean final perplexity of that order alone (a row marked partial has "
             "finished only the orders shown; its run resumes with the same command, which runs the orders "
             "given by --orders, or every order without it). Last column: A-BWT / A-PPL over the orders "
             "the row finished, ± their standard deviation across those orders.", "",
             "| pattern | method | init | " + " | ".join(" → ".join(order) for order in protocol)
             + " | orders finished |",
             "|---|---|---|" + "---:|" * (len(protocol) + 1)]
    for row in rows:
        by_order = {tuple(run["order"]): metrics(list(run["order"]), {tuple(run["order"]): run["steps"]})
                    for run in row["matrix"]}
        finished = metrics(s["datasets"], {tuple(run["order"]): run["steps"] for run in row["matrix"]})
        partial = f" (partial, {len(row['matrix'])} of {len(protocol)} orders)" if row.get("partial") else ""
        lines.append(f"| {row['pattern']} | {row['method']}{partial} | {row['init']} | " + " | ".join(
            f"{_fmt(by_order[o]['a_bwt'], 2)} / {by_order[o]['a_ppl']:.2f}" if o in by_order else "–"
            for o in protocol) + f" | {_spread(finished['a_bwt'], finished['a_bwt_std'])} / "
            f"{_spread(finished['a_ppl'], finished['a_ppl_std'])} |")
    return lines


def _current(row):
    """A row as the study writes it now: rows written before the selection scope was part of the
    label, or before A-PPL over every step was reported, get both (from the method's default
    scope and the row's own matrix)."""
    if row.get("partial"):
        return row
    if " per " not in row["pattern"] and ":" not in row["pattern"]:
        method = row["method"].split(" ")[0]
        row["pattern"] += f" per {methods.get(method).default_scope}"
    if "a_ppl_steps" not in row or "a_bwt_std" not in row:
        names = list(row["per_dataset"])
        measured = metrics(names, {tuple(r["order"]): r["steps"] for r in row["matrix"]})
        row.update({key: measured[key] for key in ("a_ppl_steps", "m_ppl_steps", "a_ppl_std", "a_bwt_std")})
    return row


def _pattern(spec: str, scope: Optional[str]):
    """A table pattern: N:M, or an unstructured sparsity (with the row's scope, if any)."""
    return parse(spec) if ":" in spec else Unstructured(float(spec), scope)


class Continual(Study):
    """COPAL's continual table (Tables 2-3): three domains, every order.

    For every pattern and row, :func:`run` prunes the model on the datasets one after another
    (every permutation by default), evaluates perplexity on all of them after every step, and
    reports A-/M-PPL and A-/M-BWT (Eqs. 13-14, :func:`metrics`). The first half of each dataset
    calibrates (``nsamples`` × ``seqlen`` random windows, the same for every order), the first
    ``eval_tokens`` tokens of its second half evaluate.

    Rows, each ``method[:init][+perturbation][/scope]``: COPAL (continual state; ``+gaussian``
    draws the perturbations instead of the proportional ones, one row per perturbation seed and
    ratio; ``/row`` selects per output row instead of the paper's per matrix), and Wanda /
    SparseGPT with global, sequential or cumulative initialisation (see the module docstring).
    A row is resumed order by order; with ``orders`` only those orders run, and the row stays
    partial until every order of the protocol has.
    """

    name = "continual"
    summary = "continual pruning over every order of three domains, A-/M-PPL and A-/M-BWT (COPAL Tables 2-3)"
    results = "continual-smollm2-135m"

    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory (recorded in the settings when not "
                        "the default)")
    patterns: Tuple[str, ...] = option(("0.5", "2:4"), "patterns: an unstructured sparsity or N:M")
    rows: Tuple[str, ...] = option(DEFAULT_ROWS, "the rows, each method[:init][+perturbation][/scope]", choices=ROWS)
    datasets: Tuple[str, ...] = option(DATASETS, "the datasets (pyprune.inputs.data sources, halves of each)")
    permutations: str = option("all", "the orders: the given one, or every permutation", choices=("given", "all"))
    nsamples: int = option(16, "calibration windows per dataset", at_least_one)
    seqlen: int = option(512, "calibration window length", at_least_one)
    seed: int = option(0, "calibration sampling seed", nonnegative)
    eval_tokens: int = option(8192, "evaluation tokens of each dataset", at_least_one)
    eval_seqlen: int = option(512, "evaluation window length", at_least_one)
    perturbation_seeds: Tuple[int, ...] = option((0,), "COPAL gaussian rows: one row per perturbation seed",
                                                 nonnegative)
    perturbation_ratios: Tuple[float, ...] = option((1.0,), "COPAL gaussian rows: one row per size ratio of dX to "
                                                    "dW", positive)
    orders: Optional[Tuple[str, ...]] = option(None, "run only these orders of the protocol (each A,B,C); a row "
                                               "stays partial until every order has run")

    def check_options(self) -> None:
        for spec in self.patterns:
            try:
                _pattern(spec, None)
            except ValueError as error:
                raise ValueError(f"option patterns of study 'continual': {error}") from None
        self.selected_orders()

    def selected_orders(self) -> List[tuple]:
        """The orders this run runs: every order of the protocol, or the requested ones (refused
        when one is not an order of the protocol)."""
        protocol = orders(self.datasets, self.permutations)
        if not self.orders:
            return protocol
        chosen = [tuple(order.split(",")) for order in self.orders]
        unknown = [",".join(order) for order in chosen if order not in protocol]
        if unknown:
            raise ValueError(f"option orders of study 'continual': {', '.join(unknown)} is not an order of datasets "
                             f"{' '.join(self.datasets)} with permutations {self.permutations}; allowed: "
                             + " ".join(",".join(order) for order in protocol))
        return list(dict.fromkeys(chosen))

    def prepare(self, path):
        model, tokenizer = load_model(self.model)
        tasks = [Task(name, data.calibration_samples(tokenizer, f"{name}:first_half", nsamples=self.nsamples,
                                                     seqlen=self.seqlen, seed=self.seed),
                      data.eval_tokens(tokenizer, f"{name}:second_half", max_tokens=self.eval_tokens))
                 for name in self.datasets]
        return {"model": model, "tasks": tasks}

    def protocol(self, context):
        settings = {"datasets": list(self.datasets), "permutations": self.permutations,
                    "calibration": f"{self.nsamples} x {self.seqlen} tokens of each first half (seed {self.seed})",
                    "evaluation": f"first {self.eval_tokens} tokens of each second half, {self.eval_seqlen}-token "
                                  "windows"}
        if self.model != DEFAULT_MODEL:
            settings["model"] = self.model
        return settings

    def start(self, settings, context):
        dense = {task.name: perplexity(context["model"], task.eval_tokens, self.eval_seqlen, progress=False)
                 for task in context["tasks"]}
        return {"settings": settings, "environment": {}, "dense": dense, "rows": []}

    def _variants(self):
        """(pattern, row name without its perturbation, COPAL options, label of the variant) of every
        row: a gaussian row once per perturbation seed and ratio."""
        for spec in self.patterns:
            for row_name in self.rows:
                scoped = row_name.partition("/")
                name, _, perturbation = scoped[0].partition("+")
                name += "".join(scoped[1:])
                if perturbation != "gaussian":
                    yield spec, name, ({"perturbation": perturbation} if perturbation else {}), perturbation
                    continue
                for ratio in self.perturbation_ratios:
                    for seed in self.perturbation_seeds:
                        yield spec, name, {"perturbation": perturbation, "perturbation_ratio": ratio,
                                           "perturbation_seed": seed}, f"gaussian, ratio {ratio:g}, seed {seed}"

    def arms(self, context):
        for spec, row_name, options, variant in self._variants():
            row_name, _, scope = row_name.partition("/")
            method, _, init = row_name.partition(":")
            init = init or "global"
            pattern = _pattern(spec, scope or None)
            scope = getattr(methods.get(method).resolve(pattern), "scope", None)
            key = (str(pattern) + (f" per {scope}" if scope else ""), method + (f" ({variant})" if variant else ""),
                   init if method != "copal" else "continual state")
            yield Arm(key, " ".join(key), (pattern, method, init, options))

    def row_key(self, row):
        return row["pattern"], row["method"], row["init"]

    def finished(self, row):
        return not row.get("partial")

    def run_arm(self, context, arm, row, checkpoint):
        pattern, method, init, options = arm.spec
        label = dict(zip(("pattern", "method", "init"), arm.key))
        done = {tuple(r["order"]): r["steps"] for r in (row or {}).get("matrix", [])}
        partial = row if row is not None else dict(label, partial=True, matrix=[])

        def on_order(order, steps):
            partial["matrix"].append({"order": list(order), "steps": steps})
            checkpoint(partial)

        protocol, selected = orders(self.datasets, self.permutations), self.selected_orders()
        start = time.perf_counter()
        if selected == protocol:
            report = run(context["model"], method, pattern, context["tasks"], init=init,
                         permutations=self.permutations, eval_seqlen=self.eval_seqlen, progress=self.progress,
                         done=done, on_order=on_order, method_options=options)
        else:  # the chosen orders one at a time; the row is complete once every order has run
            by_name = {task.name: task for task in context["tasks"]}
            for order in selected:
                if order not in done:
                    run(context["model"], method, pattern, [by_name[name] for name in order], init=init,
                        eval_seqlen=self.eval_seqlen, progress=self.progress, on_order=on_order, method_options=options)
            matrix = {tuple(r["order"]): r["steps"] for r in partial["matrix"]}
            if set(matrix) != set(protocol):
                return None
            report = metrics(list(self.datasets), matrix) | {
                "matrix": [{"order": list(order), "steps": matrix[order]} for order in protocol]}
        report["time_s"] = round(time.perf_counter() - start, 1)
        return dict(label, resumed_orders=len(done), **{k: report[k] for k in (
            "a_ppl", "a_ppl_std", "m_ppl", "a_ppl_steps", "m_ppl_steps", "a_bwt", "a_bwt_std", "m_bwt",
            "per_dataset", "matrix", "time_s")})

    def describe(self, row):
        return (f"A-BWT {_fmt(row['a_bwt'])} M-BWT {_fmt(row['m_bwt'])} A-PPL {row['a_ppl']:.3f} (over every step "
                f"{row['a_ppl_steps']:.3f}) M-PPL {row['m_ppl']:.3f} ({row['time_s']} s)")

    def complete(self, result, context):
        result["rows"] = [_current(row) for row in result["rows"]]
        result["environment"] = environment_record(torch.device("cpu"))
        return result

    def markdown(self, result):
        return markdown(result)


SEED = re.compile(r" \(seed (\d+)\)")


def _label(row):
    return row["pattern"], row["method"], row["init"]


def merge_seeds(results: Sequence[dict]) -> dict:
    """The seeds summary of ``results`` (results files of :class:`Continual`, one per calibration
    seed): for the rows every file holds and the orders every one of them finished, each seed's
    A-BWT and A-PPL over those orders, their mean ± (population) standard deviation over the seeds,
    and each (seed, order)'s own metrics."""
    where = "option inputs of study 'continual-seeds'"
    protocols = {json.dumps({**r["settings"], "calibration": SEED.sub("", r["settings"]["calibration"])},
                            sort_keys=True) for r in results}
    if len(protocols) != 1:
        raise ValueError(f"{where}: the results files differ in more than the calibration seed; got settings "
                         + " / ".join(protocols))
    seeds = [int(SEED.search(r["settings"]["calibration"]).group(1)) for r in results]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{where}: each file must have its own calibration seed; got seeds {seeds}")
    settings = json.loads(protocols.pop())
    by_file = [{_label(row): {tuple(run["order"]): run["steps"] for run in row["matrix"]} for row in r["rows"]}
               for r in results]
    labels = [label for label in by_file[0] if all(by_file_i.get(label) for by_file_i in by_file)]
    common = set.intersection(*(set(rows[label]) for rows in by_file for label in labels)) if labels else set()
    chosen = [order for order in orders(settings["datasets"], settings["permutations"]) if order in common]
    if not chosen:
        raise ValueError(f"{where}: no row has finished a common order in every file")
    names = settings["datasets"]
    rows = []
    for label in labels:
        per_seed = []
        for seed, file_rows in zip(seeds, by_file):
            matrix = {order: file_rows[label][order] for order in chosen}
            measured = metrics(names, matrix)
            per_seed.append({"seed": seed, "a_bwt": measured["a_bwt"], "a_ppl": measured["a_ppl"],
                             "orders": {" → ".join(order): metrics(names, {order: matrix[order]})
                                        for order in chosen}})
        rows.append({"pattern": label[0], "method": label[1], "init": label[2], "per_seed": per_seed} | {
            f"{key}_{stat}": fn([s[key] for s in per_seed]) for key in ("a_bwt", "a_ppl")
            for stat, fn in (("mean", statistics.fmean), ("std", statistics.pstdev))})
    return {"settings": settings | {"calibration_seeds": seeds}, "orders": [list(o) for o in chosen],
            "dense": results[0]["dense"], "rows": rows}


def seeds_verdicts(summary):
    """COPAL against cumulative Wanda over the calibration seeds: for every COPAL row and the
    ``wanda`` ``cumulative`` row of its pattern, (COPAL row, Wanda row, A-BWT verdict, A-PPL
    verdict) on the seeds both ran (:func:`pyprune.studies.verdict.paired_verdict`; lower is better
    for both: less forgetting, lower perplexity)."""
    rows = summary["rows"]
    found = []
    for copal in (row for row in rows if row["method"].startswith("copal")):
        wanda = next((row for row in rows if row["pattern"] == copal["pattern"] and row["method"] == "wanda"
                      and row["init"] == "cumulative"), None)
        if wanda is None:
            continue
        found.append((copal, wanda, *(paired_verdict({p["seed"]: p[metric] for p in copal["per_seed"]},
                                                     {p["seed"]: p[metric] for p in wanda["per_seed"]})
                                      for metric in ("a_bwt", "a_ppl"))))
    return found


def seeds_verdict_lines(summary):
    """The markdown of :func:`seeds_verdicts` (nothing without a COPAL row and its Wanda row)."""
    found = seeds_verdicts(summary)
    if not found:
        return []
    lines = ["", f"COPAL against cumulative Wanda, paired by calibration seed: ahead or behind only when {RULE} "
             "(pyprune.studies.verdict), otherwise unsettled. Difference = COPAL − Wanda; lower is better for "
             "both.", "",
             "| pattern | method | init | A-BWT against Wanda | A-PPL against Wanda |", "|---|---|---|---|---|"]
    for copal, _, bwt, ppl in found:
        lines.append(f"| {copal['pattern']} | {copal['method']} | {copal['init']} | {verdict_cell(bwt, '.3f')} | "
                     f"{verdict_cell(ppl, '.3f')} |")
    return lines


def seeds_markdown(summary) -> str:
    s = summary["settings"]
    seeds = s["calibration_seeds"]
    names = [" → ".join(order) for order in summary["orders"]]
    lines = [f"# Continual pruning on {model_label(s)} over calibration seeds", "",
             f"Datasets {', '.join(s['datasets'])}; calibration {s['calibration']}, drawn with seeds "
             f"{', '.join(map(str, seeds))}; evaluation {s['evaluation']}. Orders: {len(names)} "
             f"({'; '.join(names)}), the ones every row below finished for every seed. A-BWT, A-PPL: means over "
             "those orders (as in the per-seed results files); mean ± standard deviation over the seeds.", "",
             "| pattern | method | init | A-BWT | A-PPL | "
             + " | ".join(f"seed {seed}: A-BWT / A-PPL" for seed in seeds) + " |", "|---|---|---|---:|---:|" + "---:|" * len(seeds)]
    for row in summary["rows"]:
        lines.append(f"| {row['pattern']} | {row['method']} | {row['init']} | "
                     f"{row['a_bwt_mean']:.3f} ± {row['a_bwt_std']:.2f} | {row['a_ppl_mean']:.3f} ± "
                     f"{row['a_ppl_std']:.2f} | " + " | ".join(f"{p['a_bwt']:.3f} / {p['a_ppl']:.3f}"
                                                            for p in row["per_seed"]) + " |")
    lines += seeds_verdict_lines(summary)
    lines += ["", "Per seed and order: A-BWT / mean final perplexity of that order alone.", "",
              "| pattern | method | init | seed | " + " | ".join(names) + " |",
              "|---|---|---|---:|" + "---:|" * len(names)]
    for row in summary["rows"]:
        for p in row["per_seed"]:
            lines.append(f"| {row['pattern']} | {row['method']} | {row['init']} | {p['seed']} | " + " | ".join(
                f"{p['orders'][o]['a_bwt']:.2f} / {p['orders'][o]['a_ppl']:.2f}" for o in names) + " |")
    return "\n".join(lines) + "\n"


class ContinualSeeds(Study):
    """COPAL's continual table over calibration draws: :class:`Continual` results files, one per
    ``seed`` and otherwise of the same protocol, merged by seed (:func:`merge_seeds`)."""

    name = "continual-seeds"
    summary = "continual results files of several calibration seeds merged: mean ± std over the seeds"
    resumes = False

    inputs: Tuple[str, ...] = option(None, "results files of the continual study, one per calibration seed")

    def check_options(self) -> None:
        missing = [name for name in self.inputs if not os.path.isfile(name)]
        if missing:
            raise ValueError(f"option inputs of study 'continual-seeds': {', '.join(missing)} is not a file")

    def prepare(self, path):
        loaded = []
        for name in self.inputs:
            with open(name, encoding="utf-8") as handle:
                loaded.append(json.load(handle))
        return loaded

    def protocol(self, context):
        return {"inputs": list(self.inputs)}

    def start(self, settings, context):
        return merge_seeds(context)

    def arms(self, context):
        return ()

    def row_key(self, row):
        return _label(row)

    def markdown(self, result):
        return seeds_markdown(result)
