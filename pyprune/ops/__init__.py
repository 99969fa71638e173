"""pyprune.ops: the public kernel API that every pruning method calls.

Each op validates its arguments (ValueError/TypeError naming the argument), then calls its
``torch.ops.pyprune`` op (:mod:`pyprune.ops.library`: one schema, a fake kernel so it traces under
torch.compile), whose implementation PyTorch's dispatcher picks by device: the csrc extensions, a
Triton kernel, or the pure-PyTorch reference in :mod:`pyprune.ops.reference`
(:mod:`pyprune.ops.implementations` lists them and forces one).
"""
import warnings

from .implementations import IMPLEMENTATIONS, use_backend, use_implementation  # noqa: F401 (use_backend: deprecated)
from .admm import admm_dual_update_
from .sam import sam_adam_step_, sam_perturb_
from .linear import nm_linear, sliced_linear, sparse24_linear
from .masks import nm_mask, score_nm_mask, score_topk_mask, topk_mask
from .moreau import moreau_perturb_, moreau_step_
from .nm_format import nm_compress, nm_decompress, sparse24_compress
from .penalty import channel_penalty_
from .prox import group_soft_threshold, soft_threshold
from .scores import (accumulate_abs_outer_, accumulate_sqnorm_, magnitude_score, taylor_score,
                     wanda_score)

__all__ = [
    "IMPLEMENTATIONS", "use_implementation",
    "magnitude_score", "wanda_score", "taylor_score", "accumulate_sqnorm_",
    "accumulate_abs_outer_",
    "topk_mask", "nm_mask", "score_nm_mask", "score_topk_mask",
    "soft_threshold", "group_soft_threshold", "moreau_step_", "moreau_perturb_",
    "nm_compress", "nm_decompress", "sparse24_compress", "nm_linear", "sliced_linear", "sparse24_linear",
    "channel_penalty_",
    "admm_dual_update_", "sam_perturb_", "sam_adam_step_",
]


def __getattr__(name):
    if name == "BACKENDS":  # the former name, for one release
        from .implementations import NAMES
        warnings.warn("pyprune.ops.BACKENDS is deprecated; use pyprune.ops.implementations.NAMES",
                      DeprecationWarning, stacklevel=2)
        return NAMES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
