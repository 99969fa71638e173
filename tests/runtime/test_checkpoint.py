"""The one checkpoint mechanism (pyprune.runtime.checkpoint) and its two users: a training run
resumed halfway equals the straight run to the bit, and so does a block-wise run resumed after its
finished blocks; another run's checkpoint is refused, naming what differs."""
import json

import pytest
import torch

from pyprune.io.storage import StateError
from pyprune.runtime import engine
from pyprune.runtime.checkpoint import Checkpoint, model_fingerprint, tokens_digest
from pyprune.runtime.training import TrainingCheckpoint, train
from tests.helpers import random_tokens, tiny_llama

KEY = {"settings": {"lr": 0.1}, "model": "m"}


def test_a_state_round_trips_with_its_key_and_another_key_or_kind_is_refused(tmp_path):
    states = Checkpoint(str(tmp_path), KEY, "test state")
    assert states.load("s.safetensors") is None and states.meta("s.safetensors") is None
    weight = torch.randn(3, 4)
    states.save("s.safetensors", {"w": weight, "tied": weight}, {"step": 7})
    tensors, meta = states.load("s.safetensors")
    assert torch.equal(tensors["w"], weight) and torch.equal(tensors["tied"], weight)
    assert (meta["step"], meta["key"], meta["kind"], meta["format"]) == (7, KEY, "test state", 1)
    other = Checkpoint(str(tmp_path), {"settings": {"lr": 0.2}, "model": "m"}, "test state")
    assert other.meta("s.safetensors", parts=["model"])["step"] == 7  # compared in the model alone
    with pytest.raises(StateError, match=r"other settings: lr 0.1 \(now 0.2\)"):
        other.load("s.safetensors")
    with pytest.raises(StateError, match="is not a pyprune other kind file"):
        Checkpoint(str(tmp_path), KEY, "other kind").load("s.safetensors")


def test_an_index_records_the_key_and_progress_and_refuses_another_run(tmp_path):
    states = Checkpoint(str(tmp_path / "run"), KEY, "test state")
    assert states.read_index("index.json") is None
    states.write_index("index.json", {"finished": 2})
    assert json.loads((tmp_path / "run" / "index.json").read_text()) == {"key": KEY, "finished": 2}
    with pytest.raises(StateError, match="another model"):
        Checkpoint(str(tmp_path / "run"), dict(KEY, model="n"), "test state").read_index("index.json")
    (tmp_path / "run" / "index.json").write_text("{ not json")
    with pytest.raises(StateError, match="index.json is not valid JSON"):
        states.read_index("index.json")


def test_the_run_key_identifies_the_model_and_the_tokens():
    tokens = random_tokens((2, 8), seed=1)
    assert tokens_digest(tokens) == tokens_digest(tokens.clone()) != tokens_digest(random_tokens((2, 8), seed=2))
    assert model_fingerprint(tiny_llama(seed=0)) == model_fingerprint(tiny_llama(seed=0))
    assert model_fingerprint(tiny_llama(seed=0)) != model_fingerprint(tiny_llama(seed=1))


def _train(model, steps, checkpoint=None):
    return train(model, list(model.parameters()), random_tokens((6, 16), seed=3), steps=steps, lr=1e-2,
                 batch_size=2, seed=5, checkpoint=checkpoint, progress=False)


def test_n_training_steps_equal_half_of_them_saved_loaded_and_the_other_half(tmp_path):
    straight = tiny_llama(seed=0)
    log = _train(straight, 6)
    key = {"settings": {"lr": 1e-2}, "model": model_fingerprint(tiny_llama(seed=0))}
    first = tiny_llama(seed=0)
    _train(first, 3, TrainingCheckpoint(str(tmp_path), 2, key))  # saved at steps 2 and 3
    assert Checkpoint(str(tmp_path), key, "training checkpoint").meta("train-checkpoint.safetensors")["step"] == 3
    resumed = tiny_llama(seed=0)
    resumed_log = _train(resumed, 6, TrainingCheckpoint(str(tmp_path), 2, key))
    assert resumed_log == log
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(StateError, match="other settings: lr"):
        _train(tiny_llama(seed=0), 6, TrainingCheckpoint(str(tmp_path), 2, dict(key, settings={"lr": 1.0})))


class _Interrupted(Exception):
    pass


def _prune_blocks(model, dense, checkpoint=None, stop_at=None, seen=None):
    """Wanda-like 2:4 in every block (|W|·‖x‖ from the block's inputs; the details: the block's
    index), the next block's inputs from this one ``dense`` or pruned; raises at block ``stop_at``."""
    def process(ctx):
        if ctx.index == stop_at:
            raise _Interrupted
        if seen is not None:
            seen.append(ctx.index)
        norms = {}

        def observe(name, linear, x, y):
            norms[name] = norms.get(name, 0) + x.reshape(-1, x.shape[-1]).square().sum(0)

        outputs = ctx.capture(observe)
        if dense:
            ctx.next_inputs = outputs
        with torch.no_grad():
            for name, linear in ctx.linears().items():
                groups = (linear.weight.abs() * norms[name].sqrt()).reshape(-1, 4)
                keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(2, dim=1).indices, True)
                linear.weight.mul_(keep.reshape(linear.weight.shape))
        return {"block": ctx.index}

    return engine.run_blockwise(model, random_tokens((4, 16), seed=1), process, batch_size=2, progress=False,
                                checkpoint=checkpoint)


@pytest.mark.parametrize("dense_propagation", [False, True])
def test_a_block_run_resumes_after_its_finished_blocks_to_the_same_model(tmp_path, dense_propagation):
    def checkpoint(model):
        return engine.BlockCheckpoint.of_run(str(tmp_path), "test", {"a": 1}, "2:4", model,
                                             None if model is None else random_tokens((4, 16), seed=1),
                                             dense_propagation)

    straight = tiny_llama(seed=0, layers=3)
    details = _prune_blocks(straight, dense_propagation)
    interrupted = tiny_llama(seed=0, layers=3)
    with pytest.raises(_Interrupted):
        _prune_blocks(interrupted, dense_propagation, checkpoint(interrupted), stop_at=2)
    assert checkpoint(interrupted).finished() == (2, [{"block": 0}, {"block": 1}])
    resumed, seen = tiny_llama(seed=0, layers=3), []
    assert _prune_blocks(resumed, dense_propagation, checkpoint(resumed), seen=seen) == details
    assert seen == [2]
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name
    (tmp_path / "block-1.safetensors").unlink()
    with pytest.raises(StateError, match="lists block 1 as finished but has no block-1.safetensors"):
        checkpoint(None).finished(parts=["method", "settings"])
    other = tiny_llama(seed=1, layers=3)
    with pytest.raises(StateError, match="another model"):
        _prune_blocks(other, dense_propagation, checkpoint(other))
    for a, b in zip(other.parameters(), tiny_llama(seed=1, layers=3).parameters()):
        assert torch.equal(a, b)
