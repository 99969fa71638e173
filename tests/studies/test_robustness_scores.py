"""The robustness study keeps each prune's group scores: every arm scores once and cuts at every
ratio, giving the rows a study scoring every ratio from scratch gives; a stopped arm resumes after
its last finished prune without scoring it again; kept scores of other settings are refused."""
import json

import pytest

from pyprune import studies
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.io.storage import StateError
from pyprune.methods.moreau import SmoothGrad
from pyprune.methods.taylor import Taylor
from pyprune.studies import robustness
from tests.helpers import random_tokens, tiny_llama

SETTINGS = dict(methods=["taylor", "smoothgrad"], arithmetic=["rounding"], seeds=[0], nsamples=2, seqlen=16,
                eval_tokens=64, eval_seqlen=16, smoothgrad_passes=1, noise_formats=["bfloat16", "float16"])


@pytest.fixture
def scorings(monkeypatch):
    """The (method, noise seed) of every element-score computation of Taylor and SmoothGrad; a
    scoring listed in ``stop`` raises instead (a stopped run)."""
    calls, stop = [], []
    for cls in (Taylor, SmoothGrad):
        def counted(self, *args, _original=cls.element_scores, **kwargs):
            calls.append((self.name, self.settings.get("noise_seed")))
            if len(calls) in stop:
                raise KeyboardInterrupt("stopped")
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(cls, "element_scores", counted)
    return calls, stop


def _json(row):
    return json.loads(json.dumps(row))


def _without_times(row):
    """A row without what the clock measures."""
    row = {key: value for key, value in row.items() if key != "wall_s"}
    row["runs"] = {name: {k: v for k, v in run.items() if k != "time_s"} for name, run in row["runs"].items()}
    return row


def test_each_arm_scores_once_and_cuts_every_ratio_as_scoring_each_ratio_does(tiny_model_dir, tmp_path, scorings):
    calls, _ = scorings
    model_dir = str(tiny_model_dir[0])
    result = studies.run("robustness", str(tmp_path / "robust.json"), model=model_dir, ratios=[0.25, 0.5], **SETTINGS)
    # Taylor: bf16, fp16; SmoothGrad: bf16, fp16 and one more noise draw in each, all at the first ratio only
    assert calls == [("taylor", None)] * 2 + [("smoothgrad", 0)] * 2 + [("smoothgrad", 1)] * 2
    assert [(r["method"], r["overall_ratio"]) for r in result["runs"]] == \
        [("taylor", 0.25), ("smoothgrad", 0.25), ("taylor", 0.5), ("smoothgrad", 0.5)]
    model, tokenizer = load_model(model_dir)
    calib = data.calibration_samples(tokenizer, "emma", nsamples=2, seqlen=16, seed=0)
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=64)
    for row in result["runs"]:  # each ratio scored from scratch, each pruned model evaluated once
        options = {"passes": 1} if row["method"] == "smoothgrad" else {}
        expected = robustness.study(model, row["method"], row["overall_ratio"], calib, tokens, eval_seqlen=16,
                                    cross=False, noise_formats=("bfloat16", "float16"), progress=False,
                                    first_layer=0, last_layer=1, **options)
        expected = dict(expected, method=row["method"], **{key: row[key] for key in ("layers", "overall_ratio", "seed",
                                                                                 "structure")})
        assert _without_times(_json(row)) == _without_times(_json(expected))
        assert row["ppl_cross"] is None
    assert len(calls) == 6 + 2 * 2 + 2 * 4  # the direct studies scored every ratio again


def test_a_stopped_arm_resumes_after_its_last_finished_prune(tiny_model_dir, tmp_path, scorings):
    calls, stop = scorings
    model_dir, settings = str(tiny_model_dir[0]), dict(SETTINGS, methods=["smoothgrad"], ratios=[0.25])
    whole = studies.run("robustness", str(tmp_path / "whole.json"), model=model_dir, **settings)
    calls.clear()
    stop.append(3)  # bf16 and fp16 scored, then stopped in the noise floor's first draw
    output = tmp_path / "robust.json"
    with pytest.raises(KeyboardInterrupt):
        studies.run("robustness", str(output), model=model_dir, **settings)
    assert not output.exists()  # no finished arm: only the scores are kept
    kept = tmp_path / "robust.scores" / "arms" / "smoothgrad-rounding-all-seed0"
    assert sorted(p.name for p in kept.iterdir()) == ["smoothgrad-bfloat16-noise0.safetensors",
                                                      "smoothgrad-float16-noise0.safetensors"]
    calls.clear()
    stop.clear()
    resumed = studies.run("robustness", str(output), model=model_dir, **settings)
    assert calls == [("smoothgrad", 1)] * 2  # only the noise floor's draws: bf16 then fp16
    assert [_without_times(_json(r)) for r in resumed["runs"]] == [_without_times(_json(r)) for r in whole["runs"]]
    assert resumed["runs"][0]["runs"]["float16"]["time_s"] > 0  # the time of the prune that scored


def test_kept_scores_of_other_settings_are_refused(tmp_path):
    model, calib, tokens = tiny_llama(), random_tokens((2, 16)), random_tokens((64,), seed=3)
    kept = str(tmp_path / "kept")
    robustness.study(model, "smoothgrad", 0.25, calib, tokens, eval_seqlen=16, cross=False, noise_control=False,
                     progress=False, scores_dir=kept, passes=1)
    with pytest.raises(StateError, match=r"smoothgrad-bfloat16-noise0.safetensors was made with other settings: "
                                         r"passes 1 \(now 2\); remove it"):
        robustness.study(model, "smoothgrad", 0.25, calib, tokens, eval_seqlen=16, progress=False,
                         scores_dir=kept, passes=2)
    with pytest.raises(StateError, match="was made with other calibration data"):
        robustness.study(model, "smoothgrad", 0.25, random_tokens((2, 16), seed=1), tokens, eval_seqlen=16,
                         progress=False, scores_dir=kept, passes=1)


def test_native_runs_are_set_beside_fp32_accumulation_from_the_kept_scores(tiny_model_dir, tmp_path, scorings):
    calls, _ = scorings
    model_dir = str(tiny_model_dir[0])
    settings = dict(SETTINGS, methods=["taylor"], ratios=[0.25])
    alone = studies.run("robustness", str(tmp_path / "alone.json"), model=model_dir,
                        **dict(settings, arithmetic=["native"]))
    assert alone["runs"][0]["against"] is None  # no fp32-accumulate scores kept: nothing to set it beside
    calls.clear()
    result = studies.run("robustness", str(tmp_path / "robust.json"), model=model_dir,
                         **dict(settings, arithmetic=["fp32-accumulate", "native"]))
    assert calls == [("taylor", None)] * 4  # each arithmetic scores bf16 and fp16 once; the comparison scores nothing
    reference, native = result["runs"]
    assert "against" not in reference and native["against"]["arithmetic"] == "fp32-accumulate"
    model, tokenizer = load_model(model_dir)
    calib = data.calibration_samples(tokenizer, "emma", nsamples=2, seqlen=16, seed=0)
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=64)
    direct = {arithmetic: robustness.study(model, "taylor", 0.25, calib, tokens, eval_seqlen=16, cross=False,
                                           arithmetic=arithmetic, keep_scores=True, progress=False,
                                           first_layer=0, last_layer=1)
              for arithmetic in ("native", "fp32-accumulate")}
    for name in robustness.FORMATS:  # as two direct prunes of each arithmetic give
        first, second = (direct[arithmetic] for arithmetic in ("native", "fp32-accumulate"))
        assert native["against"][name] == _json({
            "agreement": robustness.agreement(first["groups"][name], second["groups"][name]),
            "spearman": robustness.rank_correlation(first["scores"][name], second["scores"][name])})
    assert "Native 16-bit against fp32 accumulation" in (tmp_path / "robust.md").read_text()
    assert "Native 16-bit against fp32 accumulation" not in (tmp_path / "alone.md").read_text()
