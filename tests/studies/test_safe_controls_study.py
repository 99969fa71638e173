"""The ``safe-controls`` study at tiny scale: the control arm is masked reconstruction from the start
its label names, the training options reach every training arm alike and no one-shot arm, each seed
is its own calibration draw, a rerun resumes; the paired table's verdict follows the rule on
made-up rows (ahead, behind, unsettled)."""
import copy
import json
import os

import pytest
import torch

import pyprune
from pyprune import studies
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.studies import safe_controls
from pyprune.studies.verdict import paired_verdict
from tests.helpers import stop_after_first_block

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
TINY = dict(patterns=["0.5"], variants=["sparsegpt", "masked-recon sparsegpt", "safe+ rho=0"], seeds=[0, 1],
            nsamples=2, seqlen=16, eval_tokens=64, eval_seqlen=16, flat_blocks=[1], flat_pairs=1,
            flat_iterations=1, epochs=1, lr=1e-3)


def test_safe_controls_arms_are_what_their_labels_say_and_a_rerun_resumes(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "controls.json"
    calls, prune = [], safe_controls.prune

    def recorded(model, method, pattern, calib, **options):
        calls.append((method, str(pattern), calib, options))
        return prune(model, method, pattern, calib, **options)

    monkeypatch.setattr(safe_controls, "prune", recorded)
    settings = dict(model=model_dir, **TINY)
    result = studies.run("safe-controls", str(output), **settings)
    assert result == json.loads(output.read_text())
    assert output.with_suffix(".md").read_text() == safe_controls.markdown(result)
    assert model_dir in output.with_suffix(".md").read_text().splitlines()[0]  # the model run, not the default
    assert result["settings"]["training"] == {"epochs": 1, "lr": 1e-3}
    rows = result["rows"]
    assert [(r["arm"], r["seed"]) for r in rows] == [
        ("sparsegpt", 0), ("sparsegpt", 1), ("masked-recon sparsegpt", 0), ("masked-recon sparsegpt", 1),
        ("safe+ rho=0", 0), ("safe+ rho=0", 1)]
    _, tokenizer = load_model(model_dir)
    draws = {seed: data.calibration_samples(tokenizer, "emma:first_half", nsamples=2, seqlen=16, seed=seed)
             for seed in (0, 1)}
    expected = {"sparsegpt": ("sparsegpt", {}),  # one-shot: no training option
                "masked-recon sparsegpt": ("masked-recon", {"start": "sparsegpt", "epochs": 1, "lr": 1e-3}),
                "safe+ rho=0": ("safe+", {"rho": 0.0, "epochs": 1, "lr": 1e-3})}
    for (method, pattern, calib, options), row in zip(calls, sorted(rows, key=lambda r: r["seed"])):
        assert (method, {k: v for k, v in options.items() if k not in ("progress", "checkpoint")}) == \
            expected[row["arm"]]
        assert options["checkpoint"].startswith(str(tmp_path / "controls.checkpoints"))
        assert pattern == row["pattern"] == "unstructured 0.5" and torch.equal(calib, draws[row["seed"]])
        assert list(row["flatness"]) == ["1"] and row["flatness"]["1"]["top_eigenvalue"] is not None
    control = next(r for r in rows if r["arm"] == "masked-recon sparsegpt" and r["seed"] == 1)
    assert [control["options"][k] for k in ("start", "epochs", "lr")] == ["sparsegpt", 1, 1e-3]
    # the control row is masked reconstruction from SparseGPT's mask on seed 1's windows, nothing else
    model, tokenizer = load_model(model_dir)
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice:second_half", max_tokens=64)
    pruned = copy.deepcopy(model)
    pyprune.prune(pruned, "masked-recon", 0.5, draws[1], progress=False, start="sparsegpt", epochs=1, lr=1e-3)
    bos = data.window_bos(tokenizer)
    assert control["perplexity"] == perplexity(pruned, tokens, 16, progress=False, bos_token_id=bos)
    assert result["dense"] == perplexity(model, tokens, 16, progress=False, bos_token_id=bos)
    sam = next(r for r in rows if r["arm"] == "safe+ rho=0")
    assert sam["options"]["rho"] == 0.0 and sam["summary"]["sam_relative"] == 0.0  # no ascent without SAM
    side = lambda arm: {r["seed"]: r["perplexity"] for r in rows if r["arm"] == arm}  # noqa: E731
    word = paired_verdict(side("masked-recon sparsegpt"), side("sparsegpt")).word
    [line] = [line for line in output.with_suffix(".md").read_text().splitlines()
              if line.startswith("| unstructured 0.5 | masked-recon sparsegpt − sparsegpt |")]
    assert line.endswith(f" | {word} |")

    calls.clear()
    studies.run("safe-controls", str(output), **{**settings, "seeds": [0, 1, 2], "skip_flatness": True})
    draw = data.calibration_samples(tokenizer, "emma:first_half", nsamples=2, seqlen=16, seed=2)
    assert [method for method, *_ in calls] == ["sparsegpt", "masked-recon", "safe+"]  # only seed 2 ran,
    assert all(torch.equal(calib, draw) for _, _, calib, _ in calls)  # on its own draw
    assert "2°: " in output.with_suffix(".md").read_text()  # its rows skipped flatness, and say so


def _made_up(differences):
    """A controls result with safe+ and its control on three seeds, safe+ − control = ``differences``."""
    rows = [{"pattern": "2:4", "arm": arm, "seed": seed, "perplexity": 50.0 + (d if arm == "safe+" else 0.0),
             "flatness": {}, "summary": {}, "time_s": 1.0, "options": {}}
            for arm in ("safe+", "masked-recon wanda") for seed, d in enumerate(differences)]
    settings = {"calibration": "c", "evaluation": "e", "tuning": "t", "training": {"epochs": 3}, "protocol_cut": "p",
                "flat_blocks": ["2"]}
    return {"settings": settings, "environment": {"device": "CPU", "cpu_threads": 1, "torch": "2"}, "dense": 40.0,
            "rows": rows}


@pytest.mark.parametrize("differences, word", [((1.0, 1.2, 0.9), "behind"), ((-1.0, -1.2, -0.9), "ahead"),
                                               ((1.0, -0.5, 2.0), "unsettled"), ((0.1, 3.0, 0.2), "unsettled")])
def test_the_paired_table_s_verdict_follows_the_rule(differences, word):
    [line] = [line for line in safe_controls.markdown(_made_up(differences)).splitlines()
              if line.startswith("| 2:4 | safe+ − masked-recon wanda |")]
    assert line.endswith(f" | {word} |")


def test_vary_train_seed_and_the_arms_that_give_admm_room_to_move_the_mask():
    """``vary_train_seed``: a training arm's minibatch seed is the calibration seed, a one-shot arm gets
    no training option; the λ-ramp and λ 25 / K 4 arms are SAFE⁺ with those options; giving both
    train_seed and vary_train_seed is refused before anything loads."""
    study = studies.get("safe-controls", vary_train_seed=True, epochs=1)
    assert study.arm_options("safe+ lam_schedule=cosine", 2) == \
        ("safe+", {"lam_schedule": "cosine", "epochs": 1, "train_seed": 2})
    assert study.arm_options("safe+ lam=25 K=4", 1) == \
        ("safe+", {"lam": 25.0, "dual_interval": 4, "epochs": 1, "train_seed": 1})
    assert study.arm_options("masked-recon wanda", 1)[1]["train_seed"] == 1
    assert study.arm_options("sparsegpt", 2) == ("sparsegpt", {})
    assert studies.get("safe-controls", epochs=1).arm_options("safe+", 2) == ("safe+", {"epochs": 1})
    with pytest.raises(ValueError, match="options train_seed and vary_train_seed of study 'safe-controls': give one"):
        studies.get("safe-controls", vary_train_seed=True, train_seed=3)


def test_the_protocol_is_called_cut_only_below_the_table_s_calibration_tokens():
    """A run at the table's 64 x 256 windows says its protocol is not cut; the cut protocol's sentence
    (part of its results file's resume key) is the one the committed file holds."""
    full = studies.get("safe-controls", nsamples=64, seqlen=256).protocol(None)["protocol_cut"]
    assert full.startswith("none: 64 x 256 calibration windows (the table's 64 x 256), 96 steps per block")
    assert "~10 jobs" not in full
    with open(os.path.join(RESULTS, "safe-controls-smollm2-135m.json")) as handle:
        committed = json.load(handle)["settings"]["protocol_cut"]
    assert studies.get("safe-controls").protocol(None)["protocol_cut"] == committed


def test_a_row_stopped_mid_model_resumes_after_its_last_finished_block(tiny_model_dir, tmp_path, monkeypatch):
    """Every finished block is saved beside the results file; a rerun after a stop goes on from
    the next block and ends where an unbroken run ends; the saves go once the row is written."""
    settings = dict(model=str(tiny_model_dir[0]), **dict(TINY, variants=["safe+ rho=0"], seeds=[0]),
                    skip_flatness=True)
    unbroken = studies.run("safe-controls", str(tmp_path / "unbroken.json"), progress=False, **settings)["rows"]
    [resumed] = stop_after_first_block(monkeypatch, "safe-controls", tmp_path / "stopped.json", **settings)["rows"]
    [theirs] = unbroken
    assert resumed["perplexity"] == theirs["perplexity"] and resumed["summary"] == theirs["summary"]
    assert resumed["options"] == theirs["options"] and "checkpoint" not in resumed["options"]
    assert resumed["resumed"] is True and "resumed" not in theirs
    assert not (tmp_path / "stopped.checkpoints").exists()  # the row's saves removed, the folder too
