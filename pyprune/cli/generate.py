"""``pyprune generate``: greedy text from a model with its prefill time and decode tokens/s, so a
user feels what N:M ``SparseLinear`` layers buy (saved by ``pyprune prune --sparse-layers``, or
made here from an N:M-pruned model with ``--sparsify``)."""
from __future__ import annotations

from .commands import SUMMARIES
from . import checks, flags, steps
from .checks import UsageError

COMMAND = "generate"
SPARSIFY = ("off", "auto", "2:4", "4:8")
WHERE = ("faster", "all")


def register(sub, method) -> None:
    parser = sub.add_parser(COMMAND, help=SUMMARIES[COMMAND])
    parser.add_argument("--model", required=True, help=flags.MODEL_HELP + "; SparseLinear layers included")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="greedy new tokens at most (default 64); generation stops earlier at the model's "
                             "end-of-sequence token (generation_config's eos_token_id, one or several)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate all --max-new-tokens, past an end-of-sequence token (runs of the same "
                             "length, so their speeds compare)")
    parser.add_argument("--sparsify", default="off", choices=SPARSIFY,
                        help="replace the linears that are N:M sparse by SparseLinear before generating "
                             "(auto: 2:4, else 4:8, per layer; default off: the model as loaded)")
    parser.add_argument("--sparse-where", default="faster", choices=WHERE,
                        help="faster (default): an N:M layer runs sparse only where sparse measured faster than "
                             "dense at 1 token on this machine (its cache, or timed on first use, a shipped "
                             "table's sparse row included: see pyprune tune), the others are (turned back "
                             "into) nn.Linear; all: every N:M layer sparse")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    flags.add_dtype_flag(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    import torch

    from ..runtime.decode import greedy_generate, stop_tokens
    from ..nn import SparseLinear, densify_slower_, detect_pattern, sparsify_, tuning
    checks.check_counts(args, ("max_new_tokens",))
    if not args.prompt.strip():
        raise UsageError("--prompt is empty; give the text to continue")
    checks.check_device(args.device)
    config = checks.check_model(args.model)
    prompt_tokens = len(steps.tokenizer(args.model)(args.prompt).input_ids)
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and prompt_tokens + args.max_new_tokens > context:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} after a prompt of {prompt_tokens} tokens passes the "
                         f"model's context of {context} tokens; give at most {max(context - prompt_tokens, 0)}")
    model, tok = steps.load(args)
    cases, seconds = tuning.COST["cases"], tuning.COST["seconds"]  # first-use tuning of this command
    faster_at = 1 if args.sparse_where == "faster" else None  # greedy decode of one sequence
    if faster_at is not None:
        densify_slower_(model, faster_at)
    if args.sparsify not in ("off", "auto"):
        _say_when_no_layer_fits(model, args.sparsify)
    if args.sparsify != "off":
        sparsify_(model, None if args.sparsify == "auto" else args.sparsify, faster_at=faster_at)
    sparse = [m for m in model.modules() if isinstance(m, SparseLinear)]
    dense_nm = sum(type(m) is torch.nn.Linear and detect_pattern(m.weight.detach()) is not None
                   for m in model.modules())
    prompt = tok(args.prompt, return_tensors="pt").input_ids.to(args.device)
    tuned_before = tuning.COST["seconds"]
    stop = () if args.ignore_eos else stop_tokens(model, tok)
    run = greedy_generate(model, prompt, args.max_new_tokens, stop)
    tuned_during = tuning.COST["seconds"] - tuned_before
    print(tok.decode(prompt[0].tolist() + run.tokens[0].tolist(), skip_special_tokens=True))
    kinds = sorted({str(m.pattern) for m in sparse})
    new = run.tokens.shape[1]
    ended = " (stopped at the end-of-sequence token)" if run.tokens[0, -1].item() in stop else ""
    print(f"[{new} new tokens{ended}; prefill of {prompt.shape[1]} prompt tokens "
          f"{run.prefill_s * 1e3:.1f} ms; decode {run.decode_tokens_per_s:.2f} tokens/s; "
          f"{len(sparse)} SparseLinear layers{' (' + ', '.join(kinds) + ')' if kinds else ''}, "
          f"{dense_nm} N:M layers as nn.Linear, "
          f"{torch.get_num_threads()} threads; first-use tuning {tuning.COST['cases'] - cases} cases "
          f"{(tuning.COST['seconds'] - seconds) * 1e3:.0f} ms, {tuned_during * 1e3:.0f} ms of it inside the prefill and "
          f"decode figures]")
    return 0


def _say_when_no_layer_fits(model, pattern: str) -> None:
    """One line when ``--sparsify N:M`` can convert nothing because no linear is N:M sparse, naming
    the patterns the model's linears do have."""
    import sys
    from collections import Counter

    import torch

    from ..nn import detect_pattern
    from ..patterns import parse
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if any(parse(pattern).fits(m.weight.detach()) for m in linears):
        return
    found = Counter(str(detect_pattern(m.weight.detach())) for m in linears)
    found.pop("None", None)
    have = ", ".join(f"{count} are {kind}" for kind, count in sorted(found.items())) or "none is 2:4 or 4:8"
    print(f"pyprune generate: --sparsify {pattern} converts nothing: no linear layer is {pattern} sparse ({have}; "
          "--sparsify auto takes each layer's own pattern)", file=sys.stderr)
