"""``pyprune study NAME [options]``: run a declared study (:mod:`pyprune.studies`), resuming a stopped run."""
from __future__ import annotations

import argparse

from .commands import SUMMARIES
from . import environment, flags

COMMAND = "study"


def register(sub, method) -> None:
    from .. import studies
    parser = sub.add_parser(COMMAND, help=SUMMARIES[COMMAND], description=__doc__ + "\n\nStudies:\n" + "\n".join(
        f"  {name}: {cls.summary}" for name, cls in studies.STUDIES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    names = parser.add_subparsers(dest="study", required=True, metavar="NAME", help="the study to run (listed above)")
    for name, cls in studies.STUDIES.items():
        study = names.add_parser(name, help=cls.summary, description=(cls.__doc__ or "").strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        where = f"benchmarks/results/{cls.results}.json" if cls.results else "required"
        study.add_argument("--output", help=f"JSON results file, the markdown beside it (default {where}); a rerun "
                                            "with the same settings resumes it")
        flags.add_option_flags(study.add_argument_group(f"options of study {name}"), cls.options, "setting_")
        environment.add_flags(study)
    parser.set_defaults(run=run)


def run(args) -> int:
    from .. import studies
    from ..studies.study import run as run_study
    from ..studies.results import markdown_path
    cls = studies.STUDIES[args.study]
    given = {option.name: getattr(args, f"setting_{option.name}") for option in cls.options
             if getattr(args, f"setting_{option.name}") is not None}
    study = studies.get(args.study, **given)  # every setting checked before anything loads
    run_study(study, args.output, progress=not args.quiet)
    path = study.output_path(args.output)
    print(f"{args.study}: results in {path} and {markdown_path(path)}")
    return 0
