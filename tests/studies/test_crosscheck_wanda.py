"""The ``crosscheck-wanda`` study: its inputs are checked before any heavy work (one line, status 2
on the command line), and its mask comparison says what its table shows."""
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
