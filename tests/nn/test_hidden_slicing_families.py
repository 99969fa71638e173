"""Hidden-channel slicing (DReSS's slice step) on every RMS-norm family: the sliced model computes
what the unsliced one computes with the removed channels zeroed and every norm's multiplier scaled
by sqrt(d'/d) (Gemma's norms multiply by 1 + w, so 1 + w is scaled) and its eps by d'/d; Gemma's
embedding keeps its scale sqrt(original hidden size). LayerNorm families are refused in one line."""
import math

import pytest
import torch

import pyprune
from pyprune.methods.dress import DReSS
from pyprune.nn import layout
from pyprune.nn.compact import keep_hidden_channels_
from pyprune.patterns import Structured
from tests.helpers import random_tokens, tiny_decoder

RMS_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "glm4", "exaone4", "olmo2")
D, KEPT = 64, 48


def tiny(family, **kwargs):
    return tiny_decoder(family, layers=2, **kwargs)


def _zeroed_and_rescaled(model, keep, offset):
    """``model`` with the channels outside ``keep`` zeroed where they enter the stream (embedding
    columns, writer rows and biases) and every norm's multiplier (``offset`` + weight) times
    sqrt(d'/d), eps times d'/d."""
    stream = layout.hidden_stream(model)
    drop = sorted(set(range(D)) - set(keep))
    with torch.no_grad():
        stream["embed"].weight[:, drop] = 0
        for writer in stream["writers"].values():
            writer.weight[drop] = 0
            if writer.bias is not None:
                writer.bias[drop] = 0
        for norm in stream["norms"].values():
            norm.weight.copy_((norm.weight + offset) * math.sqrt(KEPT / D) - offset)
            field = "eps" if hasattr(norm, "eps") else "variance_epsilon"
            setattr(norm, field, getattr(norm, field) * KEPT / D)
    return model


@pytest.mark.parametrize("family", RMS_FAMILIES)
def test_sliced_model_equals_the_zeroed_model_with_rescaled_norms(family):
    keep = sorted(torch.randperm(D, generator=torch.Generator().manual_seed(2))[:KEPT].tolist())
    offset = 1.0 if family.startswith("gemma") else 0.0  # Gemma's norms multiply by 1 + w
    sliced, reference = tiny(family), _zeroed_and_rescaled(tiny(family), keep, offset)
    tokens = random_tokens((2, 20), seed=4)
    embedded = sliced.get_input_embeddings()(tokens)[..., keep]  # Gemma's: times sqrt(64)
    keep_hidden_channels_(sliced, keep)
    assert sliced.config.hidden_size == KEPT and sliced.get_input_embeddings().weight.shape == (128, KEPT)
    torch.testing.assert_close(sliced.get_input_embeddings()(tokens), embedded, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(sliced(input_ids=tokens).logits, reference(input_ids=tokens).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ("llama", "gemma3", "phi3"))
def test_a_saved_slice_reloads_with_identical_logits(family, tmp_path):
    """Gemma builds its embedding scale from config.hidden_size on load: the slice folds the
    original sqrt(64) into the weights, so the reloaded model (scale sqrt(48)) computes the same."""
    model = tiny(family)
    keep_hidden_channels_(model, list(range(8, 56)))
    pyprune.save(model, None, str(tmp_path / "sliced"))
    loaded, _ = pyprune.load(str(tmp_path / "sliced"))
    tokens = random_tokens((2, 20), seed=4)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)


@pytest.mark.parametrize("family", ("gemma3", "phi3"))
def test_dress_without_regularisation_and_its_preview_give_the_same_model(family):
    """DReSS with steps=0 slices and rescales the norms (on 1 + w for Gemma); the preview with its
    norm_scale (views, no copy) computes the same logits."""
    calib = random_tokens((8, 32), seed=1)
    sliced, preview = tiny(family), tiny(family)
    report = pyprune.prune(sliced, "dress", Structured(0.25), calib, progress=False, steps=0)
    assert report["hidden_size"] == [D, KEPT] and report["regularisation"] == {}
    keep = sorted(set(range(D)) - set(report["pruned_channels"]))
    pyprune.nn.slice_hidden_channels_(preview, keep, norm_scale=report["norm_scale"])
    with torch.no_grad():
        torch.testing.assert_close(preview(input_ids=calib).logits, sliced(input_ids=calib).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ("opt", "gpt_neox"))
def test_layer_norm_families_are_refused_in_one_line_untouched(family):
    model = tiny(family)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="LayerNorm") as info:
        keep_hidden_channels_(model, list(range(KEPT)))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="LayerNorm"):
        pyprune.prune(model, "dress", Structured(0.25), random_tokens((8, 32)), progress=False, steps=0)
    with pytest.raises(ValueError, match="no rms_norm_eps"):  # from the config alone, before loading
        DReSS().check_config(model.config, Structured(0.25))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
