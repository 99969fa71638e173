"""The ``sleb`` and ``slicegpt`` studies at tiny scale: SLEB's row removed the number of blocks
its ratio names, searched on the windows it says, one row per calibration seed (resumed per seed),
with the seeds' stability summarised; SliceGPT's row sliced the hidden size by its
ratio with PCAs on the windows its label names, and a rerun resumes it (or reruns it to score
tasks it lacks); DReSS's rows are quoted only from a file of the same settings."""
import json

import pytest

from pyprune import studies
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.studies import beside_dress

from tests.helpers import tiny_llama, tiny_tokenizer

TINY = dict(nsamples=8, seqlen=16, eval_tokens=64, eval_seqlen=16)


def _calls(monkeypatch):
    calls, prune = [], beside_dress.prune

    def recorded(model, method, pattern, calib, **options):
        calls.append((method, pattern, calib))
        return prune(model, method, pattern, calib, **options)

    monkeypatch.setattr(beside_dress, "prune", recorded)
    return calls


def test_sleb_removes_the_blocks_its_ratio_names(tmp_path, monkeypatch):
    model_dir = str(tmp_path / "tiny4")  # four blocks: SLEB keeps the first and the last
    tiny_llama(layers=4).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    output = tmp_path / "sleb.json"
    calls = _calls(monkeypatch)
    result = studies.run("sleb", str(output), model=model_dir, ratio=0.5, sleb_windows=2,
                         tasks=["austen_continuation"], limit=4, **TINY)
    assert result == json.loads(output.read_text())
    assert output.with_suffix(".md").read_text() == studies.get("sleb").markdown(result)
    [row] = result["rows"]
    assert row["seed"] == 0 and row["blocks"] == 4 and len(row["removed_blocks"]) == 2  # ratio 0.5 of 4 blocks
    assert [step["removed"] for step in row["steps"]] == row["removed_blocks"]
    assert not {0, 3} & set(row["removed_blocks"]) and row["parameters"][1] < row["parameters"][0]
    _, tokenizer = load_model(model_dir)
    [(method, pattern, calib)] = calls  # the search ran on the first 2 of DReSS's 8 windows
    assert (method, str(pattern)) == ("sleb", "structured 0.5")
    assert calib.equal(data.calibration_samples(tokenizer, "emma", nsamples=8, seqlen=16, seed=0)[:2])
    assert set(row["ppl"]) == set(beside_dress.EVAL_TEXTS) and row["ppl"]["pride_and_prejudice"] > 0
    assert row["zero_shot"]["austen_continuation"]["n"] == 4
    assert result["dense_zero_shot"]["austen_continuation"]["n"] == 4  # no DReSS file: the dense model scored
    assert result["settings"]["sleb_windows"] == 2 and "beside DReSS" not in output.with_suffix(".md").read_text()
    with pytest.raises(ValueError, match="sleb_windows of study 'sleb' must be at most nsamples"):
        studies.get("sleb", nsamples=2, sleb_windows=4)


def test_sleb_searches_each_seeds_own_windows_one_row_each_and_resumes_per_seed(tmp_path, monkeypatch):
    model_dir = str(tmp_path / "tiny5")
    tiny_llama(layers=5).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    output = tmp_path / "sleb.json"
    calls = _calls(monkeypatch)
    settings = dict(model=model_dir, ratio=0.4, sleb_windows=2, **TINY)
    result = studies.run("sleb", str(output), seeds=[1, 0], **settings)
    _, tokenizer = load_model(model_dir)
    drawn = {seed: data.calibration_samples(tokenizer, "emma", nsamples=8, seqlen=16, seed=seed)[:2] for seed in (0, 1)}
    assert not drawn[0].equal(drawn[1])  # the seeds draw different windows
    assert [calib.equal(drawn[1]) for _, _, calib in calls] == [True, False]  # the seeds in the order given
    assert calls[1][2].equal(drawn[0])
    assert [row["seed"] for row in result["rows"]] == [0, 1]  # one row per seed, in seed order
    assert all(len(row["removed_blocks"]) == 2 for row in result["rows"])
    assert result["stability"] == beside_dress.stability(result["rows"])
    markdown = output.with_suffix(".md").read_text()
    assert "mean ± std over the seeds" in markdown and "| 2 (0, 1) |" in markdown
    assert "| 2 x 16 | 64 | 1 (seed 1) |" in markdown  # every row states its protocol
    assert beside_dress.mean_std([row["ppl"]["moby_dick"] for row in result["rows"]], ".2f") in markdown

    calls.clear()
    again = studies.run("sleb", str(output), seeds=[0, 1, 2], **settings)
    assert len(calls) == 1 and calls[0][2].equal(
        data.calibration_samples(tokenizer, "emma", nsamples=8, seqlen=16, seed=2)[:2])  # only seed 2 ran
    assert again["rows"][:2] == result["rows"] and again["stability"]["seeds"] == [0, 1, 2]


def test_sleb_stability_names_the_common_blocks_and_each_pairs_overlap():
    rows = [{"seed": 0, "removed_blocks": [13, 12, 16, 14]}, {"seed": 1, "removed_blocks": [12, 13, 17, 15]},
            {"seed": 2, "removed_blocks": [16, 12, 13, 9]}]
    assert beside_dress.stability(rows) == {
        "seeds": [0, 1, 2], "removed": 4, "common": [12, 13], "any": [9, 12, 13, 14, 15, 16, 17],
        "pairs": [{"seeds": [0, 1], "both": 2}, {"seeds": [0, 2], "both": 3}, {"seeds": [1, 2], "both": 2}]}
    assert beside_dress.stability(rows[:1])["pairs"] == [] and beside_dress.stability(rows[:1])["common"] == [
        12, 13, 14, 16]


def test_slicegpt_slices_by_its_ratio_on_the_labelled_windows_and_resumes(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "slicegpt.json"
    calls = _calls(monkeypatch)
    settings = dict(model=model_dir, pca_windows=4, lora_steps=2, train_batch=2, **TINY)
    result = studies.run("slicegpt", str(output), **settings)
    assert output.with_suffix(".md").read_text() == studies.get("slicegpt").markdown(result)
    assert result["settings"] == {"hidden": "64 -> ratio 0.25", "calibration": "6 x 16 Emma windows train, 2 train "
                                  "LoRA", "evaluation": "first 64 tokens of pride_and_prejudice and moby_dick, "
                                  "16-token windows", "lora": "2 steps, rank 32, alpha 10, lr 0.0001, batch 2",
                                  "threads": result["settings"]["threads"], "model": model_dir}
    [row] = result["rows"]
    assert row["label"] == "ratio 0.25, slice_head false, PCA on 4 of the 6 windows" and row["hidden_size"] == [64, 48]
    assert row["head_size"] == 64 and row["slice_head"] is False and row["options"]["slice_head"] is False
    assert (row["pca_windows"], row["lora_windows"]) == (4, 2)
    assert "| 4 x 16 + 2 x 16 LoRA | 64 | 1 (seed 0) |" in output.with_suffix(".md").read_text()  # its protocol
    _, tokenizer = load_model(model_dir)
    [(method, pattern, calib)] = calls
    assert (method, str(pattern)) == ("slicegpt", "structured 0.25")
    assert calib.equal(data.calibration_samples(tokenizer, "emma", nsamples=8, seqlen=16, seed=0)[:4])
    assert row["ppl_lora"] is not None and row["ppl_lora"] != row["ppl_sliced"] and row["lora_s"] > 0

    calls.clear()
    studies.run("slicegpt", str(output), **settings)
    assert calls == []  # done: the rerun resumes
    again = studies.run("slicegpt", str(output), tasks=["austen_continuation"], limit=4, **settings)
    assert len(calls) == 1  # the row lacks the task: rerun (the PCA is deterministic) and replaced
    [row] = again["rows"]
    assert row["zero_shot_sliced"]["austen_continuation"]["n"] == 4 and row["zero_shot_lora"]
    assert again["dense_zero_shot"]["austen_continuation"]["n"] == 4
    sliced = studies.run("slicegpt", str(output), recovery=False, slice_head=True, **settings)["rows"][1]
    assert sliced["label"] == "ratio 0.25, slice_head true, PCA on 4 of the 6 windows, no LoRA run"
    assert sliced["ppl_lora"] is None and sliced["lora_s"] is None
    assert sliced["head_size"] == 48 and sliced["options"]["slice_head"] is True  # the head sliced too
    assert output.with_suffix(".md").read_text().count("the LM head keep all 64") == 1  # the first row only
    assert sliced["ppl_sliced"] != row["ppl_sliced"]
    with pytest.raises(ValueError, match="pca_windows of study 'slicegpt' must be at most the 6 windows"):
        studies.get("slicegpt", nsamples=8, pca_windows=7)


def test_dress_rows_are_quoted_only_from_a_file_of_the_same_settings(monkeypatch):
    study = studies.get("slicegpt")
    settings = {"hidden": "576 -> ratio 0.25", "threads": 1}
    dress = {"settings": settings, "rows": [{"label": "DReSS-l2"}]}
    monkeypatch.setattr(beside_dress, "read_dress", lambda model: dress)
    assert study.dress_rows(settings) == dress["rows"]
    assert study.dress_rows({**settings, "threads": 2}) == []
    sleb = studies.get("sleb", eval_tokens=4096, eval_seqlen=256)
    dress["settings"] = {"evaluation": "first 4096 tokens of pride_and_prejudice and moby_dick, 256-token windows"}
    assert sleb.dress({"eval_tokens": 4096, "eval_seqlen": 256}) is dress
    assert sleb.dress({"eval_tokens": 2048, "eval_seqlen": 256}) is None
