"""The ``safe-sweep`` study at tiny scale: each run is the grid setting its label names (its options,
calibration size and dual updates), its one-shot reference is the block projected by Wanda's
metric, a rerun resumes and a run of other options runs again."""
import copy
import json

import pytest

import pyprune
from pyprune import studies
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.runtime import engine
from pyprune.studies import safe_sweep

TINY = dict(blocks=[0], only=["dec-lam25-K8", "dec-lam100-K4"], nsamples=16, seqlen=32, heldout_tokens=64)


def test_safe_sweep_runs_are_their_settings_and_a_rerun_resumes(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "sweep.json"
    result = studies.run("safe-sweep", str(output), model=model_dir, **TINY)
    assert result == json.loads(output.read_text())
    assert output.with_suffix(".md").read_text() == safe_sweep.markdown(result)
    assert model_dir in output.with_suffix(".md").read_text().splitlines()[0]  # the model run, not the default
    assert result["settings"] == {"method": "safe+", "pattern": "2:4", "blocks": [0],
                                  "calibration": "the first n of 16 x 32 windows of emma:first_half (seed 0)",
                                  "heldout": "2 x 32 tokens of emma:second_half (validation: no reported table uses "
                                             "it)", "model": model_dir}
    grid = {name: (n, options) for name, n, options in safe_sweep.GRID}
    rows = result["rows"]
    assert [(r["setting"], r["block"]) for r in rows] == [("dec-lam25-K8", 0), ("dec-lam100-K4", 0)]
    for row in rows:
        nsamples, options = grid[row["setting"]]
        assert row["nsamples"] == nsamples and all(row["options"][k] == v for k, v in options.items())
        # 16 windows, 3 epochs of batches of 2: 24 steps, a dual update every K of them after z₀
        assert row["steps"] == 24 and len(row["residuals"]) == 1 + 24 // options["dual_interval"]
    assert list(result["one_shot"]) == ["0-16"]  # one reference per block and calibration size
    # the one-shot reference of SAFE⁺ is the dense block under Wanda's mask (|W|·‖X_j‖), as z₀ is
    model, tokenizer = load_model(model_dir)
    calib = data.calibration_samples(tokenizer, "emma:first_half", nsamples=16, seqlen=32, seed=0)
    inputs, kwargs = engine.capture_block_inputs(model, calib, 4)
    wanda = copy.deepcopy(model)
    pyprune.prune(wanda, "wanda", "2:4", calib, progress=False)  # block 0 sees the same inputs as in the sweep
    error = safe_sweep.relative_error(engine.decoder_blocks(wanda)[0], engine.decoder_blocks(model)[0], inputs,
                                      kwargs[0])
    assert result["one_shot"]["0-16"]["calib_error"] == pytest.approx(error, rel=1e-5)
    text = output.with_suffix(".md").read_text()
    assert "| dec-lam25-K8 | 0 |" in text and "| dec-lam100-K4 | 0 | 16 |" in text

    runs = []
    monkeypatch.setattr(safe_sweep, "one_shot", lambda *args: runs.append("one-shot"))
    studies.run("safe-sweep", str(output), model=model_dir, **TINY)
    assert runs == []  # the references and every run are there
    stale = json.loads(output.read_text())
    stale["rows"][0]["options"]["lam"] = 1.0  # as if the setting's options had been other ones
    output.write_text(json.dumps(stale))
    rerun = studies.run("safe-sweep", str(output), model=model_dir, **TINY)
    assert rerun["rows"][0]["options"]["lam"] == 25.0 and len(rerun["rows"]) == 2 and runs == []
    with pytest.raises(ValueError, match="option nsamples of study 'safe-sweep' must be at least 64"):
        studies.get("safe-sweep", only=["dec-lam100-K8-n64"], nsamples=16)


def test_a_concurrent_sweep_s_rows_and_one_shot_references_are_merged():
    study = studies.get("safe-sweep")
    ours = {"rows": [{"setting": "dec-lam25-K8", "block": 1}], "one_shot": {"1-16": {"heldout_error": 0.5}}}
    theirs = {"rows": [{"setting": "dec-lam25-K8", "block": 1}, {"setting": "dec-lam25-K8", "block": 15}],
              "one_shot": {"1-16": {"heldout_error": 0.7}, "15-16": {"heldout_error": 0.6}}}
    study.merge(ours, theirs)
    assert [row["block"] for row in ours["rows"]] == [1, 15]
    assert ours["one_shot"] == {"1-16": {"heldout_error": 0.5}, "15-16": {"heldout_error": 0.6}}
