"""``pyprune compare``: reports of prune/eval runs -> one markdown table and a figure."""
from __future__ import annotations

import os

from .commands import SUMMARIES
from . import checks
from .checks import UsageError

COMMAND = "compare"


def register(sub, method) -> None:
    parser = sub.add_parser(COMMAND, help=SUMMARIES[COMMAND])
    parser.add_argument("reports", nargs="+", help="JSON reports (pyprune prune/eval --report)")
    parser.add_argument("--output", default=".", help="directory for NAME.md, NAME.png, NAME.svg (default .)")
    parser.add_argument("--name", default="compare", help="file name stem (default compare)")
    parser.set_defaults(run=run)


def run(args) -> int:
    """Reports -> one markdown table (best per column in bold) and a figure (PNG + SVG)."""
    from ..studies import compare
    reports = [compare.load_report(path) for path in args.reports]
    checks.check_destination(args.output, "--output", directory=True)
    for ext in ("md", "png", "svg"):
        checks.check_destination(os.path.join(args.output, f"{args.name}.{ext}"), "--output/--name",
                                 directory=False)
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise UsageError(f"--output {args.output}: its parent directory does not exist")
    written = compare.compare(reports, args.output, name=args.name)
    print(compare.markdown_table(compare.rows(reports)), end="")
    print(f"wrote {written['markdown']}, {written['png']}, {written['svg']}")
    return 0
