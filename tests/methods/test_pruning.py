"""``pyprune.prune`` at the edge of the Python API: calibration that is not token ids of the model
(text, NumPy, float ids, ids outside the vocabulary, wrong rank, empty, longer than the model's
positions), a pattern the method cannot produce, and gradient methods under no_grad /
inference_mode: each refused before the model changes, with a message that says what to write."""
import re

import pytest
import torch

import pyprune
from pyprune import methods
from tests.helpers import random_tokens, tiny_llama

VOCAB, POSITIONS = 128, 32
CALIB = random_tokens((4, 16), vocab=VOCAB, seed=3)


def _model():
    """A one-block tiny Llama whose config allows sequences of POSITIONS tokens."""
    model = tiny_llama(layers=1, vocab=VOCAB)
    model.config.max_position_embeddings = POSITIONS
    return model


def _weights(model):
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def _assert_unchanged(model, before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)


@pytest.mark.parametrize("calib,error,message", [
    (["the house", "is good"], TypeError, r"calib must be token ids .*, not text; tokenize it first"),
    ("the house is good", TypeError, r"calib must be token ids .*, not text"),
    (CALIB.numpy(), TypeError, r"calib must be a torch integer tensor \[nsamples, seqlen\] of token ids; got "
                               r"numpy.ndarray \(convert it with torch.from_numpy\(calib\)\)"),
    (CALIB.tolist(), TypeError, r"got builtins.list \(convert it with torch.tensor\(calib\)\)"),
    (CALIB.float(), TypeError, r"calib must hold integer token ids \(int64\); got dtype torch.float32"),
    (CALIB.bool(), TypeError, r"got dtype torch.bool"),
    (CALIB[0], ValueError, r"calib must be \[nsamples, seqlen\]; got shape \(16,\) \(calib\[None\] is one sample\)"),
    (CALIB[None], ValueError, r"calib must be \[nsamples, seqlen\]; got shape \(1, 4, 16\)$"),
    (CALIB[:0], ValueError, r"calib must hold at least one token; got shape \(0, 16\)"),
    (CALIB - VOCAB, ValueError, r"calib holds token ids in \[-\d+, -?\d+\]; the model embeds ids in \[0, 128\)"),
    (CALIB.clone().index_fill_(1, torch.tensor([3]), VOCAB), ValueError,
     r"calib holds token ids in \[\d+, 128\]; the model embeds ids in \[0, 128\)"),
    (random_tokens((2, POSITIONS + 1), vocab=VOCAB), ValueError,
     r"calib has sequences of 33 tokens; the model takes at most 32 \(max_position_embeddings\)"),
])
@pytest.mark.parametrize("method", ["wanda", "magnitude"])
def test_calibration_that_is_not_token_ids_is_refused_before_the_model_changes(method, calib, error, message):
    """The rule is the same for every method, magnitude (which needs none) included: calibration,
    when given, is a torch integer tensor [nsamples, seqlen] of ids the model embeds."""
    model = _model()
    before = _weights(model)
    with pytest.raises(error, match=message):
        pyprune.prune(model, method, "2:4", calib, progress=False)
    _assert_unchanged(model, before)


def test_a_pattern_the_method_cannot_produce_shows_the_call_that_can():
    model = _model()
    before = _weights(model)
    with pytest.raises(ValueError, match=r"method 'taylor' supports patterns Structured; got unstructured 0.2: write "
                                         r"pyprune.prune\(model, 'taylor', Structured\(0.2\), \.\.\.\) with from "
                                         r"pyprune.patterns import Structured"):
        pyprune.prune(model, "taylor", 0.2, CALIB, progress=False)
    with pytest.raises(ValueError, match=r"method 'wanda' supports patterns Unstructured, NM; got structured 0.3: "
                                         r"write pyprune.prune\(model, 'wanda', 0.3 or \"2:4\", \.\.\.\)$"):
        pyprune.prune(model, "wanda", pyprune.patterns.Structured(0.3), CALIB, progress=False)
    _assert_unchanged(model, before)


GRADIENT_METHODS = sorted(name for name, cls in methods.METHODS.items() if cls.uses_gradients)


def test_the_gradient_methods_are_the_ones_that_call_backward():
    assert GRADIENT_METHODS == ["dress", "masked-recon", "moreau", "moreau-gs", "safe", "safe+", "smoothgrad", "taylor"]


@pytest.mark.parametrize("method", GRADIENT_METHODS)
def test_gradient_methods_refuse_inference_mode_in_one_line(method):
    """torch.enable_grad cannot leave inference_mode, so a gradient method says so before anything."""
    model = _model()
    before = _weights(model)
    pattern = methods.METHODS[method].patterns[0]
    pattern = pattern(0.25) if pattern is not pyprune.patterns.NM else pattern(2, 4)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match=rf"method '{re.escape(method)}' computes gradients, which "
                                               r"torch.inference_mode\(\) forbids; call pyprune.prune outside it"):
            pyprune.prune(model, method, pattern, CALIB, progress=False)
    _assert_unchanged(model, before)


def test_taylor_under_no_grad_turns_gradients_on_itself():
    """Under torch.no_grad() a gradient method prunes as outside it: the same heads and channels."""
    outside, inside = _model(), _model()
    pyprune.prune(outside, "taylor", pyprune.patterns.Structured(0.25), CALIB, progress=False)
    with torch.no_grad():
        report = pyprune.prune(inside, "taylor", pyprune.patterns.Structured(0.25), CALIB, progress=False)
    assert report["parameters_after"] < report["parameters_before"]
    _assert_unchanged(inside, _weights(outside))


def test_numpy_token_ids_prune_once_converted_as_the_message_says():
    model = _model()
    report = pyprune.prune(model, "wanda", "2:4", torch.from_numpy(CALIB.numpy()), progress=False)
    assert report["nm_valid"]["2:4"]


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_a_model_on_the_meta_device_is_refused_before_pruning_and_saving(method, tmp_path):
    """A model built under ``init_empty_weights`` / a meta device map has no weights: prune and save
    say so in one line (not torch's "Tensor.item() cannot be called on meta tensors" after the run)."""
    with torch.device("meta"):
        model = _model()
    with pytest.raises(ValueError, match=r"^pruning with .*: \d+ tensors of the model are on the meta device"):
        pyprune.prune(model, method, 0.5, CALIB)
    with pytest.raises(ValueError, match=r"^saving to .*on the meta device.*load them first"):
        pyprune.save(model, None, tmp_path / "out")
    assert not (tmp_path / "out").exists()
