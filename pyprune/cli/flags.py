"""The flags that several subcommands share (model, device, dtype, batch size; calibration;
evaluation; pattern; zero-shot tasks) and the method's own options (--threads and --quiet, flags of
every subcommand: :mod:`pyprune.cli.environment`).

A method's options are flags of the subcommand only when ``--method NAME`` names a method that
serves it: :func:`method_named_in` reads the name before the parser is built, and
:func:`add_method_flags` adds that method's declared options (``pyprune.methods.options``) alone.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Sequence


from ..inputs import data
from ..inputs.models import MODEL_ALIASES
from .. import methods
from ..patterns import NM, Structured, Unstructured
from ..recipes import PATTERN_FIELDS, pattern_from as pattern_of
from .checks import DTYPES, UsageError



def method_named_in(argv: Sequence[str]) -> Optional[str]:
    """The value of ``--method`` in ``argv`` (``--method X`` or ``--method=X``), or None."""
    for index, arg in enumerate(argv):
        if arg == "--method" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--method="):
            return arg.split("=", 1)[1]
    return None


#: What --model accepts, with every model alias pyprune fetches on first use.
MODEL_HELP = ("a Hugging Face model directory, a pyprune output directory, a model alias fetched on first "
              f"use ({', '.join(sorted(MODEL_ALIASES))}), or a Hugging Face hub id org/name[@REVISION] read from "
              "the Hugging Face cache or downloaded into it (an existing directory of that name wins)")


def add_model_flags(parser: argparse.ArgumentParser, *, dtype: bool = True, batch_size: int = 8,
                    batch_help: str = "calibration/evaluation batch size", model_help: str = "") -> None:
    """--model, --device, --dtype (unless ``dtype`` is False), --batch-size."""
    parser.add_argument("--model", required=True, help=model_help or MODEL_HELP)
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    if dtype:
        add_dtype_flag(parser)
    parser.add_argument("--batch-size", type=int, default=batch_size, help=f"{batch_help} (default {batch_size})")


def add_dtype_flag(parser: argparse.ArgumentParser, what: str = "the model's weights and activations") -> None:
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help=f"dtype of {what} (default float32)")


def add_method_flag(parser: argparse.ArgumentParser, command: str, required: bool = True) -> None:
    names = methods.serving(command)
    parser.add_argument("--method", required=required,
                        help=f"one of {', '.join(names)}; `pyprune {command} --method NAME --help` lists its options")


def add_calibration_flags(parser: argparse.ArgumentParser, command: str, method: Optional[str],
                          calib_help: Optional[str], nsamples_help: str = "calibration samples",
                          calib_required: bool = False) -> None:
    """--calib (unless ``calib_help`` is None), --nsamples, --seqlen, --seed. The sample count and
    length default to the method's (:attr:`Method.calibration`): the help gives ``method``'s, or
    every serving method's."""
    if calib_help is not None:
        parser.add_argument("--calib", required=calib_required, help=calib_help)
    parser.add_argument("--nsamples", type=int, default=None,
                        help=f"{nsamples_help} (default: {_calibration_defaults(command, method, 0)})")
    parser.add_argument("--seqlen", type=int, default=None,
                        help=f"calibration sample length (default: {_calibration_defaults(command, method, 1)})")
    parser.add_argument("--seed", type=int, default=0, help="calibration sampling seed (default 0)")


def _calibration_defaults(command: str, method: Optional[str], which: int) -> str:
    if method in methods.serving(command):
        return f"{methods.METHODS[method].calibration[which]} for {method}"
    by_value: Dict[int, List[str]] = {}
    for name in methods.serving(command):
        by_value.setdefault(methods.METHODS[name].calibration[which], []).append(name)
    return "the method's: " + "; ".join(f"{value} for {', '.join(names)}" for value, names in by_value.items())


def apply_calibration_defaults(args, runner) -> None:
    """--nsamples / --seqlen not given: the method's calibration defaults."""
    args.nsamples = runner.calibration[0] if args.nsamples is None else args.nsamples
    args.seqlen = runner.calibration[1] if args.seqlen is None else args.seqlen


def source_help(what: str) -> str:
    return (f"{what}: an embedded corpus ({', '.join(data.EMBEDDED)}), a .txt file, a directory, "
            "wikitext2/c4/ptb; any of them with :first_half or :second_half")


def add_eval_flags(parser: argparse.ArgumentParser, *, nargs: str = "*", required: bool = False,
                   seqlen: int = 512, eval_help: str = "evaluation texts (same forms as --calib)") -> None:
    """--eval, --eval-seqlen, --eval-tokens."""
    parser.add_argument("--eval", nargs=nargs, required=required, help=eval_help)
    parser.add_argument("--eval-seqlen", type=int, default=seqlen, help=f"perplexity window (default {seqlen})")
    add_eval_tokens_flag(parser, old="--eval-max-tokens")


def add_eval_tokens_flag(parser: argparse.ArgumentParser, old: Optional[str] = None,
                         default: Optional[int] = None) -> None:
    """--eval-tokens: the one name of the evaluation token limit in every subcommand (``old``, the
    name it had in this subcommand, still works)."""
    names = ["--eval-tokens"] + ([old] if old else [])
    parser.add_argument(*names, dest="eval_tokens", type=int, default=default, metavar="N",
                        help="evaluate the first N tokens of each text only (default: "
                             f"{'all' if default is None else default})" + (f"; {old} is the old name" if old else ""))


def add_pattern_flags(parser: argparse.ArgumentParser, structured: bool = True) -> None:
    """--sparsity / --scope / --pattern, and with ``structured`` --ratio / --uniform."""
    parser.add_argument("--sparsity", type=float, help="unstructured sparsity in [0, 1)")
    parser.add_argument("--scope", choices=["row", "tensor"], default=None,
                        help="unstructured selection per output row or per layer (default: the method's)")
    parser.add_argument("--pattern", help="N:M semi-structured pattern, e.g. 2:4 or 4:8")
    if structured:
        add_ratio_flags(parser)
    else:
        parser.set_defaults(ratio=None, uniform=False)


def add_ratio_flags(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument("--ratio", type=float, required=required, help="structured ratio removed: of the heads and channels (each expert's, "
                        "in an MoE model), of the blocks (sleb), of the experts (reap)")
    parser.add_argument("--uniform", action="store_true",
                        help="structured: same sizes in every layer, so plain transformers can load it")


def pattern_from(args):
    """The one pattern given by --sparsity (with --scope), --pattern or --ratio (with --uniform)."""
    try:
        return pattern_of({name: getattr(args, name, None) for name in PATTERN_FIELDS}, lambda name: f"--{name}")
    except ValueError as error:
        raise UsageError(str(error)) from None


def check_pattern(runner, pattern) -> None:
    """``runner`` produces ``pattern`` (:meth:`pyprune.methods.base.Method.check_pattern`, its hint
    written as flags); a UsageError otherwise."""
    try:
        runner.check_pattern(pattern, _pattern_flags)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _pattern_flags(kinds, like) -> str:
    """The flags that give a pattern of ``kinds`` (with the amount of ``like``)."""
    amount = f"{getattr(like, 'sparsity', getattr(like, 'ratio', 0.5)):g}"
    flags = {Unstructured: f"--sparsity {amount}", NM: "--pattern 2:4", Structured: f"--ratio {amount}"}
    return " or ".join(flags[kind] for kind in kinds)


def structured_from(args) -> Structured:
    """--ratio R (with --uniform) as a pattern; 0 (nothing removed) is refused: on the command line it is a mistake."""
    try:
        return pattern_of({"ratio": args.ratio, "uniform": args.uniform}, lambda name: f"--{name}")
    except ValueError as error:
        raise UsageError(str(error)) from None


def add_dist_timeout_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dist-timeout", type=float, default=None, metavar="SECONDS",
                        help="under torchrun: seconds a rank waits for a silent one before the job fails "
                             "(default 600)")


def add_overwrite_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an --output directory that pyprune saved before (never one holding other "
                             "files); the old one stays until the new one is complete")


def add_zero_shot_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", help="zero-shot accuracy (lm-evaluation-harness, extra pyprune[eval]) on "
                        "these comma-separated tasks: austen_continuation, moby_dick_continuation, "
                        "python_continuation (local, no download) or lm-eval names (piqa, arc_easy, ...)")
    parser.add_argument("--limit", type=int, default=None, help="with --tasks: the first N items of each task")


def _parse_bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false; got {text!r}")


def add_method_flags(parser: argparse.ArgumentParser, command: str, method: Optional[str]) -> None:
    """One flag per declared option of ``method``, when it names a method serving ``command``."""
    if method not in methods.serving(command):
        return
    add_option_flags(parser.add_argument_group(f"options of method {method}"), methods.METHODS[method].options,
                     "option_")


def add_option_flags(group, declared, prefix: str) -> None:
    """One flag per declared option (:mod:`pyprune.options`: a method's, a study's, LoRA
    recovery's), its value in ``args.<prefix><name>``, None when not given; an option without a
    default (neither ``Optional`` nor set by default) is a required flag; a ``Tuple[type, ...]``
    option takes one or more values; a bool takes true or false, or none (true)."""
    for option in declared:
        kwargs = {"choices": option.choices} if option.choices else {}
        if option.many:
            kwargs["nargs"] = "+"
        if option.type is bool:  # --owl alone is --owl true
            kwargs.update(nargs="?", const=True)
        required = option.default is None and not option.optional
        default = " ".join(map(str, option.default)) if option.many and option.default else repr(option.default)
        group.add_argument(option.flag, dest=f"{prefix}{option.name}", default=None, metavar=option.name.upper(),
                           type=_parse_bool if option.type is bool else option.type, required=required,
                           help=f"{option.help} ({'required' if required else 'default ' + default})"
                           .replace("%", "%%"), **kwargs)


def check_method(command: str, name: str) -> None:
    """``name`` is a method that serves ``command``."""
    if name not in methods.METHODS:
        raise UsageError(f"--method must be one of {', '.join(sorted(methods.METHODS))}; got {name!r}")
    if name not in methods.serving(command):
        raise UsageError(f"--method for {command} must be one of {', '.join(methods.serving(command))}; "
                         f"got {name!r}")


def unrecognised(args, extras: Sequence[str]) -> str:
    """The error for arguments the parser did not take: an option of another method is named as such."""
    method = getattr(args, "method", None)
    flags = [arg for arg in extras if arg.startswith("--")]
    if method in methods.METHODS and flags:
        declared = [option.name for option in methods.METHODS[method].options]
        others = {option.name for cls in methods.METHODS.values() for option in cls.options}
        name = flags[0][2:].split("=", 1)[0].replace("-", "_")
        if name in others:
            return (f"method {method!r} has no option {name}; its options: "
                    f"{', '.join(declared) if declared else 'none'}")
    return f"unrecognized arguments: {' '.join(extras)}"


def method_option_values(args) -> dict:
    """The options of ``args.method`` given on the command line."""
    cls = methods.METHODS[args.method]
    return {option.name: getattr(args, f"option_{option.name}") for option in cls.options
            if getattr(args, f"option_{option.name}", None) is not None}


def build_method(args):
    """``args.method`` built with its options from the command line; a bad value is a UsageError."""
    try:
        return methods.get(args.method, **method_option_values(args))
    except ValueError as error:
        raise UsageError(str(error)) from None
