"""torch.library.opcheck for every pyprune op, on every implementation that runs on CPU tensors
(reference, the C++ kernels, Triton in the interpreter): schema and mutation declarations, the
fake implementation against the real one, autograd registration (nm_linear, sliced_linear carry
their own backward) and AOT dispatch. The list of ops comes from the registry, so a new op
without a case here fails."""
import pytest
import torch

import pyprune.ops  # noqa: F401 (registers the ops)
from pyprune import ops
from pyprune.ops import nm_format
from pyprune.ops.conventions import ScoreKind, sparse24_mma_meta
from tests.helpers import randn

# Cases of the ops that have no opcheck in their own test file; the others name where theirs is.
CHECKED_ELSEWHERE = {
    "accumulate_abs_outer_": "test_scores.py", "admm_dual_update_": "test_admm.py",
    "channel_penalty_": "test_penalty.py", "moreau_perturb_": "test_moreau.py",
    "moreau_step_": "test_moreau.py", "sam_adam_step_": "test_sam.py", "sam_perturb_": "test_sam.py",
}


def _w(shape=(8, 16), dtype=torch.float32, seed=0, grad=False):
    return randn(shape, dtype, seed=seed).requires_grad_(grad)


def _nm_form(n=2, m=4, dtype=torch.float32, grad=False):
    w = _w(dtype=dtype)
    values, meta = nm_format.nm_compress(w, ops.score_nm_mask(w, n, m), n, m)
    return values.detach().requires_grad_(grad), meta


def _sparse24_form(dtype):
    """(values, int16 mma.sp metadata) of a 2:4-pruned [8, 32] weight, as sparse24_linear takes them."""
    w = _w((8, 32), dtype)
    values, meta = nm_format.nm_compress(w, ops.score_nm_mask(w, 2, 4), 2, 4)
    return values, sparse24_mma_meta(meta, 32)


def _cases():
    """op name -> a list of argument tuples."""
    act = randn((16,), seed=3).abs()
    values, meta = _nm_form(grad=True)
    index_in, index_out = torch.tensor([0, 3, 5, 9, 15]), torch.tensor([7, 1, 2])
    w24 = _w((8, 32), torch.float16)
    return {
        "score": [(_w(), None, ScoreKind.MAGNITUDE), (_w(), act, ScoreKind.WANDA),
                  (_w(dtype=torch.bfloat16), _w(seed=1), ScoreKind.TAYLOR)],
        "accumulate_sqnorm_": [(torch.zeros(16), _w((2, 3, 16), torch.bfloat16))],
        "nm_mask": [(_w(), None, 2, 4, ScoreKind.GIVEN), (_w(), act, 3, 8, ScoreKind.WANDA)],
        "topk_mask": [(_w((2, 8)), None, 3, True, ScoreKind.GIVEN),  # 2 rows: the interpreter
                      (_w(dtype=torch.float16), act, 50, False, ScoreKind.WANDA)],
        "soft_threshold": [(_w(), 0.3)],
        "group_soft_threshold": [(_w(), 0.5, 0), (_w(), 0.5, 1)],
        "nm_compress": [(_w(), ops.nm_mask(_w(seed=2), 2, 4), 2, 4)],
        "nm_decompress": [_nm_form()[:2] + (2, 4)],
        "sparse24_compress": [(w24, ops.score_nm_mask(w24, 2, 4))],
        "nm_linear": [(_w((3, 16), grad=True), values, meta, 2, 4, None),
                      (_w((2, 5, 16), grad=True), values, meta, 2, 4, _w((8,), seed=4, grad=True))],
        "sparse24_linear": [
            (_w((3, 32), torch.float16),) + _sparse24_form(torch.float16) + (None,),
            (_w((2, 5, 32), torch.bfloat16),) + _sparse24_form(torch.bfloat16) + (_w((8,), torch.bfloat16, seed=4),)],
        "sliced_linear": [
            (_w((4, 5), grad=True), _w(grad=True), _w((8,), seed=4, grad=True), index_in, index_out, True),
            (_w((2, 3, 16), grad=True), _w(grad=True), None, None, index_out, False),
            (_w((4, 5), grad=True), _w(grad=True), None, index_in, None, True)],
    }


def _registered():
    """Every op pyprune registers (the 'pyprune' namespace of torch.ops)."""
    return sorted(name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("pyprune::"))


def test_every_registered_op_has_an_opcheck():
    assert len(_registered()) >= 19
    assert set(_registered()) == set(_cases()) | set(CHECKED_ELSEWHERE)


def _params():
    for name, args_list in _cases().items():
        for implementation in sorted(set(ops.IMPLEMENTATIONS[name]) - {"cuda"}):
            for i in range(len(args_list)):
                yield pytest.param(name, implementation, i, id=f"{name}-{implementation}-{i}")


@pytest.mark.parametrize("name,implementation,case", list(_params()))
def test_opcheck(name, implementation, case):
    args = _cases()[name][case]
    with ops.use_implementation(implementation):
        torch.library.opcheck(getattr(torch.ops.pyprune, name).default, args)
