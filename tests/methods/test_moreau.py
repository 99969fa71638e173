"""MoreauPruner, MoreauPruner-GS and SmoothGrad: the inner loops against closed forms on a
quadratic loss, then the methods on tiny random Llamas."""
import copy

import pytest
import torch
from torch import nn

import pyprune
from pyprune.methods import moreau
from pyprune.methods.moreau import moreau_displacements, released_shrink_, smoothed_scores
from pyprune.patterns import Structured
from tests.helpers import random_tokens, tiny_llama


class Quadratic:
    """L(v) = ½·a·‖v − c‖² for one parameter; gradient() returns [a·(v − c)] and records v."""

    def __init__(self, param: nn.Parameter, a: float, seed: int = 1):
        gen = torch.Generator().manual_seed(seed)
        self.param, self.a = param, a
        self.c = torch.randn(param.shape, generator=gen, dtype=torch.float64)
        self.seen = []

    def __call__(self):
        v = self.param.detach().double()
        self.seen.append(v.clone())
        return [(self.a * (v - self.c)).to(self.param.dtype)]


def _param(shape=(6, 9), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(shape, generator=gen).to(dtype))


def test_moreau_steps_follow_algorithm_1_exactly():
    """T steps of δ ← (1 − γ/ρ)δ − γ∇L(w + δ), noise off, against the recursion in float64; the
    gradient of step t is taken at w + δ_t."""
    p = _param()
    w = p.detach().double().clone()
    loss = Quadratic(p, a=3.0)
    rho, gamma, steps = 0.05, 1e-3, 10
    delta = moreau_displacements([p], loss, rho=rho, gamma=gamma, steps=steps, noise_std=0.0)[0]
    iterates = [torch.zeros_like(w)]
    for _ in range(steps):
        d = iterates[-1]
        iterates.append((1 - gamma / rho) * d - gamma * loss.a * (w + d - loss.c))
    torch.testing.assert_close(delta.double(), iterates[-1], rtol=1e-5, atol=1e-9)
    assert len(loss.seen) == steps
    for seen, d in zip(loss.seen, iterates):
        torch.testing.assert_close(seen, w + d, rtol=0, atol=1e-6)
    assert torch.equal(p.detach().double(), w) and p.grad is None  # restored


def test_moreau_converges_to_the_proximal_point():
    """Many steps reach δ* = argmin L(w + δ) + ‖δ‖²/2ρ = a(c − w)/(a + 1/ρ) (Eq. 6, 10)."""
    p = _param()
    w = p.detach().double().clone()
    loss = Quadratic(p, a=2.0)
    rho = 0.5
    delta = moreau_displacements([p], loss, rho=rho, gamma=0.05, steps=400, noise_std=0.0)[0]
    torch.testing.assert_close(delta.double(), loss.a * (loss.c - w) / (loss.a + 1 / rho), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("group,dim", [("rows", 1), ("columns", 0)])
def test_group_sparse_moreau_converges_to_the_group_lasso_prox(group, dim):
    """With η‖δ‖₂,₁ (step 7, GST after every step) the limit is, per group S,
    δ_S = max(0, 1 − η/‖b_S‖)·b_S/(a + 1/ρ) with b = a(c − w): some groups exactly zero."""
    p = _param((8, 12))
    w = p.detach().double().clone()
    loss = Quadratic(p, a=1.0)
    b = loss.a * (loss.c - w)
    norms = b.norm(dim=dim, keepdim=True)
    rho, eta = 0.5, float(norms.median())  # about half the groups vanish
    group_dim = {"rows": 0, "columns": 1}[group]
    delta = moreau_displacements([p], loss, rho=rho, gamma=0.05, steps=600, eta=eta, group_dim=group_dim,
                                 noise_std=0.0)[0].double()
    expected = torch.clamp(1 - eta / norms, min=0) * b / (loss.a + 1 / rho)
    torch.testing.assert_close(delta, expected, rtol=1e-4, atol=1e-6)
    zero_groups = (expected.abs().sum(dim=dim) == 0)
    assert 0 < int(zero_groups.sum()) < zero_groups.numel()  # the test exercises both cases
    assert torch.all(delta.abs().sum(dim=dim)[zero_groups] == 0)


def test_noise_draws_perturb_each_gradient_and_average():
    """Each gradient sees w + δ + ε with ε ~ N(0, (σ|w|)²), fresh per draw and step; m draws
    average (γ/m), so with noise off m = 3 gives the same δ as m = 1."""
    p = _param((64, 64))
    w = p.detach().double().clone()
    loss = Quadratic(p, a=1.0)
    moreau_displacements([p], loss, rho=0.05, gamma=1e-3, steps=2, noise_std=0.05, draws=3, seed=7)
    assert len(loss.seen) == 6
    first = (loss.seen[0] - w) / (0.05 * w.abs())
    assert abs(first.mean().item()) < 0.05 and abs(first.std().item() - 1) < 0.05
    second = (loss.seen[1] - w) / (0.05 * w.abs())  # same δ (= 0), another draw
    assert abs(torch.corrcoef(torch.stack([first.flatten(), second.flatten()]))[0, 1].item()) < 0.05

    q1, q3 = _param(), _param()
    d1 = moreau_displacements([q1], Quadratic(q1, 1.0), rho=0.1, gamma=1e-2, steps=5, noise_std=0.0, draws=1)[0]
    d3 = moreau_displacements([q3], Quadratic(q3, 1.0), rho=0.1, gamma=1e-2, steps=5, noise_std=0.0, draws=3)[0]
    torch.testing.assert_close(d3, d1, rtol=1e-5, atol=1e-8)
    assert d1.abs().sum() > 0


def test_same_seed_same_noise_other_seed_other_noise():
    runs = []
    for seed in (3, 3, 4):
        p = _param()
        runs.append(moreau_displacements([p], Quadratic(p, 1.0), rho=0.05, gamma=1e-3, steps=3,
                                         noise_std=0.05, seed=seed)[0])
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_delta_is_fp32_with_16_bit_weights(dtype):
    """δ accumulates in fp32: 10 steps of γ·g far below the weights' 16-bit resolution survive."""
    p = nn.Parameter(torch.full((4, 8), 1.0, dtype=dtype))
    loss = Quadratic(p, a=1e-3)
    delta = moreau_displacements([p], loss, rho=0.05, gamma=1e-3, steps=10, noise_std=0.0)[0]
    assert delta.dtype == torch.float32 and bool((delta != 0).all())
    assert torch.equal(p.detach(), torch.full((4, 8), 1.0, dtype=dtype))


def test_weights_restored_after_an_error():
    p = _param()
    before = p.detach().clone()
    calls = []

    def failing():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return Quadratic(p, 1.0)()

    with pytest.raises(RuntimeError, match="boom"):
        moreau_displacements([p], failing, rho=0.05, gamma=1e-3, steps=5, noise_std=0.05)
    assert torch.equal(p.detach(), before) and p.grad is None


def test_smoothgrad_averages():
    """Noise off: both readings are the Taylor score. Noise on: E|g ⊙ w| ≥ |E[g] ⊙ w| (v2 ≥ v1)
    element-wise, and the v1 reading is |mean of the seen gradients ⊙ w|."""
    p = _param()
    w = p.detach().double().clone()
    loss = Quadratic(p, a=2.0)
    taylor = (loss.a * (w - loss.c) * w).abs()
    for average in ("gradients", "scores"):
        score = smoothed_scores([p], loss, passes=4, noise_std=0.0, average=average)[0]
        torch.testing.assert_close(score.double(), taylor, rtol=1e-5, atol=1e-7)
    loss.seen.clear()
    v1 = smoothed_scores([p], loss, passes=16, noise_std=0.5, average="gradients", seed=1)[0].double()
    mean_grad = torch.stack([loss.a * (v - loss.c) for v in loss.seen]).mean(dim=0)
    torch.testing.assert_close(v1, (mean_grad * w).abs(), rtol=1e-5, atol=1e-6)
    v2 = smoothed_scores([p], loss, passes=16, noise_std=0.5, average="scores", seed=1)[0].double()
    assert bool((v2 >= v1 - 1e-6).all()) and bool((v2 > v1 + 1e-3).any())
    assert torch.equal(p.detach().double(), w)
    with pytest.raises(ValueError, match="average must be one of gradients, scores"):
        smoothed_scores([p], loss, passes=1, average="mean")


def test_released_shrink_against_a_hand_computation():
    """η = 0.5, threshold 0.1. Row 0: RMS 0.05 ≤ 0.1, zeroed. Row 1: RMS 0.2, factor 1 − 0.5/0.2 =
    −1.5 (sign flipped). Row 2: [2, 0, 0, 0], RMS √(4/4) = 1, factor 0.5. GST_0.1 (Eq. 8) would
    keep row 1 as 0.2·(1 − 0.1/0.4) and row 2 as 2·(1 − 0.1/2)."""
    delta = torch.tensor([[0.05, -0.05, 0.05, -0.05], [0.2, 0.2, -0.2, 0.2], [2.0, 0.0, 0.0, 0.0]])
    expected = torch.tensor([[0.0, 0.0, 0.0, 0.0], [-0.3, -0.3, 0.3, -0.3], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(released_shrink_(delta.clone(), eta=0.5, threshold=0.1), expected)
    torch.testing.assert_close(released_shrink_(delta.t().contiguous(), eta=0.5, threshold=0.1, group_dim=1),
                               expected.t())
    out = delta.clone()
    assert released_shrink_(out, eta=0.5, threshold=0.1) is out  # in place


def test_released_code_loop_follows_its_recursion():
    """decay off, the released operator after each step and the mean δ of the last 3 of 6 steps
    against the float64 recursion δ ← shrink(δ − γ∇L(w + δ)) (noise off)."""
    p = _param((5, 8))
    w = p.detach().double().clone()
    loss = Quadratic(p, a=3.0)
    gamma, eta, steps = 0.05, 0.3, 6
    delta = moreau_displacements([p], loss, rho=0.1, gamma=gamma, steps=steps, eta=eta, noise_std=0.0,
                                 decay=False, operator="released", average_last=3)[0].double()
    iterates, d = [], torch.zeros_like(w)
    for _ in range(steps):
        d = released_shrink_(d - gamma * loss.a * (w + d - loss.c), eta=eta, threshold=gamma * eta)
        iterates.append(d)
    torch.testing.assert_close(delta, torch.stack(iterates[-3:]).mean(dim=0), rtol=1e-5, atol=1e-7)
    for seen, d in zip(loss.seen[1:], iterates):  # each gradient at w + the shrunk δ
        torch.testing.assert_close(seen, w + d, rtol=0, atol=1e-6)
    assert not torch.allclose(iterates[-1], iterates[-2])  # averaging is not δ_T here


def test_released_operator_at_eta_zero_is_the_plain_step():
    """η = 0: the released operator is the identity and the unfused path gives the fused one's δ,
    noise included, bit for bit; average_last=1 is δ_T."""
    runs = []
    for operator in ("gst", "released"):
        p = _param((16, 16))
        runs.append(moreau_displacements([p], Quadratic(p, 1.0), rho=0.05, gamma=1e-3, steps=4, noise_std=0.05,
                                         seed=2, operator=operator, average_last=1)[0])
    assert torch.equal(runs[0], runs[1]) and runs[0].abs().sum() > 0
    with pytest.raises(ValueError, match="operator must be one of gst, released"):
        moreau_displacements([p], Quadratic(p, 1.0), rho=0.05, gamma=1e-3, steps=1, operator="rms")


def test_smooth_all_perturbs_every_parameter_and_scores_the_pruned(monkeypatch):
    """smooth="all": the Moreau loop runs over every parameter (embeddings and norms too) and the
    selection uses only the pruned layers' δ; the unpruned parameters come back unchanged."""
    seen = []

    def spy(params, *args, **kwargs):
        seen.append({id(q) for q in params})
        return moreau_displacements(params, *args, **kwargs)

    monkeypatch.setattr(moreau, "moreau_displacements", spy)
    model = _llama()
    embed, norm = model.model.embed_tokens.weight, model.model.layers[0].input_layernorm.weight
    before = (embed.detach().clone(), norm.detach().clone())
    pyprune.prune(model, "moreau", Structured(0.5), _calib(), progress=False, smooth="all", steps=1)
    assert id(embed) in seen[0] and id(norm) in seen[0] and len(seen[0]) == len(list(model.parameters()))
    assert torch.equal(embed, before[0]) and torch.equal(norm, before[1])
    pyprune.prune(_llama(), "moreau", Structured(0.5), _calib(), progress=False, steps=1)
    assert id(embed) not in seen[1] and len(seen[1]) < len(seen[0])


# ------------------------------------------------------------------------------------ methods


def _calib():
    return random_tokens((4, 16))


def _llama(dtype=torch.float32):
    return tiny_llama(hidden=64, heads=4, kv_heads=2).to(dtype)


def test_moreau_method_selects_by_delta_times_weight():
    """The channels MoreauPruner removes are the lowest Σ|δ_T ⊙ w|/ρ of gate/up rows + down column,
    δ_T computed by the same loop on the same calibration loss."""
    from pyprune.runtime import engine
    from pyprune.methods.structured import gradients_for
    model, calib = _llama(), _calib()
    reference = copy.deepcopy(model)
    report = pyprune.prune(model, "moreau", Structured(0.25), calib, progress=False, heads=False, noise_seed=5)
    mlp = reference.model.layers[0].mlp
    params = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    all_params = [p for block in reference.model.layers for lin in engine.block_linears(block).values()
                  for p in lin.parameters()]
    with gradients_for(reference, all_params):
        deltas = moreau_displacements(
            all_params, lambda: engine.loss_gradients(reference, all_params, calib, batch_size=8),
            rho=0.05, gamma=1e-3, steps=10, seed=5)
    by_param = {id(p): d for p, d in zip(all_params, deltas)}
    s = [(by_param[id(p)] * p.detach()).abs() / 0.05 for p in params]
    channel = s[0].sum(1) + s[1].sum(1) + s[2].sum(0)
    expected = sorted(torch.sort(channel, stable=True).indices[:32].tolist())
    assert report["structure"][0]["pruned_channels"] == expected
    # the kept weights are the original ones, not the noisy iterates
    kept = [c for c in range(128) if c not in expected]
    assert torch.equal(model.model.layers[0].mlp.gate_proj.weight, mlp.gate_proj.weight[kept])


@pytest.mark.parametrize("method,options", [
    ("moreau", {}), ("moreau-gs", {}), ("moreau-gs", {"group": "columns", "eta": 10.0}),
    ("smoothgrad", {"passes": 2}), ("smoothgrad", {"passes": 2, "average": "gradients"}),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_methods_prune_and_the_result_runs(method, options, dtype):
    model = _llama(dtype)
    calib = _calib()
    report = pyprune.prune(model, method, Structured(0.5), calib, progress=False, **options)
    assert all((e["heads"], e["kv_heads"], e["channels"]) == (2, 1, 64) or e["heads"] == 2
               for e in report["structure"])
    assert [e["channels"] for e in report["structure"]] == [64, 64]
    assert all(p.dtype == dtype and p.grad is None and p.requires_grad for p in model.parameters())
    logits = model(input_ids=calib[:1]).logits
    assert torch.isfinite(logits.float()).all()


def test_moreau_gs_threshold_changes_the_selection():
    """A large η zeroes whole rows of δ (their score 0), so the selection differs from η = 0."""
    calib = _calib()
    plain = pyprune.prune(_llama(), "moreau-gs", Structured(0.5), calib, progress=False, eta=0.0, noise_seed=1)
    sparse = pyprune.prune(_llama(), "moreau-gs", Structured(0.5), calib, progress=False, eta=50.0, noise_seed=1)
    assert [e["pruned_channels"] for e in plain["structure"]] != \
        [e["pruned_channels"] for e in sparse["structure"]]


@pytest.mark.parametrize("method,options,match", [
    ("moreau", {"rho": 0.0}, "option rho of method 'moreau' must be > 0; got 0.0"),
    ("moreau", {"rho": 0.01, "gamma": 0.02}, "gamma of method 'moreau' must be < rho"),
    ("moreau", {"gamma": 0.05}, "must be < rho"),
    ("moreau-gs", {"eta": -1e-6}, "option eta of method 'moreau-gs' must be >= 0"),
    ("moreau", {"steps": 0}, "option steps of method 'moreau' must be >= 1"),
    ("moreau", {"noise_draws": 0}, "noise_draws .* must be >= 1"),
    ("moreau", {"eta": 1e-6}, "method 'moreau' has no option eta; its options: first_layer"),
    ("moreau-gs", {"group": "heads"}, "option group of method 'moreau-gs' must be one of rows, columns"),
    ("smoothgrad", {"passes": 0}, "option passes of method 'smoothgrad' must be >= 1"),
    ("smoothgrad", {"average": "median"}, "must be one of scores, gradients|must be one of gradients, scores"),
    ("moreau", {"steps": 2.5}, "option steps of method 'moreau' must be an integer"),
    ("moreau", {"average_last": 11}, "option average_last of method 'moreau' must be <= steps"),
    ("moreau-gs", {"operator": "l1"}, "option operator of method 'moreau-gs' must be one of gst, released"),
    ("moreau", {"smooth": "norms"}, "option smooth of method 'moreau' must be one of pruned, all"),
])
def test_bad_hyperparameters_raise_before_the_model_changes(method, options, match):
    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        pyprune.prune(model, method, Structured(0.2), _calib(), progress=False, **options)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
