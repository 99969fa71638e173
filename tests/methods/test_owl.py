"""OWL's layer-wise sparsity (option ``owl`` of every unstructured method): the outlier ratios of the
dense model, block sparsities that average to the target and fall as the ratios rise, exact counts."""
import pytest
import torch

import pyprune
from pyprune import methods
from pyprune.methods import owl
from pyprune.ops.conventions import kept_count
from pyprune.runtime import engine
from tests.helpers import random_tokens, tiny_llama

LAYERS = 4


def _outlying_llama():
    """A tiny Llama whose block i has 4·i input columns of down_proj scaled by 8 (more outliers
    deeper), except the last block, which gets fewer than the one before it: ratios not sorted."""
    model = tiny_llama(layers=LAYERS)
    with torch.no_grad():
        for index, columns in enumerate([0, 8, 16, 4]):
            model.model.layers[index].mlp.down_proj.weight[:, :columns] *= 8
    return model


def _dense_outlier_ratios(model, calib, m):
    """D per block by brute force: ‖X_j‖² from hooks on one forward of the dense model, the scores
    of all the block's linears in one tensor."""
    sqnorms, handles = {}, []
    for index, block in enumerate(model.model.layers):
        for name, linear in engine.block_linears(block).items():
            def hook(module, args, output, key=(index, name)):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                sqnorms[key] = sqnorms.get(key, 0) + x.square().sum(0)
            handles.append(linear.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=calib)
    for handle in handles:
        handle.remove()
    ratios = []
    for index, block in enumerate(model.model.layers):
        scores = torch.cat([(linear.weight.double().abs() * sqnorms[(index, name)].sqrt()).flatten()
                            for name, linear in engine.block_linears(block).items()])
        ratios.append(float((scores > m * scores.mean()).double().mean()))
    return ratios


def test_allocation_averages_to_the_target_and_spans_two_lambda():
    ratios = [0.01, 0.03, 0.02, 0.05, 0.01]
    sparsities = owl.allocate(ratios, 0.7, 0.08)
    assert sum(sparsities) / len(sparsities) == pytest.approx(0.7, abs=1e-12)
    assert max(sparsities) - min(sparsities) == pytest.approx(0.16, abs=1e-12)
    assert sparsities[3] == min(sparsities) and sparsities[0] == sparsities[4] == max(sparsities)
    assert sparsities[1] < sparsities[2] < sparsities[0]
    assert owl.allocate([0.02] * 3, 0.6, 0.08) == [0.6] * 3
    with pytest.raises(ValueError, match="owl_lambda=0.3"):
        owl.allocate(ratios, 0.8, 0.3)


@pytest.mark.parametrize("blocks", [2, 3, 30])
def test_a_lambda_is_refused_before_loading_exactly_when_no_outlier_ratios_could_allocate_it(blocks):
    """check_spread refuses (target, lambda) exactly where allocate refuses every set of differing
    ratios of that many blocks: a refused one fails on random ratios and on the extremes; an
    accepted one has ratios that allocate (one block at the top, one at the bottom, the others at a
    level r chosen so that the mean shift is inside the feasible interval)."""
    generator = torch.Generator().manual_seed(0)
    for target in (0.15, 0.5, 0.8, 0.93):  # none on a boundary, where rounding decides
        for lam in (0.01, 0.05, 0.1, 0.2, 0.3, 0.45, 0.5, 0.6):
            low = max(2 * lam - target, 2 * lam / blocks)  # the feasible mean shifts [low, high)
            high = min(1 - target, 2 * lam * (blocks - 1) / blocks)
            try:
                owl.check_spread(target, lam, blocks)
            except ValueError as error:
                assert f"owl_lambda={lam}" in str(error) and "\n" not in str(error)
                assert not low < high or 2 * lam >= 1, (target, lam)
                draws = [torch.rand(blocks, generator=generator).tolist() for _ in range(50)]
                for ratios in draws + [[1.0] + [0.0] * (blocks - 1), [0.0] + [1.0] * (blocks - 1)]:
                    with pytest.raises(ValueError):
                        owl.allocate(ratios, target, lam)
                continue
            mean = (low + high) / 2  # = 2*lam*(1 + (blocks - 2) * r) / blocks for ratios [1, 0, r, ..., r]
            level = (mean * blocks / (2 * lam) - 1) / max(blocks - 2, 1)
            sparsities = owl.allocate([1.0, 0.0] + [level] * (blocks - 2), target, lam)
            assert 0 <= min(sparsities) and max(sparsities) < 1


def test_outlier_ratios_are_those_of_the_dense_model():
    model, calib = _outlying_llama(), random_tokens((4, 16))
    expected = _dense_outlier_ratios(model, calib, 2.0)
    report = pyprune.prune(model, "wanda", 0.5, calib, progress=False, owl=True, owl_m=2.0)
    assert report["owl"]["outlier_ratio"] == pytest.approx(expected, abs=2e-6)
    assert len(set(expected)) == LAYERS


@pytest.mark.parametrize("method,options", [("magnitude", {}), ("wanda", {}), ("sparsegpt", {}), ("copal", {}),
                                            ("safe", {"epochs": 1})])
def test_block_sparsities_follow_the_outlier_ratios_with_exact_counts(method, options):
    model, calib = _outlying_llama(), random_tokens((4, 16))
    report = pyprune.prune(model, method, 0.6, calib, progress=False, owl=True, owl_m=2.0, owl_lambda=0.1,
                           **options)
    ratios, sparsities = report["owl"]["outlier_ratio"], report["owl"]["block_sparsity"]
    assert sum(sparsities) / LAYERS == pytest.approx(0.6, abs=1e-5)
    assert max(sparsities) - min(sparsities) == pytest.approx(0.2, abs=1e-5)
    order = sorted(range(LAYERS), key=ratios.__getitem__)
    assert [sparsities[i] for i in order] == sorted(sparsities, reverse=True), "more outliers, fewer pruned"
    measured = {layer["name"]: layer["sparsity"] for layer in report["layers"]}
    for index, block in enumerate(model.model.layers):
        for name, linear in engine.block_linears(block).items():
            rows, columns = linear.weight.shape
            zeros = rows * (columns - kept_count(columns, sparsities[index])) if report["scope"] == "row" \
                else linear.weight.numel() - kept_count(linear.weight.numel(), sparsities[index])
            assert int((linear.weight == 0).sum()) == zeros, f"block {index} {name}"
            assert measured[f"model.layers.{index}.{name}"] == pytest.approx(zeros / linear.weight.numel())


def test_uniform_without_owl_and_refusals():
    model, calib = _outlying_llama(), random_tokens((4, 16))
    assert "owl" not in pyprune.prune(model, "wanda", 0.5, calib, progress=False)
    with pytest.raises(ValueError, match="option owl of method 'sparsegpt'.*2:4"):
        pyprune.prune(model, "sparsegpt", "2:4", calib, progress=False, owl=True)
    with pytest.raises(ValueError, match="method 'magnitude' needs calibration"):
        pyprune.prune(model, "magnitude", 0.5, None, progress=False, owl=True)
    with pytest.raises(ValueError, match="option owl_m of method 'wanda' must be > 0"):
        methods.get("wanda", owl=True, owl_m=0.0)
