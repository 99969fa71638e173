"""The ``pyprune`` command line: prune, eval, demo.

    pyprune prune --model smollm2-135m --method wanda --pattern 2:4 --calib emma \\
                  --eval pride_and_prejudice --output pruned/ --report report.json
    pyprune eval --model pruned/ --data pride_and_prejudice
    pyprune demo

Every argument is checked before the model is loaded or anything is written; a bad one prints a
one-line error and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

import torch

from . import data, methods
from .patterns import NM, Structured, Unstructured, parse

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(Exception):
    """A bad argument: reported in one line with exit status 2."""


def _pattern(args):
    given = [name for name in ("sparsity", "pattern", "ratio") if getattr(args, name) is not None]
    if len(given) != 1:
        raise UsageError("give exactly one of --sparsity S, --pattern N:M, --ratio R")
    try:
        if args.sparsity is not None:
            return Unstructured(args.sparsity, args.scope)
        if args.ratio is not None:
            return Structured(args.ratio, uniform=args.uniform)
        pattern = parse(args.pattern)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not isinstance(pattern, NM):
        raise UsageError(f"--pattern takes N:M (e.g. 2:4, 4:8); got {args.pattern!r}")
    return pattern


def _check_output(path: Optional[str], flag: str) -> None:
    if path is None:
        return
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UsageError(f"{flag} {path} already exists and is not an empty directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: the parent directory {parent} does not exist")


def _check_report(path: Optional[str]) -> None:
    if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise UsageError(f"--report {path}: its directory does not exist")


def _write_json_atomic(path: str, payload) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def _evaluate(model, tokenizer, sources: List[str], seqlen: int, max_tokens: Optional[int],
              batch_size: int, progress: bool):
    from .eval import perplexity
    results = []
    for source in sources:
        tokens = data.eval_tokens(tokenizer, source, max_tokens=max_tokens)
        ppl = perplexity(model, tokens, seqlen, batch_size=batch_size, progress=progress)
        used = tokens.numel() // seqlen * seqlen
        results.append({"data": source, "perplexity": round(ppl, 4), "tokens": used, "seqlen": seqlen})
        print(f"perplexity {ppl:.3f} on {source} ({used} tokens, seqlen {seqlen})")
    return results


def _load(args):
    from .models import load_model
    return load_model(args.model, dtype=DTYPES[args.dtype], device=args.device)


def cmd_prune(args) -> int:
    pattern = _pattern(args)
    try:
        runner = methods.get(args.method)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not isinstance(pattern, runner.patterns):
        allowed = ", ".join(p.__name__ for p in runner.patterns)
        raise UsageError(f"method {args.method!r} supports {allowed} patterns; got {pattern}")
    if runner.needs_calibration and args.calib is None:
        raise UsageError(f"method {args.method!r} needs --calib (a calibration text)")
    for source in ([args.calib] if args.calib is not None else []) + list(args.eval or []):
        data.check_source(source)
    _check_output(args.output, "--output")
    _check_report(args.report)
    if args.sparse_layers and (not isinstance(pattern, NM) or not args.output):
        raise UsageError("--sparse-layers needs --pattern N:M and --output")
    for flag in ("nsamples", "seqlen", "batch_size"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}")

    from . import pruning
    from .io import save
    model, tokenizer = _load(args)
    calib = None
    if runner.needs_calibration:
        calib = data.calibration_samples(tokenizer, args.calib, nsamples=args.nsamples,
                                         seqlen=args.seqlen, seed=args.seed)
    report = pruning.prune(model, args.method, pattern, calib, batch_size=args.batch_size,
                           progress=not args.quiet)
    print(f"{args.method} {pattern}: measured sparsity {report['sparsity']:.4f} in {report['time_s']:.1f} s")
    report.update({"model": args.model, "calib": args.calib, "nsamples": args.nsamples,
                   "seqlen": args.seqlen, "seed": args.seed, "dtype": args.dtype})
    report["eval"] = _evaluate(model, tokenizer, args.eval or [], args.eval_seqlen, args.eval_max_tokens,
                               args.batch_size, not args.quiet)
    if args.sparse_layers:
        from .nn import sparsify_
        report["sparse_layers"] = len(sparsify_(model, pattern))
        print(f"stored {report['sparse_layers']} layers as SparseLinear {pattern}")
    if args.output:
        save(model, tokenizer, args.output, report=report)
        print(f"saved the pruned model to {args.output}")
    if args.report:
        _write_json_atomic(args.report, report)
        print(f"wrote {args.report}")
    return 0


def cmd_eval(args) -> int:
    for source in args.data:
        data.check_source(source)
    _check_report(args.report)
    model, tokenizer = _load(args)
    results = _evaluate(model, tokenizer, args.data, args.seqlen, args.max_tokens, args.batch_size,
                        not args.quiet)
    if args.report:
        _write_json_atomic(args.report, {"model": args.model, "eval": results})
    return 0


def cmd_demo(args) -> int:
    """Wanda 2:4 on SmolLM2-135M, calibrated on Emma, measured on Pride and Prejudice."""
    from . import pruning
    from .eval import perplexity
    from .models import load_model
    calib_source, eval_source = "emma", "pride_and_prejudice"
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyprune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--model", required=True, help="a Hugging Face model directory, a pyprune output "
                       "directory, or the alias smollm2-135m")
        p.add_argument("--device", default="cpu", help="torch device (default cpu)")
        p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
        p.add_argument("--batch-size", type=int, default=8, help="calibration/evaluation batch size")
        p.add_argument("--quiet", action="store_true", help="no progress bars")

    prune = sub.add_parser("prune", help="prune a model with one method and pattern")
    common(prune)
    prune.add_argument("--method", required=True, help=f"one of {', '.join(sorted(methods.METHODS))}")
    prune.add_argument("--sparsity", type=float, help="unstructured sparsity in [0, 1)")
    prune.add_argument("--scope", choices=["row", "tensor"], default=None,
                       help="unstructured selection per output row or per layer (default: the method's)")
    prune.add_argument("--pattern", help="N:M semi-structured pattern, e.g. 2:4 or 4:8")
    prune.add_argument("--ratio", type=float, help="structured ratio of heads/channels removed")
    prune.add_argument("--uniform", action="store_true",
                       help="structured: same sizes in every layer, so plain transformers can load it")
    prune.add_argument("--calib", help="calibration text (every method but magnitude): an embedded "
                       f"corpus ({', '.join(data.EMBEDDED)}), a .txt file, a directory, "
                       "wikitext2/c4/ptb; any of them with :first_half or :second_half")
    prune.add_argument("--nsamples", type=int, default=64)
    prune.add_argument("--seqlen", type=int, default=512)
    prune.add_argument("--seed", type=int, default=0)
    prune.add_argument("--eval", nargs="*", help="evaluation texts (same forms as --calib)")
    prune.add_argument("--eval-seqlen", type=int, default=512)
    prune.add_argument("--eval-max-tokens", type=int, default=None)
    prune.add_argument("--output", help="directory for the pruned model (written atomically)")
    prune.add_argument("--sparse-layers", action="store_true",
                       help="with --pattern N:M and --output: store the pruned linears as SparseLinear "
                            "(compressed N:M, 9/16 of the dense bytes for 16-bit 2:4/4:8)")
    prune.add_argument("--report", help="JSON report path")
    prune.set_defaults(run=cmd_prune)

    evaluate = sub.add_parser("eval", help="perplexity of a model on texts")
    common(evaluate)
    evaluate.add_argument("--data", nargs="+", required=True)
    evaluate.add_argument("--seqlen", type=int, default=512)
    evaluate.add_argument("--max-tokens", type=int, default=None)
    evaluate.add_argument("--report", help="JSON report path")
    evaluate.set_defaults(run=cmd_eval)

    demo = sub.add_parser("demo", help="Wanda 2:4 on SmolLM2-135M with Austen text")
    demo.add_argument("--nsamples", type=int, default=16)
    demo.add_argument("--eval-tokens", type=int, default=8192)
    demo.add_argument("--quiet", action="store_true")
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (UsageError, ValueError, FileNotFoundError) as error:
        print(f"pyprune {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
