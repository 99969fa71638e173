"""The ``pyprune`` command line: prune, recover, continual, eval, robustness, demo.

    pyprune prune --model smollm2-135m --method wanda --pattern 2:4 --calib emma \\
                  --eval pride_and_prejudice --output pruned/ --report report.json
    pyprune eval --model pruned/ --data pride_and_prejudice --tasks austen_continuation,piqa --limit 200
    pyprune compare dense.json wanda.json sparsegpt.json --output comparison/
    pyprune recover --model pruned/ --calib emma --steps 200 --eval pride_and_prejudice \\
                    --output recovered/ --report recover.json
    pyprune robustness --model smollm2-135m --method moreau --ratio 0.2 --calib emma \\
                       --eval pride_and_prejudice --report robust.json
    pyprune continual --model smollm2-135m --method copal --sparsity 0.5 \\
                      --datasets austen moby_dick python --report continual.json
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

from . import data, methods, storage
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
            return _structured(args)
        pattern = parse(args.pattern)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not isinstance(pattern, NM):
        raise UsageError(f"--pattern takes N:M (e.g. 2:4, 4:8); got {args.pattern!r}")
    return pattern


def _structured(args) -> Structured:
    """--ratio R as a pattern; 0 (nothing removed) is refused: on the command line it is a mistake."""
    if args.ratio == 0:
        raise UsageError("--ratio must be in (0, 1): 0 removes nothing")
    return Structured(args.ratio, uniform=args.uniform)


def _check_output(path: Optional[str], flag: str) -> None:
    if path is None:
        return
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UsageError(f"{flag} {path} already exists and is not an empty directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: the parent directory {parent} does not exist")


def _check_report(path: Optional[str]) -> None:
    if path is None:
        return
    if os.path.isdir(path):
        raise UsageError(f"--report {path} is a directory; give the path of a JSON file")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise UsageError(f"--report {path}: its directory does not exist")


def _check_counts(args, flags, optional=()) -> None:
    """Every integer flag in ``flags`` (and in ``optional`` when given) is >= 1."""
    for flag in list(flags) + [f for f in optional if getattr(args, f) is not None]:
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}")


def _check_device(device: str) -> None:
    """A device this torch build has (``--device cuda`` on a CPU build is refused before loading)."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    backend = getattr(torch, kind, None)
    if kind != "cpu" and not (hasattr(backend, "is_available") and backend.is_available()):
        raise UsageError(f"--device {device}: this torch build ({torch.__version__}) has no usable {kind} "
                         "device; use --device cpu")
    index = torch.device(device).index
    if index is not None and hasattr(backend, "device_count") and index >= backend.device_count():
        raise UsageError(f"--device {device}: there are {backend.device_count()} {kind} devices")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _check_model(model: str):
    """The model's config, read before its weights load, with its ``pyprune.json`` and the headers
    of its safetensors files checked: a broken file is named in one line."""
    from transformers import AutoConfig

    from . import io
    from .models import resolve_model_dir
    directory = resolve_model_dir(model)
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise UsageError(f"--model {model}: {directory} has no config.json, so it is not a Hugging Face model "
                         "directory")
    try:
        with open(config_path, encoding="utf-8") as handle:
            json.load(handle)
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"--model {model}: {config_path} is not a valid model config ({_first_line(error)})") from None
    io.read_manifest(directory)
    io.check_weights(directory)
    return config


def _check_method_config(runner, config, pattern) -> None:
    """The method's checks that need only the model's config and files on disk (e.g. DReSS's channel
    rounding, a COPAL state's settings)."""
    try:
        runner.check_config(config, pattern)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    from .models import resolve_model_dir
    try:
        return AutoTokenizer.from_pretrained(resolve_model_dir(model), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(f"--model {model}: could not load its tokenizer ({_first_line(error)})") from None


def _read(flag: str, source: str, read):
    """``read()`` of a text source; a dataset that cannot be loaded now becomes a UsageError."""
    try:
        return read()
    except RuntimeError as error:
        raise UsageError(f"{flag} {source}: {error}") from None


def _calibration(tokenizer, source: str, args, flag: str = "--calib"):
    return _read(flag, source, lambda: data.calibration_samples(tokenizer, source, nsamples=args.nsamples,
                                                                seqlen=args.seqlen, seed=args.seed))


def _eval_streams(tokenizer, sources: List[str], seqlen: int, max_tokens: Optional[int], flag: str,
                  seqlen_flag: str) -> list:
    """(source, token stream) of every evaluation text, each checked to hold one window at least,
    before the model loads."""
    streams = []
    for source in sources:
        tokens = _read(flag, source, lambda: data.eval_tokens(tokenizer, source, max_tokens=max_tokens))
        if tokens.numel() < seqlen:
            raise UsageError(f"{flag} {source} has {tokens.numel()} tokens, fewer than one window of "
                             f"{seqlen_flag} {seqlen}")
        streams.append((source, tokens))
    return streams


def _evaluate(model, streams: list, seqlen: int, batch_size: int, progress: bool):
    from .eval import perplexity
    results = []
    for source, tokens in streams:
        ppl = perplexity(model, tokens, seqlen, batch_size=batch_size, progress=progress)
        used = tokens.numel() // seqlen * seqlen
        results.append({"data": source, "perplexity": round(ppl, 4), "tokens": used, "seqlen": seqlen})
        print(f"perplexity {ppl:.3f} on {source} ({used} tokens, seqlen {seqlen})")
    return results


def _zero_shot_tasks(args):
    """Check --tasks / --limit and load the tasks with their data (lm-eval), before any model work:
    an unknown task, a missing extra or data that cannot be downloaded is a one-line error."""
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1; got {args.limit}")
    if args.tasks is None:
        if args.limit is not None:
            raise UsageError("--limit needs --tasks")
        return None
    from . import zeroshot
    names = [name.strip() for name in args.tasks.split(",")]
    try:
        return zeroshot.load_tasks(names)
    except (ImportError, zeroshot.TaskDataError, ValueError) as error:
        raise UsageError(f"--tasks: {error}") from None


def _add_zero_shot_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", help="zero-shot accuracy (lm-evaluation-harness, extra pyprune[eval]) on "
                        "these comma-separated tasks: austen_continuation, moby_dick_continuation, "
                        "python_continuation (local, no download) or lm-eval names (piqa, arc_easy, ...)")
    parser.add_argument("--limit", type=int, default=None, help="with --tasks: the first N items of each task")


def _zero_shot(model, tokenizer, tasks, args) -> dict:
    from . import zeroshot
    results = zeroshot.evaluate(model, tokenizer, tasks, limit=args.limit, batch_size=args.batch_size)
    for name, result in results.items():
        norm = "" if result["acc_norm"] is None else f", acc_norm {result['acc_norm']:.4f}"
        print(f"{name}: acc {result['acc']:.4f} ± {result['stderr']['acc']:.4f}{norm} ({result['n']} items, "
              f"{result['num_fewshot']}-shot)")
    return results


def _load(args):
    from .models import load_model
    return load_model(args.model, dtype=DTYPES[args.dtype], device=args.device)


def _run_info(args) -> dict:
    """What a report records of the run itself."""
    from . import __version__
    return {"device": args.device, "dtype": getattr(args, "dtype", "float32"), "batch_size": args.batch_size,
            "threads": torch.get_num_threads(), "pyprune": __version__, "torch": torch.__version__}


def _method_option_values(args) -> dict:
    """The method options given on the command line (flags from the methods' declarations)."""
    return {name: getattr(args, f"option_{name}") for name in _declared_options()
            if getattr(args, f"option_{name}", None) is not None}


def _declared_options() -> dict:
    """Every declared method option by name: (option, {method: default}, [distinct helps])."""
    declared = {}
    for name, cls in sorted(methods.METHODS.items()):
        for option in cls.options:
            _, defaults, helps = declared.setdefault(option.name, (option, {}, []))
            defaults[name] = option.default
            if option.help not in helps:
                helps.append(option.help)
    return declared


def _parse_bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false; got {text!r}")


def _add_method_options(parser: argparse.ArgumentParser) -> None:
    """One flag per declared method option (shared names share a flag)."""
    group = parser.add_argument_group("method options (each applies to the methods named in its help)")
    for name, (option, defaults, helps) in _declared_options().items():
        values = set(map(repr, defaults.values()))
        default = (f"default {next(iter(values))}" if len(values) == 1 else
                   "defaults " + ", ".join(f"{m} {d!r}" for m, d in defaults.items()))
        kwargs = {"choices": option.choices} if option.choices else {}
        group.add_argument(option.flag, dest=f"option_{name}", default=None,
                           type=_parse_bool if option.type is bool else option.type, metavar=name.upper(),
                           help=f"{'; '.join(helps)} [{', '.join(defaults)}; {default}]", **kwargs)


def _build_method(name: str, args):
    try:
        return methods.get(name, **_method_option_values(args))
    except ValueError as error:
        raise UsageError(str(error)) from None


def cmd_prune(args) -> int:
    pattern = _pattern(args)
    runner = _build_method(args.method, args)
    args.nsamples = runner.calibration[0] if args.nsamples is None else args.nsamples
    args.seqlen = runner.calibration[1] if args.seqlen is None else args.seqlen
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
    _check_counts(args, ("nsamples", "seqlen", "batch_size", "eval_seqlen"), optional=("eval_max_tokens",))
    _check_device(args.device)
    _check_method_config(runner, _check_model(args.model), pattern)
    tokenizer = _tokenizer(args.model)
    calib = _calibration(tokenizer, args.calib, args) if runner.needs_calibration else None
    streams = _eval_streams(tokenizer, args.eval or [], args.eval_seqlen, args.eval_max_tokens, "--eval",
                            "--eval-seqlen")
    tasks = _zero_shot_tasks(args)

    from . import pruning
    from .io import save, write_report
    model, tokenizer = _load(args)
    report = pruning.prune(model, args.method, pattern, calib, batch_size=args.batch_size,
                           progress=not args.quiet, **_method_option_values(args))
    print(f"{args.method} {pattern}: measured sparsity {report['sparsity']:.4f} in {report['time_s']:.1f} s")
    report.update({"model": args.model, "calib": args.calib, "nsamples": args.nsamples,
                   "seqlen": args.seqlen, "seed": args.seed, **_run_info(args)})
    if args.sparse_layers:
        from .nn import sparsify_
        report["sparse_layers"] = len(sparsify_(model, pattern))
        print(f"stored {report['sparse_layers']} layers as SparseLinear {pattern}")
    if args.output:  # saved before evaluating: a failing evaluation never loses the prune
        save(model, tokenizer, args.output, report=report)
        print(f"saved the pruned model to {args.output}")
    report["eval"] = _evaluate(model, streams, args.eval_seqlen, args.batch_size, not args.quiet)
    if tasks is not None:
        report["tasks"] = _zero_shot(model, tokenizer, tasks, args)
    if args.output and (report["eval"] or tasks is not None):
        write_report(args.output, report)
    if args.report:
        storage.write_json(args.report, report)
        print(f"wrote {args.report}")
    return 0


def cmd_robustness(args) -> int:
    """Prune in bf16 and in fp16, compare the pruned groups and perplexities (MoreauPruner Table 1)."""
    from . import robustness
    runner = _build_method(args.method, args)
    if not isinstance(runner, methods.StructuredMethod):
        structured = sorted(n for n, c in methods.METHODS.items() if issubclass(c, methods.StructuredMethod))
        raise UsageError(f"--method for robustness must be a structured method ({', '.join(structured)}); "
                         f"got {args.method!r}")
    try:
        _structured(args)
    except ValueError as error:
        raise UsageError(str(error)) from None
    args.nsamples = runner.calibration[0] if args.nsamples is None else args.nsamples
    args.seqlen = runner.calibration[1] if args.seqlen is None else args.seqlen
    _check_counts(args, ("nsamples", "seqlen", "batch_size", "eval_seqlen"), optional=("eval_max_tokens",))
    for source in (args.calib, args.eval):
        data.check_source(source)
    _check_report(args.report)
    _check_device(args.device)
    _check_method_config(runner, _check_model(args.model), _structured(args))
    tokenizer = _tokenizer(args.model)
    calib = _calibration(tokenizer, args.calib, args)
    [(_, tokens)] = _eval_streams(tokenizer, [args.eval], args.eval_seqlen, args.eval_max_tokens, "--eval",
                                  "--eval-seqlen")

    from .models import load_model
    model, _ = load_model(args.model, dtype=torch.float32, device=args.device)
    report = robustness.study(model, args.method, args.ratio, calib, tokens, eval_seqlen=args.eval_seqlen,
                              arithmetic=args.arithmetic, uniform=args.uniform, batch_size=args.batch_size,
                              progress=not args.quiet, **_method_option_values(args))
    report.update({"model": args.model, "calib": args.calib, "nsamples": args.nsamples, "seqlen": args.seqlen,
                   "seed": args.seed, "eval": args.eval, "eval_tokens": tokens.numel() // args.eval_seqlen
                   * args.eval_seqlen, "eval_seqlen": args.eval_seqlen, **_run_info(args)})
    print(f"{args.method} at {args.ratio}: perplexity bf16 {report['ppl_bf16']:.3f}, fp16 "
          f"{report['ppl_fp16']:.3f}, ppl_diff {report['ppl_diff']:.3f}, agreement {report['agreement']:.4f} "
          f"({args.arithmetic})")
    storage.write_json(args.report, report)
    print(f"wrote {args.report}")
    return 0


def _continual_sources(args):
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
    for calib, evaluation in pairs:
        data.check_source(calib)
        data.check_source(evaluation)
    return pairs


def cmd_continual(args) -> int:
    """COPAL's continual setting: prune on datasets one after another, evaluate all after each."""
    from . import continual
    pattern = _pattern(args)
    runner = _build_method(args.method, args)
    if not isinstance(pattern, runner.patterns) or not runner.needs_calibration:
        raise UsageError(f"--method {args.method!r} is not a calibrated unstructured/N:M method "
                         "(continual: copal, wanda, sparsegpt)")
    if args.init == "cumulative" and (runner.keeps_state or not getattr(runner, "can_accumulate", False)):
        raise UsageError(f"--init cumulative needs a method whose statistics add up across datasets (wanda, "
                         f"sparsegpt); got --method {args.method!r}")
    if len(set(args.datasets)) != len(args.datasets) or len(args.datasets) < 2:
        raise UsageError(f"--datasets needs two or more distinct texts; got {args.datasets}")
    pairs = _continual_sources(args)
    args.nsamples = runner.calibration[0] if args.nsamples is None else args.nsamples
    args.seqlen = runner.calibration[1] if args.seqlen is None else args.seqlen
    _check_counts(args, ("nsamples", "seqlen", "batch_size", "eval_seqlen"), optional=("eval_max_tokens",))
    _check_report(args.report)
    _check_device(args.device)
    _check_method_config(runner, _check_model(args.model), pattern)
    settings = {"model": args.model, "dtype": args.dtype, "method": args.method, "pattern": str(pattern),
                "scope": getattr(runner.resolve(pattern), "scope", None), "init": args.init,
                "permutations": args.permutations, "datasets": args.datasets,
                "sources": [list(pair) for pair in pairs], "nsamples": args.nsamples, "seqlen": args.seqlen,
                "seed": args.seed, "eval_seqlen": args.eval_seqlen, "eval_max_tokens": args.eval_max_tokens,
                "options": runner.settings}
    done = {}
    if os.path.exists(args.report):
        try:
            with open(args.report, encoding="utf-8") as f:
                previous = json.load(f)
        except ValueError as error:
            raise UsageError(f"--report {args.report} is not valid JSON ({error}); remove it or choose another "
                             "path") from None
        if not isinstance(previous, dict) or previous.get("settings") != settings:
            raise UsageError(f"--report {args.report} holds a run with other settings; remove it or choose "
                             "another path")
        done = {tuple(run["order"]): run["steps"] for run in previous["matrix"]}
        print(f"resuming: {len(done)} order(s) already in {args.report}")

    tokenizer = _tokenizer(args.model)
    tasks = [continual.Task(name, _calibration(tokenizer, calib, args, "--datasets"),
                            _eval_streams(tokenizer, [evaluation], args.eval_seqlen, args.eval_max_tokens,
                                          "--eval" if args.eval else "--datasets", "--eval-seqlen")[0][1])
             for name, (calib, evaluation) in zip(args.datasets, pairs)]
    model, _ = _load(args)

    def checkpoint(order, steps):
        done[order] = steps
        storage.write_json(args.report, {"settings": settings, "partial": True,
                                         "matrix": [{"order": list(o), "steps": s} for o, s in done.items()]})

    report = continual.run(model, args.method, pattern, tasks, init=args.init, permutations=args.permutations,
                           eval_seqlen=args.eval_seqlen, batch_size=args.batch_size, progress=not args.quiet,
                           done=done, on_order=checkpoint, method_options=_method_option_values(args))
    report["settings"] = settings
    report["run"] = _run_info(args)
    print(f"{args.method} {pattern} ({report['init']}): A-PPL {report['a_ppl']:.3f}, M-PPL {report['m_ppl']:.3f}, "
          f"A-BWT {report['a_bwt']:.3f}, M-BWT {report['m_bwt']:.3f} over {len(report['matrix'])} order(s)")
    storage.write_json(args.report, report)
    print(f"wrote {args.report}")
    return 0


def cmd_eval(args) -> int:
    _check_counts(args, ("seqlen", "batch_size"), optional=("max_tokens",))
    if not args.data and args.tasks is None:
        raise UsageError("give --data TEXT ... (perplexity) and/or --tasks NAME,... (zero-shot accuracy)")
    for source in args.data:
        data.check_source(source)
    _check_report(args.report)
    _check_device(args.device)
    _check_model(args.model)
    streams = _eval_streams(_tokenizer(args.model), args.data, args.seqlen, args.max_tokens, "--data", "--seqlen")
    tasks = _zero_shot_tasks(args)
    model, tokenizer = _load(args)
    report = {"model": args.model, "eval": _evaluate(model, streams, args.seqlen, args.batch_size, not args.quiet)}
    if tasks is not None:
        report["tasks"] = _zero_shot(model, tokenizer, tasks, args)
    if args.report:
        storage.write_json(args.report, {**report, **_run_info(args)})
    return 0


def cmd_compare(args) -> int:
    """Reports -> one markdown table (best per column in bold) and a figure (PNG + SVG)."""
    from . import compare
    reports = [compare.load_report(path) for path in args.reports]
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise UsageError(f"--output {args.output} exists and is not a directory")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise UsageError(f"--output {args.output}: its parent directory does not exist")
    written = compare.compare(reports, args.output, name=args.name)
    print(compare.markdown_table(compare.rows(reports)), end="")
    print(f"wrote {written['markdown']}, {written['png']}, {written['svg']}")
    return 0


def cmd_recover(args) -> int:
    """LoRA recovery fine-tuning of a (pruned) model, merged back into dense weights."""
    from . import recovery
    recovery.check_settings(steps=args.steps, rank=args.rank, alpha=args.alpha, lr=args.lr,
                            batch_size=args.batch_size, seed=args.seed, target_modules=args.target_modules)
    _check_counts(args, ("nsamples", "eval_seqlen"), optional=("eval_max_tokens",))
    if args.seqlen < 2:
        raise UsageError(f"--seqlen must be >= 2 (next-token loss); got {args.seqlen}")
    if args.batch_size > args.nsamples:
        raise UsageError(f"--batch-size {args.batch_size} is larger than --nsamples {args.nsamples}")
    for source in [args.calib] + list(args.eval or []):
        data.check_source(source)
    _check_output(args.output, "--output")
    _check_report(args.report)
    _check_device(args.device)
    _check_model(args.model)
    tokenizer = _tokenizer(args.model)
    calib = _calibration(tokenizer, args.calib, args)
    streams = _eval_streams(tokenizer, args.eval or [], args.eval_seqlen, args.eval_max_tokens, "--eval",
                            "--eval-seqlen")

    from .io import save, write_report
    model, tokenizer = _load(args)
    report = {"model": args.model, "calib": args.calib, **_run_info(args)}
    report["eval_before"] = _evaluate(model, streams, args.eval_seqlen, args.batch_size, not args.quiet)
    report["recovery"] = recovery.lora_finetune(
        model, calib, steps=args.steps, rank=args.rank, alpha=args.alpha, lr=args.lr, batch_size=args.batch_size,
        target_modules=args.target_modules, seed=args.seed, progress=not args.quiet)
    done = report["recovery"]
    if args.steps:
        print(f"LoRA rank {args.rank} on {done['lora_layers']} layers, {args.steps} steps in {done['time_s']:.1f} s: "
              f"training loss {done['first_loss']:.4f} -> {done['last_loss']:.4f}")
    save(model, tokenizer, args.output, report=report)  # before evaluating: the training is never lost
    print(f"saved the recovered model to {args.output}")
    report["eval_after"] = _evaluate(model, streams, args.eval_seqlen, args.batch_size, not args.quiet)
    if report["eval_after"]:
        write_report(args.output, report)
    if args.report:
        storage.write_json(args.report, report)
        print(f"wrote {args.report}")
    return 0


def cmd_demo(args) -> int:
    """Wanda 2:4 on SmolLM2-135M, calibrated on Emma, measured on Pride and Prejudice."""
    from . import pruning
    from .eval import perplexity
    from .models import load_model
    calib_source, eval_source = "emma", "pride_and_prejudice"
    _check_counts(args, ("nsamples", "eval_tokens"))
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
    prune.add_argument("--nsamples", type=int, default=None,
                       help="calibration samples (default: the method's; 64, or 10 for the structured "
                            "gradient methods as in LLM-Pruner/MoreauPruner)")
    prune.add_argument("--seqlen", type=int, default=None,
                       help="calibration sample length (default: the method's; 512, or 128)")
    prune.add_argument("--seed", type=int, default=0)
    prune.add_argument("--eval", nargs="*", help="evaluation texts (same forms as --calib)")
    prune.add_argument("--eval-seqlen", type=int, default=512)
    prune.add_argument("--eval-max-tokens", type=int, default=None)
    prune.add_argument("--output", help="directory for the pruned model (written atomically)")
    prune.add_argument("--sparse-layers", action="store_true",
                       help="with --pattern N:M and --output: store the pruned linears as SparseLinear "
                            "(compressed N:M, 9/16 of the dense bytes for 16-bit 2:4/4:8)")
    prune.add_argument("--report", help="JSON report path")
    _add_zero_shot_options(prune)
    _add_method_options(prune)
    prune.set_defaults(run=cmd_prune)

    robust = sub.add_parser("robustness", help="prune in bf16 and in fp16 and compare (MoreauPruner Table 1)")
    robust.add_argument("--model", required=True, help="as for prune; loaded in fp32, then cast to each format")
    robust.add_argument("--device", default="cpu", help="torch device (default cpu)")
    robust.add_argument("--method", required=True, help="a structured method: moreau, moreau-gs, taylor, smoothgrad")
    robust.add_argument("--ratio", type=float, required=True, help="structured ratio of heads/channels removed")
    robust.add_argument("--uniform", action="store_true", help="same sizes in every layer")
    robust.add_argument("--calib", required=True, help="calibration text (as for prune)")
    robust.add_argument("--nsamples", type=int, default=None, help="default: the method's (10)")
    robust.add_argument("--seqlen", type=int, default=None, help="default: the method's (128)")
    robust.add_argument("--seed", type=int, default=0, help="calibration sampling seed")
    robust.add_argument("--eval", required=True, help="evaluation text (as for prune)")
    robust.add_argument("--eval-seqlen", type=int, default=128, help="perplexity windows (paper: 128)")
    robust.add_argument("--eval-max-tokens", type=int, default=None)
    robust.add_argument("--arithmetic", choices=["fp32-accumulate", "native"], default="fp32-accumulate",
                        help="16-bit weights with fp32-accumulated linear layers (default, as tensor cores do), "
                             "or torch's native 16-bit kernels throughout (slow for fp16 on CPU)")
    robust.add_argument("--batch-size", type=int, default=8)
    robust.add_argument("--report", required=True, help="JSON report path (written atomically)")
    robust.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_method_options(robust)
    robust.set_defaults(run=cmd_robustness)

    cont = sub.add_parser("continual", help="continual pruning over a sequence of datasets with backward "
                          "transfer (COPAL)")
    common(cont)
    cont.add_argument("--method", required=True, help="copal, or a baseline: wanda, sparsegpt")
    cont.add_argument("--sparsity", type=float, help="unstructured sparsity in [0, 1)")
    cont.add_argument("--scope", choices=["row", "tensor"], default=None,
                      help="unstructured selection per output row or per layer (default: the method's)")
    cont.add_argument("--pattern", help="N:M semi-structured pattern, e.g. 2:4 or 4:8")
    cont.add_argument("--datasets", nargs="+", required=True,
                      help="the sequence of texts (as --calib of prune); without --eval the first half of each "
                           "calibrates and the second half evaluates")
    cont.add_argument("--eval", nargs="+", help="one evaluation text per dataset")
    cont.add_argument("--eval-seqlen", type=int, default=512)
    cont.add_argument("--eval-max-tokens", type=int, default=None)
    cont.add_argument("--nsamples", type=int, default=None, help="calibration samples per dataset "
                      "(default: the method's; COPAL 16)")
    cont.add_argument("--seqlen", type=int, default=None, help="calibration sample length (default: the method's)")
    cont.add_argument("--seed", type=int, default=0, help="calibration sampling seed (the same for every order)")
    cont.add_argument("--permutations", choices=["given", "all"], default="given",
                      help="run the given order, or every order of the datasets")
    cont.add_argument("--init", choices=["global", "sequential", "cumulative"], default="global",
                      help="baselines: re-prune the dense model on each dataset (global), prune the "
                           "already-pruned model (sequential), or prune the dense model from statistics summed "
                           "over the datasets so far (cumulative: wanda, sparsegpt); COPAL keeps its own "
                           "continual state")
    cont.add_argument("--report", required=True, help="JSON report (rewritten after every order; an existing "
                      "report of the same settings is resumed)")
    _add_method_options(cont)
    cont.set_defaults(run=cmd_continual, ratio=None, uniform=False)

    evaluate = sub.add_parser("eval", help="perplexity of a model on texts, zero-shot accuracy on tasks")
    common(evaluate)
    evaluate.add_argument("--data", nargs="*", default=[], help="texts for perplexity (as prune's --calib)")
    evaluate.add_argument("--seqlen", type=int, default=512)
    evaluate.add_argument("--max-tokens", type=int, default=None)
    evaluate.add_argument("--report", help="JSON report path")
    _add_zero_shot_options(evaluate)
    evaluate.set_defaults(run=cmd_eval)

    comp = sub.add_parser("compare", help="reports of prune/eval runs -> one markdown table and a figure")
    comp.add_argument("reports", nargs="+", help="JSON reports (pyprune prune/eval --report)")
    comp.add_argument("--output", default=".", help="directory for NAME.md, NAME.png, NAME.svg (default .)")
    comp.add_argument("--name", default="compare", help="file name stem (default compare)")
    comp.set_defaults(run=cmd_compare)

    recover = sub.add_parser("recover", help="LoRA recovery fine-tuning (RFT) of a pruned model, merged "
                             "back into dense weights")
    recover.add_argument("--model", required=True, help="a pyprune output directory, a Hugging Face model "
                         "directory, or the alias smollm2-135m")
    recover.add_argument("--device", default="cpu", help="torch device (default cpu)")
    recover.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    recover.add_argument("--calib", required=True, help="training text (same forms as prune's --calib)")
    recover.add_argument("--nsamples", type=int, default=64, help="training samples (default 64)")
    recover.add_argument("--seqlen", type=int, default=512, help="training sample length (default 512; "
                         "DReSS: 2048)")
    recover.add_argument("--seed", type=int, default=0, help="seed of the samples, the adapters' "
                         "initialisation and the batch order")
    recover.add_argument("--steps", type=int, required=True, help="optimizer steps (0: no training)")
    recover.add_argument("--rank", type=int, default=32, help="LoRA rank (default 32, as DReSS)")
    recover.add_argument("--alpha", type=float, default=10.0, help="LoRA alpha; the scale is alpha/rank "
                         "(default 10, as DReSS)")
    recover.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate, constant (default 1e-4; "
                         "DReSS: 2e-5)")
    recover.add_argument("--batch-size", type=int, default=4, help="training samples per step, also the "
                         "evaluation batch (default 4; DReSS: 64)")
    recover.add_argument("--target-modules", nargs="+", default=None, help="linears of the decoder blocks "
                         "to adapt (default all: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; "
                         "PEFT's llama default: q_proj v_proj)")
    recover.add_argument("--eval", nargs="*", help="evaluation texts, measured before and after")
    recover.add_argument("--eval-seqlen", type=int, default=512)
    recover.add_argument("--eval-max-tokens", type=int, default=None)
    recover.add_argument("--output", required=True, help="directory for the recovered model (written "
                         "atomically)")
    recover.add_argument("--report", help="JSON report path")
    recover.add_argument("--quiet", action="store_true", help="no progress bars")
    recover.set_defaults(run=cmd_recover)

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
    except KeyboardInterrupt:
        print(f"pyprune {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
