"""The ``continual`` and ``continual-seeds`` studies at tiny scale: a row is the method and
initialisation its label names, a row run order by order stays partial until every order has
run, and the seeds summary pairs the rows every seed ran over their common orders."""
import json
from pathlib import Path

import pytest

import pyprune
from pyprune import studies
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.patterns import Unstructured
from pyprune.studies import continual

TINY = dict(patterns=["0.5"], datasets=["austen", "moby_dick"], nsamples=2, seqlen=16, eval_tokens=64,
            eval_seqlen=16)


def test_continual_rows_are_what_their_labels_say(tiny_model_dir, tmp_path):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "continual.json"
    result = studies.run("continual", str(output), model=model_dir, rows=["wanda:global", "wanda:sequential"], **TINY)
    assert result == json.loads(output.read_text()) and output.with_suffix(".md").read_text() == \
        continual.markdown(result)
    assert model_dir in output.with_suffix(".md").read_text().splitlines()[0]  # the model run, not the default
    assert [(r["pattern"], r["method"], r["init"]) for r in result["rows"]] == [
        ("unstructured 0.5 per row", "wanda", "global"), ("unstructured 0.5 per row", "wanda", "sequential")]
    model, tokenizer = load_model(model_dir)
    calib = {name: data.calibration_samples(tokenizer, f"{name}:first_half", nsamples=2, seqlen=16, seed=0)
             for name in TINY["datasets"]}
    tokens = {name: data.eval_tokens(tokenizer, f"{name}:second_half", max_tokens=64) for name in TINY["datasets"]}
    assert result["dense"] == {name: perplexity(model, tokens[name], 16, progress=False) for name in tokens}

    def pruned_on(*names):
        pruned, _ = load_model(model_dir)
        for name in names:
            pyprune.prune(pruned, "wanda", Unstructured(0.5, "row"), calib[name], progress=False)
        return {name: perplexity(pruned, tokens[name], 16, progress=False) for name in tokens}

    global_row, sequential_row = result["rows"]
    for run in global_row["matrix"]:  # global: each step re-prunes the dense model on its dataset alone
        assert [step["perplexity"] for step in run["steps"]] == [pruned_on(name) for name in run["order"]]
    for run in sequential_row["matrix"]:  # sequential: each step prunes what the previous one left
        order = run["order"]
        assert [step["perplexity"] for step in run["steps"]] == [pruned_on(order[0]), pruned_on(*order)]


def test_a_continual_row_run_order_by_order_is_partial_until_every_order_ran(tiny_model_dir, tmp_path):
    settings = dict(model=str(tiny_model_dir[0]), rows=["copal"], **TINY)
    output = tmp_path / "continual.json"
    first = studies.run("continual", str(output), orders=["moby_dick,austen"], **settings)
    [row] = first["rows"]
    assert row["partial"] and [run["order"] for run in row["matrix"]] == [["moby_dick", "austen"]]
    assert "| copal (partial, 1 of 2 orders) | continual state |" in output.with_suffix(".md").read_text()
    [row] = studies.run("continual", str(output), **settings)["rows"]  # every order: the other one runs
    assert "partial" not in row and row["resumed_orders"] == 1
    assert [run["order"] for run in row["matrix"]] == [["austen", "moby_dick"], ["moby_dick", "austen"]]
    assert row["matrix"][1] == first["rows"][0]["matrix"][0]
    assert row["a_bwt"] == continual.metrics(TINY["datasets"], {tuple(r["order"]): r["steps"]
                                                                 for r in row["matrix"]})["a_bwt"]


def test_continual_orders_outside_the_protocol_are_refused_before_anything_loads():
    with pytest.raises(ValueError, match="option orders of study 'continual': python,austen,moby_dick is not an "
                                         "order of datasets austen moby_dick python with permutations given; "
                                         "allowed: austen,moby_dick,python$"):
        studies.get("continual", permutations="given", orders=["python,austen,moby_dick"])
    study = studies.get("continual", orders=["python,austen,moby_dick", "austen,moby_dick,python",
                                             "python,austen,moby_dick"])
    assert study.selected_orders() == [("python", "austen", "moby_dick"), ("austen", "moby_dick", "python")]
    with pytest.raises(ValueError, match="option patterns of study 'continual'"):
        studies.get("continual", patterns=["3:2"])


def _continual_result(seed, rows):
    """A continual results file over datasets a, b: ``rows`` maps a method label to its
    orders, each (P[step 1][a], P[step 1][b], P[step 2][a], P[step 2][b])."""
    def steps(order, p):
        return [{"pruned_on": order[0], "perplexity": {"a": p[0], "b": p[1]}},
                {"pruned_on": order[1], "perplexity": {"a": p[2], "b": p[3]}}]
    return {"settings": {"datasets": ["a", "b"], "permutations": "all", "calibration": f"2 x 8 tokens (seed {seed})",
                         "evaluation": "16 tokens"}, "dense": {"a": 1.0, "b": 1.0},
            "rows": [{"pattern": "2:4", "method": method, "init": "cumulative", "partial": len(runs) < 2,
                      "matrix": [{"order": list(order), "steps": steps(order, p)} for order, p in runs.items()]}
                     for method, runs in rows.items()]}


def test_continual_seeds_summary_pairs_the_rows_every_seed_ran_over_their_common_orders(tmp_path):
    seed0 = _continual_result(0, {"copal": {("a", "b"): (10, 20, 13, 21), ("b", "a"): (30, 40, 31, 44)},
                                  "wanda": {("a", "b"): (10, 20, 12, 22), ("b", "a"): (1, 1, 1, 1)},
                                  "sparsegpt": {("a", "b"): (1, 1, 1, 1)}})
    seed1 = _continual_result(1, {"copal": {("a", "b"): (10, 20, 15, 23)}, "wanda": {("a", "b"): (10, 20, 11, 21)}})
    summary = continual.merge_seeds([seed0, seed1])
    assert summary["orders"] == [["a", "b"]]  # the order (b, a) is missing from seed 1
    assert summary["settings"]["calibration"] == "2 x 8 tokens" and summary["settings"]["calibration_seeds"] == [0, 1]
    copal, wanda = summary["rows"]  # sparsegpt: seed 0 only
    assert (copal["method"], wanda["method"]) == ("copal", "wanda")
    # order a -> b: BWT of a = P[2][a] - P[1][a]; A-PPL = mean of the final P
    assert [p["a_bwt"] for p in copal["per_seed"]] == [3, 5] and [p["a_ppl"] for p in copal["per_seed"]] == [17, 19]
    assert (copal["a_bwt_mean"], copal["a_bwt_std"], copal["a_ppl_mean"], copal["a_ppl_std"]) == (4, 1, 18, 1)
    assert (wanda["a_bwt_mean"], wanda["a_ppl_mean"]) == (1.5, 16.5)
    text = continual.seeds_markdown(summary)
    assert "| 2:4 | copal | cumulative | 4.000 ± 1.00 | 18.000 ± 1.00 | 3.000 / 17.000 | 5.000 / 19.000 |" in text
    assert "| 2:4 | wanda | cumulative | 1 | 1.00 / 16.00 |" in text
    with pytest.raises(ValueError, match="each file must have its own calibration seed; got seeds \\[0, 0\\]"):
        continual.merge_seeds([seed0, seed0])
    other = _continual_result(1, {"copal": {("a", "b"): (1, 1, 1, 1)}})
    other["settings"]["evaluation"] = "32 tokens"
    with pytest.raises(ValueError, match="differ in more than the calibration seed"):
        continual.merge_seeds([seed0, other])
    inputs = [tmp_path / "seed0.json", tmp_path / "seed1.json"]
    for path, result in zip(inputs, (seed0, seed1)):
        path.write_text(json.dumps(result))
    written = studies.run("continual-seeds", str(tmp_path / "seeds.json"), inputs=[str(p) for p in inputs])
    assert written == summary == json.loads((tmp_path / "seeds.json").read_text())
    assert (tmp_path / "seeds.md").read_text() == text


def test_continual_table_gives_each_partial_row_its_metrics_over_the_orders_it_finished():
    result = _continual_result(0, {"copal": {("a", "b"): (10, 20, 13, 21)}})
    text = continual.markdown(result)
    assert "| 2:4 | copal (partial, 1 of 2 orders) | cumulative | 3.00 / 17.00 | – | 3.000 / 17.000 |" in text
    assert "No row has run every order" in text and "| A-BWT | M-BWT |" not in text
    result["rows"][0]["matrix"].append({"order": ["b", "a"], "steps": _continual_result(
        0, {"copal": {("b", "a"): (30, 40, 31, 44)}})["rows"][0]["matrix"][0]["steps"]})
    # b -> a: BWT of b = 44 - 40, final mean 37.5; over both orders A-BWT = mean of the per-dataset BWTs
    assert "| 3.00 / 17.00 | 4.00 / 37.50 | 3.500 ± 0.50 / 27.250 ± 10.25 |" in continual.markdown(result)


def _seed_rows(method, init, per_seed):
    """A row of a seeds summary: ``per_seed`` maps a seed to its (A-BWT, A-PPL)."""
    return {"pattern": "2:4", "method": method, "init": init,
            "per_seed": [{"seed": seed, "a_bwt": bwt, "a_ppl": ppl} for seed, (bwt, ppl) in per_seed.items()]}


def test_the_seeds_verdict_pairs_each_copal_row_with_cumulative_wanda_by_seed():
    """COPAL ahead where it forgets less and reaches lower perplexity on every seed by more than two
    standard errors, behind the other way round, unsettled where the signs differ; no line without
    the cumulative Wanda row."""
    wanda = _seed_rows("wanda", "cumulative", {0: (1.0, 70.0), 1: (2.0, 71.0), 2: (1.5, 70.5)})
    ahead = _seed_rows("copal (gaussian)", "continual state", {0: (0.2, 65.0), 1: (0.9, 66.5), 2: (0.6, 65.0)})
    behind = _seed_rows("copal", "continual state", {0: (3.0, 75.0), 1: (4.5, 76.0), 2: (3.5, 75.2)})
    mixed = _seed_rows("copal (ratio 2)", "continual state", {0: (0.5, 71.0), 1: (2.5, 70.0), 2: (1.0, 72.0)})
    other = _seed_rows("wanda", "global", {0: (9.0, 99.0), 1: (9.0, 99.0), 2: (9.0, 99.0)})
    found = continual.seeds_verdicts({"rows": [wanda, other, ahead, behind, mixed]})
    assert [(copal["method"], theirs is wanda, bwt.word, ppl.word) for copal, theirs, bwt, ppl in found] == [
        ("copal (gaussian)", True, "ahead", "ahead"), ("copal", True, "behind", "behind"),
        ("copal (ratio 2)", True, "unsettled", "unsettled")]
    lines = continual.seeds_verdict_lines({"rows": [wanda, ahead, behind]})
    assert "| 2:4 | copal (gaussian) | continual state | -0.933 ± 0.153, 3 seeds: ahead | " \
           "-5.000 ± 0.500, 3 seeds: ahead |" in lines
    assert "| 2:4 | copal | continual state | +2.167 ± 0.289, 3 seeds: behind | +4.900 ± 0.173, 3 seeds: behind |" \
        in lines
    assert continual.seeds_verdict_lines({"rows": [other, ahead]}) == []


def test_the_committed_seeds_table_is_what_the_renderer_makes_of_its_results():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / \
        "continual-smollm2-135m-unstructured50-seeds.json"
    summary = json.loads(path.read_text(encoding="utf-8"))
    assert path.with_suffix(".md").read_text(encoding="utf-8") == continual.seeds_markdown(summary)
