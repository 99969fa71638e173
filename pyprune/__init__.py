"""pyprune: kernels for pruning large language models, and the pruning methods built on them."""
from . import ops
from .backend import use_backend
from .pruning import prune

__version__ = "0.1.0"
__all__ = ["ops", "prune", "use_backend", "__version__"]
