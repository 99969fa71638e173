"""Zero-shot accuracy through EleutherAI's lm-evaluation-harness, on the model in memory.

Any lm-eval task name works (``piqa``, ``arc_easy``, ...; their data comes from the Hugging Face
hub), and so do three local tasks that need no download, built deterministically from the
held-out halves of the embedded corpora (:data:`LOCAL_TASKS`): after ``CONTEXT_LINES`` lines of a
passage, pick the ``CONTINUATION_LINES`` lines that follow among four candidates, the three others
taken from elsewhere in the same text. Every candidate starts mid-paragraph and has the same number
of lines, so the form gives nothing away. The tasks are written as lm-eval YAML + JSONL
(``dataset_path: json``) and loaded with ``TaskManager(include_path=...)``; lm-eval scores each
candidate by the log-likelihood of its tokens after the context (``acc``) and by that divided by
its length in characters (``acc_norm``).

    tasks = zeroshot.load_tasks(["austen_continuation", "piqa"])   # before the model loads
    results = zeroshot.evaluate(model, tokenizer, tasks, limit=200)
    results["austen_continuation"]   # {"acc", "acc_norm", "stderr", "n", "metric", "paper_metric"}

Needs the extra ``pyprune[eval]`` (``lm-eval``).
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from ..files import atomic_path, cache_dir
from ..inputs import data

__all__ = ["LOCAL_TASKS", "PAPER_METRICS", "TaskDataError", "LoadedTasks",
           "build_items", "write_local_task", "load_tasks", "evaluate"]

CONTEXT_LINES = 4
CONTINUATION_LINES = 1
CHOICES = 4
ITEMS = 500
#: Distractors start at least this many lines away from the true continuation.
MIN_DISTANCE = 100
SEED = 0

#: Local task name -> the held-out text it is built from (the project's evaluation splits).
LOCAL_TASKS = {
    "austen_continuation": "pride_and_prejudice",
    "moby_dick_continuation": "moby_dick:second_half",
    "python_continuation": "python:second_half",
}

#: The metric each paper family reports for the common zero-shot tasks. Wanda's authors report
#: ``acc`` throughout (locuslab/wanda#31; SparseGPT's zero-shot tables are Wanda's baselines).
#: LLM-Pruner's published numbers match ``acc_norm`` for HellaSwag, ARC-c and OpenBookQA and
#: ``acc`` elsewhere (the reproduction in horseee/LLM-Pruner#25); MoreauPruner reuses its baselines.
PAPER_METRICS = {
    task: {"wanda/sparsegpt": "acc",
           "llm-pruner/moreaupruner": "acc_norm" if task in ("hellaswag", "arc_challenge", "openbookqa")
           else "acc"}
    for task in ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa",
                 "lambada_openai")
}


class TaskDataError(RuntimeError):
    """A task's data could not be loaded (e.g. a hub dataset while offline)."""


def _lm_eval():
    try:
        import lm_eval  # noqa: F401  (heavy; imported only when zero-shot evaluation is asked for)
        from lm_eval.tasks import TaskManager  # noqa: F401
    except ImportError as error:
        raise ImportError(f"zero-shot evaluation needs lm-evaluation-harness: pip install 'pyprune[eval]' "
                          f"({error})") from None
    return lm_eval


def _one_line(error: BaseException, limit: int = 240) -> str:
    return " ".join(str(error).split())[:limit] or type(error).__name__


# --------------------------------------------------------------------------------------------
# local tasks
# --------------------------------------------------------------------------------------------


def _span_starts(lines: Sequence[str], context_lines: int, continuation_lines: int) -> List[int]:
    """Line indices s where a candidate can start mid-paragraph: line s - 1 and lines
    s .. s + continuation_lines - 1 are not blank, and a full context fits before s."""
    filled = [bool(line.strip()) for line in lines]
    return [s for s in range(context_lines, len(lines) - continuation_lines + 1)
            if filled[s - 1] and all(filled[s:s + continuation_lines])]


def build_items(text: str, *, items: int = ITEMS, context_lines: int = CONTEXT_LINES,
                continuation_lines: int = CONTINUATION_LINES, choices: int = CHOICES,
                min_distance: int = MIN_DISTANCE, seed: int = SEED) -> List[Dict]:
    """``items`` multiple-choice items from ``text``: ``{"context", "choices", "label"}``, the
    context the ``context_lines`` lines before a continuation, ``choices[label]`` the
    ``continuation_lines`` lines that follow it, the other choices as many lines starting at least
    ``min_distance`` lines away (distinct texts). The anchors are one per equal stretch of the
    text, the items in a seeded random order (so any first N of them spread over the text); the
    same arguments give the same items."""
    for name, value, low in (("items", items, 1), ("context_lines", context_lines, 1),
                             ("continuation_lines", continuation_lines, 1), ("choices", choices, 2),
                             ("min_distance", min_distance, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
    lines = text.split("\n")
    starts = _span_starts(lines, context_lines, continuation_lines)
    if len(starts) < items + choices * 2:
        raise ValueError(f"the text has {len(starts)} places to cut, too few for {items} items")
    rng = random.Random(seed)
    span = lambda s: "\n".join(lines[s:s + continuation_lines])  # noqa: E731
    stride = len(starts) / items
    out = []
    for k in range(items):
        anchor = starts[int(k * stride) + rng.randrange(max(1, int(stride)))]
        truth = span(anchor)
        others: List[str] = []
        while len(others) < choices - 1:
            s = rng.choice(starts)
            if abs(s - anchor) >= min_distance and span(s) != truth and span(s) not in others:
                others.append(span(s))
        label = rng.randrange(choices)
        out.append({"context": "\n".join(lines[anchor - context_lines:anchor]),
                    "choices": others[:label] + [truth] + others[label:], "label": label})
    rng.shuffle(out)
    return out


def _task_yaml(name: str, jsonl: str) -> str:
    return "\n".join([
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(jsonl)}",
        "test_split: test",
        "output_type: multiple_choice",
        'doc_to_text: "{{context}}"',
        'doc_to_choice: "{{choices}}"',
        "doc_to_target: label",
        'target_delimiter: "\\n"',
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
        "  - metric: acc_norm",
        "    aggregation: mean",
        "    higher_is_better: true",
        "",
    ])


def _write_if_changed(path: str, text: str) -> None:
    """Atomic write, skipped when the file already holds ``text`` (the datasets cache keys on it)."""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            if handle.read() == text:
                return
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)


def write_local_task(name: str, directory: str, *, source: Optional[str] = None, **build) -> str:
    """Write task ``name`` (its JSONL items from ``source``, default :data:`LOCAL_TASKS`\\[name],
    and its lm-eval YAML) into ``directory``; returns the YAML path. ``build`` goes to
    :func:`build_items`."""
    if source is None:
        if name not in LOCAL_TASKS:
            raise ValueError(f"name must be one of {', '.join(LOCAL_TASKS)} (or give source=); got {name!r}")
        source = LOCAL_TASKS[name]
    os.makedirs(directory, exist_ok=True)
    items = build_items(data.load_text(source), **build)
    jsonl = os.path.join(os.path.abspath(directory), f"{name}.jsonl")
    _write_if_changed(jsonl, "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    path = os.path.join(directory, f"{name}.yaml")
    _write_if_changed(path, _task_yaml(name, jsonl))
    return path


def _default_task_dir() -> str:
    return cache_dir("zeroshot")


# --------------------------------------------------------------------------------------------
# loading and evaluating
# --------------------------------------------------------------------------------------------


@dataclass
class LoadedTasks:
    """lm-eval tasks ready to run: the TaskManager and ``{name requested: [lm-eval Task]}``."""
    manager: object
    tasks: Dict[str, list]


def _check_names(names: Sequence[str]) -> List[str]:
    if isinstance(names, str) or not names:
        raise ValueError(f"tasks must be a non-empty list of names; got {names!r}")
    cleaned = [str(name).strip() for name in names]
    if any(not name for name in cleaned) or len(set(cleaned)) != len(cleaned):
        raise ValueError(f"tasks must be distinct, non-empty names; got {list(names)}")
    return cleaned


@functools.lru_cache(maxsize=4)
def _manager(task_dir: str, with_hub_tasks: bool):
    """lm-eval's TaskManager over ``task_dir`` (and its own tasks: indexing them takes seconds, so
    managers are kept per process)."""
    from lm_eval.tasks import TaskManager
    return _quiet(TaskManager, include_path=task_dir, include_defaults=with_hub_tasks)


def _without_bars(hflm):
    """lm-eval's HFLM whose request methods run with their progress bars off (``disable_tqdm``)."""
    class QuietHFLM(hflm):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return super().generate_until(requests, disable_tqdm=True)
    return QuietHFLM


def _quiet(factory, *args, **kwargs):
    """Call ``factory`` with lm-eval's info/warning logging silenced, and without its probe of the
    working directory's git commit (``git describe`` prints "fatal: not a git repository" to the
    terminal outside a repository; pyprune's reports do not use the hash)."""
    from lm_eval import evaluator
    logger = logging.getLogger("lm_eval")
    level, probe = logger.level, evaluator.get_git_commit_hash
    logger.setLevel(logging.ERROR)
    evaluator.get_git_commit_hash = lambda: None
    try:
        return factory(*args, **kwargs)
    finally:
        logger.setLevel(level)
        evaluator.get_git_commit_hash = probe


def load_tasks(names: Sequence[str], *, task_dir: Optional[str] = None) -> LoadedTasks:
    """Build the local tasks among ``names`` into ``task_dir`` (default
    ``$PYPRUNE_CACHE/zeroshot``) and load every task with its data, so a task whose data cannot be
    had fails here, before any model work: :class:`TaskDataError` naming the task, in one line.
    ValueError for an empty, repeated or unknown name (:data:`LOCAL_TASKS` or lm-eval's tasks,
    groups and tags). Hub datasets are read from the cache only when the hub does not answer."""
    names = _check_names(names)
    _lm_eval()
    task_dir = os.path.abspath(_default_task_dir() if task_dir is None else task_dir)
    for name in LOCAL_TASKS:  # all of them, so the (kept) index of task_dir knows every one
        write_local_task(name, task_dir)
    hub = [name for name in names if name not in LOCAL_TASKS]
    manager = _manager(task_dir, bool(hub))
    unknown = [name for name in hub if name not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}: tasks are {', '.join(LOCAL_TASKS)} "
                         "(local, no download) or lm-eval task names (e.g. piqa, arc_easy, hellaswag)")
    offline = bool(hub) and (data._env_offline() or not data._hub_reachable())
    loaded = {}
    for name in names:
        try:
            with data._forced_offline() if offline and name in hub else contextlib.nullcontext():
                loaded[name] = list(_quiet(manager.load, [name])["tasks"].values())
        except Exception as error:  # datasets raises ConnectionError, FileNotFoundError, ValueError, ...
            where = " (the Hugging Face hub is unreachable and the dataset is not cached)" if offline else ""
            raise TaskDataError(f"task {name!r}: its data could not be loaded{where}: {_one_line(error)}; "
                                f"the local tasks {', '.join(LOCAL_TASKS)} need no download") from None
    return LoadedTasks(manager, loaded)


@contextlib.contextmanager
def _model_as_given(model):
    """HFLM puts the model in eval mode and re-ties its embeddings; keep it as it was (no
    re-tying, which would fail on SlicedLinear heads, and its training flag restored)."""
    was_training = model.training
    model.tie_weights = lambda *args, **kwargs: None  # an instance attribute hides the method
    try:
        yield
    finally:
        del model.tie_weights
        model.train(was_training)


def _summary(name: str, task, results: Dict) -> Dict:
    metrics = results["results"][name]
    value = lambda key: metrics.get(f"{key},none")  # noqa: E731
    return {"acc": value("acc"), "acc_norm": value("acc_norm"), "n": results["n-samples"][name]["effective"],
            "stderr": {"acc": value("acc_stderr"), "acc_norm": value("acc_norm_stderr")},
            "metric": "acc", "paper_metric": PAPER_METRICS.get(name),
            "chance": 1 / CHOICES if name in LOCAL_TASKS else None,
            "num_fewshot": task.get_config("num_fewshot")}


def evaluate(model, tokenizer, tasks, *, limit: Optional[int] = None, batch_size: int = 8,
             details: bool = False, progress: bool = True) -> Dict[str, Dict]:
    """Zero-shot accuracy of ``model`` (in memory, any pyprune layers) on ``tasks`` (a
    :class:`LoadedTasks` or task names), the first ``limit`` items of each:
    ``{task: {"acc", "acc_norm", "stderr": {"acc", "acc_norm"}, "n", "metric", "paper_metric",
    "chance", "num_fewshot"}}`` (``chance`` for the local tasks). ``metric`` is the one pyprune's
    tables show (``acc``); ``paper_metric`` names the one each paper family reports, where known. With ``details`` each task also lists per item
    the label and every choice's log-likelihood. ``progress`` False hides lm-eval's request bars.
    The model comes back unchanged (its mode too)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an int >= 1 or None; got {limit!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1; got {batch_size!r}")
    if not isinstance(tasks, LoadedTasks):
        tasks = load_tasks(tasks)
    _lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    leaves = {task.task_name: task for group in tasks.tasks.values() for task in group}
    with _model_as_given(model):
        lm = _quiet(HFLM if progress else _without_bars(HFLM), pretrained=model, tokenizer=tokenizer,
                    batch_size=batch_size)
        results = _quiet(simple_evaluate, model=lm, tasks=list(leaves.values()), task_manager=tasks.manager,
                         limit=limit, log_samples=details, random_seed=None, numpy_random_seed=None,
                         torch_random_seed=None)
    summary = {name: _summary(name, task, results) for name, task in leaves.items()}
    if details:
        for name in leaves:
            summary[name]["items"] = [{"label": sample["target"],
                                       "loglikelihoods": [float(r[0][0]) for r in sample["resps"]]}
                                      for sample in results["samples"][name]]
    return summary

