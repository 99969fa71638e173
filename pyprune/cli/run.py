"""``pyprune run RECIPE``: a whole run described by a recipe (:mod:`pyprune.recipes`), checked
completely before the model loads; and :func:`perform`, the run itself, which ``pyprune prune``
shares (it builds the same recipe from its flags).

    pyprune run recipe.yaml                        # the recipe's output.path
    pyprune run pruned/ --output again/            # a saved directory's recipe.yaml, elsewhere
"""
from __future__ import annotations

import shutil
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

from .commands import SUMMARIES
from . import checks, flags, steps
from .checks import UsageError
from .. import recipes
from ..files import make_temp_dir
from ..patterns import NM, Structured

COMMAND = "run"


def register(sub, method) -> None:
    parser = sub.add_parser(COMMAND, help=SUMMARIES[COMMAND])
    parser.add_argument("recipe", help="a recipe YAML file (docs/recipes.md), or a directory pyprune saved (its "
                        "recipe.yaml reproduces it)")
    parser.add_argument("--output", help="directory for the model instead of the recipe's output.path")
    flags.add_overwrite_flag(parser)
    parser.add_argument("--report", help="JSON report path")
    flags.add_dist_timeout_flag(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    recipe = recipes.load(args.recipe)
    execute(recipe, output=args.output, overwrite=args.overwrite, report=args.report, quiet=args.quiet,
            dist_timeout=args.dist_timeout)
    return 0


def run_recipe(recipe: Any, *, output: Optional[str] = None, overwrite: bool = False, report: Optional[str] = None,
               quiet: bool = False) -> Dict[str, Any]:
    """Run ``recipe`` (a YAML file, a directory pyprune saved, a dict or a
    :class:`~pyprune.recipes.Recipe`): check it and every file it names before the model loads
    (a bad field: :class:`~pyprune.recipes.RecipeError` naming its path; a bad file or setting:
    :class:`~pyprune.cli.UsageError`), run its stages, save to ``output`` (default: its
    ``output.path``) with the recipe as ``recipe.yaml``, evaluate; returns the report."""
    return execute(recipes.load(recipe), output=output, overwrite=overwrite, report=report, quiet=quiet)


def execute(recipe: recipes.Recipe, *, output: Optional[str], overwrite: bool, report: Optional[str],
            quiet: bool, dist_timeout: Optional[float] = None) -> Dict[str, Any]:
    """Check, prepare the texts, then :func:`perform` ``recipe``; under ``torchrun`` on every rank
    (:func:`steps.in_process_group`), rank 0 alone writes."""
    args = _arguments(recipe, output, overwrite, report, quiet)
    args.dist_timeout = dist_timeout
    return steps.in_process_group(args, lambda: _execute(recipe, args))


def _execute(recipe: recipes.Recipe, args) -> Dict[str, Any]:
    check(recipe, args)
    tok = steps.tokenizer(args.model)
    calibs = [steps.calibration(tok, stage.calibration["data"], SimpleNamespace(**stage.calibration),
                                stage.origin["data"]) if stage.needs_calibration else None for stage in recipe.stages]
    streams = steps.eval_streams(tok, args.eval, args.eval_seqlen, args.eval_tokens, "evaluation.data",
                                 "evaluation.seqlen")
    return perform(recipe, args, calibs, streams, _at("evaluation", lambda: steps.zero_shot_tasks(args)))


def _arguments(recipe: recipes.Recipe, output: Optional[str], overwrite: bool, report: Optional[str],
               quiet: bool) -> SimpleNamespace:
    """The run's settings under the names the CLI's steps read (a subcommand's ``args``)."""
    evaluation, out = recipe.evaluation.settings, recipe.output.settings
    pruning = [stage for stage in recipe.stages if not stage.recovers]
    return SimpleNamespace(
        command=COMMAND, **recipe.run.settings, quiet=quiet, overwrite=overwrite, report=report,
        output=output if output is not None else out["path"], sparse_layers=out["sparse_layers"],
        offload=out["offload"], eval=list(evaluation["data"] or []), eval_seqlen=evaluation["seqlen"],
        eval_tokens=evaluation["tokens"], tasks=",".join(evaluation["tasks"]) if evaluation["tasks"] else None,
        limit=evaluation["limit"], method=pruning[-1].method if pruning else recipes.RECOVERY)


def _at(path: str, check):
    """``check()``, its UsageError, ValueError or FileNotFoundError prefixed with the recipe ``path``
    it concerns."""
    try:
        return check()
    except (UsageError, ValueError, FileNotFoundError) as error:
        raise UsageError(f"{path}: {error}") from None


def check(recipe: recipes.Recipe, args) -> None:
    """What the recipe's fields alone cannot tell (:func:`pyprune.recipes.from_dict` checked
    those): the texts and files it names, the output, the device, the model's config and length,
    each method against the model's structure, and the memory; all before the model loads."""
    output_path = "--output" if args.output is not None and args.output != recipe.output.settings["path"] \
        else "output.path"
    for stage in recipe.stages:
        if stage.needs_calibration:
            _at(stage.origin["data"], lambda: checks.check_sources([stage.calibration["data"]]))
    _at("evaluation.data", lambda: checks.check_sources(args.eval))
    checks.check_output(args.output, output_path, args.model, args.overwrite)
    checks.check_report(args.report, args.model, output=args.output)
    if not (args.output or args.report or args.eval or args.tasks):
        raise UsageError("output.path: nothing would keep the model or say how it did: give output.path (or "
                         "--output), --report, evaluation.data or evaluation.tasks")
    pruning = [(index, stage) for index, stage in enumerate(recipe.stages) if not stage.recovers]
    if args.sparse_layers and (not pruning or not isinstance(pruning[-1][1].pattern, NM) or not args.output):
        raise UsageError("output.sparse_layers: needs a last pruning stage with pattern N:M, and output.path")
    _at("device", lambda: checks.check_device(args.device))
    config = _at("model", lambda: checks.check_model(args.model))
    _check_lengths(recipe, config)
    for index, stage in enumerate(recipe.stages):
        where = f"stages[{index}]"
        runner = stage.runner()
        if args.offload:
            if runner is None:
                raise UsageError(f"output.offload: {where} (lora) trains the whole model at once; it cannot run "
                                 "offloaded")
            _at("output.offload", lambda: checks.check_offload(_namespace(args, stage), runner))
        if runner is None:  # a LoRA stage
            from ..runtime import recovery
            _at(where, lambda: recovery.check_group(stage.options.get("shard_training", False)))
            continue
        if runner.needs_calibration:
            runner.check_samples(stage.calibration["nsamples"])
        _at(where, lambda: checks.check_method_directories(runner, args.model))
        if not _reshaped(recipe.stages[:index]):  # a stage after a structured one meets its shapes at run time
            _at(where, lambda: checks.check_method_config(runner, args, config, stage.pattern))
            _at(where, lambda: checks.check_memory(_namespace(args, stage), runner, args.offload))


def _namespace(args, stage: recipes.Stage) -> SimpleNamespace:
    """``args`` with ``stage``'s method and calibration sizes (what the CLI's checks read)."""
    return SimpleNamespace(**dict(vars(args), method=stage.method, nsamples=stage.calibration["nsamples"],
                                  seqlen=stage.calibration["seqlen"]))


def _reshaped(stages: List[recipes.Stage]) -> bool:
    """Whether any of ``stages`` changes the model's shapes (a structured pattern)."""
    return any(isinstance(stage.pattern, Structured) for stage in stages)


def _check_lengths(recipe: recipes.Recipe, config) -> None:
    """Every window the recipe asks for is within the model's ``max_position_embeddings``."""
    from ..runtime.tokens import position_limit
    limit = position_limit(config)
    lengths = [(stage.origin["seqlen"], stage.calibration["seqlen"]) for stage in recipe.stages
               if stage.needs_calibration]
    if recipe.evaluation.settings["data"]:
        lengths.append(("evaluation.seqlen", recipe.evaluation.settings["seqlen"]))
    for path, value in lengths:
        if limit is not None and value > limit:
            raise UsageError(f"{path}: {value} is longer than the model's {limit} positions "
                             f"(max_position_embeddings of {recipe.model})")


def perform(recipe: recipes.Recipe, args, calibs: list, streams: list, tasks) -> dict:
    """Load the model (with output.offload, its blocks on disk in a temporary directory beside the
    output, removed at the end), run every stage on its
    calibration tokens in ``calibs``, then save (with the recipe), evaluate and report
    (:func:`pyprune.cli.steps.save_evaluate_report`). Under ``torchrun`` every rank prunes, rank 0
    alone saves. The report is the last pruning stage's, with ``recovery`` of a LoRA stage and,
    for several stages, each one's in ``stages``."""
    steps.checks_passed(args)  # before the offload directory is made
    offload_dir = make_temp_dir(args.output) if args.offload else None
    try:
        return _perform(recipe, args, calibs, streams, tasks, offload_dir)
    finally:
        if offload_dir is not None:
            shutil.rmtree(offload_dir, ignore_errors=True)


def _perform(recipe: recipes.Recipe, args, calibs: list, streams: list, tasks, offload_dir: Optional[str]) -> dict:
    model, tok = steps.load(args, offload_dir=offload_dir, dense=True)
    report: Dict[str, Any] = {}
    done = []
    for stage, calib in zip(recipe.stages, calibs):
        result = _recover(model, stage, calib, args) if stage.recovers else _prune(model, stage, calib, args)
        done.append(result)
        report = dict(report, recovery=result["recovery"]) if stage.recovers else dict(result)
    last = recipe.stages[-1]
    if len(done) > 1:
        report["stages"] = done
    report.update({"model": args.model, "calib": last.calibration["data"], **_calibration_used(last, calibs[-1]),
                   **({} if last.recovers else {"offload": args.offload}), **steps.run_info(args)})
    if args.sparse_layers:
        from ..nn import sparsify_
        pattern = [stage.pattern for stage in recipe.stages if not stage.recovers][-1]
        report["sparse_layers"] = len(sparsify_(model, pattern))
        print(f"stored {report['sparse_layers']} layers as SparseLinear {pattern}")

    def evaluate_into(report: dict) -> bool:
        report["eval"] = steps.evaluate(model, streams, args.eval_seqlen, args.batch_size, not args.quiet, tok)
        if tasks is not None:
            report["tasks"] = steps.zero_shot(model, tok, tasks, args)
        return bool(report["eval"]) or tasks is not None

    steps.save_evaluate_report(model, tok, args, report, evaluate_into,
                               "recovered model" if last.recovers else "pruned model",
                               recipe=recipe.to_dict(output=args.output))
    return report


def _calibration_used(stage: recipes.Stage, calib) -> dict:
    """The calibration settings a stage used; one without calibration (magnitude) records none."""
    return {key: stage.calibration[key] for key in ("nsamples", "seqlen", "seed")} if calib is not None else {}


def _prune(model, stage: recipes.Stage, calib, args) -> dict:
    from ..methods import pruning
    report = pruning.prune(model, stage.method, stage.pattern, calib, batch_size=args.batch_size,
                           progress=not args.quiet, **stage.options)
    print(f"{stage.method} {stage.pattern}: measured sparsity {report['sparsity']:.4f} in {report['time_s']:.1f} s")
    left = report["left_dense"]["tensors"]
    if left:
        print(f"left dense: {len(left)} block matrices ({report['left_dense']['parameters']:,} parameters, "
              f"e.g. {left[0]}), not in that sparsity")
    return report


def _recover(model, stage: recipes.Stage, calib, args) -> dict:
    from ..runtime import recovery
    done = recovery.lora_finetune(model, calib, **stage.options, seed=stage.calibration["seed"],
                                  progress=not args.quiet)
    steps.print_recovery(done)
    return {"method": recipes.RECOVERY, "recovery": done}
