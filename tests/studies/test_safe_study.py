"""The ``safe`` study at tiny scale: each row is the method, scope and options its label names (the
SAFE options reach the SAFE rows only), a rerun resumes, a row of other options runs again, and the
SAFE options are typed by the method's declaration."""
import copy
import json

import pytest

import pyprune
from pyprune import studies
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.io.storage import StateError
from pyprune.studies import safe
from tests.helpers import stop_after_first_block

TINY = dict(patterns=["0.5", "2:4"], methods=["wanda", "safe+"], nsamples=2, seqlen=16, eval_tokens=64,
            epochs=1, lam=25.0, dual_interval=1)


def test_safe_rows_are_what_their_labels_say_and_a_rerun_resumes(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "safe.json"
    calls, prune = [], safe.prune

    def recorded(model, method, pattern, calib, **options):
        calls.append((method, pattern, options))
        return prune(model, method, pattern, calib, **options)

    monkeypatch.setattr(safe, "prune", recorded)
    result = studies.run("safe", str(output), model=model_dir, **TINY)
    assert result == json.loads(output.read_text())
    assert output.with_suffix(".md").read_text() == safe.markdown(result)
    assert model_dir in output.with_suffix(".md").read_text().splitlines()[0]  # the model run, not the default
    assert result["settings"] == {"calibration": "2 x 16 tokens of emma:first_half (seed 0)",
                                  "evaluation": "first 64 tokens of pride_and_prejudice:second_half, 16-token windows",
                                  "tuning": safe.TUNING, "safe_options": {"epochs": 1, "lam": 25.0, "dual_interval": 1},
                                  "model": model_dir}
    rows = result["rows"]
    assert [(r["pattern"], r["method"], r["scope"]) for r in rows] == [
        ("unstructured 0.5", "wanda", None), ("unstructured 0.5", "safe+", "row"),
        ("unstructured 0.5", "safe+", "tensor"), ("2:4", "wanda", None), ("2:4", "safe+", None)]
    called = {(str(pattern), method, getattr(pattern, "scope", None)): options for method, pattern, options in calls}
    assert set(called) == {(r["pattern"], r["method"], r["scope"]) for r in rows}  # each row's pattern and scope
    for row in rows:
        options = called[row["pattern"], row["method"], row["scope"]]
        assert options.pop("checkpoint").startswith(str(tmp_path / "safe.checkpoints"))  # each row saves its blocks
        if row["method"] == "safe+":  # the SAFE options reach the SAFE rows, and only them
            assert options == {"progress": False, "epochs": 1, "lam": 25.0, "dual_interval": 1}
            assert (row["options"]["epochs"], row["options"]["lam"], row["options"]["dual_interval"]) == (1, 25.0, 1)
            assert [len(block["residuals"]) for block in row["blocks"]] == [2, 2]  # z₀, then the one dual update
        else:
            assert options == {"progress": False} and "lam" not in row["options"]
    # the Wanda row is Wanda on the labelled calibration draw, evaluated on the held-out text
    model, tokenizer = load_model(model_dir)
    calib = data.calibration_samples(tokenizer, "emma:first_half", nsamples=2, seqlen=16, seed=0)
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice:second_half", max_tokens=64)
    assert result["dense"] == perplexity(model, tokens, 16, progress=False)
    pruned = copy.deepcopy(model)
    pyprune.prune(pruned, "wanda", "2:4", calib, progress=False)
    assert rows[3]["perplexity"] == perplexity(pruned, tokens, 16, progress=False)
    assert "| 2:4 | safe+ |" in output.with_suffix(".md").read_text()

    calls.clear()
    studies.run("safe", str(output), model=model_dir, **TINY)
    assert calls == []  # every row done with these options
    stale = json.loads(output.read_text())
    stale["rows"][3]["options"]["owl"] = True  # as if Wanda's defaults had changed since
    output.write_text(json.dumps(stale))
    studies.run("safe", str(output), model=model_dir, **TINY)
    assert [(method, str(pattern)) for method, pattern, _ in calls] == [("wanda", "2:4")]
    assert len(json.loads(output.read_text())["rows"]) == 5
    before = output.read_text()
    with pytest.raises(StateError, match=r"other settings: lam 25.0 \(now 50.0\)"):
        studies.run("safe", str(output), model=model_dir, **{**TINY, "lam": 50.0})
    assert output.read_text() == before


def test_safe_options_are_the_method_s_typed_options():
    with pytest.raises(ValueError, match=r"option lr of study 'safe' must be > 0; got -0.1"):
        studies.get("safe", lr=-0.1)
    with pytest.raises(ValueError, match=r"option epochs of study 'safe' must be an integer; got 2.5"):
        studies.get("safe", epochs=2.5)
    with pytest.raises(ValueError, match=r"option penalty of study 'safe' must be one of decoupled, adam"):
        studies.get("safe", penalty="sgd")
    with pytest.raises(ValueError, match=r"option patterns of study 'safe': pattern must look like N:M"):
        studies.get("safe", patterns=["2-4"])
    assert studies.get("safe", lr=1e-3, train_norms=True).safe_options == {"lr": 1e-3, "train_norms": True}
    assert studies.get("safe", lr=1e-3).command() == "pyprune study safe --lr 0.001"


def test_a_stopped_row_resumes_after_its_last_finished_block(tiny_model_dir, tmp_path, monkeypatch):
    settings = dict(TINY, model=str(tiny_model_dir[0]), patterns=["2:4"], methods=["safe+"])
    [unbroken] = studies.run("safe", str(tmp_path / "unbroken.json"), progress=False, **settings)["rows"]
    output = tmp_path / "stopped.json"
    [resumed] = stop_after_first_block(monkeypatch, "safe", output, **settings)["rows"]
    assert resumed["perplexity"] == unbroken["perplexity"] and resumed["blocks"] == unbroken["blocks"]
    assert resumed["options"] == unbroken["options"] and "checkpoint" not in resumed["options"]
    assert resumed["resumed"] is True and unbroken["resumed"] is False
    assert "(resumed: the blocks after the checkpoint only)" in output.with_suffix(".md").read_text()
    assert not (tmp_path / "stopped.checkpoints").exists()  # the row's saves removed, the folder too
