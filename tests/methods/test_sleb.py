"""SLEB: removes exactly the requested number of blocks, each time the one a brute-force search
says hurts the calibration loss least; the smaller model saves, loads in plain transformers with the
same logits and generates with its KV cache."""
import copy

import pytest
import torch
import transformers

import pyprune
from pyprune.io import model_dir
from pyprune.methods.sleb import calibration_loss, skipped
from pyprune.nn.compact import keep_blocks_
from pyprune.patterns import Structured
from tests.helpers import random_tokens, tiny_decoder


def _greedy_by_brute_force(model, calib, count):
    """The blocks SLEB should remove: at each step, physically remove each remaining block from a
    copy of the model and keep the removal of least calibration loss."""
    kept = list(range(len(model.model.layers)))
    removed = []
    for _ in range(count):
        losses = {}
        for block in kept:
            trial = copy.deepcopy(model)
            keep_blocks_(trial, [i for i in kept if i != block])
            losses[block] = calibration_loss(trial, calib, 4)
        best = min(kept, key=losses.__getitem__)
        kept.remove(best)
        removed.append(best)
    return removed


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_removes_the_blocks_a_brute_force_search_picks(family):
    model, calib = tiny_decoder(family, layers=5, attn_implementation="eager"), random_tokens((4, 16))
    expected = _greedy_by_brute_force(model, calib, 2)
    report = pyprune.prune(model, "sleb", Structured(0.4), calib, progress=False, early_barrier=0,
                           latter_barrier=0)
    assert report["removed_blocks"] == expected
    assert report["kept_blocks"] == sorted(set(range(5)) - set(expected))
    assert len(model.model.layers) == model.config.num_hidden_layers == 3


def test_removes_the_requested_share_within_the_barriers():
    model, calib = tiny_decoder("llama", layers=6), random_tokens((4, 16))
    report = pyprune.prune(model, "sleb", Structured(0.5), calib, progress=False)  # barriers 1 and 1
    assert len(report["removed_blocks"]) == 3 and len(model.model.layers) == 3
    assert 0 in report["kept_blocks"] and 5 in report["kept_blocks"]
    assert report["parameters_after"] < report["parameters_before"]
    with pytest.raises(ValueError, match="method 'sleb': ratio 0.05 of 3 blocks removes 0; give a ratio that removes 1 to 1 "):
        pyprune.prune(model, "sleb", Structured(0.05), calib, progress=False)
    with pytest.raises(ValueError, match="supports patterns Structured"):
        pyprune.prune(model, "sleb", "2:4", calib, progress=False)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_saved_model_loads_in_plain_transformers_and_generates(family, tmp_path):
    model, calib = tiny_decoder(family, layers=6, attn_implementation="eager"), random_tokens((4, 16))
    dense = copy.deepcopy(model)
    report = pyprune.prune(model, "sleb", Structured(0.34), calib, progress=False)
    tokens = random_tokens((2, 20), seed=3)
    with torch.no_grad(), skipped(dense.model.layers[report["removed_blocks"][0]]), \
            skipped(dense.model.layers[report["removed_blocks"][1]]):
        expected = dense(input_ids=tokens).logits
    model_dir.save(model, None, str(tmp_path / "sleb"), report)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "sleb"),
                                                               attn_implementation="eager").eval()
    assert loaded.config.num_hidden_layers == len(loaded.model.layers) == 4
    assert loaded.config.layer_types == [dense.config.layer_types[i] for i in report["kept_blocks"]]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, expected)
        torch.testing.assert_close(loaded(input_ids=tokens).logits, expected)
    reloaded, _ = pyprune.load(str(tmp_path / "sleb"))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits, expected)
    prompt = tokens[:1, :12]  # longer than the sliding window: the cache's layer slots must match the blocks
    cached = loaded.generate(prompt, max_new_tokens=6, do_sample=False)
    uncached = loaded.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert cached.shape == (1, 18) and torch.equal(cached, uncached)
