"""Greedy decoding with the KV cache, timed: what ``pyprune generate`` and the end-to-end benchmark
run, so a user feels (and the benchmark measures) the same loop."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Collection, List, Set, Tuple

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


def stop_tokens(model: nn.Module, tokenizer=None) -> Set[int]:
    """The end-of-sequence ids generation stops at: the model's ``generation_config.eos_token_id``
    (an id or a list of them, as Gemma's and Llama 3's list several), else its config's, else the
    tokenizer's ``eos_token_id``; empty where none names one."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        found = getattr(source, "eos_token_id", None)
        if found is not None:
            return {int(i) for i in (found if isinstance(found, (list, tuple, set)) else [found])}
    return set()


@torch.no_grad()
def greedy_generate(model: nn.Module, prompt: Tensor, max_new_tokens: int,
                    stop: Collection[int] = ()) -> Generation:
    """Up to ``max_new_tokens`` argmax continuations of ``prompt`` ([B, T] token ids) with the KV
    cache: the first from one forward over the prompt, each further one from one forward of the
    last token, until every row has produced a token of ``stop`` (kept, last; e.g. :func:`stop_tokens`).
    With no ``stop`` (the default) every run does the same work, so runs compare."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int; got {max_new_tokens!r}")
    if prompt.dim() != 2 or prompt.shape[0] < 1 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be [B, T] token ids with B, T >= 1; got shape {tuple(prompt.shape)}")
    stop = torch.tensor(sorted(stop), dtype=torch.long, device=prompt.device)
    begin = time.perf_counter()
    token, cache = prompt_step(model, prompt)
    prefill_s = time.perf_counter() - begin
    begin = time.perf_counter()
    tokens, done = [token], torch.isin(token[:, 0], stop)
    while len(tokens) < max_new_tokens and not bool(done.all()):
        token, cache = next_step(model, token, cache)
        tokens.append(token)
        done |= torch.isin(token[:, 0], stop)
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
        token, cache = next_step(model, token, cache)
        tokens.append(token)
    return tokens


@torch.no_grad()
def next_step(model: nn.Module, token: Tensor, cache) -> Tuple[Tensor, object]:
    """The greedy token ([B, 1]) after ``token`` from one forward of it, and the extended ``cache``."""
    out = model(input_ids=token, cache=cache, use_cache=True)
    return out.logits[:, -1:].argmax(-1), out.cache
