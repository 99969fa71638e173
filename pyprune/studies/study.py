"""A study, declared: its settings and arms are typed options, one runner runs it.

A study is a subclass of :class:`Study` that names itself, declares its settings with
:func:`pyprune.methods.options.option` (the methods' machinery: ``seeds: Tuple[int, ...] =
option((0, 1, 2), "calibration seeds")``; a ``Tuple[type, ...]`` is an arm list) and defines what
one arm computes and how its table reads. :func:`run` does the rest, the same way for every study:

1. the settings are converted and checked when the study is built (an error names the option
   and what it allows), :meth:`Study.check_options` adds the constraints between them;
2. the results file must be a place pyprune can write (:func:`pyprune.files.check_destination`);
3. :meth:`Study.prepare` loads what the arms share (model, data; files beside the results);
4. a resumable study reads the results file back through
   :func:`pyprune.runtime.checkpoint.read_results`, keyed by :meth:`Study.protocol` (the file's
   ``"settings"``): a file of other settings is refused, naming what differs, never overwritten;
5. every arm of :meth:`Study.arms` not yet done runs (:meth:`Study.run_arm`) and, after each,
   the results are rewritten (:func:`pyprune.studies.results.write`, JSON and markdown, atomic),
   merged under a lock with the rows a concurrent run of the same settings wrote meanwhile. The
   arms are asked for one at a time, each after the rows before it are recorded in
   :attr:`Study.current`, so a later arm may depend on earlier rows (a setting tuned on them).

A stopped study resumes by running the same command again.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import shlex
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Hashable, Iterable, Optional, Tuple

from ..files import check_destination, locked
from ..methods.options import Option, collect, resolve
from ..runtime.checkpoint import read_results
from .results import write as write_results

#: where the results files of the studies live, relative to the repository root
RESULTS_DIR = os.path.join("benchmarks", "results")
#: how a results file names the model when its settings name none (the studies' default model)
DEFAULT_MODEL_NAME = "SmolLM2-135M"


def model_label(settings: dict) -> str:
    """The model a results file's ``settings`` were run on, for its title: the ``model`` they
    record (studies record it when it is not the default), else :data:`DEFAULT_MODEL_NAME`."""
    return settings.get("model", DEFAULT_MODEL_NAME)


@dataclass(frozen=True)
class Arm:
    """One arm of a study: ``key`` identifies the row it makes (as :meth:`Study.row_key` reads the
    row), ``label`` is what the progress line prints, ``spec`` what :meth:`Study.run_arm` needs."""

    key: Hashable
    label: str
    spec: Any = None


def arm_saves(stem: str, arm: Arm) -> str:
    """Where ``arm`` keeps what a stopped run of it resumes from (training or block checkpoints):
    a directory of its own, named by its key, in STEM.checkpoints/ beside the results file
    STEM.json; the arm removes it once its row is written."""
    return os.path.join(f"{stem}.checkpoints", hashlib.sha256(repr(arm.key).encode()).hexdigest()[:12])


def remove_arm_saves(saves: str) -> None:
    """Remove the directory :func:`arm_saves` named, once the arm's row is written, and STEM.checkpoints/
    with it when no other arm keeps anything there."""
    shutil.rmtree(saves, ignore_errors=True)
    with contextlib.suppress(OSError):  # not empty: another arm's saves stay
        os.rmdir(os.path.dirname(saves))


class Study:
    """Base of the declared studies; see the module docstring. Subclasses set :attr:`name`,
    :attr:`summary` and :attr:`results`, declare their options and define :meth:`protocol`,
    :meth:`arms`, :meth:`row_key`, :meth:`run_arm` and :meth:`markdown`."""

    #: the study's name (``pyprune study NAME``, ``pyprune.studies.run(NAME)``)
    name: ClassVar[str] = ""
    #: one line for ``pyprune study --help``
    summary: ClassVar[str] = ""
    #: the default results file's name in :data:`RESULTS_DIR` (without ``.json``); "" = none
    results: ClassVar[str] = ""
    #: the key of the result's list of rows
    row_list: ClassVar[str] = "rows"
    #: False: the result is rebuilt and replaced by every run (nothing to resume)
    resumes: ClassVar[bool] = True
    #: what the option errors call it
    kind: ClassVar[str] = "study"
    #: the declared options, collected from the class body (as a method's)
    options: ClassVar[Tuple[Option, ...]] = ()
    #: the result as it stands while :func:`run` runs the arms (None before): the rows of the arms
    #: run or resumed so far, which :meth:`arms` may read to derive its later arms
    current: Optional[dict] = None
    #: whether the arms draw progress bars (set by :func:`run`; ``pyprune study --quiet`` turns them off)
    progress: bool = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.options = collect(cls, cls.options)

    def __init__(self, **settings: Any):
        self.settings: Dict[str, Any] = resolve(self.options, settings, self.name, self.kind)
        self.check_options()

    # -- what a study may refine ---------------------------------------------------------------

    def check_options(self) -> None:
        """Constraints between options: ValueError naming them (nothing is loaded yet)."""

    def output_path(self, output: Optional[str]) -> str:
        """The JSON results file: ``output``, or :attr:`results` in :data:`RESULTS_DIR`."""
        if output is not None:
            return os.fspath(output)
        if not self.results:
            raise ValueError(f"study {self.name!r} has no default results file; give output (--output FILE.json)")
        return os.path.join(RESULTS_DIR, f"{self.results}.json")

    def prepare(self, path: str) -> Any:
        """What every arm shares (model, tokenizer, data), loaded once after the checks; ``path``
        is the results file (a study may keep more files beside it)."""
        return None

    def protocol(self, context: Any) -> dict:
        """The results file's ``"settings"``: what every row of the file shares (its resume key)."""
        raise NotImplementedError

    def start(self, settings: dict, context: Any) -> dict:
        """The result before any arm ran."""
        return {"settings": settings, self.row_list: []}

    def arms(self, context: Any) -> Iterable[Arm]:
        raise NotImplementedError

    def row_key(self, row: dict) -> Hashable:
        """The key of the arm that made ``row``."""
        raise NotImplementedError

    def finished(self, row: dict) -> bool:
        """Whether a stored row is complete (a partial one is handed to its arm to go on)."""
        return True

    def done(self, result: dict, arm: Arm) -> bool:
        """Whether ``arm`` has run already: a finished row of its key is in ``result``."""
        row = self.find(result, arm.key)
        return row is not None and self.finished(row)

    def run_arm(self, context: Any, arm: Arm, row: Optional[dict], checkpoint: Callable[[dict], None]) -> Optional[dict]:
        """Run ``arm``: its row (None when it is not complete yet). ``row`` is its stored partial
        row, if any; ``checkpoint(row)`` records and writes a partial row mid-arm."""
        raise NotImplementedError

    def record(self, result: dict, arm: Arm, row: dict) -> None:
        """Put ``arm``'s ``row`` into ``result``, in place of its earlier (partial) row."""
        rows = result[self.row_list]
        index = next((i for i, stored in enumerate(rows) if self.row_key(stored) == arm.key), None)
        if index is None:
            rows.append(row)
        else:
            rows[index] = row

    def merge(self, result: dict, on_disk: dict) -> None:
        """Add to ``result`` (in place) what a concurrent run of the same settings wrote to the
        results file meanwhile (``on_disk``): its rows of keys ``result`` lacks."""
        have = {self.row_key(row) for row in result[self.row_list]}
        result[self.row_list].extend(row for row in on_disk.get(self.row_list, []) if self.row_key(row) not in have)

    def complete(self, result: dict, context: Any) -> dict:
        """``result`` as written: derived entries (the environment, summaries) filled in."""
        return result

    def markdown(self, result: dict) -> str:
        raise NotImplementedError

    def describe(self, row: dict) -> str:
        """One line of an arm's row for the progress output ("" for none)."""
        return ""

    # -- shared --------------------------------------------------------------------------------

    def find(self, result: dict, key: Hashable) -> Optional[dict]:
        return next((row for row in result[self.row_list] if self.row_key(row) == key), None)

    def command(self) -> str:
        """The ``pyprune study`` command of these settings (those that differ from the defaults)."""
        words = ["pyprune", "study", self.name]
        for declared in self.options:
            value = self.settings[declared.name]
            if value == declared.default or (declared.many and declared.default is not None
                                             and value == tuple(declared.default)):
                continue
            words.append(declared.flag)
            values = value if declared.many else (value,)
            words += [str(v).lower() if isinstance(v, bool) else str(v) for v in values]
        return shlex.join(words)


def run(study: Study, output: Optional[str] = None, progress: bool = True) -> dict:
    """Run ``study`` into ``output`` (its default results file if None), resuming what a stopped
    run of the same settings left, its arms' progress bars shown when ``progress``; returns the
    result as written. See the module docstring."""
    study.progress = progress
    path = study.output_path(output)
    check_destination(path, "the results file")
    context = study.prepare(path)
    settings = study.protocol(context)
    stored = read_results(path, settings) if study.resumes else None
    result = stored if stored is not None else study.start(settings, context)
    study.current = result
    written: list = []

    def write() -> None:
        with locked(path):
            if study.resumes:
                on_disk = read_results(path, settings)
                if on_disk is not None:
                    study.merge(result, on_disk)
            written[:] = [study.complete(result, context)]
            write_results(path, written[0], study.markdown)

    for arm in study.arms(context):
        if study.done(result, arm):
            continue

        def checkpoint(row: dict, arm: Arm = arm) -> None:
            study.record(result, arm, row)
            write()

        row = study.run_arm(context, arm, study.find(result, arm.key), checkpoint)
        if row is not None:
            checkpoint(row)
            print(f"{study.name}: {arm.label}: {study.describe(row) or 'done'}", flush=True)
    if not written:
        if stored is not None:
            return stored  # every arm had run: the file stays as it is
        write()  # a study without arms (a summary) writes its result once
    return written[0]
