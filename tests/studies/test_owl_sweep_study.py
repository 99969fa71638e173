"""The ``owl-sweep`` study: the choice is the grid's OWL setting of lowest tuning perplexity on the
tuning seed (made-up rows), the default grid spans the ranges it is meant to, the verdict against
uniform pairs the seeds (made-up rows), and at tiny scale the seed arms run uniform, the paper's and
the chosen setting, a rerun runs nothing, and a λ that leaves [0, 1) is refused before any arm runs."""
import json

import pytest

from pyprune import studies
from pyprune.patterns import Unstructured
from pyprune.studies import baselines, owl_sweep
from pyprune.studies.owl_sweep import PAPER, owl_verdict, select, setting_of


def _row(method, setting, seed, tuning=100.0, evaluation=100.0):
    m, lam = setting if setting is not None else (None, None)
    return {"method": method, "owl": setting is not None, "m": m, "lambda": lam, "seed": seed, "sparsity": 0.7,
            "tuning_perplexity": tuning, "perplexity": evaluation, "prune_time_s": 1.0, "time_s": 1.0,
            "block_sparsity": [0.65, 0.75] if setting is not None else None,
            "outlier_ratio": [0.01, 0.02] if setting is not None else None}


GRID = [(3.0, 0.02), (5.0, 0.02), (3.0, 0.08), (5.0, 0.08)]


def test_the_choice_is_the_grid_setting_of_lowest_tuning_perplexity_on_the_tuning_seed():
    rows = [_row("wanda", None, 0, tuning=10.0),  # uniform is lowest, but not an OWL setting
            _row("wanda", (3.0, 0.02), 0, tuning=50.0), _row("wanda", (5.0, 0.02), 0, tuning=42.0),
            _row("wanda", (3.0, 0.08), 0, tuning=47.0, evaluation=1.0),  # lowest on the evaluation text: unread
            _row("wanda", (5.0, 0.08), 0, tuning=45.0),
            _row("wanda", (3.0, 0.02), 1, tuning=20.0),  # another seed
            _row("sparsegpt", (5.0, 0.08), 0, tuning=30.0),  # another method
            _row("wanda", (7.0, 0.2), 0, tuning=25.0)]  # off the grid
    assert setting_of(select(rows, "wanda", 0, GRID)) == (5.0, 0.02)
    assert select(rows[:-3], "wanda", 0, GRID + [(7.0, 0.02)]) is None  # the grid is not complete yet
    tie = [_row("wanda", setting, 0, tuning=40.0) for setting in GRID]
    assert setting_of(select(tie, "wanda", 0, GRID)) == GRID[0]  # a tie: the first in the grid's order


def test_the_default_grid_spans_lambda_002_to_02_and_m_3_to_10_with_the_papers_setting():
    grid = studies.get("owl-sweep").grid()
    assert {m for m, _ in grid} == {3.0, 5.0, 10.0} and {lam for _, lam in grid} == {0.02, 0.08, 0.2}
    assert len(grid) == 9 and PAPER in grid
    assert grid[:3] == [(3.0, 0.02), (5.0, 0.02), (10.0, 0.02)]  # λ-major
    with pytest.raises(ValueError, match="option owl_lambdas of study 'owl-sweep' must be > 0"):
        studies.get("owl-sweep", owl_lambdas=[0.0])
    with pytest.raises(ValueError, match="option methods of study 'owl-sweep' must be one of"):
        studies.get("owl-sweep", methods=["slicegpt"])


def test_the_verdict_pairs_owl_and_uniform_by_seed():
    uniform = [_row("wanda", None, seed, evaluation=v) for seed, v in enumerate((100.0, 110.0, 90.0))]
    better = [_row("wanda", PAPER, seed, evaluation=v) for seed, v in enumerate((95.0, 104.0, 86.0))]
    mixed = [_row("wanda", (3.0, 0.02), seed, evaluation=v) for seed, v in enumerate((95.0, 115.0, 89.0))]
    worse_one_seed = [_row("sparsegpt", None, 0, evaluation=50.0), _row("sparsegpt", PAPER, 0, evaluation=60.0)]
    rows = uniform + better + mixed + worse_one_seed
    ahead = owl_verdict(rows, "wanda", PAPER)
    assert (ahead.word, ahead.seeds, ahead.mean) == ("ahead", 3, pytest.approx(-5.0))
    assert owl_verdict(rows, "wanda", (3.0, 0.02)).reason == "signs differ across seeds"
    assert owl_verdict(rows, "sparsegpt", PAPER).reason == "one seed"
    assert owl_verdict(rows, "sparsegpt", (3.0, 0.02)) is None  # no such row


def _calls(monkeypatch):
    calls, prune = [], baselines.prune

    def recorded(model, method, pattern, calib, progress=True, **options):  # options: the method's
        calls.append((method, pattern, options, calib.clone()))
        return prune(model, method, pattern, calib, **options)

    monkeypatch.setattr(baselines, "prune", recorded)
    return calls


def test_tiny_run_tunes_then_runs_uniform_paper_and_chosen_on_every_seed(tiny_model_dir, tmp_path, monkeypatch):
    model_dir, output = str(tiny_model_dir[0]), tmp_path / "sweep.json"
    settings = dict(model=model_dir, methods=["wanda"], owl_ms=[3, 5], owl_lambdas=[0.02, 0.08], seeds=[0, 1],
                    nsamples=2, seqlen=16, eval_tokens=64, tuning_tokens=64)
    calls = _calls(monkeypatch)
    result = studies.run("owl-sweep", str(output), **settings)
    assert result == json.loads(output.read_text())
    assert output.with_suffix(".md").read_text() == owl_sweep.markdown(result)
    chosen = result["selection"]["wanda"]
    tuning = {(r["m"], r["lambda"]): r["tuning_perplexity"] for r in result["rows"] if r["owl"] and r["seed"] == 0}
    assert len(tuning) == 4 and chosen["tuning_perplexity"] == min(tuning.values())
    best = (chosen["m"], chosen["lambda"])
    assert tuning[best] == chosen["tuning_perplexity"]
    seed1 = [(r["m"], r["lambda"]) for r in result["rows"] if r["seed"] == 1]
    assert seed1 == list(dict.fromkeys([(None, None), PAPER, best]))  # uniform, the paper's, the chosen one
    owl_calls = [options for _, _, options, _ in calls if options]
    assert owl_calls[:4] == [{"owl": True, "owl_m": m, "owl_lambda": lam} for lam in (0.02, 0.08) for m in (3.0, 5.0)]
    assert all(pattern == Unstructured(0.7) for _, pattern, _, _ in calls)
    assert not calls[0][3].equal(calls[-1][3])  # seed 1's calibration windows are another draw
    for row in result["rows"]:
        if row["owl"]:
            assert sum(row["block_sparsity"]) / 2 == pytest.approx(0.7, abs=1e-6)
            assert max(row["block_sparsity"]) - min(row["block_sparsity"]) == pytest.approx(2 * row["lambda"])
    calls.clear()
    assert studies.run("owl-sweep", str(output), **settings) == result and calls == []  # all done: nothing runs


def test_a_lambda_that_leaves_the_unit_interval_is_refused_before_any_arm(tiny_model_dir, tmp_path, monkeypatch):
    calls = _calls(monkeypatch)
    output = tmp_path / "sweep.json"
    with pytest.raises(ValueError, match="option owl_lambdas of study 'owl-sweep': option owl_lambda=0.4 spreads"):
        studies.run("owl-sweep", str(output), model=str(tiny_model_dir[0]), owl_lambdas=[0.02, 0.4], nsamples=2,
                    seqlen=16, eval_tokens=64, tuning_tokens=64)
    assert calls == [] and not output.exists()
