"""ALPS's layer solver: ADMM support selection with the penalty schedule, PCG refit on the support."""
import pytest
import torch

from pyprune.methods.sparsegpt import SparseGPT, _Hessian
from pyprune.ops.conventions import kept_count
from pyprune.patterns import NM, Unstructured
from pyprune.runtime.layer_solver import (AdmmSchedule, admm_support, normalise, pcg_on_support,
                                            reconstruction_error)

OUT, IN = 32, 64
PATTERNS = [Unstructured(0.5, "tensor"), Unstructured(0.7, "tensor"), Unstructured(0.7, "row"), NM(2, 4), NM(4, 8)]


def _layer(seed=0):
    """Random weights and the Hessian of correlated inputs (where a weight update matters)."""
    generator = torch.Generator().manual_seed(seed)
    W = torch.randn(OUT, IN, generator=generator)
    x = torch.randn(512, IN, generator=generator) @ torch.randn(IN, IN, generator=generator)
    stats = _Hessian(IN, "cpu")
    stats.add(x)
    return W, x, stats


def _normalised(seed=0):
    W, _, stats = _layer(seed)
    return normalise(stats.H, W, 0.01)


def _restricted_least_squares(H, W, keep):
    """Each row's exact minimiser of E over its kept weights: solve H_SS ŵ_S = (WH)_S."""
    H, target = H.double(), W.double() @ H.double()
    exact = torch.zeros_like(target)
    for row in range(W.shape[0]):
        kept = keep[row]
        exact[row, kept] = torch.linalg.solve(H[kept][:, kept], target[row, kept])
    return exact.float()


def test_normalise_keeps_the_damped_error_and_gives_a_unit_diagonal():
    W, _, stats = _layer()
    H, Wn, scale = normalise(stats.H, W, 0.01)
    torch.testing.assert_close(torch.diagonal(H), torch.ones(IN), rtol=1e-5, atol=1e-5)
    damped = stats.H + 0.01 * torch.diagonal(stats.H).mean() * torch.eye(IN)
    W_hat = W * (torch.rand(OUT, IN, generator=torch.Generator().manual_seed(1)) > 0.5)
    assert reconstruction_error(H, Wn, W_hat * scale) == pytest.approx(reconstruction_error(damped, W, W_hat),
                                                                      rel=1e-4)
    assert reconstruction_error(H, Wn, Wn) == 0.0 and reconstruction_error(H, Wn, torch.zeros_like(Wn)) == 1.0


def test_normalise_of_all_zero_inputs_is_the_identity():
    H, Wn, scale = normalise(torch.zeros(IN, IN), torch.randn(OUT, IN), 0.01)
    assert torch.equal(H, torch.eye(IN)) and torch.equal(scale, torch.ones(IN))


@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_admm_support_has_the_exact_count_and_pcg_refit_lowers_the_error(pattern):
    H, W, _ = _normalised()
    projected, keep, trace = admm_support(H, W, pattern)
    if isinstance(pattern, NM):
        assert bool((keep.reshape(-1, pattern.m).sum(dim=1) == pattern.n).all())
    elif pattern.scope == "row":
        assert bool((keep.sum(dim=1) == kept_count(IN, pattern.sparsity)).all())
    else:
        assert int(keep.sum()) == kept_count(OUT * IN, pattern.sparsity)
    assert torch.equal(projected != 0, keep), "random weights: every kept weight is nonzero"
    refit = pcg_on_support(H, W, projected, keep)
    assert bool((refit[~keep] == 0).all())
    before, after = reconstruction_error(H, W, projected), reconstruction_error(H, W, refit)
    assert after < before
    exact = reconstruction_error(H, W, _restricted_least_squares(H, W, keep))
    assert after == pytest.approx(exact, rel=1e-4), "10 PCG iterations reach the restricted optimum"


def test_pcg_from_a_magnitude_mask_reaches_the_restricted_least_squares_weights():
    H, W, _ = _normalised(seed=3)
    keep = NM(2, 4).weight_mask(W)
    refit = pcg_on_support(H, W, W * keep, keep, max_iterations=100, rtol=1e-6)
    torch.testing.assert_close(refit, _restricted_least_squares(H, W, keep), rtol=1e-3, atol=1e-3)
    assert reconstruction_error(H, W, refit) < 0.7 * reconstruction_error(H, W, W * keep)


@pytest.mark.parametrize("pattern", [Unstructured(0.7, "tensor"), NM(2, 4)], ids=str)
def test_admm_converges_the_primal_residual_falls_as_rho_grows(pattern):
    H, W, _ = _normalised()
    _, _, trace = admm_support(H, W, pattern)
    iterations, rhos, changes, residuals = zip(*trace.updates)
    assert trace.iterations < AdmmSchedule().max_iterations, "stopped on a stable support"
    assert residuals[-1] < 0.05 * residuals[0]
    assert list(rhos) == sorted(rhos) and rhos[-1] > rhos[0]
    assert changes[-1] < 3e-4 * kept_count(OUT * IN, pattern.sparsity) + 1


def test_a_too_large_rho_is_lowered_until_the_support_moves():
    H, W, _ = _normalised()
    _, keep, trace = admm_support(H, W, NM(2, 4), AdmmSchedule(rho=1e4))
    rhos = [rho for _, rho, _, _ in trace.updates]
    assert rhos[1] == pytest.approx(1e4 / 5) and min(rhos) < 1e3 and rhos[-1] > min(rhos)
    assert not torch.equal(keep, NM(2, 4).weight_mask(W)), "the support left the magnitude mask"


@pytest.mark.parametrize("pattern", [Unstructured(0.5, "tensor"), Unstructured(0.7, "tensor"), NM(2, 4)], ids=str)
def test_alps_reconstructs_better_than_sparsegpt(pattern):
    """The paper's claim on the layer objective (ALPS ≤ SparseGPT), on correlated inputs."""
    W, x, stats = _layer()
    H, Wn, scale = normalise(stats.H, W, 0.01)
    projected, keep, _ = admm_support(H, Wn, pattern)
    alps = pcg_on_support(H, Wn, projected, keep) / scale
    linear = torch.nn.Linear(IN, OUT, bias=False)
    linear.weight.data.copy_(W)
    SparseGPT(blocksize=16).prune_layer(linear, stats, pattern)
    errors = {name: float((x @ (w - W).T).square().mean()) for name, w in
              (("alps", alps), ("sparsegpt", linear.weight.detach()))}
    assert errors["alps"] < 0.8 * errors["sparsegpt"]


@pytest.mark.parametrize("min_iterations,first_stop", [(30, 33), (29, 30), (0, 3)])
def test_the_stable_support_stop_waits_past_min_iterations_counted_from_zero_as_the_authors(min_iterations,
                                                                                            first_stop):
    # their loop: for i_admm in range(300) ... update when (i_admm + 1) % 3 == 0, stop if i_admm >= 30 and the
    # support change is small: with every change "small" the first stop is the update of iteration 33 (i_admm 32)
    H, W, _ = _normalised()
    schedule = AdmmSchedule(min_iterations=min_iterations, stable_fraction=float("inf"), rho=1e-3)
    _, _, trace = admm_support(H, W, Unstructured(0.7, "tensor"), schedule)
    assert trace.iterations == first_stop
