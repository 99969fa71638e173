"""``pyprune eval``: perplexity of a model on texts and zero-shot accuracy on tasks."""
from __future__ import annotations

from .commands import SUMMARIES
from . import checks, flags, steps
from .checks import UsageError

COMMAND = "eval"


def register(sub, method) -> None:
    parser = sub.add_parser(COMMAND, help=SUMMARIES[COMMAND])
    flags.add_model_flags(parser)
    parser.add_argument("--data", nargs="*", default=[], help="texts for perplexity (as prune's --calib)")
    parser.add_argument("--seqlen", type=int, default=512, help="perplexity window (default 512)")
    flags.add_eval_tokens_flag(parser, old="--max-tokens")
    parser.add_argument("--report", help="JSON report path")
    flags.add_zero_shot_flags(parser)
    flags.add_dist_timeout_flag(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    """Under ``torchrun`` every rank runs this (:func:`steps.in_process_group`); rank 0 alone writes."""
    return steps.in_process_group(args, lambda: _run(args))


def _run(args) -> int:
    checks.check_counts(args, ("seqlen", "batch_size"), optional=("eval_tokens",))
    if not args.data and args.tasks is None:
        raise UsageError("give --data TEXT ... (perplexity) and/or --tasks NAME,... (zero-shot accuracy)")
    checks.check_sources(args.data)
    checks.check_report(args.report, args.model)
    checks.check_device(args.device)
    checks.check_lengths(args, checks.check_model(args.model), ("seqlen",) if args.data else ())
    streams = steps.eval_streams(steps.tokenizer(args.model), args.data, args.seqlen, args.eval_tokens, "--data",
                                 "--seqlen")
    tasks = steps.zero_shot_tasks(args)
    model, tok = steps.load(args)
    report = {"model": args.model, **steps.pruned_by(args.model), "eval": steps.evaluate(model, streams, args.seqlen, args.batch_size, not args.quiet, tok)}
    if tasks is not None:
        report["tasks"] = steps.zero_shot(model, tok, tasks, args)
    if args.report:
        steps.output_report(args, {**report, **steps.run_info(args)})
    return 0
