"""ALPS on a tiny random Llama: exact patterns, the refit it reports, its options and CLI flags."""
import pytest

import pyprune
import pyprune.methods
from pyprune import cli
from pyprune.ops.conventions import kept_count
from pyprune.runtime import engine
from pyprune.patterns import Unstructured, parse
from tests.helpers import random_tokens, tiny_llama


def _linears(model):
    for block in model.model.layers:
        yield from engine.block_linears(block).values()


@pytest.mark.parametrize("pattern", ["2:4", "0.7", "0.5/row"])
def test_alps_prunes_every_linear_to_the_exact_pattern(pattern):
    model = tiny_llama()
    spec, _, scope = pattern.partition("/")
    target = parse(spec)
    if scope:
        target = Unstructured(target.sparsity, scope)
    report = pyprune.prune(model, "alps", target, random_tokens((4, 16)), progress=False)
    linears = list(_linears(model))
    assert report["admm"]["layers"] == len(linears) == 2 * 7
    for linear in linears:
        kept = linear.weight != 0
        if spec == "2:4":
            assert bool((kept.reshape(-1, 4).sum(dim=1) == 2).all())
        elif scope == "row":
            assert bool((kept.sum(dim=1) == kept_count(linear.in_features, 0.5)).all())
        else:  # ALPS's own default: the k largest of the whole layer
            assert int(kept.sum()) == kept_count(linear.weight.numel(), 0.7)
    assert report["scope"] == (scope or ("tensor" if spec == "0.7" else None))
    assert 0 < report["admm"]["error_pcg_mean"] < report["admm"]["error_admm_mean"] < 1


def test_alps_options_are_the_authors_defaults_and_checked():
    settings = pyprune.methods.get("alps").settings
    assert (settings["rho"], settings["admm_iterations"], settings["rho_interval"], settings["min_iterations"],
            settings["pcg_iterations"], settings["pcg_rtol"], settings["percdamp"]) == (0.1, 300, 3, 30, 10, 1e-4, 0.01)
    with pytest.raises(ValueError, match="option rho of method 'alps' must be > 0; got 0"):
        pyprune.methods.get("alps", rho=0)
    with pytest.raises(ValueError, match="must have min_iterations <= admm_iterations .*got min_iterations=30, "
                                         "admm_iterations=5"):
        pyprune.methods.get("alps", admm_iterations=5)
    assert pyprune.methods.get("alps", admm_iterations=5, min_iterations=5).settings["admm_iterations"] == 5


def test_alps_cli_flags_come_from_its_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["prune", "--method", "alps", "--help"])
    text = capsys.readouterr().out
    for flag in ("--rho", "--admm-iterations", "--rho-interval", "--min-iterations", "--pcg-iterations",
                 "--pcg-rtol", "--percdamp"):
        assert flag in text
