"""StructuredMethod.use_scores: the scores of a prune at one ratio, cut at another, prune exactly as
a prune at that ratio from scratch (the scores do not depend on the ratio), without scoring again;
scores that do not fit the model are refused."""
import copy

import pytest
import torch

import pyprune
from pyprune import methods
from pyprune.patterns import Structured
from tests.helpers import random_tokens, tiny_decoder

CALIB = random_tokens((4, 16))


@pytest.mark.parametrize("family,method,options", [
    ("llama", "moreau", {"steps": 2, "loss_scaling": True}),   # heads and MLP channels; details: Moreau, loss scale
    ("llama", "smoothgrad", {"passes": 2, "structure": "hidden"}),  # hidden channels
    ("qwen2_moe", "taylor", {"heads": False}),                  # experts' and shared expert's channels
    ("lfm2", "taylor", {"heads": False}),                       # a hybrid model's MLP channels
])
def test_scores_of_one_ratio_prune_another_as_a_fresh_prune_does(family, method, options, monkeypatch):
    model = tiny_decoder(family, layers=2)
    first = methods.get(method, **options)
    pyprune.prune(copy.deepcopy(model), first, Structured(0.25), CALIB, batch_size=4, progress=False)
    fresh_model, fresh = copy.deepcopy(model), methods.get(method, **options)
    expected = pyprune.prune(fresh_model, fresh, Structured(0.5), CALIB, batch_size=4, progress=False)

    scored = []
    monkeypatch.setattr(type(first), "element_scores", lambda *args, **kwargs: scored.append(1))
    cut_model = copy.deepcopy(model)
    given = methods.get(method, **options).use_scores(first.layer_scores, first.scoring_details())
    report = pyprune.prune(cut_model, given, Structured(0.5), CALIB, batch_size=4, progress=False)
    assert scored == []  # nothing scored again
    for key in set(expected) - {"time_s"}:
        assert report[key] == expected[key], key
    assert report.get("moreau") == first.scoring_details().get("moreau")  # the scoring prune's details
    assert set(given.layer_scores) == set(fresh.layer_scores)
    for layer, kinds in fresh.layer_scores.items():
        assert all(torch.equal(given.layer_scores[layer][kind], scores) for kind, scores in kinds.items())
    assert cut_model.state_dict().keys() == fresh_model.state_dict().keys()
    assert all(torch.equal(cut_model.state_dict()[k], v) for k, v in fresh_model.state_dict().items())


def test_scores_that_do_not_fit_the_model_are_refused():
    model = tiny_decoder("llama", layers=2)
    first = methods.get("taylor")
    pyprune.prune(copy.deepcopy(model), first, Structured(0.25), CALIB, batch_size=4, progress=False)
    shorter = {layer: dict(kinds, channels=kinds["channels"][:-1]) for layer, kinds in first.layer_scores.items()}
    with pytest.raises(ValueError, match=r"method 'taylor': the given scores do not fit this model: layer 0 channels "
                                         r"has shape \(127,\) there and \(128,\) here"):
        pyprune.prune(copy.deepcopy(model), methods.get("taylor").use_scores(shorter), Structured(0.5), CALIB,
                      progress=False)
    one_layer = {0: first.layer_scores[0]}
    with pytest.raises(ValueError, match=r"layer 1 channels has shape None there and \(128,\) here"):
        pyprune.prune(copy.deepcopy(model), methods.get("taylor").use_scores(one_layer), Structured(0.5), CALIB,
                      progress=False)
