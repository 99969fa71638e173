"""SAFE / SAFE⁺: the optimiser pruning an MLP while it learns a task, the ADMM bookkeeping, the
block-wise method on tiny Llamas (exact patterns, reconstruction better than Wanda's, dtype and
trainability restored), and on two SmolLM2-135M blocks (slow)."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyprune
import pyprune.methods
from pyprune.runtime import engine
from pyprune.runtime.optim import SafeOptimizer
from pyprune.patterns import NM, Unstructured
from tests.helpers import random_tokens, tiny_llama


def _rings(n, seed):
    """Points in the unit disc labelled by ring (0 inside r < 1/3, 1 in 1/3 ≤ r < 2/3, 0 outside): a
    task no linear model solves."""
    g = torch.Generator().manual_seed(seed)
    points = torch.rand(n, 2, generator=g) * 2 - 1
    radius = points.norm(dim=1)
    return points, ((radius * 3).floor().long() % 2)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))


def _accuracy(model, x, y):
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def _train_safe(model, pattern, x, y, steps=600, lam=0.05, lr=1e-2, **kwargs):
    weights = [m.weight for m in model if isinstance(m, nn.Linear)][1:]  # the input layer stays dense
    others = [p for p in model.parameters() if all(p is not w for w in weights)]
    optimizer = SafeOptimizer([{"params": weights}, {"params": others, "pattern": None}], pattern, lr=lr,
                              betas=(0.9, 0.999), rho=0.01, lam=lam, dual_interval=20, **kwargs)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        index = torch.randint(0, x.shape[0], (128,), generator=g)

        def closure():
            loss = F.cross_entropy(model(x[index]), y[index])
            loss.backward()
            return loss

        optimizer.step(closure)
    optimizer.project_()
    return optimizer, weights


def test_safe_optimizer_prunes_an_mlp_while_it_learns_a_ring_task():
    x, y = _rings(2048, seed=0)
    x_test, y_test = _rings(1024, seed=1)
    model = _mlp()
    optimizer, weights = _train_safe(model, Unstructured(0.8), x, y)
    for w in weights:  # exactly 20% of every row kept
        assert ((w != 0).sum(dim=1) == round(0.2 * w.shape[1])).all()
    accuracy = _accuracy(model, x_test, y_test)
    assert accuracy > 0.75
    residuals = optimizer.residuals
    assert residuals[-1] < 0.3 * residuals[0]  # x approaches the constraint set
    # without the penalty (λ = 0: dense SAM training, then the same projection) the pruned net fails
    dense_then_pruned = _mlp()
    _train_safe(dense_then_pruned, Unstructured(0.8), x, y, lam=0.0)
    assert _accuracy(dense_then_pruned, x_test, y_test) < accuracy - 0.15


def test_safe_optimizer_without_radius_and_penalty_is_adam():
    x, y = _rings(512, seed=0)
    ours, theirs = _mlp(), _mlp()
    safe = SafeOptimizer([{"params": list(ours.parameters()), "pattern": None}], None, lr=1e-2,
                         betas=(0.9, 0.999), rho=0.0, lam=0.0)
    adam = torch.optim.Adam(theirs.parameters(), lr=1e-2, betas=(0.9, 0.999))
    for step in range(5):
        index = torch.arange(step * 64, step * 64 + 64)
        for model, optimizer in ((ours, safe), (theirs, adam)):
            def closure(model=model, optimizer=optimizer):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x[index]), y[index])
                loss.backward()
                return loss
            optimizer.step(closure)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_safe_optimizer_n_m_and_importance_weighted_projection():
    x, y = _rings(2048, seed=0)
    model = _mlp()
    layer = model[2]
    importance = {layer.weight: torch.tensor([0.01, 0.01, 4.0, 4.0]).repeat(16)}  # favour 2 of each 4 columns
    optimizer, weights = _train_safe(model, NM(2, 4), x, y, steps=200, importance=importance)
    for w in weights:
        assert ((w.reshape(-1, 4) != 0).sum(dim=1) <= 2).all()
    kept = (layer.weight != 0).float().mean(dim=0)
    favoured = torch.arange(64) % 4 >= 2
    assert kept[favoured].mean() > 0.75  # P decides which entries survive


def test_safe_optimizer_state_dict_resumes_exactly():
    x, y = _rings(512, seed=0)

    def run(model, optimizer, steps):
        for step in steps:
            index = torch.arange(step * 32, step * 32 + 32)

            def closure():
                loss = F.cross_entropy(model(x[index]), y[index])
                loss.backward()
                return loss

            optimizer.step(closure)

    def build(model):
        return SafeOptimizer([model[2].weight], NM(2, 4), lr=1e-2, rho=0.01, lam=0.05, dual_interval=3)

    straight = _mlp()
    optimizer = build(straight)
    run(straight, optimizer, range(8))
    resumed = _mlp()
    first = build(resumed)
    run(resumed, first, range(4))
    saved_model, saved_optimizer = copy.deepcopy(resumed.state_dict()), copy.deepcopy(first.state_dict())
    resumed = _mlp()
    resumed.load_state_dict(saved_model)
    second = build(resumed)
    second.load_state_dict(saved_optimizer)
    run(resumed, second, range(4, 8))
    for a, b in zip(resumed.parameters(), straight.parameters()):
        torch.testing.assert_close(a, b)
    assert second.residuals == optimizer.residuals and second.steps_done == 8


def test_initialisation_is_z0_the_projection_u0_zero_and_the_first_dual_update_after_k_steps():
    """Algorithm 1: z₀ = proj(x₀), u₀ = 0; the first z/u-step after K steps, then every K. On f ≡ 0
    the x-step pulls the pruned entries to z₀'s zeros, not past them (u₀ = x₀⊙¬keep would pull them
    toward −x₀)."""
    torch.manual_seed(0)
    x0 = torch.randn(8, 16)
    w = nn.Parameter(x0.clone())
    K = 5
    optimizer = SafeOptimizer([w], NM(2, 4), lr=1e-2, betas=(0.9, 0.999), rho=0.0, lam=1.0, dual_interval=K)

    def no_loss():
        loss = (w * 0).sum()
        loss.backward()
        return loss

    projected = NM(2, 4).weight_mask(x0)
    for step in range(1, K + 1):
        before = w.detach().clone()
        optimizer.step(no_loss)
        state = optimizer.state[w]
        if step == 1:
            torch.testing.assert_close(w.detach()[projected], x0[projected])  # the kept entries feel nothing
        if step < K:
            assert torch.equal(state["keep"], projected)
            assert torch.equal(state["v"], x0 * projected)  # z = proj(x₀), u = v⊙¬keep = 0
            assert len(optimizer.residuals) == 1
        else:  # after step K: v = x_K + u₀ = x_K, keep = the support of proj(x_K)
            assert len(optimizer.residuals) == 2
            torch.testing.assert_close(state["v"], w.detach())
            assert not torch.equal(before, w.detach())
    torch.testing.assert_close(optimizer.residuals[0], float((x0 * ~projected).norm() / x0.norm()))
    pulled = SafeOptimizer([nn.Parameter(x0.clone())], NM(2, 4), lr=1e-2, betas=(0.9, 0.999), rho=0.0, lam=1.0,
                           dual_interval=10 ** 6)
    weight = pulled.param_groups[0]["params"][0]
    for _ in range(300):
        pulled.step(lambda: (weight * 0).sum().backward())
    pruned = weight.detach()[~projected]
    assert pruned.abs().max() < 0.1 * x0[~projected].abs().min() + 0.05  # at z₀'s zeros, not at −x₀


def test_dual_init_box_starts_u0_at_x0_minus_z0_and_zero_at_zero():
    """``dual_init``: z₀ = proj(x₀) either way; u₀ = 0 ("zero", Algorithm 1, line 2) or x₀ − z₀ ("box",
    the printed box's u-step at t = 0). On f ≡ 0 the decoupled penalty's first step then moves a pruned
    entry by lr·λ·(x₀ − z₀ + u₀): to 0.7·x₀ from u₀ = 0, to 0.4·x₀ from u₀ = x₀ − z₀ (lr·λ = 0.3)."""
    torch.manual_seed(0)
    x0 = torch.randn(8, 16)
    z0 = x0 * NM(2, 4).weight_mask(x0)
    for dual_init, u0, factor in (("zero", torch.zeros_like(x0), 0.7), ("box", x0 - z0, 0.4)):
        w = nn.Parameter(x0.clone())
        optimizer = SafeOptimizer([w], NM(2, 4), lr=1e-2, rho=0.0, lam=30.0, dual_interval=100,
                                  penalty="decoupled", dual_init=dual_init)
        optimizer.initialise()
        state = optimizer.state[w]
        assert torch.equal(state["v"] * state["keep"], z0)  # z₀
        assert torch.equal(state["v"] * ~state["keep"], u0)  # u₀
        optimizer.step(lambda: (w * 0).sum().backward())
        torch.testing.assert_close(w.detach(), torch.where(z0 != 0, x0, factor * x0))
    with pytest.raises(ValueError, match="dual_init must be one of zero, box; got 'ones'"):
        SafeOptimizer([w], NM(2, 4), dual_init="ones")
    with pytest.raises(ValueError, match="option dual_init of method 'safe' must be one of zero, box"):
        pyprune.methods.get("safe", dual_init="ones")


def test_decoupled_penalty_closes_lr_times_lambda_of_the_distance_to_z_minus_u_each_step():
    """Algorithm 1, lines 12–13 with Adam in line 12: on f ≡ 0 (Adam's step is 0) each step moves x
    by lr·λ·(x − z + u), so with z₀ = proj(x₀), u₀ = 0 the pruned entries are x₀(1 − lr·λ)ⁿ after n
    steps and the kept ones stay."""
    torch.manual_seed(0)
    x0 = torch.randn(8, 16)
    w = nn.Parameter(x0.clone())
    optimizer = SafeOptimizer([w], NM(2, 4), lr=1e-2, rho=0.0, lam=30.0, dual_interval=100, penalty="decoupled")
    for _ in range(5):
        optimizer.step(lambda: (w * 0).sum().backward())
    kept = NM(2, 4).weight_mask(x0)
    torch.testing.assert_close(w.detach(), torch.where(kept, x0, x0 * 0.7 ** 5))
    with pytest.raises(ValueError, match=r"lr \* lam must be <= 1 with penalty='decoupled'"):
        SafeOptimizer([w], NM(2, 4), lr=1e-2, lam=200.0, penalty="decoupled")
    with pytest.raises(ValueError, match="penalty must be one of adam, decoupled"):
        SafeOptimizer([w], NM(2, 4), penalty="prox")


def test_cosine_lambda_ramp_starts_near_zero_and_reaches_lambda_at_the_last_step():
    """``lam_schedule="cosine"`` (the paper's penalty warm-up, App. B): on f ≡ 0 step t moves a pruned
    entry by lr·λ_t·x with λ_t = λ(1 − cos(πt/T))/2, so after T steps the pruned entries are
    x₀·∏(1 − lr·λ_t), the first step barely moves them, step T uses the full λ and the kept entries
    stay; "constant" is λ at every step."""
    torch.manual_seed(0)
    x0 = torch.randn(8, 16)
    kept = NM(2, 4).weight_mask(x0)
    w = nn.Parameter(x0.clone())
    steps, lr, lam = 6, 1e-2, 30.0
    optimizer = SafeOptimizer([w], NM(2, 4), lr=lr, rho=0.0, lam=lam, dual_interval=100, penalty="decoupled",
                              lam_schedule="cosine", lam_steps=steps)
    lams = []
    for _ in range(steps):
        optimizer.step(lambda: (w * 0).sum().backward())
        lams.append(optimizer.current_lam())
    expected = [lam * (1 - math.cos(math.pi * t / steps)) / 2 for t in range(1, steps + 1)]
    assert lams == pytest.approx(expected) and lams[-1] == lam and lams[0] < 0.07 * lam
    shrink = math.prod(1 - lr * value for value in expected)
    torch.testing.assert_close(w.detach(), torch.where(kept, x0, x0 * shrink))
    assert shrink > 0.7 ** steps  # the ramp leaves x further from z₀ than the constant penalty
    constant = SafeOptimizer([nn.Parameter(x0.clone())], NM(2, 4), lr=lr, lam=lam)
    assert constant.current_lam() == lam
    with pytest.raises(ValueError, match="lam_steps must be an integer >= 1 with lam_schedule='cosine'"):
        SafeOptimizer([w], NM(2, 4), lam_schedule="cosine")
    with pytest.raises(ValueError, match="lam_schedule must be one of constant, cosine; got 'linear'"):
        SafeOptimizer([w], NM(2, 4), lam_schedule="linear", lam_steps=4)
    with pytest.raises(ValueError, match="option lam_schedule of method 'safe\\+' must be one of constant, cosine"):
        pyprune.methods.get("safe+", lam_schedule="linear")


def test_safe_plus_with_the_lambda_ramp_moves_the_mask_further_from_wandas():
    """On a tiny Llama SAFE⁺ with λ ramped from 0 ends with a mask further from z₀ (Wanda's mask) than
    with λ constant, on the same steps: the ramp is what lets ADMM search."""
    calib = random_tokens((8, 32), seed=1)
    moved = {}
    for schedule in ("constant", "cosine"):
        report = pyprune.prune(tiny_llama(seed=0), "safe+", "0.5", calib, progress=False, epochs=4,
                               lam_schedule=schedule)
        moved[schedule] = sum(block["mask_moved"] for block in report["blocks"])
        assert report["options"]["lam_schedule"] == schedule
    assert moved["cosine"] > moved["constant"]


def test_safe_admm_converges_on_a_tiny_llama():
    """With the defaults (decoupled penalty, λ = 100, K = 8, lr 5e-3) ‖x − z‖/‖x‖ falls at every dual
    update in every block and ends below 0.05; with the penalty inside Adam's moments (the authors'
    form) at a λ that dominates ∇f the weights move about lr per step and it does not."""
    calib = random_tokens((8, 32), seed=1)
    for options in ({}, {"penalty": "adam", "lam": 1.0}):
        report = pyprune.prune(tiny_llama(seed=0), "safe+", "2:4", calib, progress=False, epochs=10, **options)
        penalty = options.get("penalty", "decoupled")
        for block in report["blocks"]:
            residuals = block["residuals"]
            assert len(residuals) == 6  # z₀ and 5 dual updates
            falling = all(b < a for a, b in zip(residuals, residuals[1:]))
            if penalty == "decoupled":
                assert falling and residuals[-1] < 0.05
            else:
                assert not falling and residuals[-1] > 0.1


def test_relative_block_loss_is_the_error_over_the_targets_mean_square_and_scale_free():
    """f = ‖Y − Ŷ‖² / ‖Y‖² (``loss="relative"``): on a linear block the first loss is that ratio
    computed by hand (the minibatch's squared error over the mean square of all targets), and SAFE on
    (100·X, 100·Y) trains the same weights as on (X, Y); with the plain MSE (the paper's literal f)
    the gradient grows 10⁴-fold against the same λ and the weights come out different."""
    from types import SimpleNamespace

    from pyprune.runtime.training import minibatches, train_block

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 16, generator=g)
    y = x @ torch.randn(16, 16, generator=g).T
    w0 = torch.randn(16, 16, generator=g) * 0.5

    def run(scale, relative):
        block = nn.Linear(16, 16, bias=False)
        with torch.no_grad():
            block.weight.copy_(w0)
        ctx = SimpleNamespace(block=block, inputs=x * scale, block_kwargs={}, samples=None, offset=0)
        optimizer = SafeOptimizer([block.weight], NM(2, 4), lr=1e-2, rho=1e-3, lam=0.1, dual_interval=4)
        losses = train_block(ctx, y * scale, optimizer, steps=24, batch_size=3, seed=0, progress=False,
                             relative=relative)
        optimizer.project_()
        return losses, block.weight.detach()

    first = next(minibatches(6, 3, torch.Generator().manual_seed(0)))
    expected = float((x[first] @ w0.T - y[first]).square().mean() / y.square().mean())
    losses, weight = run(1.0, relative=True)
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    scaled_losses, scaled_weight = run(100.0, relative=True)
    assert scaled_losses == pytest.approx(losses, rel=1e-4)
    torch.testing.assert_close(scaled_weight, weight, rtol=1e-4, atol=1e-5)
    _, mse_weight = run(1.0, relative=False)
    _, scaled_mse_weight = run(100.0, relative=False)
    assert (scaled_mse_weight - mse_weight).norm() > 0.05 * mse_weight.norm()


def test_dual_update_keeps_the_scaled_dual_on_the_pruned_entries():
    """After a dual update u = (x + u_old)⊙¬keep is zero on the kept support, z + u = x + u_old, and
    the step's penalty target is x + v⊙(1 − 2·keep) (spec §1.8)."""
    w = nn.Parameter(torch.randn(8, 16))
    optimizer = SafeOptimizer([w], NM(2, 4), lr=1e-2, lam=0.1, dual_interval=1)
    for _ in range(3):
        state = optimizer.state.get(w, {})
        u_old = state["v"] * ~state["keep"] if state else torch.zeros_like(w)
        x_before = w.detach().clone()
        optimizer.dual_update()
        v, keep = optimizer.state[w]["v"], optimizer.state[w]["keep"]
        z, u = v * keep, v * ~keep
        torch.testing.assert_close(z + u, x_before + u_old)
        assert ((keep.reshape(-1, 4)).sum(dim=1) == 2).all() and (u[keep] == 0).all()
        w.grad = torch.randn_like(w)
        optimizer.step(lambda: (w.square().sum()).backward() or w.square().sum())


def test_safe_optimizer_rejects_bad_arguments():
    w = nn.Parameter(torch.randn(4, 8))
    with pytest.raises(ValueError, match="dual_interval must be an integer >= 1"):
        SafeOptimizer([w], NM(2, 4), dual_interval=0)
    with pytest.raises(ValueError, match="rho must be a finite number >= 0"):
        SafeOptimizer([w], NM(2, 4), rho=-1.0)
    with pytest.raises(ValueError, match="constrained parameters must be 2-D"):
        SafeOptimizer([nn.Parameter(torch.randn(4))], NM(2, 4))
    with pytest.raises(ValueError, match="unstructured sparsity or N:M"):
        SafeOptimizer([w], pyprune.patterns.Structured(0.5))
    with pytest.raises(ValueError, match="needs a closure"):
        SafeOptimizer([w], NM(2, 4)).step(None)


def _block_error(model, dense, calib):
    """Mean squared error of the last hidden states against the dense model's."""
    with torch.no_grad():
        ours = model(input_ids=calib, output_hidden_states=True).hidden_states[-1]
        theirs = dense(input_ids=calib, output_hidden_states=True).hidden_states[-1]
    return float(F.mse_loss(ours, theirs))


@pytest.mark.parametrize("method", ["safe", "safe+"])
@pytest.mark.parametrize("pattern", [NM(2, 4), Unstructured(0.5)])
def test_safe_prunes_every_block_exactly_and_reconstructs_better_than_wanda(method, pattern):
    calib = random_tokens((8, 32), seed=1)
    dense = tiny_llama(seed=0)
    wanda = copy.deepcopy(dense)
    pyprune.prune(wanda, "wanda", pattern, calib, progress=False)
    model = copy.deepcopy(dense)
    report = pyprune.prune(model, method, pattern, calib, progress=False, epochs=30, lr=2e-3, lam=100.0,
                           dual_interval=8, train_batch=4)
    for block in engine.decoder_blocks(model):
        for linear in engine.block_linears(block).values():
            w = linear.weight
            if isinstance(pattern, NM):
                assert ((w.reshape(-1, 4) != 0).sum(dim=1) == 2).all()
            else:
                assert ((w != 0).sum(dim=1) == w.shape[1] // 2).all()
            assert w.requires_grad and w.dtype == torch.float32
    assert report["steps_per_block"] == 60 and report["dual_updates_per_block"] == 7  # after steps 8, 16, …, 56
    for block, details in zip(engine.decoder_blocks(model), report["blocks"]):
        residuals = details["residuals"]  # the initial projection, then every dual update
        assert len(residuals) == 8 and residuals[-1] < residuals[0]
        weights = [linear.weight.detach() for linear in engine.block_linears(block).values()]
        norm = float(torch.sqrt(sum(w.square().sum() for w in weights)))
        assert details["sam_relative"] == pytest.approx(2e-4 / norm, rel=1e-5)  # ‖ε‖ = ρ over the final ‖w‖
        assert details["sam_per_weight"] == pytest.approx(2e-4 / sum(w.numel() for w in weights) ** 0.5)
        assert details["step_over_sam"] > 1  # Adam moves far more than the ascent on these weights
        assert 0 <= details["mask_moved"] < 1
    assert _block_error(model, dense, calib) < _block_error(wanda, dense, calib)


def test_safe_train_norms_trains_the_rmsnorm_gains_unconstrained():
    dense = tiny_llama(seed=0)
    calib = random_tokens((4, 16), seed=1)
    for train_norms in (False, True):
        model = copy.deepcopy(dense)
        pyprune.prune(model, "safe", "2:4", calib, progress=False, epochs=2, train_norms=train_norms)
        for block, dense_block in zip(engine.decoder_blocks(model), engine.decoder_blocks(dense)):
            for name in ("input_layernorm", "post_attention_layernorm"):
                gain, dense_gain = getattr(block, name).weight, getattr(dense_block, name).weight
                assert gain.requires_grad and (gain != 0).all()
                assert torch.equal(gain, dense_gain) != train_norms


def test_safe_on_a_bf16_model_trains_fp32_masters_and_returns_bf16():
    model = tiny_llama(seed=0).to(torch.bfloat16)
    report = pyprune.prune(model, "safe+", "2:4", random_tokens((4, 16), seed=1), progress=False, epochs=2)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert report["nm_valid"]["2:4"]


def test_safe_checkpoint_resumes_after_the_last_finished_block_and_refuses_other_settings(tmp_path):
    import json
    calib = random_tokens((4, 16), seed=1)
    options = dict(epochs=2, checkpoint=str(tmp_path / "ckpt"))
    straight = tiny_llama(seed=0)
    report = pyprune.prune(straight, "safe+", "2:4", calib, progress=False, **options)
    manifest_path = tmp_path / "ckpt" / "blockwise.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["finished"] == 2 and manifest["details"] == report["blocks"]
    manifest.update(finished=1, details=manifest["details"][:1])  # as if stopped after block 0
    manifest_path.write_text(json.dumps(manifest))
    resumed = tiny_llama(seed=0)
    again = pyprune.prune(resumed, "safe+", "2:4", calib, progress=False, **options)
    assert again["blocks"] == report["blocks"]
    for a, b in zip(resumed.parameters(), straight.parameters()):
        torch.testing.assert_close(a, b)
    untouched = tiny_llama(seed=0)
    with pytest.raises(ValueError, match=r"was made with other settings: epochs 2 \(now 3\)"):
        pyprune.prune(untouched, "safe+", "2:4", calib, progress=False, epochs=3, checkpoint=str(tmp_path / "ckpt"))
    for a, b in zip(untouched.parameters(), tiny_llama(seed=0).parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_safe_plus_reconstructs_smollm2_blocks_better_than_wanda(smollm2_copy):
    """The claim behind Table 1 on the objective SAFE optimises: on the first two blocks of
    SmolLM2-135M at 2:4 (16 x 256 calibration windows of Emma's first half at 10 epochs: 80 steps,
    as the default 64 windows at 3 epochs give 96), SAFE⁺ with the CPU defaults otherwise leaves
    the hidden states of windows of Emma's second half (disjoint from every calibration window)
    closer to the dense model's than Wanda does, after each block; and its ADMM converges there:
    ‖x − z‖/‖x‖ does not rise from one dual update to the next (by more than 0.002, its noise at
    the floor of ~0.001) and ends below 0.05."""
    from pyprune.inputs import data

    dense, tokenizer = smollm2_copy
    del engine.decoder_blocks(dense)[2:]
    dense.config.num_hidden_layers = 2
    calib = data.calibration_samples(tokenizer, "emma:first_half", nsamples=16, seqlen=256, seed=0)
    held_out = data.calibration_samples(tokenizer, "emma:second_half", nsamples=8, seqlen=256, seed=1)  # disjoint

    def errors(model):
        with torch.no_grad():
            ours = model(input_ids=held_out, output_hidden_states=True).hidden_states[1:]
            theirs = dense(input_ids=held_out, output_hidden_states=True).hidden_states[1:]
        return [float(F.mse_loss(a, b)) for a, b in zip(ours, theirs)]

    results = {}
    for method in ("wanda", "safe+"):
        model = copy.deepcopy(dense)
        options = {"epochs": 10} if method == "safe+" else {}
        report = pyprune.prune(model, method, "2:4", calib, progress=False, **options)
        assert report["nm_valid"]["2:4"]
        results[method] = errors(model)
        for block in report.get("blocks", []):
            residuals = block["residuals"]
            rises = [b - a for a, b in zip(residuals, residuals[1:])]  # ≤ 0.002: no rise beyond the floor's noise
            assert max(rises) <= 2e-3 and residuals[-1] < 0.05, residuals
    assert all(ours < theirs for ours, theirs in zip(results["safe+"], results["wanda"]))


def test_safe_plus_projects_by_the_activation_statistic_and_safe_by_magnitude():
    """With training switched off (no radius, no penalty, a vanishing learning rate) the weights stay
    and the blocks end as their first projection: SAFE⁺'s keeps Wanda's mask (|W|·‖X_j‖, the
    statistic of the block's calibration inputs), SAFE's the magnitude mask; the two differ here."""
    calib, dense = random_tokens((4, 16), seed=1), tiny_llama(seed=0)
    masks = {}
    for method, options in (("safe+", dict(epochs=1, lr=1e-12, rho=0.0, lam=0.0)),
                            ("safe", dict(epochs=1, lr=1e-12, rho=0.0, lam=0.0)), ("wanda", {}), ("magnitude", {})):
        model = copy.deepcopy(dense)
        pyprune.prune(model, method, "2:4", calib, progress=False, **options)
        masks[method] = {name: p != 0 for name, p in model.named_parameters() if name.endswith("proj.weight")}
    for name, mask in masks["wanda"].items():
        assert torch.equal(masks["safe+"][name], mask), name
        assert torch.equal(masks["safe"][name], masks["magnitude"][name]), name
    assert any(not torch.equal(mask, masks["magnitude"][name]) for name, mask in masks["wanda"].items())


def test_too_few_steps_for_one_dual_update_is_a_run_warning():
    """The API says it too (pyprune.methods.RunWarning); enough steps say nothing."""
    import warnings
    calib = random_tokens((4, 16), seed=1)
    with pytest.warns(pyprune.methods.RunWarning, match=r"give 2 steps a block, fewer than dual_interval=8"):
        pyprune.prune(tiny_llama(seed=0, layers=1), "safe+", "2:4", calib, progress=False, epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pyprune.methods.RunWarning)
        report = pyprune.prune(tiny_llama(seed=0, layers=1), "safe+", "2:4", calib, progress=False, epochs=4)
    assert report["dual_updates_per_block"] == 1
