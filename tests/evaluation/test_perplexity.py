"""Perplexity windows with and without the tokenizer's BOS, against a hand computation."""
import math

import torch
import torch.nn.functional as F

from pyprune.evaluation.perplexity import perplexity
from tests.helpers import random_tokens, tiny_llama


def _nll(model, window, scored_from):
    logits = model(input_ids=window[None]).logits[0, :-1].float()
    log_probs = F.log_softmax(logits, dim=-1).gather(-1, window[1:, None])[:, 0]
    return -float(log_probs[scored_from:].sum()), int(log_probs[scored_from:].numel())


@torch.no_grad()
def test_a_bos_window_is_bos_then_seqlen_minus_one_text_tokens_all_scored():
    model = tiny_llama()
    stream = random_tokens((70,), vocab=120, seed=1) + 3  # ids 3.., so id 1 is only ever the BOS
    seqlen, bos = 16, 1
    nll, count = 0.0, 0
    for start in range(0, 70 // (seqlen - 1) * (seqlen - 1), seqlen - 1):
        window = torch.cat([torch.tensor([bos]), stream[start:start + seqlen - 1]])
        part, n = _nll(model, window, 0)
        nll, count = nll + part, count + n
    assert count == 4 * 15
    got = perplexity(model, stream, seqlen, batch_size=3, progress=False, bos_token_id=bos)
    assert math.isclose(got, math.exp(nll / count), rel_tol=1e-5)
    plain = perplexity(model, stream, seqlen, batch_size=3, progress=False)
    assert not math.isclose(plain, got, rel_tol=1e-3)
