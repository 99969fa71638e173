"""Block-wise pruning resumes after a SIGKILL (engine.BlockCheckpoint, the ``checkpoint`` option of
every block-wise method) to the bit, and the same seed and inputs give the same masks: across two
runs and across torch thread counts."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pyprune
from pyprune.evaluation.perplexity import perplexity
from pyprune.runtime import engine
from tests.helpers import random_tokens, tiny_llama

ROOT = Path(__file__).resolve().parents[2]

#: (method, options): every block-wise method; COPAL with dense propagation (its next block's
#: inputs come from the dense block, so a resumed run must recompute them before restoring)
BLOCKWISE = [("wanda", {}), ("sparsegpt", {}), ("copal", {"propagate": "dense"}), ("safe", {"epochs": 1})]
IDS = [method for method, _ in BLOCKWISE]

#: One process per method is killed by SIGKILL once blocks 0 and 1 of 3 are saved: forked from one
#: interpreter that imports everything first and runs no torch work itself (so forking is safe), at the
#: test process's thread count (under `pytest -n 2` a worker runs 1 thread, a fresh interpreter 2).
_KILLED_RUNS = """
import json, os, signal, sys
import torch
import pyprune
from pyprune.runtime import engine
from tests.helpers import random_tokens, tiny_llama
save = engine.BlockCheckpoint.save
def save_then_die(self, index, block, details):
    save(self, index, block, details)
    if index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
engine.BlockCheckpoint.save = save_then_die
torch.set_num_threads(int(sys.argv[2]))  # the test process's count: SparseGPT's float sums depend on it
statuses = {}
for method, options, directory in json.loads(sys.argv[1]):
    child = os.fork()
    if child == 0:
        pyprune.prune(tiny_llama(seed=0, layers=3), method, "2:4", random_tokens((4, 16), seed=1), progress=False,
                      checkpoint=directory, **options)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    statuses[method] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
print(json.dumps(statuses))
"""


@pytest.fixture(scope="module")
def killed_checkpoints(tmp_path_factory):
    """{method: checkpoint directory of its run killed after two of three blocks}."""
    base = tmp_path_factory.mktemp("killed")
    runs = [(method, options, str(base / method)) for method, options in BLOCKWISE]
    result = subprocess.run([sys.executable, "-c", _KILLED_RUNS, json.dumps(runs), str(torch.get_num_threads())],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {method: 9 for method in IDS}
    return {method: base / method for method in IDS}


def _prune(method, options, **extra):
    model = tiny_llama(seed=0, layers=3)
    pyprune.prune(model, method, "2:4", random_tokens((4, 16), seed=1), progress=False, **options, **extra)
    return model


def _masks(model):
    return {name: p != 0 for name, p in model.named_parameters() if name.endswith("proj.weight")}


def _processed_blocks(monkeypatch):
    """The list that the indices of the blocks a prune processes (rather than restores) are appended
    to, in order: every method's per-block work reaches the engine as its ``process_block``."""
    processed = []
    run_blockwise = engine.run_blockwise

    def counting(model, tokens, process_block, **kwargs):
        def process(ctx):
            processed.append(ctx.index)
            return process_block(ctx)
        return run_blockwise(model, tokens, process, **kwargs)

    monkeypatch.setattr(engine, "run_blockwise", counting)
    return processed


@pytest.mark.parametrize("method,options", BLOCKWISE, ids=IDS)
def test_a_killed_prune_resumes_to_the_same_model(killed_checkpoints, method, options, monkeypatch):
    """The resumed run processes only the block the killed one did not finish, and ends as a run
    without a checkpoint."""
    checkpoint = killed_checkpoints[method]
    assert json.loads((checkpoint / "blockwise.json").read_text())["finished"] == 2
    processed = _processed_blocks(monkeypatch)
    resumed = _prune(method, options, checkpoint=str(checkpoint))
    assert processed == [2]
    assert json.loads((checkpoint / "blockwise.json").read_text())["finished"] == 3
    straight = _prune(method, options)
    for name, mask in _masks(straight).items():
        assert torch.equal(_masks(resumed)[name], mask), name
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name
    tokens = random_tokens((64,), seed=5)
    assert perplexity(resumed, tokens, 16, progress=False) == perplexity(straight, tokens, 16, progress=False)


def test_a_resume_says_so_once(tmp_path, capsys):
    """A rerun that restores finished blocks prints one line naming the checkpoint and how many."""
    checkpoint = str(tmp_path / "ckpt")
    _prune("wanda", {}, checkpoint=checkpoint)
    assert "resuming" not in capsys.readouterr().err
    pyprune.prune(tiny_llama(seed=0, layers=3), "wanda", "2:4", random_tokens((4, 16), seed=1), checkpoint=checkpoint)
    lines = [line for line in capsys.readouterr().err.splitlines() if "resuming" in line]
    assert lines == [f"pyprune: resuming from checkpoint {checkpoint}: 3 of 3 blocks already done, restored from it"]


def test_a_checkpoint_of_another_method_or_calibration_is_refused(tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    _prune("wanda", {}, checkpoint=checkpoint)
    model = tiny_llama(seed=0, layers=3)
    with pytest.raises(ValueError, match="other settings"):
        pyprune.prune(model, "sparsegpt", "2:4", random_tokens((4, 16), seed=1), progress=False, checkpoint=checkpoint)
    with pytest.raises(ValueError, match="other calibration data"):
        pyprune.prune(model, "wanda", "2:4", random_tokens((4, 16), seed=2), progress=False, checkpoint=checkpoint)
    for a, b in zip(model.parameters(), tiny_llama(seed=0, layers=3).parameters()):
        assert torch.equal(a, b)


def test_copal_checkpoint_excludes_its_state_and_a_resumed_object_is_not_continued(tmp_path):
    with pytest.raises(ValueError, match="checkpoint and state exclude each other"):
        pyprune.methods.get("copal", checkpoint=str(tmp_path / "c"), state=str(tmp_path / "s"))
    checkpoint = tmp_path / "ckpt"
    _prune("copal", {}, checkpoint=str(checkpoint))
    manifest = json.loads((checkpoint / "blockwise.json").read_text())
    (checkpoint / "blockwise.json").write_text(json.dumps(dict(manifest, finished=1, details=manifest["details"][:1])))
    copal = pyprune.methods.get("copal", checkpoint=str(checkpoint))
    copal.prune(tiny_llama(seed=0, layers=3), pyprune.patterns.parse("2:4"), random_tokens((4, 16), seed=1),
                progress=False)
    with pytest.raises(RuntimeError, match="resumed from a block checkpoint"):
        copal.prune(tiny_llama(seed=0, layers=3), pyprune.patterns.parse("2:4"), random_tokens((4, 16), seed=3),
                    progress=False)


@pytest.mark.parametrize("method,options", BLOCKWISE, ids=IDS)
def test_the_same_seed_gives_the_same_masks_across_runs_and_thread_counts(method, options):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        first, second = _masks(_prune(method, options)), _masks(_prune(method, options))
        torch.set_num_threads(2)
        two_threads = _masks(_prune(method, options))
    finally:
        torch.set_num_threads(threads)
    for name, mask in first.items():
        assert torch.equal(second[name], mask), f"{name}: two runs differ"
        assert torch.equal(two_threads[name], mask), f"{name}: 1 and 2 threads differ"
