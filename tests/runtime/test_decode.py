"""pyprune.runtime.decode.greedy_generate: the tokens of transformers' greedy generate, timed per phase."""
import warnings

import pytest
import torch

from pyprune.runtime.decode import greedy_generate, stop_tokens

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


def test_greedy_generate_stops_once_every_row_has_produced_a_stop_token():
    """Each row keeps its tokens up to and past its own stop while another row runs on; the run ends
    when the last row stops, or at max_new_tokens; the stop ids are the generation config's (a
    list or one id), else the config's."""
    model = tiny_llama(layers=2).eval()
    prompt = random_tokens((2, 5), seed=3)
    free = greedy_generate(model, prompt, 10).tokens
    first = free[0, 2].item()  # row 0 stops at step 3 (or earlier, where that token came before)
    ends = [next(i for i, t in enumerate(row.tolist()) if t == first) if first in row.tolist() else None
            for row in free]
    run = greedy_generate(model, prompt, 10, stop={first})
    expected = 10 if None in ends else max(ends) + 1
    assert run.tokens.shape[1] == expected and torch.equal(run.tokens, free[:, :expected])
    assert greedy_generate(model, prompt, 10, stop={10 ** 6}).tokens.shape[1] == 10
    model.generation_config.eos_token_id = [5, 9]
    assert stop_tokens(model) == {5, 9}
    model.generation_config.eos_token_id, model.config.eos_token_id = None, 4
    assert stop_tokens(model) == {4}


def test_greedy_generate_rejects_bad_arguments():
    model = tiny_llama(layers=1).eval()
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        greedy_generate(model, random_tokens((1, 3)), 0)
    with pytest.raises(ValueError, match=r"prompt must be \[B, T\]"):
        greedy_generate(model, random_tokens((3,)), 2)
