"""LoRA recovery keeps a pruned model's masks: the adapters merge under each layer's mask
(W += s·BA ⊙ M), so a 2:4 model stays exactly 2:4 and an unstructured one keeps its zeros."""
import pytest
import torch

import pyprune
from pyprune import cli
from pyprune.patterns import Unstructured
from pyprune.runtime import recovery
from pyprune.runtime.recovery import lora_finetune
from tests.helpers import random_tokens, tiny_llama

SETTINGS = dict(rank=4, alpha=8.0, lr=1e-2, batch_size=2, seed=0, progress=False)


def _block_weights(model):
    return {name: module.weight.detach().clone() for name, module in model.model.layers.named_modules()
            if isinstance(module, torch.nn.Linear)}


@pytest.mark.parametrize("pattern", ["2:4", "4:8", Unstructured(0.5)], ids=str)
def test_recovery_keeps_the_mask_and_trains_the_kept_weights(pattern):
    model = tiny_llama()
    pyprune.prune(model, "magnitude", pattern, progress=False)
    before = _block_weights(model)
    report = lora_finetune(model, random_tokens((4, 16), seed=2), steps=3, **SETTINGS)
    after = _block_weights(model)
    assert report["masked_layers"] == len(before) == 14
    for name, weight in before.items():
        assert torch.equal(after[name] == 0, weight == 0), name  # the same zeros, no new ones
        assert not torch.equal(after[name], weight), name  # and the kept weights moved
    if isinstance(pattern, str):
        assert pyprune.nn.measure.sparsity_report(model)["nm_valid"][pattern]


def test_the_merge_is_the_masked_lora_update(monkeypatch):
    """Merged weight = weight + (alpha/rank)·BA ⊙ (weight != 0), from the adapters as trained."""
    model = tiny_llama()
    pyprune.prune(model, "magnitude", "2:4", progress=False)
    expected = {}
    merge = recovery._merge_under_masks

    def recording(wrapped_model, masks):
        from peft.tuners.lora import LoraLayer
        with torch.no_grad():
            for name, module in wrapped_model.named_modules():
                if isinstance(module, LoraLayer):
                    weight = module.get_base_layer().weight
                    expected[name] = weight + module.get_delta_weight("default") * (weight != 0)
        return merge(wrapped_model, masks)

    monkeypatch.setattr(recovery, "_merge_under_masks", recording)
    lora_finetune(model, random_tokens((4, 16), seed=2), steps=2, **SETTINGS)
    assert len(expected) == 14
    for name, weight in expected.items():
        torch.testing.assert_close(model.get_submodule(name).weight, weight, rtol=0, atol=0)


def test_pyprune_recover_on_a_2_4_model_stays_exactly_2_4(tiny_model_dir, tmp_path):
    model_dir, text = tiny_model_dir
    pruned, recovered = tmp_path / "pruned", tmp_path / "recovered"
    assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "2:4", "--output",
                     str(pruned), "--quiet"]) == 0
    assert cli.main(["recover", "--model", str(pruned), "--calib", str(text), "--steps", "2", "--nsamples", "4",
                     "--seqlen", "16", "--batch-size", "2", "--lr", "0.01", "--output", str(recovered),
                     "--quiet"]) == 0
    before, _ = pyprune.load(pruned)
    after, _ = pyprune.load(recovered)
    stats = pyprune.nn.measure.sparsity_report(after)
    assert stats["nm_valid"]["2:4"]
    old, new = _block_weights(before), _block_weights(after)
    assert all(torch.equal(new[name] == 0, old[name] == 0) for name in old)
    assert any(not torch.equal(new[name], old[name]) for name in old)
