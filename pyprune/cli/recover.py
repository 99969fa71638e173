"""``pyprune recover``: LoRA recovery fine-tuning of a (pruned) model, merged back into dense weights."""
from __future__ import annotations

from .commands import SUMMARIES
from ..runtime.recovery import DEFAULTS as LORA
from . import checks, flags, steps
from .checks import UsageError
from .. import recipes

COMMAND = "recover"


def register(sub, method) -> None:
    parser = sub.add_parser(COMMAND, help=SUMMARIES[COMMAND])
    flags.add_model_flags(parser, batch_size=LORA.batch_size, batch_help="training samples per step, also the evaluation "
                            "batch (DReSS: 64)")
    parser.add_argument("--calib", required=True, help="training text (same forms as prune's --calib)")
    parser.add_argument("--nsamples", type=int, default=64, help="training samples (default 64)")
    parser.add_argument("--seqlen", type=int, default=512, help="training sample length (default 512; DReSS: 2048)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples, the adapters' initialisation and "
                        "the batch order")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps (0: no training)")
    parser.add_argument("--rank", type=int, default=LORA.rank, help=f"LoRA rank (default {LORA.rank}, as DReSS)")
    parser.add_argument("--alpha", type=float, default=LORA.alpha, help="LoRA alpha; the scale is alpha/rank "
                        f"(default {LORA.alpha:g}, as DReSS)")
    parser.add_argument("--lr", type=float, default=LORA.lr, help=f"AdamW learning rate, constant (default "
                        f"{LORA.lr:g}; DReSS: 2e-5)")
    parser.add_argument("--target-modules", nargs="+", default=None, help="linears of the decoder blocks to adapt "
                        "(default all: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; PEFT's llama "
                        "default: q_proj v_proj)")
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
    from ..runtime import recovery
    recovery.check_settings(steps=args.steps, rank=args.rank, alpha=args.alpha, lr=args.lr,
                            batch_size=args.batch_size, seed=args.seed, target_modules=args.target_modules)
    checks.check_counts(args, ("nsamples", "eval_seqlen"), optional=("eval_tokens",))
    if args.seqlen < 2:
        raise UsageError(f"--seqlen must be >= 2 (next-token loss); got {args.seqlen}")
    if args.batch_size > args.nsamples:
        raise UsageError(f"--batch-size {args.batch_size} is larger than --nsamples {args.nsamples}")
    recipe = recipes.from_recover_args(args)
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
    report["recovery"] = done = recovery.lora_finetune(
        model, calib, steps=args.steps, rank=args.rank, alpha=args.alpha, lr=args.lr, batch_size=args.batch_size,
        target_modules=args.target_modules, seed=args.seed, progress=not args.quiet)
    if args.steps:
        print(f"LoRA rank {args.rank} on {done['lora_layers']} layers, {args.steps} steps in {done['time_s']:.1f} s: "
              f"training loss {done['first_loss']:.4f} -> {done['last_loss']:.4f}")

    def evaluate_into(report: dict) -> bool:
        report["eval_after"] = steps.evaluate(model, streams, args.eval_seqlen, args.batch_size, not args.quiet, tok)
        return bool(report["eval_after"])

    steps.save_evaluate_report(model, tok, args, report, evaluate_into, "recovered model",
                               recipe=recipe.to_dict(output=args.output))
    return 0
