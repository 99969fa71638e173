"""``pyprune demo``: Wanda 2:4 on SmolLM2-135M, calibrated on Emma, measured on Pride and Prejudice."""
from __future__ import annotations

from .commands import SUMMARIES
from ..inputs import data
from . import checks, flags

COMMAND = "demo"


def register(sub, method) -> None:
    parser = sub.add_parser(COMMAND, help=SUMMARIES[COMMAND])
    parser.add_argument("--nsamples", type=int, default=16,
                        help="calibration windows of 256 tokens of Emma (default 16)")
    flags.add_eval_tokens_flag(parser, default=8192)
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..methods import pruning
    from ..evaluation.perplexity import perplexity
    from ..inputs.models import load_model
    calib_source, eval_source = "emma", "pride_and_prejudice"
    checks.check_counts(args, ("nsamples", "eval_tokens"))
    model, tokenizer = load_model("smollm2-135m")
    calib = data.calibration_samples(tokenizer, calib_source, nsamples=args.nsamples, seqlen=256, seed=0)
    tokens = data.eval_tokens(tokenizer, eval_source, max_tokens=args.eval_tokens)
    dense = perplexity(model, tokens, 256, progress=False)
    report = pruning.prune(model, "wanda", "2:4", calib, progress=not args.quiet)
    pruned = perplexity(model, tokens, 256, progress=False)
    print(f"SmolLM2-135M, Wanda 2:4 ({args.nsamples}x256 calibration tokens of Emma, "
          f"{report['time_s']:.1f} s): every linear layer of every block is 2:4 = "
          f"{report['nm_valid']['2:4']}, sparsity {report['sparsity']:.3f}")
    print(f"perplexity on Pride and Prejudice ({tokens.numel() // 256 * 256} tokens): "
          f"dense {dense:.2f} -> pruned {pruned:.2f}")
    return 0
