"""SlicedLinear evaluates a channel mask without copying weights: the model it gives equals the
physically compacted one (MLP channels, or a whole model's hidden channels), and unslice_
restores the original exactly."""
import copy

import pytest
import torch
from torch import nn

from pyprune.nn import (SlicedLinear, keep_hidden_channels_, keep_mlp_channels_, slice_hidden_channels_,
                        slice_mlp_channels_, unslice_)

from tests.helpers import random_tokens, randn, tiny_llama


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_sliced_hidden_channels_give_the_compacted_model_and_unslice_restores_it(tied, dtype):
    model = tiny_llama(layers=2, tie_word_embeddings=tied)
    with torch.no_grad():  # norm weights away from 1, so slicing them shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    model.to(dtype)
    tokens = random_tokens((2, 12), seed=3)
    keep = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:44].sort().values
    with torch.no_grad():
        dense_logits = model(input_ids=tokens).logits
        compacted = copy.deepcopy(model)
        keep_hidden_channels_(compacted, keep)
        slice_hidden_channels_(model, keep)
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(model(input_ids=tokens).logits, compacted(input_ids=tokens).logits, **tol)
    with pytest.raises(ValueError, match="Sliced"):
        slice_hidden_channels_(model, keep)
    layers = 2 * 7 + 2 * 2 + 3  # per block 5 readers, 2 writers, 2 norms; embedding, final norm, lm_head
    assert unslice_(model) == layers
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, dense_logits)


def test_sliced_hidden_channels_train_the_full_weights():
    model = tiny_llama(layers=1)
    keep = torch.arange(48)
    slice_hidden_channels_(model, keep)
    tokens = random_tokens((2, 8), seed=4)
    model(input_ids=tokens, labels=tokens).loss.backward()
    q_grad = model.model.layers[0].self_attn.q_proj.base.weight.grad
    assert q_grad.shape == (64, 64) and q_grad[:, :48].abs().sum() > 0 and q_grad[:, 48:].abs().sum() == 0
    embed_grad = model.model.embed_tokens.base.weight.grad
    assert embed_grad[:, :48].abs().sum() > 0 and embed_grad[:, 48:].abs().sum() == 0
