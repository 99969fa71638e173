"""``pyprune continual``: COPAL's continual setting: prune on datasets one after another, evaluate
all after each (:mod:`pyprune.studies.continual`); the report is rewritten after every order and resumed."""
from __future__ import annotations

from .commands import SUMMARIES
from ..inputs import data
from . import checks, flags, steps
from .checks import UsageError

COMMAND = "continual"


def register(sub, method) -> None:
    parser = sub.add_parser(COMMAND, help=SUMMARIES[COMMAND])
    flags.add_model_flags(parser)
    flags.add_method_flag(parser, COMMAND)
    flags.add_pattern_flags(parser, structured=False)
    parser.add_argument("--datasets", nargs="+", required=True,
                        help="the sequence of texts (as --calib of prune); without --eval the first half of each "
                             "calibrates and the second half evaluates")
    flags.add_eval_flags(parser, nargs="+", eval_help="one evaluation text per dataset")
    flags.add_calibration_flags(parser, COMMAND, method, None,
                                nsamples_help="calibration samples per dataset")
    parser.add_argument("--permutations", choices=["given", "all"], default="given",
                        help="run the given order, or every order of the datasets")
    parser.add_argument("--init", choices=["global", "sequential", "cumulative"], default="global",
                        help="baselines: re-prune the dense model on each dataset (global), prune the "
                             "already-pruned model (sequential), or prune the dense model from statistics summed "
                             "over the datasets so far (cumulative: wanda, sparsegpt); COPAL keeps its own "
                             "continual state")
    parser.add_argument("--report", required=True, help="JSON report (rewritten after every order; an existing "
                        "report of the same settings is resumed)")
    flags.add_method_flags(parser, COMMAND, method)
    flags.add_dist_timeout_flag(parser)
    parser.set_defaults(run=run)


def _sources(args):
    """(calibration source, evaluation source) per dataset: --eval when given, else the second
    half of each text (the first half calibrates); hub datasets use their own calib/eval splits."""
    if args.eval is not None and len(args.eval) != len(args.datasets):
        raise UsageError(f"--eval needs one text per dataset ({len(args.datasets)}); got {len(args.eval)}")
    pairs = []
    for index, source in enumerate(args.datasets):
        if args.eval is not None:
            pairs.append((source, args.eval[index]))
        elif source.strip().lower() in data.KNOWN_DATASETS:
            pairs.append((source, source))
        elif source.endswith((":first_half", ":second_half")):
            raise UsageError(f"--datasets {source} names a half already: give --eval texts for it")
        else:
            pairs.append((f"{source}:first_half", f"{source}:second_half"))
    checks.check_sources(source for pair in pairs for source in pair)
    return pairs


def run(args) -> int:
    """Under ``torchrun`` every rank runs this (:func:`steps.in_process_group`); rank 0 alone writes."""
    return steps.in_process_group(args, lambda: _run(args))


def _run(args) -> int:
    from ..runtime import distributed
    from ..studies import continual
    pattern = flags.pattern_from(args)
    runner = flags.build_method(args)
    flags.check_pattern(runner, pattern)
    if args.init == "cumulative" and (runner.keeps_state or not getattr(runner, "can_accumulate", False)):
        raise UsageError(f"--init cumulative needs a method whose statistics add up across datasets (wanda, "
                         f"sparsegpt); got --method {args.method!r}")
    try:
        runner.check_continual()
    except ValueError as error:
        raise UsageError(str(error)) from None
    if len(set(args.datasets)) != len(args.datasets) or len(args.datasets) < 2:
        raise UsageError(f"--datasets needs two or more distinct texts; got {args.datasets}")
    pairs = _sources(args)
    flags.apply_calibration_defaults(args, runner)
    checks.check_counts(args, ("nsamples", "seqlen", "batch_size", "eval_seqlen"), optional=("eval_tokens",))
    checks.check_report(args.report, args.model)
    checks.check_method_directories(runner, args.model)
    checks.check_device(args.device)
    config = checks.check_model(args.model)
    checks.check_lengths(args, config, ("seqlen", "eval_seqlen"))
    checks.check_method_config(runner, args, config, pattern)
    settings = {"model": args.model, "dtype": args.dtype, "method": args.method, "pattern": str(pattern),
                "scope": getattr(runner.resolve(pattern), "scope", None), "init": args.init,
                "permutations": args.permutations, "datasets": args.datasets,
                "sources": [list(pair) for pair in pairs], "nsamples": args.nsamples, "seqlen": args.seqlen,
                "seed": args.seed, "eval_seqlen": args.eval_seqlen,
                "eval_max_tokens": args.eval_tokens,  # the key of earlier reports, so they resume
                "options": runner.settings}
    try:
        done = continual.resume(args.report, settings, label="--report")
    except ValueError as error:
        raise UsageError(str(error)) from None
    if done:
        print(f"resuming: {len(done)} order(s) already in {args.report}")

    tok = steps.tokenizer(args.model)
    tasks = [continual.Task(name, steps.calibration(tok, calib, args, "--datasets"),
                            steps.eval_streams(tok, [evaluation], args.eval_seqlen, args.eval_tokens,
                                               "--eval" if args.eval else "--datasets", "--eval-seqlen")[0][1])
             for name, (calib, evaluation) in zip(args.datasets, pairs)]
    model, _ = steps.load(args, dense=True)

    def record(order, order_steps):
        done[order] = order_steps
        if distributed.is_main():
            continual.write_partial(args.report, settings, done)

    report = continual.run(model, args.method, pattern, tasks, init=args.init, permutations=args.permutations,
                           eval_seqlen=args.eval_seqlen, batch_size=args.batch_size, progress=not args.quiet,
                           done=done, on_order=record, method_options=flags.method_option_values(args))
    report["settings"] = settings
    report["run"] = steps.run_info(args)
    print(f"{args.method} {pattern} ({report['init']}): A-PPL {report['a_ppl']:.3f}, M-PPL {report['m_ppl']:.3f}, "
          f"A-BWT {report['a_bwt']:.3f}, M-BWT {report['m_bwt']:.3f} over {len(report['matrix'])} order(s)")
    steps.output_report(args, report)
    return 0
