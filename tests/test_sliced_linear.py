"""SlicedLinear evaluates a channel mask without copying weights: the model it gives equals the
physically compacted one, and unslice_ restores the original exactly."""
import copy

import pytest
import torch
from torch import nn

from pyprune.nn import SlicedLinear, keep_mlp_channels_, slice_mlp_channels_, unslice_

from .helpers import random_tokens, randn, tiny_llama


def test_sliced_linear_equals_the_sliced_weight_and_shares_it():
    base = nn.Linear(12, 10)
    in_index, out_index = torch.tensor([3, 0, 11]), torch.tensor([9, 1])
    layer = SlicedLinear(base, in_index, out_index)
    x = randn((4, 3), seed=1)
    expected = nn.functional.linear(x, base.weight[out_index][:, in_index], base.bias[out_index])
    torch.testing.assert_close(layer(x), expected)
    assert layer.base.weight.data_ptr() == base.weight.data_ptr()
    assert (layer.in_features, layer.out_features) == (3, 2)
    assert set(layer.state_dict()) == {"base.weight", "base.bias"}


def test_bad_index_names_the_argument():
    with pytest.raises(ValueError, match="out_index must hold positions in \\[0, 10\\)"):
        SlicedLinear(nn.Linear(12, 10), out_index=torch.tensor([10]))
    with pytest.raises(TypeError, match="base must be an nn.Linear"):
        SlicedLinear(nn.Conv1d(1, 1, 1))
    layer = SlicedLinear(nn.Linear(12, 10), in_index=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 2\] of dtype torch.float32"):
        layer(torch.zeros(3, 12))


def test_sliced_mlp_gives_the_compacted_model_and_unslice_restores_it():
    model = tiny_llama(layers=2)
    tokens = random_tokens((2, 10), seed=2)
    with torch.no_grad():
        dense_logits = model(input_ids=tokens).logits
    keep = [torch.arange(0, 128, 3), torch.randperm(128, generator=torch.Generator().manual_seed(0))[:50]]
    compacted = copy.deepcopy(model)
    for block, index in zip(compacted.model.layers, keep):
        keep_mlp_channels_(block, index)
    for block, index in zip(model.model.layers, keep):
        slice_mlp_channels_(block, index)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits,
                                   compacted(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="already sliced"):
        slice_mlp_channels_(model.model.layers[0], keep[0])
    assert unslice_(model) == 6
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, dense_logits)


def test_bool_channel_mask_is_accepted():
    model = tiny_llama(layers=1)
    mask = torch.zeros(128, dtype=torch.bool)
    mask[::2] = True
    slice_mlp_channels_(model.model.layers[0], mask)
    assert model.model.layers[0].mlp.down_proj.in_features == 64
