"""pyprune.ops: the public kernel API that every pruning method calls.

Each op validates its arguments (ValueError/TypeError naming the argument), then runs as a
``torch.library`` custom op (with a fake implementation, so it traces under torch.compile) on the
backend chosen by :mod:`pyprune.ops.backend`: the csrc extension, a Triton kernel, or the
pure-PyTorch reference in :mod:`pyprune.ops.reference`.
"""
from .backend import BACKENDS, use_backend
from .admm import admm_dual_update_
from .sam import sam_adam_step_, sam_perturb_
from .linear import nm_linear, sliced_linear, sparse24_linear
from .masks import nm_mask, score_nm_mask, score_topk_mask, topk_mask
from .moreau import moreau_perturb_, moreau_step_
from .nm_format import nm_compress, nm_decompress
from .penalty import channel_penalty_
from .prox import group_soft_threshold, soft_threshold
from .scores import (accumulate_abs_outer_, accumulate_sqnorm_, magnitude_score, taylor_score,
                     wanda_score)

__all__ = [
    "BACKENDS", "use_backend",
    "magnitude_score", "wanda_score", "taylor_score", "accumulate_sqnorm_",
    "accumulate_abs_outer_",
    "topk_mask", "nm_mask", "score_nm_mask", "score_topk_mask",
    "soft_threshold", "group_soft_threshold", "moreau_step_", "moreau_perturb_",
    "nm_compress", "nm_decompress", "nm_linear", "sliced_linear", "sparse24_linear",
    "channel_penalty_",
    "admm_dual_update_", "sam_perturb_", "sam_adam_step_",
]
