"""pyprune.runtime.decode.greedy_generate: the tokens of transformers' greedy generate, timed per phase."""
import warnings

import pytest
import torch

from pyprune.runtime.decode import greedy_generate

from tests.helpers import random_tokens, tiny_llama


def test_greedy_generate_matches_transformers_greedy_search():
    model = tiny_llama(layers=2).eval()
    prompt = random_tokens((2, 5), seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning per call (the cache is passed as `cache`)
        run = greedy_generate(model, prompt, 6)
    model.generation_config.eos_token_id = None  # no stop token, as greedy_generate
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                              do_sample=False, pad_token_id=0)[:, prompt.shape[1]:]
    assert torch.equal(run.tokens, expected)
    assert run.prefill_s > 0 and run.decode_s > 0 and run.decode_tokens_per_s > 0


def test_greedy_generate_rejects_bad_arguments():
    model = tiny_llama(layers=1).eval()
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        greedy_generate(model, random_tokens((1, 3)), 0)
    with pytest.raises(ValueError, match=r"prompt must be \[B, T\]"):
        greedy_generate(model, random_tokens((3,)), 2)
