"""``pyprune recover``: LoRA recovery fine-tuning of a (pruned) model, merged back into dense weights."""
from __future__ import annotations

from .commands import SUMMARIES
from ..runtime import recovery
from . import checks, flags, steps
from .checks import UsageError
from .. import recipes

COMMAND = "recover"


def register(sub, method) -> None:
    parser = sub.add_parser(COMMAND, help=SUMMARIES[COMMAND])
    batch = recovery.LoraSettings.batch_size  # --batch-size is also the evaluation batch
    flags.add_model_flags(parser, batch_size=batch.default, batch_help=f"{batch.help}, also the evaluation batch")
    parser.add_argument("--calib", required=True, help="training text (same forms as prune's --calib)")
    nsamples, seqlen = recipes.RECOVERY_CALIBRATION
    parser.add_argument("--nsamples", type=int, default=nsamples, help=f"training samples (default {nsamples})")
    parser.add_argument("--seqlen", type=int, default=seqlen, help=f"training sample length (default {seqlen}; "
                        "DReSS: 2048)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples, the adapters' initialisation and "
                        "the batch order")
    flags.add_option_flags(parser.add_argument_group("LoRA options"),
                           [declared for declared in recovery.SETTINGS if declared is not batch], "")
    flags.add_eval_flags(parser, eval_help="evaluation texts, measured before and after")
    parser.add_argument("--output", required=True, help="directory for the recovered model (written atomically)")
    flags.add_overwrite_flag(parser)
    parser.add_argument("--report", help="JSON report path")
    flags.add_dist_timeout_flag(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    """Under ``torchrun`` every rank runs this (:func:`steps.in_process_group`); rank 0 alone writes."""
    return steps.in_process_group(args, lambda: _run(args))


def _run(args) -> int:
    settings = recovery.check_settings(**lora_flags(args))
    recovery.check_group(settings["shard_training"])
    checks.check_counts(args, ("nsamples", "eval_seqlen"), optional=("eval_tokens",))
    if args.seqlen < 2:
        raise UsageError(f"--seqlen must be >= 2 (next-token loss); got {args.seqlen}")
    if args.batch_size > args.nsamples:
        raise UsageError(f"--batch-size {args.batch_size} is larger than --nsamples {args.nsamples}")
    recipe = recipes.from_recover_args(args, settings)
    checks.check_sources([args.calib] + list(args.eval or []))
    checks.check_output(args.output, "--output", args.model, args.overwrite)
    checks.check_report(args.report, args.model, output=args.output)
    checks.check_device(args.device)
    checks.check_lengths(args, checks.check_model(args.model), ("seqlen", "eval_seqlen"))
    tok = steps.tokenizer(args.model)
    calib = steps.calibration(tok, args.calib, args)
    streams = steps.eval_streams(tok, args.eval or [], args.eval_seqlen, args.eval_tokens, "--eval",
                                 "--eval-seqlen")

    model, tok = steps.load(args, dense=True)
    report = {"model": args.model, **steps.pruned_by(args.model), "calib": args.calib, **steps.run_info(args)}
    report["eval_before"] = steps.evaluate(model, streams, args.eval_seqlen, args.batch_size, not args.quiet, tok)
    report["recovery"] = done = recovery.lora_finetune(model, calib, **settings, seed=args.seed,
                                                       progress=not args.quiet)
    steps.print_recovery(done)

    def evaluate_into(report: dict) -> bool:
        report["eval_after"] = steps.evaluate(model, streams, args.eval_seqlen, args.batch_size, not args.quiet, tok)
        return bool(report["eval_after"])

    steps.save_evaluate_report(model, tok, args, report, evaluate_into, "recovered model",
                               recipe=recipe.to_dict(output=args.output))
    return 0


def lora_flags(args) -> dict:
    """The LoRA settings given on the command line (:data:`pyprune.runtime.recovery.SETTINGS`; a
    flag not given is left out, so the setting takes its default)."""
    return {declared.name: getattr(args, declared.name) for declared in recovery.SETTINGS
            if getattr(args, declared.name) is not None}
