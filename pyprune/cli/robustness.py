"""``pyprune robustness``: prune in bf16 and in fp16 and compare the choices (MoreauPruner Table 1)."""
from __future__ import annotations

import torch

from .commands import SUMMARIES
from ..studies import robustness
from . import checks, flags, steps

COMMAND = "robustness"


def register(sub, method) -> None:
    parser = sub.add_parser(COMMAND, help=SUMMARIES[COMMAND])
    flags.add_model_flags(parser, dtype=False, model_help="as for prune; loaded in fp32, then cast to each format")
    flags.add_method_flag(parser, COMMAND)
    flags.add_ratio_flags(parser, required=True)
    flags.add_calibration_flags(parser, COMMAND, method, "calibration text (as for prune)", calib_required=True)
    flags.add_eval_flags(parser, nargs=None, required=True, seqlen=128,
                         eval_help="evaluation text (as for prune); perplexity windows of 128 as the paper")
    parser.add_argument("--arithmetic", choices=robustness.ARITHMETIC, default="rounding",
                        help="rounding (default): weights rounded to each format, held in fp32, fp32 arithmetic "
                             "(the papers vary the weights' bit format); fp32-accumulate: 16-bit weights and "
                             "activations, linear layers accumulating in fp32 (as tensor cores do); native: torch's "
                             "16-bit kernels (slow for fp16 on CPU). The 16-bit ones use dynamic loss scaling")
    parser.add_argument("--eval-format", choices=tuple(robustness.EVAL_FORMATS), default="float32",
                        help="the one format both pruned models are evaluated in (default float32); the 2 x 2 of "
                             "pruned in x evaluated in bf16/fp16 is in the report too")
    parser.add_argument("--report", required=True, help="JSON report path (written atomically)")
    flags.add_method_flags(parser, COMMAND, method)
    parser.set_defaults(run=run)


def run(args) -> int:
    runner = flags.build_method(args)
    pattern = flags.structured_from(args)
    flags.apply_calibration_defaults(args, runner)
    checks.check_counts(args, ("nsamples", "seqlen", "batch_size", "eval_seqlen"), optional=("eval_tokens",))
    checks.check_sources((args.calib, args.eval))
    checks.check_report(args.report, args.model)
    checks.check_method_directories(runner, args.model)
    checks.check_device(args.device)
    config = checks.check_model(args.model)
    checks.check_lengths(args, config, ("seqlen", "eval_seqlen"))
    checks.check_method_config(runner, args, config, pattern)
    tok = steps.tokenizer(args.model)
    calib = steps.calibration(tok, args.calib, args)
    [(_, tokens)] = steps.eval_streams(tok, [args.eval], args.eval_seqlen, args.eval_tokens, "--eval",
                                       "--eval-seqlen")

    model, _ = steps.load(args, dtype=torch.float32, dense=True)
    report = robustness.study(model, args.method, args.ratio, calib, tokens, eval_seqlen=args.eval_seqlen,
                              arithmetic=args.arithmetic, eval_format=args.eval_format, uniform=args.uniform, batch_size=args.batch_size,
                              progress=not args.quiet, **flags.method_option_values(args))
    report.update({"model": args.model, "calib": args.calib, "nsamples": args.nsamples, "seqlen": args.seqlen,
                   "seed": args.seed, "eval": args.eval, "eval_tokens": tokens.numel() // args.eval_seqlen
                   * args.eval_seqlen, "eval_seqlen": args.eval_seqlen, **steps.run_info(args)})
    floor = report["noise_floor"]
    print(f"{args.method} at {args.ratio}: perplexity in {args.eval_format} of the bf16 run {report['ppl_bf16']:.3f}, "
          f"of the fp16 run {report['ppl_fp16']:.3f}, ppl_diff {report['ppl_diff']:.3f}, agreement "
          f"{report['agreement']:.4f}" + (f" (noise floor {floor['agreement']:.4f})" if floor else "")
          + "".join(f", {kind} rank correlation {rho:.4f}" for kind, rho in report["spearman"].items())
          + f" ({args.arithmetic})")
    steps.output_report(args, report)
    return 0
