"""``pyprune prune``: one method, one pattern, one model; saved, evaluated, reported."""
from __future__ import annotations

import shutil

from .commands import SUMMARIES
from . import checks, flags, steps
from .checks import UsageError
from ..files import make_temp_dir
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
    tok = steps.tokenizer(args.model)
    calib = steps.calibration(tok, args.calib, args) if runner.needs_calibration else None
    streams = steps.eval_streams(tok, args.eval or [], args.eval_seqlen, args.eval_tokens, "--eval",
                                 "--eval-seqlen")
    tasks = steps.zero_shot_tasks(args)

    offload_dir = make_temp_dir(args.output) if args.offload else None
    try:
        _prune(args, pattern, calib, streams, tasks, offload_dir)
    finally:
        if offload_dir is not None:
            shutil.rmtree(offload_dir, ignore_errors=True)
    return 0


def _prune(args, pattern, calib, streams, tasks, offload_dir) -> None:
    """Load (blocks on disk in ``offload_dir`` when given), prune, save, evaluate, report."""
    from ..methods import pruning
    model, tok = steps.load(args, offload_dir=offload_dir, dense=True)
    report = pruning.prune(model, args.method, pattern, calib, batch_size=args.batch_size,
                           progress=not args.quiet, **flags.method_option_values(args))
    print(f"{args.method} {pattern}: measured sparsity {report['sparsity']:.4f} in {report['time_s']:.1f} s")
    left = report["left_dense"]["tensors"]
    if left:
        print(f"left dense: {len(left)} block matrices ({report['left_dense']['parameters']:,} parameters, "
              f"e.g. {left[0]}), not in that sparsity")
    # the calibration settings a run used; a method without calibration (magnitude) records none
    used = {"nsamples": args.nsamples, "seqlen": args.seqlen, "seed": args.seed} if calib is not None else {}
    report.update({"model": args.model, "calib": args.calib, **used, "offload": args.offload, **steps.run_info(args)})
    if args.sparse_layers:
        from ..nn import sparsify_
        report["sparse_layers"] = len(sparsify_(model, pattern))
        print(f"stored {report['sparse_layers']} layers as SparseLinear {pattern}")

    def evaluate_into(report: dict) -> bool:
        report["eval"] = steps.evaluate(model, streams, args.eval_seqlen, args.batch_size, not args.quiet, tok)
        if tasks is not None:
            report["tasks"] = steps.zero_shot(model, tok, tasks, args)
        return bool(report["eval"]) or tasks is not None

    steps.save_evaluate_report(model, tok, args, report, evaluate_into, "pruned model")
