"""The steps the subcommands share once their arguments are checked: tokenizer and texts (read
before the model loads), the model, perplexity and zero-shot evaluation, the run's description,
and the tail of every command that writes a model: save, then evaluate, then report."""
from __future__ import annotations

import contextlib
import os
from typing import Callable, List, Optional

import torch

from ..inputs import data
from ..io.manifest import write_report
from .checks import UsageError, first_line
from .flags import DTYPES


def in_process_group(args, body: Callable[[], int]) -> int:
    """``body()``, the command, on every rank under ``torchrun``: the command joins its process group
    for its run (:func:`pyprune.runtime.distributed.join_from_environment`, gloo on CPU, NCCL on
    ``cuda:LOCAL_RANK``; --dist-timeout) and leaves it after. Every rank runs the same steps, each
    its shard of the calibration and evaluation windows; rank 0 alone prints, shows progress and
    writes (the others run with --quiet and no stdout; :func:`save_evaluate_report`,
    :func:`output_report`). The ranks agree on their pre-load checks before anything loads or is
    written (:func:`checks_passed`). In one process, or in a group the caller joined, ``body()`` as
    it is."""
    import torch.distributed as dist
    from ..runtime import distributed
    if args.dist_timeout is not None and not args.dist_timeout > 0:
        raise UsageError(f"--dist-timeout must be > 0 seconds; got {args.dist_timeout}")
    joined = not dist.is_initialized()
    try:
        args.device = distributed.join_from_environment(args.device, args.dist_timeout or distributed.DEFAULT_TIMEOUT_S)
        joined = joined and dist.is_initialized()
        with _checks_shared(args):
            if distributed.is_main():
                return body()
            args.quiet = True
            with open(os.devnull, "w") as silent, contextlib.redirect_stdout(silent):
                return body()
    finally:
        if joined:
            distributed.leave()


@contextlib.contextmanager
def _checks_shared(args):
    """In a process group, the command's body with its pre-load checks shared: a rank that raises
    before :func:`checks_passed` (a file only it cannot read, a path only it sees) takes part in the
    ranks' status exchange there with its error, so that every rank ends with the same one-line
    :class:`UsageError` at once, before any rank loads or writes; a body that never gets there (it
    loads nothing) exchanges at its end."""
    from ..runtime import distributed
    args.checks_pending = distributed.active()
    try:
        yield
    except Exception as error:
        if not args.checks_pending:
            raise
        args.checks_pending = False
        raise _checks_failure(error) from None
    else:
        checks_passed(args)
    finally:
        args.checks_pending = False


def checks_passed(args) -> None:
    """The ranks' status exchange after the pre-load checks of a command (once; :func:`load` and
    ``pyprune run``'s :func:`~pyprune.cli.run.perform` call it before they load or write): when a
    rank failed its checks, every rank raises a :class:`UsageError` naming it and its error. Nothing
    outside :func:`in_process_group`'s process group."""
    if getattr(args, "checks_pending", False):
        args.checks_pending = False
        failure = _checks_failure(None)
        if failure is not None:
            raise failure


def _checks_failure(error: Optional[Exception]) -> Optional[Exception]:
    """The status exchange: every rank's check ``error`` (None: passed) gathered on every rank. None
    when every rank passed; this rank's own ``error`` when every rank failed alike (the message of
    one process); otherwise a UsageError naming the first failing rank and its error."""
    from ..runtime import distributed
    message = None
    if error is not None:
        message = first_line(error) if isinstance(error, (UsageError, ValueError, FileNotFoundError)) \
            else f"{type(error).__name__}: {first_line(error)}"
    failed = [(rank, text) for rank, text in enumerate(distributed.all_gather_objects(message)) if text is not None]
    if not failed:
        return None
    if error is not None and len(failed) == distributed.world_size() and len({text for _, text in failed}) == 1:
        return error
    (rank, text), others = failed[0], [str(other) for other, _ in failed[1:]]
    return UsageError(f"rank {rank} failed its checks: {text}"
                      + (f" (and rank{'s' if len(others) > 1 else ''} {', '.join(others)})" if others else ""))


def tokenizer(model: str):
    from ..inputs.models import resolve_model_dir
    from ..io import read_tokenizer
    try:
        return read_tokenizer(resolve_model_dir(model, weights=False))
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(f"--model {model}: could not load its tokenizer ({first_line(error)})") from None


def _read(flag: str, source: str, read):
    """``read()`` of a text source; a dataset that cannot be loaded now, or a text that cannot
    serve (not UTF-8, only whitespace, too short), becomes a UsageError naming the flag."""
    try:
        return read()
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"{flag} {source}: {first_line(error)}") from None


def calibration(tok, source: str, args, flag: str = "--calib"):
    """--nsamples windows of --seqlen tokens of ``source`` (seeded by --seed)."""
    return _read(flag, source, lambda: data.calibration_samples(tok, source, nsamples=args.nsamples,
                                                                seqlen=args.seqlen, seed=args.seed))


def eval_streams(tok, sources: List[str], seqlen: int, max_tokens: Optional[int], flag: str,
                 seqlen_flag: str) -> list:
    """(source, token stream) of every evaluation text (its first ``max_tokens``, --eval-tokens,
    when given), each checked to hold one window at least, before the model loads."""
    streams = []
    for source in sources:
        tokens = _read(flag, source, lambda: data.eval_tokens(tok, source, max_tokens=max_tokens))
        if tokens.numel() < seqlen:
            if max_tokens is not None and tokens.numel() == max_tokens:  # the limit is short, not the text
                raise UsageError(f"--eval-tokens {max_tokens} is fewer than one window of {seqlen_flag} {seqlen}")
            raise UsageError(f"{flag} {source} has {tokens.numel()} tokens, fewer than one window of "
                             f"{seqlen_flag} {seqlen}")
        streams.append((source, tokens))
    return streams


def evaluate(model, streams: list, seqlen: int, batch_size: int, progress: bool, tok=None) -> list:
    """Perplexity of ``model`` on every stream, printed and returned as report entries; each window
    starts with BOS where the tokenizer ``tok`` starts texts with one (the entry's ``bos``)."""
    from ..evaluation.perplexity import perplexity
    bos = data.window_bos(tok) if tok is not None else None
    text = seqlen - 1 if bos is not None else seqlen
    results = []
    for source, tokens in streams:
        ppl = perplexity(model, tokens, seqlen, batch_size=batch_size, progress=progress, bos_token_id=bos)
        used = tokens.numel() // text * text
        results.append({"data": source, "perplexity": round(ppl, 4), "tokens": used, "seqlen": seqlen,
                        "bos": bos is not None})
        print(f"perplexity {ppl:.3f} on {source} ({used} tokens, seqlen {seqlen}"
              f"{', <bos> first in every window' if bos is not None else ''})")
    return results


def print_recovery(done: dict) -> None:
    """One line on a LoRA recovery (its report, :func:`pyprune.runtime.recovery.lora_finetune`'s);
    none when it trained no step."""
    if done["steps"]:
        print(f"LoRA rank {done['rank']} on {done['lora_layers']} layers, {done['steps']} steps in "
              f"{done['time_s']:.1f} s: training loss {done['first_loss']:.4f} -> {done['last_loss']:.4f}")


def zero_shot_tasks(args):
    """Check --tasks / --limit and load the tasks with their data (lm-eval), before any model work:
    an unknown task, a missing extra or data that cannot be downloaded is a one-line error."""
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1; got {args.limit}")
    if args.tasks is None:
        if args.limit is not None:
            raise UsageError("--limit needs --tasks")
        return None
    from ..evaluation import zeroshot
    names = [name.strip() for name in args.tasks.split(",")]
    try:
        return zeroshot.load_tasks(names)
    except (ImportError, zeroshot.TaskDataError, ValueError) as error:
        raise UsageError(f"--tasks: {error}") from None


def zero_shot(model, tok, tasks, args) -> dict:
    """Zero-shot accuracy of ``model`` on the loaded ``tasks``, printed and returned; in a process
    group on rank 0 alone (the tasks are not sharded), None on the others."""
    from ..evaluation import zeroshot
    from ..runtime import distributed
    if not distributed.is_main():
        return None
    results = zeroshot.evaluate(model, tok, tasks, limit=args.limit, batch_size=args.batch_size,
                                progress=not args.quiet)
    for name, result in results.items():
        norm = "" if result["acc_norm"] is None else f", acc_norm {result['acc_norm']:.4f}"
        print(f"{name}: acc {result['acc']:.4f} ± {result['stderr']['acc']:.4f}{norm} ({result['n']} items, "
              f"{result['num_fewshot']}-shot)")
    return results


def load(args, dtype: Optional[torch.dtype] = None, offload_dir: Optional[str] = None, *, dense: bool = False):
    """(model, tokenizer) of --model on --device, in ``dtype`` or --dtype; with ``offload_dir`` its
    decoder blocks stay on disk (:mod:`pyprune.io.offload`). With ``dense`` (the commands that
    change weights: prune, recover, continual, robustness) the SparseLinear layers of a
    ``--sparse-layers`` output become nn.Linear again, with the same weights. In a process group,
    after the ranks agree on their checks (:func:`checks_passed`)."""
    from ..inputs.models import load_model
    from ..nn import densify_
    checks_passed(args)
    model, tok = load_model(args.model, dtype=dtype or DTYPES[args.dtype], device=args.device,
                            offload_dir=offload_dir)
    densified = densify_(model) if dense else {}
    if densified and not getattr(args, "quiet", False):
        print(f"--model {args.model}: its {len(densified)} SparseLinear layers become nn.Linear with the same weights "
              f"for {args.command}")
    return model, tok


def pruned_by(model: str) -> dict:
    """``method``, ``pattern`` and ``sparsity`` of the prune that wrote the model directory ``model``
    (its ``pyprune.json`` report), so a report on it says what model it measured; {} for a model
    pyprune did not prune."""
    from ..inputs.models import resolve_model_dir
    from ..io import read_manifest
    report = read_manifest(resolve_model_dir(model, weights=False)).get("report") or {}
    return {key: report[key] for key in ("method", "pattern", "sparsity") if key in report}


def run_info(args) -> dict:
    """What a report records of the run itself."""
    from .. import __version__
    return {"device": args.device, "dtype": getattr(args, "dtype", "float32"), "batch_size": args.batch_size,
            "threads": torch.get_num_threads(), "pyprune": __version__, "torch": torch.__version__}


def output_report(args, report: dict, model_dir: Optional[str] = None) -> None:
    """``report`` into the saved ``model_dir`` (when given) and to --report (when given), by
    :func:`pyprune.io.write_report`."""
    from ..runtime import distributed
    if not distributed.is_main():
        return
    write_report(report, model_dir=model_dir, report_file=args.report)
    if args.report:
        print(f"wrote {args.report}")


def save_evaluate_report(model, tok, args, report: dict, evaluate_into: Callable[[dict], bool],
                         what: str, recipe: Optional[dict] = None) -> None:
    """Save the model to --output (when given) before anything can fail in evaluation, so a
    finished prune or training is never lost; then ``evaluate_into(report)``, which adds its
    results and says whether it evaluated anything; then the report, into the saved directory too.
    The report records ``config_compatible`` (whether plain ``from_pretrained`` reads the saved
    directory); the saved directory holds ``recipe`` (:mod:`pyprune.recipes`) as ``recipe.yaml``. A report that cannot be written is a one-line error saying where the model is."""
    from ..io import config_compatible, save
    from ..runtime import distributed
    if args.output and distributed.is_main():  # in a process group the others evaluate their shards alone
        report["config_compatible"] = config_compatible(model)
        try:
            save(model, tok, args.output, report=report, overwrite=getattr(args, "overwrite", False), recipe=recipe)
        except FileExistsError:
            raise UsageError(f"--output {args.output} was filled by another run while this one worked; nothing "
                             f"was replaced and the {what} was not saved: rerun with another --output") from None
        print(f"saved the {what} to {args.output}")
    evaluated = evaluate_into(report)
    try:
        output_report(args, report, model_dir=args.output if evaluated else None)
    except (OSError, ValueError) as error:
        if not args.output:
            raise
        raise UsageError(f"the {what} is saved in {args.output}, but the report could not be written "
                         f"({first_line(error)})") from None
