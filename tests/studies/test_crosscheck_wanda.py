"""The ``crosscheck-wanda`` study: its inputs are checked before any heavy work (one line, status 2
on the command line), and its mask comparison says what its table shows."""
import hashlib
import json
import sys

import pytest
import torch
import transformers

from pyprune import cli, ops, studies
from pyprune.patterns import NM
from pyprune.studies import crosscheck_wanda


def _one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pyprune study: error: option ")
    return err


def test_crosscheck_without_a_wanda_checkout_exits_2_at_once(tmp_path, capsys):
    assert cli.main(["study", "crosscheck-wanda"]) == 2
    assert "wanda_repo of study 'crosscheck-wanda' is required" in _one_line_error(capsys)
    missing = tmp_path / "nowhere"
    assert cli.main(["study", "crosscheck-wanda", "--wanda-repo", str(missing), "--python", sys.executable]) == 2
    assert f"{str(missing)!r} is not a directory" in _one_line_error(capsys)
    assert cli.main(["study", "crosscheck-wanda", "--wanda-repo", str(tmp_path), "--python", sys.executable]) == 2
    assert "is not a checkout of locuslab/wanda (no lib/prune.py, lib/sparsegpt.py" in _one_line_error(capsys)


def test_crosscheck_without_a_transformers_4_36_python_exits_2_at_once(tmp_path, capsys):
    for name in crosscheck_wanda.AUTHORS_FILES:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    assert cli.main(["study", "crosscheck-wanda", "--wanda-repo", str(tmp_path)]) == 2
    assert "option python of study 'crosscheck-wanda' is required" in _one_line_error(capsys)
    assert cli.main(["study", "crosscheck-wanda", "--wanda-repo", str(tmp_path), "--python",
                     str(tmp_path / "python")]) == 2
    assert "cannot be run" in _one_line_error(capsys)
    with pytest.raises(ValueError, match=f"has transformers {transformers.__version__}; the authors' code needs "
                                         "4.36.x"):
        studies.get("crosscheck-wanda", wanda_repo=str(tmp_path), python=sys.executable)


def test_mask_comparison_counts_identical_entries_and_names_the_first_differing_layer():
    ours = {"model.layers.0.q": torch.tensor([[True, False]]), "model.layers.1.q": torch.tensor([[True, True]])}
    theirs = {"model.layers.0.q": torch.tensor([[True, False]]), "model.layers.1.q": torch.tensor([[False, True]])}
    masks = crosscheck_wanda.compare_masks(ours, theirs)
    assert (masks["identical"], masks["total"], masks["fraction"]) == (3, 4, 0.75)
    assert (masks["layers"], masks["layers_differing"], masks["min_layer_fraction"]) == (2, 1, 0.5)
    assert masks["first_differing"] == {"layer": "model.layers.1.q", "differing": 1}
    assert crosscheck_wanda.percent_down(0.999999) == "99.99%" and crosscheck_wanda.percent_down(1.0) == "100%"
    with pytest.raises(RuntimeError, match="the two sides pruned different layers"):
        crosscheck_wanda.compare_masks(ours, {"model.layers.0.q": ours["model.layers.0.q"]})


def test_tied_differences_find_the_entries_whose_wanda_score_equals_another_of_their_group():
    weight = torch.tensor([[1.0, 1.0, 3.0, 4.0]])  # entries 0 and 1 score alike: a 2:4 tie
    norms = torch.ones(4)
    ours = torch.tensor([[True, False, True, True]])
    theirs = torch.tensor([[False, True, True, True]])
    found = crosscheck_wanda.tied_differences(weight, norms, ours, theirs, NM(2, 4))
    assert found == {"differing": 2, "tied": 2, "largest_relative_gap": 0.0}
    assert torch.equal(ops.wanda_score(weight, norms), weight.abs())


def test_the_table_compares_each_run_with_the_authors_side(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The authors' side replaced by pyprune itself, one mask entry flipped in Wanda 2:4's first
    layer: every other run matches in full; the flipped one is named, with its tie count."""
    import copy
    import pyprune
    from pyprune.evaluation.perplexity import perplexity

    def authors(study, model, calib, windows, workdir):
        runs = {}
        for name, method, pattern in crosscheck_wanda.RUNS:
            pruned = copy.deepcopy(model)
            pyprune.prune(pruned, method, pattern, calib, progress=False)
            masks = crosscheck_wanda.nonzero_masks(pruned)
            runs[name] = {"perplexity": 2.0, "time_s": 0.5, "masks": masks}
        first = next(iter(runs["wanda 2:4"]["masks"].values()))
        first[0, :4] = ~first[0, :4]  # one 2:4 group kept the other way round
        return {"dense_perplexity": perplexity(model, windows.reshape(-1), study.seqlen, progress=False),
                "runs": runs,
                "environment": {"torch": "t", "transformers": "4.36.2", "attention": "sdpa"}}

    monkeypatch.setattr(crosscheck_wanda, "run_authors", authors)
    monkeypatch.setattr(crosscheck_wanda.CrosscheckWanda, "check_options", lambda self: None)
    repo = tmp_path / "wanda"
    for name in crosscheck_wanda.AUTHORS_FILES:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(f"# {name}\n")
    output = tmp_path / "crosscheck.json"
    result = studies.run("crosscheck-wanda", str(output), wanda_repo=str(repo), python="/venv/python",
                         model=str(tiny_model_dir[0]), nsamples=2, seqlen=16, eval_tokens=64)
    assert result == json.loads(output.read_text())
    assert result["command"] == (f"pyprune study crosscheck-wanda --wanda-repo {repo} --python /venv/python --model "
                                 f"{tiny_model_dir[0]} --nsamples 2 --seqlen 16 --eval-tokens 64")
    assert result["authors_code"]["files_sha256"] == {  # the files in the checkout, named by their digest
        name: hashlib.sha256(f"# {name}\n".encode()).hexdigest() for name in crosscheck_wanda.AUTHORS_FILES}
    assert result["authors_code"]["commit"] is None  # not a git checkout
    dense, two_four, unstructured, sparsegpt = result["results"]
    assert [row["run"] for row in result["results"]] == ["dense"] + [name for name, _, _ in crosscheck_wanda.RUNS]
    assert dense["relative_difference"] == 0.0 and "masks" not in dense
    for row in (unstructured, sparsegpt):
        assert row["masks"]["fraction"] == 1.0 and row["masks"]["first_differing"] is None
        assert row["pyprune"]["sparsity"] == row["authors"]["sparsity"] == 0.5
        assert row["relative_difference"] == row["pyprune"]["perplexity"] / 2.0 - 1.0
    first = two_four["masks"]["first_differing"]
    assert first["layer"] == "model.layers.0.self_attn.q_proj" and first["differing"] == 4
    assert first["tied"] <= 4 and two_four["masks"]["identical"] == two_four["masks"]["total"] - 4
    text = output.with_suffix(".md").read_text()
    assert text == crosscheck_wanda.markdown(result) and "`model.layers.0.self_attn.q_proj`: 4 entries" in text
    assert "| sparsegpt 2:4 | " in text and "| 100% (" in text
    assert "crosscheck-wanda: wanda 2:4: perplexity " in capsys.readouterr().out
