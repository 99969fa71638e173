"""The ``baselines``, ``owl`` and ``zeroshot`` studies at tiny scale: each row is the method,
pattern and options its label names (OWL's rows really allocate non-uniform block sparsities
averaging the target), a rerun runs only the arms not yet done, and the committed results files
render through the studies' tables byte for byte."""
import copy
import json
import os

import pytest

import pyprune
from pyprune import studies
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.io.storage import StateError
from pyprune.patterns import NM, Unstructured
from pyprune.studies import baselines

TINY = dict(nsamples=2, seqlen=16, eval_tokens=64)
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _calls(monkeypatch):
    """Every pyprune.prune call of the studies, recorded: (method, pattern, options)."""
    calls, prune = [], baselines.prune

    def recorded(model, method, pattern, calib, progress=True, **options):  # options: the method's
        calls.append((method, pattern, options))
        return prune(model, method, pattern, calib, **options)

    monkeypatch.setattr(baselines, "prune", recorded)
    return calls


def test_baselines_rows_are_their_arms_and_a_rerun_runs_only_the_new_ones(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "baselines.json"
    calls = _calls(monkeypatch)
    result = studies.run("baselines", str(output), model=model_dir, rows=["wanda-0.5", "safe+-2:4-lr0.001"], **TINY)
    assert result == json.loads(output.read_text())
    assert output.with_suffix(".md").read_text() == studies.get("baselines").markdown(result)
    assert result["settings"] == {"calibration": "2 x 16 tokens of austen/emma.txt, seed 0",
                                  "evaluation": "first 64 tokens of austen/pride_and_prejudice.txt, 16-token windows",
                                  "model": model_dir}
    assert [(r["method"], r["pattern"]) for r in result["results"]] == [
        ("dense", "-"), ("wanda", "unstructured 0.5"), ("safe+", "2:4, lr=0.001")]
    assert calls == [("wanda", Unstructured(0.5), {"batch_size": 8}), ("safe+", NM(2, 4), {"batch_size": 8, "lr": 0.001})]
    # the wanda row is Wanda at 50% on the study's calibration draw, evaluated on its tokens
    model, tokenizer = load_model(model_dir)
    calib = data.calibration_samples(tokenizer, "emma", nsamples=2, seqlen=16, seed=0)
    tokens = data.eval_tokens(tokenizer, "pride_and_prejudice", max_tokens=64)
    dense, wanda, safe = result["results"]
    assert dense["perplexity"] == perplexity(model, tokens, 16)
    pruned = copy.deepcopy(model)
    pyprune.prune(pruned, "wanda", Unstructured(0.5), calib)
    assert wanda["perplexity"] == perplexity(pruned, tokens, 16) and wanda["sparsity"] == 0.5
    assert safe["sparsity"] == 0.5

    calls.clear()  # a rerun with one more arm runs only that one, keeps the rows there and their order
    again = studies.run("baselines", str(output), model=model_dir, rows=["wanda-0.5", "magnitude-4:8"], **TINY)
    assert calls == [("magnitude", NM(4, 8), {"batch_size": 8})]
    assert [r["pattern"] for r in again["results"]] == ["-", "unstructured 0.5", "2:4, lr=0.001", "4:8"]
    assert again["results"][:3] == result["results"]
    before = output.read_text()
    with pytest.raises(StateError, match="other settings: calibration"):
        studies.run("baselines", str(output), model=model_dir, rows=["wanda-0.5"], **{**TINY, "seed": 1})
    assert output.read_text() == before


def test_baselines_arms_name_their_method_pattern_and_options():
    assert studies.get("baselines").rows == baselines.DEFAULT_ARMS
    assert "safe+-2:4-lr0.001" not in baselines.DEFAULT_ARMS and "dress-0.25-steps40" not in baselines.DEFAULT_ARMS
    method, pattern, options = baselines.ARMS["taylor-0.2-ends"]
    assert (method, baselines.pattern_label(pattern, options)) == ("taylor", "structured 0.2, first_layer=3, "
                                                                             "last_layer=-2")
    with pytest.raises(ValueError, match="option rows of study 'baselines' must be one of .*; got 'wanda'"):
        studies.get("baselines", rows=["wanda"])


def test_owl_rows_allocate_non_uniform_block_sparsities_averaging_the_target(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "owl.json"
    calls = _calls(monkeypatch)
    result = studies.run("owl", str(output), model=model_dir, methods=["wanda"], sparsities=[0.6], owl_lambda=0.1,
                         **TINY)
    assert output.with_suffix(".md").read_text() == studies.get("owl").markdown(result)
    assert list(result) == ["model", "settings", "evaluation", "dense", "environment", "results"]
    assert result["settings"] == {"model": model_dir, "nsamples": 2, "seqlen": 16, "eval_tokens": 64, "seed": 0,
                                  "owl_m": 5.0, "owl_lambda": 0.1}
    uniform, owl = result["results"]
    assert [(r["method"], r["target"], r["owl"]) for r in (uniform, owl)] == [("wanda", 0.6, False),
                                                                            ("wanda", 0.6, True)]
    assert calls == [("wanda", Unstructured(0.6), {}),
                     ("wanda", Unstructured(0.6), {"owl": True, "owl_m": 5.0, "owl_lambda": 0.1})]
    assert uniform["block_sparsity"] is None and uniform["sparsity"] == pytest.approx(0.6, abs=0.01)
    blocks = owl["block_sparsity"]
    assert len(blocks) == 2 and len(set(blocks)) == 2  # non-uniform: one per block
    assert sum(blocks) / len(blocks) == pytest.approx(0.6, abs=1e-3)
    assert all(abs(b - 0.6) <= 0.1 + 1e-6 for b in blocks) and len(owl["outlier_ratio"]) == 2
    assert (f"| wanda | 0.6 | OWL | 2 x 16 | 64 | 1 (seed 0) | {owl['sparsity']:.3f} | "
            f"{min(blocks):.3f}–{max(blocks):.3f} |") in \
        output.with_suffix(".md").read_text()
    calls.clear()
    studies.run("owl", str(output), model=model_dir, methods=["wanda"], sparsities=[0.6], owl_lambda=0.1, **TINY)
    assert calls == []  # every arm done: nothing runs


def test_zeroshot_rows_are_reports_of_their_arms_with_accuracy(tiny_model_dir, tmp_path):
    output = tmp_path / "zeroshot.json"
    result = studies.run("zeroshot", str(output), model=str(tiny_model_dir[0]), rows=["wanda-0.5"], items=4, **TINY)
    assert output.with_suffix(".md").read_text() == studies.get("zeroshot").markdown(result)
    assert output.with_suffix(".md").read_text().startswith(f"{tiny_model_dir[0].name}, zero-shot")
    assert result["settings"]["runs"] == [["wanda", "unstructured 0.5", {}]] and result["settings"]["items"] == 4
    dense, wanda = result["rows"]
    assert (dense["method"], dense["pattern"], wanda["method"], wanda["pattern"]) == (
        "dense", "-", "wanda", "unstructured 0.5")
    assert wanda["sparsity"] == 0.5 and "layers" not in wanda
    for row in (dense, wanda):
        assert set(row["tasks"]) == set(baselines.TASKS) and all(t["n"] == 4 for t in row["tasks"].values())
        assert row["eval"][0]["tokens"] == 64
    assert dense["eval"][0]["perplexity"] != wanda["eval"][0]["perplexity"]
    assert set(result["context"]) == set(baselines.TASKS)
    assert output.with_suffix(".png").exists() and output.with_suffix(".svg").exists()


@pytest.mark.parametrize("stem,settings", [
    ("baselines-smollm2-135m", ("baselines", {})),
    ("baselines-gemma3-270m", ("baselines", {"model": "gemma3-270m", "eval_tokens": 4096})),
    ("owl-smollm2-135m", ("owl", {})),
    ("owl-gemma3-270m", ("owl", {"model": "gemma3-270m"})),
    ("owl-sweep-smollm2-135m", ("owl-sweep", {})),
    ("owl-sweep-gemma3-270m", ("owl-sweep", {"model": "gemma3-270m"})),
    ("zeroshot-smollm2-135m", ("zeroshot", {"items": 40})),
    ("sleb-smollm2-135m", ("sleb", {})),
    ("sleb-gemma3-270m", ("sleb", {"model": "gemma3-270m"})),
    ("dress-slicegpt-smollm2-135m", ("slicegpt", {})),
])
def test_the_committed_results_render_byte_for_byte_and_are_the_default_files(stem, settings, monkeypatch):
    monkeypatch.chdir(ROOT)
    study = studies.get(settings[0], **settings[1])
    path = study.output_path(None)
    assert path == os.path.join("benchmarks", "results", f"{stem}.json")
    with open(path, encoding="utf-8") as handle:
        result = json.load(handle)
    with open(os.path.splitext(path)[0] + ".md", encoding="utf-8") as handle:
        assert study.markdown(result) == handle.read()
