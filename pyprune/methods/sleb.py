"""SLEB (Song et al., 2024): remove whole transformer blocks, one at a time, each time the block
whose removal raises the calibration perplexity least (Algorithm 1).

At every step each remaining candidate block is skipped in turn (its input passed on unchanged)
and the model's mean next-token loss on the calibration windows measured; the block of least loss
is removed and the search repeats on the smaller model, until the requested share of blocks is gone
(``structured r``: ``kept_count(blocks, r)`` blocks stay, halves kept; 25% of SmolLM2's 30 blocks
removes 7). The blocks are then deleted (:func:`pyprune.nn.compact.keep_blocks_`): the result is a
dense model with fewer layers that plain ``from_pretrained`` loads.

As in the authors' code, the first ``early_barrier`` and the last ``latter_barrier`` remaining blocks
are never candidates. The authors' code (``get_trainloaders``) searches on the first 128 *rows* of
the shuffled WikiText-2 train split (seed 0; many rows are empty or headings), joined and cut into
windows of the model's sequence length: a few thousand tokens, not 128 windows. The default here,
16 windows of 256 tokens, is of that size (every step runs the model once per candidate).
"""
from __future__ import annotations

import contextlib
import math
from typing import Dict, List

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..nn.anatomy import decoder_blocks
from ..nn.compact import keep_blocks_
from ..ops.conventions import kept_count
from ..patterns import Structured
from ..runtime import distributed
from .base import Method
from .options import nonnegative, option


@contextlib.contextmanager
def skipped(block: nn.Module):
    """``block`` passes its hidden states on unchanged while inside (an instance attribute shadows
    its class's forward, as a removed block would), in the container its own forward returns: its
    first call runs the block once to see whether that is a tuple (Falcon-H1's) or the tensor itself."""
    own, run, returns_tuple = block.__dict__.get("forward"), block.forward, []

    def skip(hidden_states=None, *args, **kwargs):
        if not returns_tuple:
            returns_tuple.append(isinstance(run(hidden_states, *args, **kwargs), tuple))
        return (hidden_states,) if returns_tuple[0] else hidden_states

    block.forward = skip
    try:
        yield
    finally:
        if own is None:
            del block.forward
        else:
            block.forward = own


@torch.no_grad()
def calibration_loss(model: nn.Module, calib: Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy of ``model`` over the calibration windows (log of their perplexity).
    Each batch's float32 mean times its size is added in float64 (exact), so in a process group the
    ranks' sums over their shards add up to the one-process value."""
    device = next(model.parameters()).device
    shard = distributed.shard(calib, batch_size)
    total = torch.zeros(1, dtype=torch.float64)
    for start in range(0, shard.shape[0], batch_size):
        batch = shard[start:start + batch_size].to(device)
        total += float(model(input_ids=batch, labels=batch, use_cache=False).loss) * batch.shape[0]
    return float(distributed.all_reduce_(total)) / calib.shape[0]


class SLEB(Method):
    name = "sleb"
    patterns = (Structured,)
    calibration = (16, 256)
    offload_refusal = "it runs the whole model once per candidate block"
    data_parallel = True  # the calibration losses are summed over the ranks
    structured_moe = True  # a block goes whole, its experts with it

    early_barrier: int = option(1, "SLEB: this many first remaining blocks are never removed (authors' code: 1)",
                                nonnegative)
    latter_barrier: int = option(1, "SLEB: this many last remaining blocks are never removed (authors' code: 1)",
                                 nonnegative)

    def removed_count(self, blocks: int, ratio: float) -> int:
        """Blocks to remove at ``ratio``; ValueError when none, or more than the barriers leave."""
        count = blocks - kept_count(blocks, ratio)
        candidates = blocks - count + 1 - self.early_barrier - self.latter_barrier  # at the last step
        if count < 1 or candidates < 1:
            raise ValueError(f"method 'sleb': ratio {ratio} of {blocks} blocks removes {count}; give a ratio that "
                             f"removes 1 to {max(0, blocks - self.early_barrier - self.latter_barrier)} blocks "
                             f"(early_barrier={self.early_barrier}, latter_barrier={self.latter_barrier})")
        return count

    def check(self, model: nn.Module, pattern) -> None:
        super().check(model, pattern)
        self.removed_count(len(decoder_blocks(model)), pattern.ratio)

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        blocks = decoder_blocks(model)
        count = self.removed_count(len(blocks), pattern.ratio)
        alive = list(range(len(blocks)))
        removed: List[int] = []
        steps: List[Dict] = []
        was_training = model.training
        model.eval()
        try:
            with contextlib.ExitStack() as gone:
                for _ in tqdm(range(count), desc=self.name, unit="block", disable=not progress):
                    candidates = alive[self.early_barrier:len(alive) - self.latter_barrier]
                    losses = {}
                    for index in candidates:
                        with skipped(blocks[index]):
                            losses[index] = calibration_loss(model, calib, batch_size)
                    best = min(candidates, key=losses.__getitem__)  # ties: the earliest block
                    gone.enter_context(skipped(blocks[best]))
                    alive.remove(best)
                    removed.append(best)
                    steps.append({"removed": best, "perplexity": math.exp(losses[best])})
        finally:
            model.train(was_training)
        keep_blocks_(model, alive)
        return {"removed_blocks": removed, "kept_blocks": alive, "steps": steps}
