"""``pyprune prune``: one method, one pattern, one model; saved, evaluated, reported. Its flags build
a one-stage recipe (:mod:`pyprune.recipes`), run by :func:`pyprune.cli.run.perform` as ``pyprune run``
runs one, and saved beside the model as ``recipe.yaml``."""
from __future__ import annotations

from .commands import SUMMARIES
from . import checks, flags, steps
from .checks import UsageError
from .run import perform
from .. import recipes
from ..patterns import NM

COMMAND = "prune"


def register(sub, method) -> None:
    parser = sub.add_parser(COMMAND, help=SUMMARIES[COMMAND])
    flags.add_model_flags(parser)
    flags.add_method_flag(parser, COMMAND)
    flags.add_pattern_flags(parser)
    flags.add_calibration_flags(parser, COMMAND, method,
                                flags.source_help("calibration text (every method but magnitude)"))
    flags.add_eval_flags(parser)
    parser.add_argument("--output", help="directory for the pruned model (written atomically)")
    flags.add_overwrite_flag(parser)
    parser.add_argument("--sparse-layers", action="store_true",
                        help="with --pattern N:M and --output: store the pruned linears as SparseLinear "
                             "(compressed N:M, 9/16 of the dense bytes for 16-bit 2:4/4:8)")
    parser.add_argument("--offload", action="store_true",
                        help="keep the weights on disk and prune one decoder block at a time (magnitude, wanda, "
                             "sparsegpt, safe, safe+, masked-recon): peak memory about one block plus the calibration "
                             "activations; needs --output, evaluates nothing")
    parser.add_argument("--report", help="JSON report path")
    flags.add_dist_timeout_flag(parser)
    flags.add_zero_shot_flags(parser)
    flags.add_method_flags(parser, COMMAND, method)
    parser.set_defaults(run=run)


def run(args) -> int:
    """Under ``torchrun`` every rank runs this (:func:`steps.in_process_group`): all check, prune and
    evaluate, each its shard of the calibration and evaluation windows; rank 0 alone saves and reports."""
    return steps.in_process_group(args, lambda: _run(args))


def _run(args) -> int:
    pattern = flags.pattern_from(args)
    runner = flags.build_method(args)
    flags.apply_calibration_defaults(args, runner)
    flags.check_pattern(runner, pattern)
    if runner.needs_calibration and args.calib is None:
        raise UsageError(f"method {args.method!r} needs --calib (a calibration text)")
    checks.check_sources(([args.calib] if args.calib is not None else []) + list(args.eval or []))
    checks.check_output(args.output, "--output", args.model, args.overwrite)
    checks.check_report(args.report, args.model, output=args.output)
    if args.sparse_layers and (not isinstance(pattern, NM) or not args.output):
        raise UsageError("--sparse-layers needs --pattern N:M and --output")
    checks.check_counts(args, ("nsamples", "seqlen", "batch_size", "eval_seqlen"), optional=("eval_tokens",))
    if runner.needs_calibration:
        runner.check_samples(args.nsamples)
    if not (args.output or args.report or args.eval or args.tasks):
        raise UsageError("nothing would keep the pruned model or say how it did: give --output, --report, --eval "
                         "or --tasks")
    checks.check_method_directories(runner, args.model)
    checks.check_device(args.device)
    if args.offload:
        checks.check_offload(args, runner)
    config = checks.check_model(args.model)
    checks.check_lengths(args, config, (["seqlen"] if runner.needs_calibration else [])
                         + (["eval_seqlen"] if args.eval else []))
    checks.check_method_config(runner, args, config, pattern)
    checks.check_memory(args, runner, args.offload)
    recipe = recipes.from_prune_args(args, pattern, flags.method_option_values(args))
    tok = steps.tokenizer(args.model)
    calib = steps.calibration(tok, args.calib, args) if runner.needs_calibration else None
    streams = steps.eval_streams(tok, args.eval or [], args.eval_seqlen, args.eval_tokens, "--eval",
                                 "--eval-seqlen")
    perform(recipe, args, [calib], streams, steps.zero_shot_tasks(args))
    return 0
