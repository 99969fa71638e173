"""The ``pyprune`` command line: prune, eval, compare, recover, robustness, continual, generate, tune, demo.

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
    pyprune generate --model pruned/ --prompt "It is a truth" --max-new-tokens 64
    pyprune tune --model pruned/ --tokens 1 8 256
    pyprune demo

A method's own options are flags once ``--method`` names it (``pyprune prune --method dress --help``).
Every argument is checked before the model is loaded or anything is written; a bad one prints a
one-line error and exits with status 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from . import compare, continual, demo, evaluate, generate, options, prune, recover, robustness, tune
from .checks import UsageError

#: one module per subcommand, each with ``COMMAND``, ``register(subparsers, method)`` and ``run(args)``
SUBCOMMANDS = (prune, evaluate, compare, recover, robustness, continual, generate, tune, demo)


def build_parser(method: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser; the subcommands that take ``--method`` get ``method``'s own option flags."""
    parser = argparse.ArgumentParser(prog="pyprune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(sub, method)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(options.method_named_in(argv))
    args, extras = parser.parse_known_args(argv)
    try:
        if getattr(args, "method", None) is not None:
            options.check_method(args.command, args.method)
        if extras:
            raise UsageError(options.unrecognised(args, extras))
        return args.run(args)
    except (UsageError, ValueError, FileNotFoundError) as error:
        print(f"pyprune {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a file that could not be read or written, named in one line
        print(f"pyprune {args.command}: error: {error.strerror or error}"
              + (f": {error.filename}" if error.filename else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"pyprune {args.command}: interrupted", file=sys.stderr)
        return 130


__all__ = ["UsageError", "build_parser", "main"]
