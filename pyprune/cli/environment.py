"""What ``--threads`` and ``--quiet`` (flags of every subcommand) change for the run, restored after:
torch's thread count; transformers' and huggingface_hub's progress bars ("Loading weights",
"Writing model shards"), their info and warning logs, and Python warnings. pyprune's own bars
follow ``--quiet`` through each command's ``progress`` argument. A :class:`pyprune.methods.RunWarning`
(a run that will do less than its options ask) prints as one line, ``--quiet`` or not."""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

from .usage import UsageError


def add_flags(parser) -> None:
    """--threads and --quiet."""
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for this run (torch.set_num_threads; default: torch's, usually one per "
                             "core)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars, no transformers/huggingface_hub logs, no Python warnings; results "
                             "and errors still print")


@contextlib.contextmanager
def applied(args) -> Iterator[None]:
    """The run inside: --threads and --quiet of ``args`` in effect, everything restored after."""
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1; got {args.threads}")
    with contextlib.ExitStack() as stack:
        if args.threads is not None:
            stack.enter_context(_threads(args.threads))
        if args.quiet:
            stack.enter_context(_quiet())
        stack.enter_context(_run_warnings(args.command))
        yield


@contextlib.contextmanager
def _run_warnings(command: str) -> Iterator[None]:
    """RunWarnings shown once each, as ``pyprune COMMAND: warning: ...`` on stderr."""
    import sys
    from ..methods import RunWarning
    show = warnings.showwarning

    def one_line(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, RunWarning):
            print(f"pyprune {command}: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("once", RunWarning)
        warnings.showwarning = one_line
        yield


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging
    verbosity, bars, hub_bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), \
        are_progress_bars_disabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if not hub_bars:
            enable_progress_bars()
