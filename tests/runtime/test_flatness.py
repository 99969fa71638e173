"""The flatness measures on a quadratic f(x) = ½ xᵀAx with a known Hessian A."""
import pytest
import torch

from pyprune.runtime.flatness import perturbed_loss_increase, top_hessian_eigenvalue


def _quadratic(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    eigenvalues = torch.linspace(0.1, 5.0, n, dtype=torch.float64)
    A = q @ torch.diag(eigenvalues) @ q.T
    x = torch.nn.Parameter(torch.randn(n, generator=g, dtype=torch.float64))
    return A, x, eigenvalues


def test_top_hessian_eigenvalue_of_a_quadratic_is_its_largest_eigenvalue():
    A, x, eigenvalues = _quadratic()
    value = top_hessian_eigenvalue(lambda: 0.5 * x @ A @ x, [x], iterations=200)
    assert value == pytest.approx(float(eigenvalues.max()), rel=1e-6)
    # restricted to a mask: the largest eigenvalue of A's kept principal submatrix
    keep = torch.arange(12) % 2 == 0
    value = top_hessian_eigenvalue(lambda: 0.5 * x @ A @ x, [x], iterations=300, masks={x: keep})
    assert value == pytest.approx(float(torch.linalg.eigvalsh(A[keep][:, keep]).max()), rel=1e-6)


def test_antithetic_perturbation_measures_the_curvature_term_exactly_on_a_quadratic():
    A, x, eigenvalues = _quadratic()
    before = x.detach().clone()
    r = 0.1
    result = perturbed_loss_increase(lambda: 0.5 * x @ A @ x, [x], relative_norm=r, pairs=400, seed=3)
    assert torch.equal(x.detach(), before)  # the weights come back exactly
    # the linear term cancels in each pair: the increase is ½ εᵀAε, mean r²‖x‖²·tr(A)/(2n) over directions
    expected = r ** 2 * float(before.square().sum()) * float(eigenvalues.sum()) / (2 * 12)
    assert result["increase"] == pytest.approx(expected, rel=4 * result["increase_stderr"] / expected)
    assert result["increase_stderr"] / expected < 0.1
    # each pair's value is exactly ½ εᵀAε of its direction (the same seeded draws, by hand)
    one = perturbed_loss_increase(lambda: 0.5 * x @ A @ x, [x], relative_norm=r, pairs=1, seed=5)
    d = torch.randn(12, generator=torch.Generator().manual_seed(5), dtype=torch.float32).double()
    d = d * (r * before.norm() / d.norm())
    assert one["increase"] == pytest.approx(float(0.5 * d @ A @ d), rel=1e-5)
    with pytest.raises(ValueError, match="relative_norm"):
        perturbed_loss_increase(lambda: 0.5 * x @ A @ x, [x], relative_norm=0)
