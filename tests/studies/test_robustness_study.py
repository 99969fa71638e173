"""The ``robustness`` study at tiny scale: each row is the method variant, seed and protocol its
label names, the calibration floor compares the seeds' own runs, and a rerun resumes."""
import json
from pathlib import Path

import pytest
import torch

from pyprune import studies
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.io.storage import StateError
from pyprune.studies import robustness

SETTINGS = dict(methods=["taylor", "moreau-gs-released"], arithmetic=["rounding"], seeds=[0, 1], ratios=[0.25],
                nsamples=2, seqlen=16, eval_tokens=64, eval_seqlen=16, noise_floor=False)


def test_layer_protocols():
    assert robustness.layer_protocol("all", 0.2, 30) == (0, 29, 0.2)
    first, last, ratio = robustness.layer_protocol("middle", 0.2, 30)  # LLaMA-7B's 4..29 of 32, scaled
    assert (first, last) == (4, 27) and ratio == pytest.approx(0.2 * 30 / 24)
    assert robustness.layer_protocol("middle", 0.2, 32)[:2] == (4, 29)


def test_robustness_rows_are_what_their_labels_say_and_a_rerun_resumes(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "robust.json"
    calls, study = [], robustness.study

    def recorded(model, method, ratio, calib, tokens, **options):
        calls.append({"method": method, "ratio": ratio, "calib": calib, **options})
        return study(model, method, ratio, calib, tokens, **options)

    monkeypatch.setattr(robustness, "study", recorded)
    result = studies.run("robustness", str(output), model=model_dir, **SETTINGS)
    assert result == json.loads(output.read_text())
    assert result["settings"]["model"] == model_dir and result["settings"]["calibration"] == "2 x 16 tokens of emma"
    runs = result["runs"]
    assert [(r["method"], r["seed"]) for r in runs] == [("taylor", 0), ("moreau-gs-released", 0), ("taylor", 1),
                                                        ("moreau-gs-released", 1)]
    # each label's method and options: the released -GS loop is moreau-gs with the authors' settings
    _, tokenizer = load_model(model_dir)
    for run, call in zip(runs, calls):
        method, variant = robustness.VARIANTS[run["method"]]
        assert call["method"] == method and all(run["options"][k] == v for k, v in variant.items())
        assert (call["first_layer"], call["last_layer"], call["ratio"]) == (0, 1, 0.25)  # layers all
        expected = data.calibration_samples(tokenizer, "emma", nsamples=2, seqlen=16, seed=run["seed"])
        assert torch.equal(call["calib"], expected)  # the seed is the calibration draw
        assert run["noise_floor"] is None and 0 <= run["agreement"] <= 1
    assert "operator" not in runs[0]["options"] and runs[1]["options"]["operator"] == "released"
    # the calibration floor: the bf16 selections of seeds 0 and 1, from the kept scores
    scores = str(output.with_suffix(".scores"))
    for method in ("taylor", "moreau-gs-released"):
        run = next(r for r in runs if r["method"] == method)
        groups = [robustness.load_scores(robustness._scores_path(scores, run, seed))[1] for seed in (0, 1)]
        floor = result["calibration_floor"][f"{method}|rounding|all|0.25"]
        assert floor["pairs"] == [[0, 1]] and floor["agreement"] == robustness.agreement(*groups)
    text = output.with_suffix(".md").read_text()
    assert text == robustness.markdown(result) and text.startswith(f"{model_dir}; calibration")
    assert "| taylor | rounding | groups | all | 0.25 | 2 |" in text
    assert "| moreau-gs-released | rounding | groups | all | 0.25 | 2 |" in text

    calls.clear()
    studies.run("robustness", str(output), model=model_dir, **{**SETTINGS, "seeds": [0, 1, 2]})
    assert [(c["method"], torch.equal(c["calib"], data.calibration_samples(
        tokenizer, "emma", nsamples=2, seqlen=16, seed=2))) for c in calls] == [("taylor", True), ("moreau-gs", True)]
    assert len(json.loads(output.read_text())["runs"]) == 6
    before = output.read_text()
    with pytest.raises(StateError, match=r"other settings: calibration '2 x 16 tokens of emma' \(now '3 x 16"):
        studies.run("robustness", str(output), model=model_dir, **{**SETTINGS, "nsamples": 3})
    assert output.read_text() == before


def test_the_eta_sweep_goes_to_its_own_file_against_eta_zero(tiny_model_dir, tmp_path):
    output = tmp_path / "robust.json"
    result = studies.run("robustness", str(output), model=str(tiny_model_dir[0]), seeds=[1], ratios=[0.25],
                         nsamples=2, seqlen=16, eval_tokens=64, eval_seqlen=16, eta_sweep=[1e-3])
    assert not output.exists() and json.loads((tmp_path / "robust-eta-sweep.json").read_text()) == result
    sweep = result["eta_sweep"]
    assert result["runs"] == [] and (sweep["seed"], sweep["layers"], sweep["ratio"]) == (1, "all", 0.25)
    assert [row["eta"] for row in sweep["rows"]] == [1e-3]
    assert result["settings"]["eta_sweep"] == [1e-3]
    assert "MoreauPruner-GS η sweep" in (tmp_path / "robust-eta-sweep.md").read_text()


def _runs(method, arithmetic, agreements, ppl_diffs, layers="all"):
    return [{"method": method, "arithmetic": arithmetic, "layers": layers, "overall_ratio": 0.2,
             "structure": "groups", "seed": seed, "agreement": agreement, "ppl_diff": ppl_diff}
            for seed, (agreement, ppl_diff) in enumerate(zip(agreements, ppl_diffs))]


def test_the_verdict_column_pairs_moreau_with_each_baseline_by_seed():
    """MoreauPruner ahead where every seed's agreement is higher and ppl_diff lower by more than
    two standard errors; behind where both go the other way; unsettled where signs differ or only
    one seed ran; no line for a baseline of another arithmetic or layers, or one sharing no seed."""
    runs = (_runs("moreau", "rounding", [0.99, 0.98, 0.97], [1.0, 2.0, 3.0])
            + _runs("taylor", "rounding", [0.95, 0.94, 0.94], [5.0, 6.5, 7.0])           # moreau ahead on both
            + _runs("smoothgrad", "rounding", [0.999, 0.995, 0.99], [0.1, 0.2, 0.4])     # moreau behind on both
            + _runs("moreau-gs", "rounding", [0.97], [3.0])
            + _runs("taylor", "native", [0.5, 0.6, 0.7], [9.0, 9.0, 9.0])               # no moreau in native
            + _runs("taylor", "rounding", [0.5], [9.0], layers="middle"))
    runs += [dict(r, seed=r["seed"] + 10) for r in _runs("smoothgrad-gradients", "rounding", [0.9], [1.0])]
    found = {(ours[0], theirs[0]): (agreement.word, ppl.word) for ours, theirs, agreement, ppl in
             robustness.verdicts(runs)}
    assert found == {("moreau", "taylor"): ("ahead", "ahead"), ("moreau", "smoothgrad"): ("behind", "behind"),
                     ("moreau-gs", "taylor"): ("unsettled", "unsettled"),
                     ("moreau-gs", "smoothgrad"): ("unsettled", "unsettled")}
    lines = robustness.verdict_lines(runs)
    assert "| moreau | taylor | rounding | groups | all | 0.2 | +0.0367 ± 0.0058, 3 seeds: ahead | " \
           "-4.17 ± 0.29, 3 seeds: ahead |" in lines
    assert "| moreau | smoothgrad | rounding | groups | all | 0.2 | -0.0147 ± 0.0055, 3 seeds: behind | " \
           "+1.77 ± 0.85, 3 seeds: behind |" in lines
    assert "| moreau-gs | taylor | rounding | groups | all | 0.2 | +0.0200, 1 seed: unsettled (one seed) | " \
           "-2.00, 1 seed: unsettled (one seed) |" in lines
    mixed = _runs("moreau", "rounding", [0.99, 0.90], [1.0, 9.0]) + _runs("taylor", "rounding", [0.95, 0.95], [5.0, 5.0])
    [(_, _, agreement, ppl)] = robustness.verdicts(mixed)
    assert agreement.word == ppl.word == "unsettled" and agreement.reason == "signs differ across seeds"
    assert robustness.verdict_lines(_runs("taylor", "rounding", [0.9], [1.0])) == []


@pytest.mark.parametrize("name", ["robustness-smollm2-135m", "robustness-smollm2-135m-cut",
                                  "robustness-smollm2-135m-channels"])
def test_the_committed_tables_are_what_the_renderer_makes_of_their_results(name):
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    result = json.loads((results / f"{name}.json").read_text(encoding="utf-8"))
    assert (results / f"{name}.md").read_text(encoding="utf-8") == robustness.markdown(result)


def _full_run(method, seed, ppl_diff, noise_ppl):
    cross = {"bfloat16": {"bfloat16": 10.0, "float16": 10.0}, "float16": {"bfloat16": 11.0, "float16": 11.0}}
    runs = {name: {"time_s": 1.0, "moreau": {}} for name in ("bfloat16", "float16")}
    floor = None if noise_ppl is None else {"agreement": 0.9, "spearman": {"hidden": 0.99},
                                            "ppl_diff": dict(zip(("bfloat16", "float16"), noise_ppl))}
    return {"method": method, "arithmetic": "fp32-accumulate", "layers": "all", "overall_ratio": 0.1, "seed": seed,
            "structure": "hidden", "agreement": 0.99, "spearman": {"hidden": 0.999}, "ppl_bf16": 10.0,
            "ppl_fp16": 10.0 + ppl_diff, "ppl_diff": ppl_diff, "ppl_cross": cross, "noise_floor": floor, "runs": runs}


def test_the_table_sets_the_papers_diff_beside_its_noise_floor_in_perplexity():
    """The summary row of a noisy method gives the paper's Diff (ppl_diff) and, beside it, the noise
    floor's perplexity difference per format (mean ± std over seeds); a deterministic one gives "–"."""
    runs = [_full_run("moreau", 0, 1.0, (0.5, 0.25)), _full_run("moreau", 1, 3.0, (1.5, 0.75)),
            _full_run("taylor", 0, 2.0, None), _full_run("taylor", 1, 4.0, None)]
    result = {"settings": {"calibration": "c", "evaluation": "e"}, "runs": runs, "calibration_floor": {},
              "environment": {"device": "CPU", "cpu_threads": 1, "torch": "t"}}
    lines = robustness.markdown(result).splitlines()
    assert "ppl_diff (the paper's Diff) | noise floor ppl_diff bf16 / fp16 |" in lines[2]
    [moreau] = [line for line in lines if line.startswith("| moreau | fp32-accumulate | hidden | all | 0.1 | 2 |")]
    assert "| 2.00 ± 1.41 | 1.00 ± 0.71 / 0.50 ± 0.35 |" in moreau
    [taylor] = [line for line in lines if line.startswith("| taylor | fp32-accumulate | hidden | all | 0.1 | 2 |")]
    assert "| 3.00 ± 1.41 | – / – |" in taylor


def _noisy_run(method, seed, agreement, floor_agreement, ppl_diff, noise_ppl):
    run = _full_run(method, seed, ppl_diff, noise_ppl)
    run["agreement"], run["noise_floor"]["agreement"] = agreement, floor_agreement
    return run


def test_the_format_is_set_against_the_noise_draw_by_the_verdict_rule():
    """Per setting with a noise floor, bf16/fp16 against two noise draws paired by seed: ahead where on
    every seed the formats agree more than the draws and their perplexities differ less (than the
    mean of the floor's formats) by more than two standard errors; behind the other way; unsettled
    where the signs differ; no perplexity verdict for floors without one, no row without a floor."""
    runs = [_noisy_run("moreau", 0, 0.99, 0.93, 0.2, (1.0, 2.0)), _noisy_run("moreau", 1, 0.98, 0.94, 0.4, (1.5, 2.5)),
            _noisy_run("moreau", 2, 0.99, 0.92, 0.3, (2.0, 1.0)),
            _noisy_run("smoothgrad", 0, 0.90, 0.95, 5.0, (1.0, 1.0)),
            _noisy_run("smoothgrad", 1, 0.91, 0.96, 6.0, (1.0, 1.0)),
            _noisy_run("smoothgrad", 2, 0.90, 0.97, 7.0, (2.0, 2.0)),
            _noisy_run("moreau-gs", 0, 0.99, 0.93, 0.2, (1.0, 1.0)),
            _noisy_run("moreau-gs", 1, 0.90, 0.93, 3.0, (1.0, 1.0)),
            _full_run("taylor", 0, 2.0, None)]
    runs[-2]["noise_floor"].pop("ppl_diff")
    runs[-3]["noise_floor"].pop("ppl_diff")  # a floor measured before the perplexity floor existed
    found = {key[0]: (agreement.word, None if ppl is None else ppl.word)
             for key, _, agreement, ppl in robustness.format_against_noise(runs)}
    assert found == {"moreau": ("ahead", "ahead"), "smoothgrad": ("behind", "behind"),
                     "moreau-gs": ("unsettled", None)}
    lines = robustness.format_against_noise_lines(runs)
    assert "| moreau | fp32-accumulate | hidden | all | 0.1 | 0.9867 ± 0.0058 | 0.9300 ± 0.0100 | +0.0567 ± 0.0153, " \
           "3 seeds: ahead | 0.30 ± 0.10 | 1.67 ± 0.29 | -1.37 ± 0.21, 3 seeds: ahead |" in lines
    assert "| moreau-gs | fp32-accumulate | hidden | all | 0.1 | 0.9450 ± 0.0636 | 0.9300 ± 0.0000 | +0.0150 ± 0.0636, " \
           "2 seeds: unsettled (signs differ across seeds) | 1.60 ± 1.98 | – | – |" in lines
    assert robustness.format_against_noise_lines([_full_run("taylor", 0, 2.0, None)]) == []
