"""Pruning methods, by name. Each is a :class:`~pyprune.methods.base.Method`."""
from .base import Method
from .copal import Copal
from .dress import DReSS
from .magnitude import Magnitude
from .moreau import MoreauPruner, MoreauPrunerGS, SmoothGrad
from .safe import Safe, SafePlus
from .sparsegpt import SparseGPT
from .structured import StructuredMethod
from .taylor import Taylor
from .wanda import Wanda

METHODS = {cls.name: cls for cls in (Magnitude, Wanda, SparseGPT, Taylor, MoreauPruner, MoreauPrunerGS,
                                     SmoothGrad, Copal, DReSS, Safe, SafePlus)}


def get(name: str, **options) -> Method:
    """The method called ``name``, built with its declared options (e.g. SparseGPT's blocksize);
    an unknown or invalid option raises ValueError naming it."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {', '.join(sorted(METHODS))}; got {name!r}")
    return METHODS[name](**options)


__all__ = ["METHODS", "Method", "StructuredMethod", "get"]
