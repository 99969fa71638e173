"""``python -m pyprune`` (and ``torchrun ... -m pyprune``): the command line, :mod:`pyprune.cli`."""
import sys

from .cli import main

sys.exit(main())
