"""A method object called directly (``Method.prune``) checks first and prunes exactly as
``pyprune.prune`` does: bit-identical weights for a baseline, COPAL (also resuming a saved state)
and DReSS; ``check`` changes neither the model nor the method object."""
import os

import pytest
import torch

import pyprune
from pyprune.methods.copal import STATE_FILE, Copal
from pyprune.methods.dress import DReSS
from pyprune.methods.wanda import Wanda
from pyprune.patterns import NM, Structured, Unstructured
from tests.helpers import random_tokens, tiny_llama


def _state(model):
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def _assert_identical(first, second):
    assert first.keys() == second.keys()
    for key in first:
        assert first[key].shape == second[key].shape and torch.equal(first[key], second[key]), key


@pytest.mark.parametrize("method,pattern", [
    (lambda: Wanda(), NM(2, 4)),
    (lambda: Copal(), Unstructured(0.5)),
    (lambda: DReSS(steps=2, channels="last"), Structured(0.25)),
])
def test_direct_call_equals_pyprune_prune(method, pattern):
    calib = random_tokens((4, 32), seed=1)
    direct, through = tiny_llama(seed=0), tiny_llama(seed=0)
    details = method().prune(direct, pattern, calib, progress=False)
    report = pyprune.prune(through, method(), pattern, calib, progress=False)
    _assert_identical(_state(direct), _state(through))
    assert all(report[key] == value for key, value in details.items() if key != "regularisation")


def test_direct_call_checks_first():
    model = tiny_llama(seed=0)
    before = _state(model)
    with pytest.raises(ValueError, match="needs calibration tokens"):
        Wanda().prune(model, NM(2, 4), None, progress=False)
    with pytest.raises(ValueError, match="supports patterns"):
        Wanda().prune(model, Structured(0.25), random_tokens((2, 16)), progress=False)
    _assert_identical(_state(model), before)


def test_copal_direct_call_resumes_a_saved_state(tmp_path):
    """A new ``Copal(state=d)`` called directly continues d's accumulators (it used to skip the
    load and overwrite d with its one step): the masks equal those of one object over both steps."""
    first, second = random_tokens((4, 32), seed=1), random_tokens((4, 32), seed=2)
    memory, method = tiny_llama(seed=0), Copal()
    for calib in (first, second):
        pyprune.prune(memory, method, 0.5, calib, progress=False)
    saved = tiny_llama(seed=0)
    Copal(state=str(tmp_path)).prune(saved, Unstructured(0.5), first, progress=False)
    resumed = Copal(state=str(tmp_path))
    details = resumed.prune(saved, Unstructured(0.5), second, progress=False)
    assert details["continual_step"] == 2
    _assert_identical(_state(saved), _state(memory))


def test_check_has_no_side_effects(tmp_path):
    calib = random_tokens((4, 32), seed=1)
    Copal(state=str(tmp_path)).prune(tiny_llama(seed=0), Unstructured(0.5), calib, progress=False)
    saved = os.path.getmtime(tmp_path / STATE_FILE)
    copal, model = Copal(state=str(tmp_path)), tiny_llama(seed=0)
    before = _state(model)
    copal.check(model, Unstructured(0.5))
    copal.check_loaded(model, Unstructured(0.5))
    assert copal.accumulators == {} and copal.dense == {} and copal.steps == []
    with pytest.raises(ValueError, match="other settings"):
        copal.check_loaded(model, Unstructured(0.25))
    dress = DReSS(checkpoint=str(tmp_path / "dress"))
    attributes = dict(vars(dress))
    dress.check(model, Structured(0.25))
    assert vars(dress) == attributes
    _assert_identical(_state(model), before)
    assert os.path.getmtime(tmp_path / STATE_FILE) == saved and not (tmp_path / "dress").exists()
