"""The ``pyprune`` command line: prune, run, eval, compare, recover, robustness, continual, study, generate, tune, demo.

    pyprune prune --model smollm2-135m --method wanda --pattern 2:4 --calib emma \\
                  --eval pride_and_prejudice --output pruned/ --report report.json
    pyprune run recipe.yaml                  # a whole run in one YAML file (docs/recipes.md)
    pyprune eval --model pruned/ --data pride_and_prejudice --tasks austen_continuation,piqa --limit 200
    pyprune compare dense.json wanda.json sparsegpt.json --output comparison/
    pyprune recover --model pruned/ --calib emma --steps 200 --eval pride_and_prejudice \\
                    --output recovered/ --report recover.json
    pyprune robustness --model smollm2-135m --method moreau --ratio 0.2 --calib emma \\
                       --eval pride_and_prejudice --report robust.json
    pyprune continual --model smollm2-135m --method copal --sparsity 0.5 \\
                      --datasets austen moby_dick python --report continual.json
    pyprune study robustness --methods moreau-gs --seeds 0 --layers middle   # `pyprune study --help` lists them
    pyprune generate --model pruned/ --prompt "It is a truth" --max-new-tokens 64
    pyprune tune --model pruned/ --tokens 1 8 256
    pyprune demo

A method's own options are flags once ``--method`` names it (``pyprune prune --method dress --help``).
Every argument is checked before the model is loaded or anything is written; a bad one prints a
one-line error and exits with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Iterable, List, Optional

from .commands import MODULES, SUMMARIES
from .usage import UsageError


def _module(command: str):
    return importlib.import_module(f"{__name__}.{MODULES[command]}")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, as every other refusal of the CLI: what is wrong
    and where the flags are listed (argparse would print the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the arguments)\n")


def build_parser(method: Optional[str] = None, commands: Optional[Iterable[str]] = None) -> argparse.ArgumentParser:
    """The parser; the subcommands that take ``--method`` get ``method``'s own option flags. Only
    the subcommands in ``commands`` (default: all) get their flags, which imports their modules
    (and torch); the others are listed by name and summary alone."""
    from . import environment
    from .. import __version__  # pyprune's __init__ is lazy: this imports no torch
    parser = OneLineParser(prog="pyprune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pyprune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    full = set(MODULES if commands is None else commands)
    for command in MODULES:
        if command in full:
            _module(command).register(sub, method)
            environment.add_flags(sub.choices[command])
        else:
            sub.add_parser(command, help=SUMMARIES[command])
    return parser


def _command_in(argv: List[str]) -> Optional[str]:
    """The subcommand ``argv`` names (its first word that is not an option), if it is one."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return first if first in MODULES else None


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_in(argv)
    if command is None:  # no or an unknown subcommand, or --help: answered without importing torch
        build_parser(commands=()).parse_args(argv)
        return 2  # not reached: that parse prints the help or the usage error and exits
    from . import environment, flags
    from ..runtime.distributed import RankFailed
    from .. import methods
    method = flags.method_named_in(argv)
    if method is not None and methods.serving(command):  # before the parse, so --help names a bad --method too
        try:
            flags.check_method(command, method)
        except UsageError as error:
            print(f"pyprune {command}: error: {error}", file=sys.stderr)
            return 2
    parser = build_parser(method, commands=[command])
    args, extras = parser.parse_known_args(argv)
    try:
        if extras:
            raise UsageError(flags.unrecognised(args, extras))
        with environment.applied(args):
            return args.run(args)
    except (UsageError, ValueError, FileNotFoundError) as error:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank checks the same arguments
            print(f"pyprune {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a file that could not be read or written, named in one line
        rank = f"rank {os.environ['RANK']}: " if "RANK" in os.environ else ""
        print(f"pyprune {args.command}: error: {rank}{error.strerror or error}"
              + (f": {error.filename}" if error.filename else ""), file=sys.stderr)
        return 1
    except RankFailed as error:  # every rank of a torchrun job raises it; rank 0 says which failed
        if error.on_rank == 0:
            print(f"pyprune {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"pyprune {args.command}: interrupted", file=sys.stderr)
        return 130


__all__ = ["UsageError", "build_parser", "main"]
