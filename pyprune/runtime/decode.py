"""Greedy decoding with the KV cache, timed: what ``pyprune generate`` and the end-to-end benchmark
run, so a user feels (and the benchmark measures) the same loop."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Tuple

import torch
from torch import Tensor, nn


@dataclass
class Generation:
    """The new tokens ([batch, new]) of one greedy run and how long its phases took."""
    tokens: Tensor
    prefill_s: float  # the forward over the prompt, up to the first new token
    decode_s: float  # the remaining new tokens, one forward each

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.tokens.shape[1] - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else float("nan")


@torch.no_grad()
def greedy_generate(model: nn.Module, prompt: Tensor, max_new_tokens: int) -> Generation:
    """The ``max_new_tokens`` argmax continuations of ``prompt`` ([B, T] token ids) with the KV
    cache: the first from one forward over the prompt, each further one from one forward of the
    last token. No stop token: every run does the same work, so runs compare."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int; got {max_new_tokens!r}")
    if prompt.dim() != 2 or prompt.shape[0] < 1 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be [B, T] token ids with B, T >= 1; got shape {tuple(prompt.shape)}")
    begin = time.perf_counter()
    token, cache = prompt_step(model, prompt)
    prefill_s = time.perf_counter() - begin
    begin = time.perf_counter()
    tokens = [token] + decode_steps(model, token, cache, max_new_tokens - 1)
    return Generation(torch.cat(tokens, dim=1), prefill_s, time.perf_counter() - begin)


@torch.no_grad()
def prompt_step(model: nn.Module, prompt: Tensor) -> Tuple[Tensor, object]:
    """The first greedy token ([B, 1]) after ``prompt`` from one forward over it, and the KV cache."""
    out = model(input_ids=prompt, use_cache=True)
    return out.logits[:, -1:].argmax(-1), out.cache  # transformers 5's name (past_key_values is deprecated)


@torch.no_grad()
def decode_steps(model: nn.Module, token: Tensor, cache, steps: int) -> List[Tensor]:
    """The ``steps`` greedy tokens ([B, 1] each) after ``token``, one forward of the last token each,
    extending ``cache`` (the KV cache of everything before ``token``)."""
    tokens = []
    for _ in range(steps):
        out = model(input_ids=token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        tokens.append(token)
    return tokens
