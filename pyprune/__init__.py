"""pyprune: kernels for pruning large language models, and the pruning methods built on them."""
from . import ops
from .backend import use_backend
from .io import load, save
from .pruning import prune

__version__ = "0.1.0"
__all__ = ["ops", "prune", "load", "save", "use_backend", "__version__"]
