"""Recipes: one YAML file that describes a whole run — the model, the calibration, one or more
stages (each a pruning method with its pattern and its declared options, or LoRA recovery), the
evaluation and the output — run by ``pyprune run RECIPE`` and :func:`pyprune.run_recipe`.

Every field is declared once (:mod:`pyprune.options`): a method's options by the method (which
also builds the CLI's flags), a LoRA stage's by :class:`pyprune.runtime.recovery.LoraSettings` (as
``pyprune recover``'s flags), the recipe's own sections here with the same ``option(...)``
declarations. :func:`from_dict` checks a recipe completely before any model is loaded; a bad field
is one :class:`RecipeError` line naming its path (``stages[1].options.sparsity: ...``). The CLI's
``pyprune prune`` and ``pyprune recover`` build the same :class:`Recipe` from their flags
(:func:`from_prune_args`, :func:`from_recover_args`), and every directory pyprune saves holds the
recipe that reproduces it (``recipe.yaml``, :mod:`pyprune.io.recipe_file`). docs/recipes.md
describes the format.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from . import methods
from .io.recipe_file import read_recipe
from .options import Option, at_least_one, collect, option
from .patterns import NM, Pattern, Structured, Unstructured, parse
from .runtime import recovery

#: the method name of a LoRA recovery stage (:func:`pyprune.runtime.recovery.lora_finetune`)
RECOVERY = "lora"
#: (nsamples, seqlen) of a LoRA recovery stage's training text by default (``pyprune recover``'s)
RECOVERY_CALIBRATION = (64, 512)
#: the fields of a stage that give its pattern (as the flags of ``pyprune prune``)
PATTERN_FIELDS = ("sparsity", "scope", "pattern", "ratio", "uniform")


class RecipeError(ValueError):
    """A bad recipe field: one line, ``PATH: what is wrong and what is allowed``."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _mapping(value: Any, path: str, allowed: Tuple[str, ...]) -> Mapping[str, Any]:
    """``value`` as a mapping whose keys are all ``allowed`` (None: an empty one)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RecipeError(path or "recipe", f"must be a mapping of fields ({', '.join(allowed)}); got {value!r}")
    for key in value:
        if key not in allowed:
            raise RecipeError(_join(path, str(key)), f"unknown field; {path or 'a recipe'} has {', '.join(allowed)}")
    return value


class Section:
    """A recipe section whose fields are declared as options (``name: type = option(default,
    help, check)``); ``Section(values, path)`` converts and checks each one, naming its path."""

    fields: Tuple[Option, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.fields = collect(cls, cls.fields)

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        return tuple(declared.name for declared in cls.fields)

    def __init__(self, values: Any = None, path: str = "", extra: Tuple[str, ...] = ()):
        values = _mapping(values, path, self.names() + extra)
        self.settings: Dict[str, Any] = {
            declared.name: declared.convert(values.get(declared.name, declared.default), "", "recipe",
                                            where=f"{_join(path, declared.name)}:")
            for declared in self.fields}

    def to_dict(self) -> Dict[str, Any]:
        return {name: _plain(value) for name, value in self.settings.items()}


def _plain(value: Any) -> Any:
    """A value as YAML writes it (a tuple as a list)."""
    return list(value) if isinstance(value, tuple) else value


class Run(Section):
    """The recipe's top-level fields."""

    model: str = option(None, "a Hugging Face model directory, a pyprune output directory or a model alias")
    dtype: str = option("float32", "dtype of the weights and activations", choices=("float32", "bfloat16", "float16"))
    device: str = option("cpu", "torch device")
    batch_size: int = option(8, "calibration and evaluation batch size", at_least_one)


class Calibration(Section):
    """``calibration:`` (and a stage's own ``calibration:``, which overrides it field by field)."""

    data: Optional[str] = option(None, "calibration text: an embedded corpus, a .txt file, a directory, "
                                 "wikitext2/c4/ptb, any of them with :first_half or :second_half")
    nsamples: Optional[int] = option(None, "calibration samples (default: the stage method's)", at_least_one)
    seqlen: Optional[int] = option(None, "calibration sample length (default: the stage method's)", at_least_one)
    seed: int = option(0, "calibration sampling seed")


class Evaluation(Section):
    """``evaluation:``, measured once every stage has run."""

    data: Optional[Tuple[str, ...]] = option(None, "perplexity on these texts (same forms as calibration.data)")
    seqlen: int = option(512, "perplexity window", at_least_one)
    tokens: Optional[int] = option(None, "evaluate the first N tokens of each text only", at_least_one)
    tasks: Optional[Tuple[str, ...]] = option(None, "zero-shot accuracy on these tasks (lm-evaluation-harness)")
    limit: Optional[int] = option(None, "with tasks: the first N items of each task", at_least_one)


class Output(Section):
    """``output:``."""

    path: Optional[str] = option(None, "directory for the model (written atomically, with this recipe)")
    sparse_layers: bool = option(False, "store the pruned linears as SparseLinear (the last pruning stage N:M)")
    offload: bool = option(False, "keep the weights on disk and prune one decoder block at a time")


class PatternFields(Section):
    """A pruning stage's pattern: exactly one of ``sparsity`` (with ``scope``), ``pattern`` (N:M)
    and ``ratio`` (with ``uniform``), as ``pyprune prune``'s flags."""

    sparsity: Optional[float] = option(None, "unstructured sparsity in [0, 1)")
    scope: Optional[str] = option(None, "unstructured selection per output row or per layer", choices=("row", "tensor"))
    pattern: Optional[str] = option(None, "N:M semi-structured pattern, e.g. '2:4' (quoted: YAML reads 2:4 as 124)")
    ratio: Optional[float] = option(None, "structured ratio of heads/channels removed")
    uniform: bool = option(False, "structured: same sizes in every layer")


class LoraOptions(Section):
    """The options of a ``method: lora`` stage: LoRA recovery's declared settings
    (:class:`pyprune.runtime.recovery.LoraSettings`, also ``pyprune recover``'s flags)."""

    fields = recovery.SETTINGS


def pattern_from(values: Mapping[str, Any], spell: Callable[[str], str] = str) -> Pattern:
    """The one pattern given by ``sparsity`` (with ``scope``), ``pattern`` or ``ratio`` (with
    ``uniform``) in ``values``; ValueError otherwise, each field written ``spell(name)`` (the CLI:
    ``--name``)."""
    given = [name for name in ("sparsity", "pattern", "ratio") if values.get(name) is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {spell('sparsity')} S, {spell('pattern')} N:M, {spell('ratio')} R")
    for name, serves in (("scope", "sparsity"), ("uniform", "ratio")):  # never silently ignored
        if values.get(name) and given[0] != serves:
            raise ValueError(f"{spell(name)} applies to {spell(serves)} only; got it with {spell(given[0])}")
    if values.get("sparsity") is not None:
        return Unstructured(values["sparsity"], values.get("scope"))
    if values.get("ratio") is not None:
        if values["ratio"] == 0:
            raise ValueError(f"{spell('ratio')} must be in (0, 1): 0 removes nothing")
        return Structured(values["ratio"], uniform=bool(values.get("uniform")))
    pattern = parse(values["pattern"])
    if not isinstance(pattern, NM):
        raise ValueError(f"{spell('pattern')} takes N:M (e.g. 2:4, 4:8); got {values['pattern']!r}")
    return pattern


def pattern_fields(pattern: Pattern) -> Dict[str, Any]:
    """The stage fields that give ``pattern`` (the inverse of :func:`pattern_from`)."""
    if isinstance(pattern, NM):
        return {"pattern": f"{pattern.n}:{pattern.m}"}
    if isinstance(pattern, Structured):
        return {"ratio": pattern.ratio, **({"uniform": True} if pattern.uniform else {})}
    return {"sparsity": pattern.sparsity, **({"scope": pattern.scope} if pattern.scope else {})}


@dataclass
class Stage:
    """One stage: a pruning ``method`` with its ``pattern`` and its resolved ``options`` (every
    declared one), or LoRA recovery (``method`` ``lora``, ``pattern`` None); ``calibration`` holds
    the resolved ``data``, ``nsamples``, ``seqlen`` and ``seed`` of its text, and ``origin`` the
    recipe path each calibration field came from (for errors found later, e.g. a missing file)."""

    method: str
    options: Dict[str, Any]
    calibration: Dict[str, Any]
    pattern: Optional[Pattern] = None
    origin: Dict[str, str] = field(default_factory=dict)

    @property
    def recovers(self) -> bool:
        return self.method == RECOVERY

    def runner(self):
        """The pruning method object (None for a recovery stage)."""
        return None if self.recovers else methods.get(self.method, **self.options)

    @property
    def needs_calibration(self) -> bool:
        return self.recovers or self.runner().needs_calibration

    def to_dict(self) -> Dict[str, Any]:
        described = {"method": self.method, **(pattern_fields(self.pattern) if self.pattern is not None else {})}
        calibration = dict(self.calibration, data=_absolute(self.calibration["data"]))
        return dict(described, options={name: _plain(value) for name, value in self.options.items()},
                    calibration=calibration if self.needs_calibration else {})


@dataclass
class Recipe:
    """A checked recipe (:func:`from_dict`); :meth:`to_dict` is the YAML that reproduces it."""

    run: Run
    calibration: Calibration
    stages: List[Stage]
    evaluation: Evaluation
    output: Output

    @property
    def model(self) -> str:
        return self.run.model

    def to_dict(self, output: Optional[str] = None) -> Dict[str, Any]:
        """The recipe as plain data: every stage's options and calibration resolved, paths
        absolute, ``output.path`` the directory written (``output``, when given)."""
        evaluation = self.evaluation.to_dict()
        if evaluation["data"] is not None:
            evaluation["data"] = [_absolute(source) for source in evaluation["data"]]
        out = self.output.to_dict()
        path = output if output is not None else out["path"]
        out["path"] = os.path.abspath(path) if path is not None else None
        run = self.run.to_dict()
        run["model"] = os.path.abspath(run["model"]) if os.path.isdir(run["model"]) else run["model"]
        return {**run, "stages": [stage.to_dict() for stage in self.stages], "evaluation": evaluation, "output": out}


def _absolute(source: Optional[str]) -> Optional[str]:
    """A text source that names a file or directory here, made absolute (a ``:first_half`` /
    ``:second_half`` suffix kept), so the saved recipe runs from any directory."""
    if source is None:
        return None
    base, colon, half = source.rpartition(":")
    base, suffix = (base, colon + half) if colon and half in ("first_half", "second_half") else (source, "")
    return os.path.abspath(os.path.expanduser(base)) + suffix if os.path.exists(os.path.expanduser(base)) else source


TOP_LEVEL = Run.names() + ("calibration", "stages", "evaluation", "output")
STAGE_FIELDS = ("method",) + PATTERN_FIELDS + ("options", "calibration")


def from_dict(data: Any) -> Recipe:
    """The checked :class:`Recipe` of ``data`` (a parsed recipe); the first bad field is a
    :class:`RecipeError` naming its path. Reads no model and no text: that is for the run."""
    data = _mapping(data, "", TOP_LEVEL)
    run = Run(data, "", extra=TOP_LEVEL[len(Run.names()):])
    calibration = Calibration(data.get("calibration"), "calibration")
    given = data.get("stages")
    if not isinstance(given, list) or not given:
        raise RecipeError("stages", f"must be a non-empty list of stages (each with a method); got {given!r}")
    stages = [_stage(value, f"stages[{index}]", calibration) for index, value in enumerate(given)]
    return Recipe(run, calibration, stages, Evaluation(data.get("evaluation"), "evaluation"),
                  Output(data.get("output"), "output"))


def _stage(value: Any, path: str, calibration: Calibration) -> Stage:
    value = _mapping(value, path, STAGE_FIELDS)
    name = value.get("method")
    known = methods.serving("prune") + [RECOVERY]
    if name not in known:
        raise RecipeError(_join(path, "method"), f"must be one of {', '.join(known)}; got {name!r}")
    own = Calibration(value.get("calibration"), _join(path, "calibration"))
    overridden = set(value.get("calibration") or ())  # the fields the stage gives itself
    origin = {key: _join(_join(path, "calibration") if key in overridden else "calibration", key)
              for key in Calibration.names()}
    settings = {key: (own if key in overridden else calibration).settings[key] for key in Calibration.names()}
    if name == RECOVERY:
        stage = _recovery_stage(value, path, settings)
    else:
        stage = _pruning_stage(name, value, path, settings)
    stage.origin = origin
    if stage.needs_calibration and stage.calibration["data"] is None:
        raise RecipeError(path, f"method {name!r} needs a calibration text: give calibration.data "
                          f"(or {path}.calibration.data)")
    return stage


def _recovery_stage(value: Mapping[str, Any], path: str, calibration: Dict[str, Any]) -> Stage:
    for name in PATTERN_FIELDS:
        if value.get(name) is not None:
            raise RecipeError(_join(path, name), "a lora stage takes no pattern: it keeps the pruned weights' zeros")
    options = LoraOptions(value.get("options"), _join(path, "options")).settings
    nsamples, seqlen = (calibration[key] if calibration[key] is not None else default
                        for key, default in zip(("nsamples", "seqlen"), RECOVERY_CALIBRATION))
    if seqlen < 2:
        raise RecipeError(_join(path, "calibration.seqlen"), f"must be >= 2 for lora (next-token loss); got {seqlen}")
    if options["batch_size"] > nsamples:
        raise RecipeError(_join(path, "options.batch_size"), f"{options['batch_size']} is larger than the stage's "
                          f"calibration nsamples {nsamples}")
    return Stage(RECOVERY, options, dict(calibration, nsamples=nsamples, seqlen=seqlen))


def _pruning_stage(name: str, value: Mapping[str, Any], path: str, calibration: Dict[str, Any]) -> Stage:
    cls = methods.METHODS[name]
    if isinstance(value.get("pattern"), int):
        raise RecipeError(_join(path, "pattern"), f"write N:M in quotes (pattern: '2:4'): YAML reads 2:4 unquoted "
                          f"as the number {value['pattern']}")
    fields = PatternFields({key: value[key] for key in PATTERN_FIELDS if key in value}, path).settings
    try:
        pattern = pattern_from(fields, lambda field_name: field_name)
    except ValueError as error:
        raise RecipeError(path, str(error)) from None
    given = value.get("options")
    if given is not None and not isinstance(given, Mapping):
        raise RecipeError(_join(path, "options"), f"must be a mapping of method {name!r}'s options; got {given!r}")
    given = given or {}
    declared_names = [declared.name for declared in cls.options]
    unknown = [key for key in given if key not in declared_names]
    if unknown:
        raise RecipeError(_join(path, f"options.{unknown[0]}"), f"method {name!r} has no option {unknown[0]}; its "
                          f"options: {', '.join(declared_names) or 'none'}")
    options = {declared.name: declared.convert(given.get(declared.name, declared.default), name,
                                               where=f"{_join(path, 'options.' + declared.name)}:")
               for declared in cls.options}
    try:
        runner = cls(**options)
    except ValueError as error:  # the constraints between options (Method.check_options)
        raise RecipeError(_join(path, "options"), str(error)) from None
    try:
        runner.check_pattern(pattern, _written)
    except ValueError as error:
        raise RecipeError(path, str(error)) from None
    defaults = dict(zip(("nsamples", "seqlen"), runner.calibration))
    resolved = {key: calibration[key] if calibration[key] is not None else defaults[key] for key in defaults}
    return Stage(name, options, dict(calibration, **resolved), pattern)


def _written(kinds, like: Pattern) -> str:
    """The stage fields that give a pattern of ``kinds`` (with the amount of ``like``)."""
    amount = f"{getattr(like, 'sparsity', getattr(like, 'ratio', 0.5)):g}"
    spelled = {Unstructured: f"sparsity: {amount}", NM: "pattern: '2:4'", Structured: f"ratio: {amount}"}
    return " or ".join(spelled[kind] for kind in kinds)


def load(recipe: Any) -> Recipe:
    """The checked :class:`Recipe` of a recipe file (or a directory holding ``recipe.yaml``), a
    dict, or a :class:`Recipe` itself."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, (str, os.PathLike)):
        return from_dict(read_recipe(recipe))
    return from_dict(recipe)


def from_prune_args(args, pattern: Pattern, options: Dict[str, Any]) -> Recipe:
    """The recipe of a ``pyprune prune`` command line (its flags, ``pattern`` and the method's
    ``options`` given there, already checked)."""
    return from_dict({
        "model": args.model, "dtype": args.dtype, "device": args.device, "batch_size": args.batch_size,
        "calibration": {"data": args.calib, "nsamples": args.nsamples, "seqlen": args.seqlen, "seed": args.seed},
        "stages": [{"method": args.method, **pattern_fields(pattern), "options": options}],
        "evaluation": {"data": args.eval or None, "seqlen": args.eval_seqlen, "tokens": args.eval_tokens,
                       "tasks": [name.strip() for name in args.tasks.split(",")] if args.tasks else None,
                       "limit": args.limit},
        "output": {"path": args.output, "sparse_layers": args.sparse_layers, "offload": args.offload}})


def from_recover_args(args, settings: Dict[str, Any]) -> Recipe:
    """The recipe of a ``pyprune recover`` command line (its flags already checked; ``settings``, its LoRA
    settings, :func:`pyprune.runtime.recovery.check_settings`)."""
    return from_dict({
        "model": args.model, "dtype": args.dtype, "device": args.device, "batch_size": args.batch_size,
        "calibration": {"data": args.calib, "nsamples": args.nsamples, "seqlen": args.seqlen, "seed": args.seed},
        "stages": [{"method": RECOVERY, "options": settings}],
        "evaluation": {"data": args.eval or None, "seqlen": args.eval_seqlen, "tokens": args.eval_tokens},
        "output": {"path": args.output}})


__all__ = ["Recipe", "RecipeError", "Stage", "from_dict", "load", "from_prune_args", "from_recover_args",
           "pattern_from", "pattern_fields", "RECOVERY"]
