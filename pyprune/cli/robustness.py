"""``pyprune robustness``: prune in bf16 and in fp16 and compare the choices (MoreauPruner Table 1)."""
from __future__ import annotations

import torch

from . import checks, options, steps

COMMAND = "robustness"


def register(sub, method) -> None:
    parser = sub.add_parser(COMMAND, help="prune in bf16 and in fp16 and compare (MoreauPruner Table 1)")
    options.add_model_flags(parser, dtype=False, model_help="as for prune; loaded in fp32, then cast to each format")
    options.add_method_flag(parser, COMMAND)
    options.add_ratio_flags(parser, required=True)
    options.add_calibration_flags(parser, COMMAND, method, "calibration text (as for prune)", calib_required=True)
    options.add_eval_flags(parser, nargs=None, required=True, seqlen=128,
                           eval_help="evaluation text (as for prune); perplexity windows of 128 as the paper")
    parser.add_argument("--arithmetic", choices=["fp32-accumulate", "native"], default="fp32-accumulate",
                        help="16-bit weights with fp32-accumulated linear layers (default, as tensor cores do), "
                             "or torch's native 16-bit kernels throughout (slow for fp16 on CPU)")
    parser.add_argument("--report", required=True, help="JSON report path (written atomically)")
    options.add_method_flags(parser, COMMAND, method)
    parser.set_defaults(run=run)


def run(args) -> int:
    from .. import robustness
    runner = options.build_method(args)
    pattern = options.structured_from(args)
    options.apply_calibration_defaults(args, runner)
    checks.check_counts(args, ("nsamples", "seqlen", "batch_size", "eval_seqlen"), optional=("eval_max_tokens",))
    checks.check_sources((args.calib, args.eval))
    checks.check_report(args.report)
    checks.check_device(args.device)
    checks.check_method_config(runner, checks.check_model(args.model), pattern)
    tok = steps.tokenizer(args.model)
    calib = steps.calibration(tok, args.calib, args)
    [(_, tokens)] = steps.eval_streams(tok, [args.eval], args.eval_seqlen, args.eval_max_tokens, "--eval",
                                       "--eval-seqlen")

    model, _ = steps.load(args, dtype=torch.float32)
    report = robustness.study(model, args.method, args.ratio, calib, tokens, eval_seqlen=args.eval_seqlen,
                              arithmetic=args.arithmetic, uniform=args.uniform, batch_size=args.batch_size,
                              progress=not args.quiet, **options.method_option_values(args))
    report.update({"model": args.model, "calib": args.calib, "nsamples": args.nsamples, "seqlen": args.seqlen,
                   "seed": args.seed, "eval": args.eval, "eval_tokens": tokens.numel() // args.eval_seqlen
                   * args.eval_seqlen, "eval_seqlen": args.eval_seqlen, **steps.run_info(args)})
    print(f"{args.method} at {args.ratio}: perplexity bf16 {report['ppl_bf16']:.3f}, fp16 "
          f"{report['ppl_fp16']:.3f}, ppl_diff {report['ppl_diff']:.3f}, agreement {report['agreement']:.4f} "
          f"({args.arithmetic})")
    steps.write_report(args, report)
    return 0
