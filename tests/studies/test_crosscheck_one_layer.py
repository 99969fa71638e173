"""The ``crosscheck-ria`` and ``crosscheck-dsnot`` studies at tiny scale, against a stand-in checkout:
the authors' function is imported from ``lib/prune.py`` with its package's relative imports, gets the
layer's recorded inputs one sequence per forward through the one-layer model (its ``get_loaders``
replaced), its CUDA calls run on the CPU, and each row compares the stand-in's mask with pyprune's."""
import json

import pytest
import torch

from pyprune import cli, studies
from pyprune.studies import crosscheck_one_layer

FAKE_LAYERWRAPPER = '''
import torch


def magnitude_mask(weight, prune_n, prune_m, sparsity):
    """True where pruned: the smallest |W| per tensor, or prune_n of every prune_m."""
    if prune_n:
        groups = weight.abs().reshape(-1, prune_m)
        pruned = torch.zeros_like(groups, dtype=torch.bool)
        pruned.scatter_(1, groups.topk(prune_n, dim=1, largest=False).indices, True)
        return pruned.reshape(weight.shape)
    threshold = torch.sort(weight.abs().flatten().cuda())[0][int(weight.numel() * sparsity)]
    return weight.abs() < threshold
'''

FAKE_PRUNE = '''
import torch
from torch import nn

from .layerwrapper import magnitude_mask

CALLS = []


def get_loaders(*args, **kwargs):
    raise RuntimeError("the study replaces the loader")


def _run(args, model, prune_n, prune_m, method):
    loader, _ = get_loaders("c4", nsamples=args.nsamples)
    layer = model.model.layers[0]
    names = [name for name, module in layer.named_modules() if type(module) is nn.Linear]
    seen = []
    handle = layer.get_submodule(names[0]).register_forward_hook(lambda m, a, o: seen.append(tuple(a[0].shape)))
    for batch, _ in loader:
        layer(batch.to("cuda:0"), attention_mask=None, position_ids=None)
    handle.remove()
    weight = layer.get_submodule(names[0]).weight
    weight.data[magnitude_mask(weight.data, prune_n, prune_m, args.sparsity_ratio)] = 0
    CALLS.append((method, names, len(seen), seen[0], prune_n, prune_m, args.sparsity_ratio))
    torch.cuda.empty_cache()


def prune_ria(args, model, tokenizer, device, prune_n=0, prune_m=0):
    _run(args, model, prune_n, prune_m, ("ria", args.a, args.reallocation, args.lsa, args.per_outneuron))


def prune_DSnoT(args, model, tokenizer, device, prune_n=0, prune_m=0):
    _run(args, model, prune_n, prune_m, ("dsnot", args.initial_method, args.max_cycle_time, args.update_threshold,
                                         args.skip_layer))
'''


def _checkout(tmp_path, name):
    repo = tmp_path / name
    (repo / "lib").mkdir(parents=True)
    (repo / "lib" / "prune.py").write_text(FAKE_PRUNE)
    (repo / "lib" / "layerwrapper.py").write_text(FAKE_LAYERWRAPPER)
    return repo


@pytest.mark.parametrize("study,option", [("crosscheck-ria", "ria_repo"), ("crosscheck-dsnot", "dsnot_repo")])
def test_the_authors_function_runs_on_the_layers_recorded_inputs_and_is_compared_with_pyprune(
        study, option, tiny_model_dir, tmp_path):
    repo = _checkout(tmp_path, "authors")
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / f"{study}.json"
    cuda, to = torch.Tensor.cuda, torch.Tensor.to
    result = studies.run(study, str(output), model=model_dir, block=1, layers=["self_attn.o_proj"],
                         **{option: str(repo)})
    assert torch.Tensor.cuda is cuda and torch.Tensor.to is to  # the mapping ended with their code
    assert result == json.loads(output.read_text())
    assert output.with_suffix(".md").read_text() == studies.get(study, **{option: str(repo)}).markdown(result)
    assert model_dir in output.with_suffix(".md").read_text().splitlines()[0]  # the model run, not the default
    assert result["authors_code"]["commit"] is None and set(result["authors_code"]["files_sha256"]) == {
        "lib/prune.py", "lib/layerwrapper.py"}
    authors = __import__(f"authors_{option[:-5]}.prune", fromlist=["CALLS"])
    cls = studies.STUDIES[study]
    assert [row["pattern"] for row in result["rows"]] == [label for label, _, _ in cls.patterns]
    for call, (_, pattern, _) in zip(authors.CALLS[-len(cls.patterns):], cls.patterns):
        method, names, forwards, shape, prune_n, prune_m, sparsity = call
        # one calibration sequence per forward, 16 x 256, through the layer under its own name
        assert names == ["self_attn.o_proj"] and forwards == 16 and shape == (1, 256, 64)
        assert (prune_n, prune_m) == ((2, 4) if hasattr(pattern, "m") else (0, 0))
        assert sparsity == pytest.approx(pattern.sparsity)
        assert method == (("ria", 0.5, method[2], method[2], False) if study == "crosscheck-ria"
                          else ("dsnot", "wanda", 50, 0.1, "no_skip"))
    for row in result["rows"]:
        assert 0.5 <= row["mask_agreement"] < 1.0  # magnitude against RIA / DSnoT: close, not equal
        target = 0.7 if "0.7" in row["pattern"] else 0.5
        assert row["sparsity_pyprune"] == pytest.approx(target, abs=0.01)  # per row of 64


def test_a_crosscheck_without_a_checkout_exits_2_at_once(tmp_path, capsys):
    assert cli.main(["study", "crosscheck-ria"]) == 2
    assert "option ria_repo of study 'crosscheck-ria' is required" in capsys.readouterr().err
    assert cli.main(["study", "crosscheck-dsnot", "--dsnot-repo", str(tmp_path)]) == 2
    assert f"{str(tmp_path)!r} is not a checkout of zyxxmu/DSnoT (no lib/prune.py, lib/layerwrapper.py)" in \
        capsys.readouterr().err
    assert crosscheck_one_layer.AUTHORS_FILES == ("lib/prune.py", "lib/layerwrapper.py")
