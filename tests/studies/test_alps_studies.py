"""The ``alps-layers`` and ``crosscheck-alps`` studies at tiny scale: each column is the method its
header names (pyprune's SparseGPT and ALPS prune the same layer to the same error, magnitude keeps
the largest |W|·‖X_j‖), the authors' side is the checkout's ``alps.py`` run with its CUDA moves
mapped to the CPU, a rerun resumes (alps-layers) or replaces (crosscheck-alps)."""
import copy
import hashlib
import json
import math

import pytest
import torch

import pyprune.methods
from pyprune import cli, studies
from pyprune.inputs import data
from pyprune.inputs.models import load_model
from pyprune.methods.sparsegpt import _Hessian
from pyprune.patterns import NM, Unstructured
from pyprune.runtime import engine
from pyprune.runtime.layer_solver import normalise, reconstruction_error
from pyprune.studies import alps_layers, crosscheck_alps

Q = "self_attn.q_proj"


def _block0_q(model_dir, nsamples, seqlen):
    """Block 0's dense q_proj, the SparseGPT Hessian statistics of its inputs on the calibration,
    and its normalised problem (H, Wn, scale)."""
    model, tokenizer = load_model(model_dir)
    calib = data.calibration_samples(tokenizer, "emma", nsamples=nsamples, seqlen=seqlen, seed=0)
    q = engine.block_linears(engine.decoder_blocks(model)[0])[Q]
    stats = _Hessian(q.in_features, "cpu")
    handle = q.register_forward_hook(lambda m, args, out: stats.add(args[0]))
    with torch.no_grad():
        model(calib)
    handle.remove()
    return q, stats, normalise(stats.H, q.weight.detach().float(), 0.01)


def _pruned(linear, stats, method, pattern):
    """``linear``'s weight after pyprune's ``method`` (at its defaults) pruned a copy of it from ``stats``."""
    pruned = copy.deepcopy(linear)
    pyprune.methods.get(method).prune_layer(pruned, copy.deepcopy(stats), pattern)
    return pruned.weight.detach()


def _magnitude(W, pattern):
    """W with its largest |W| kept: per tensor, or per N:M group."""
    if isinstance(pattern, NM):
        groups = W.abs().reshape(-1, pattern.m)
        keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(pattern.n, dim=1).indices, True)
        return W * keep.reshape(W.shape)
    kept = W.numel() - round(pattern.sparsity * W.numel())
    keep = torch.zeros(W.numel(), dtype=torch.bool)
    keep[W.abs().flatten().topk(kept).indices] = True
    return W * keep.reshape(W.shape)


def test_alps_layers_columns_are_the_methods_they_name_and_a_rerun_resumes(tiny_model_dir, tmp_path):
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "layers.json"
    result = studies.run("alps-layers", str(output), model=model_dir, block=0, layers=[Q, "mlp.up_proj"],
                         patterns=["0.5", "2:4"])
    assert result == json.loads(output.read_text())
    assert output.with_suffix(".md").read_text() == alps_layers.markdown(result)
    assert model_dir in output.with_suffix(".md").read_text().splitlines()[0]  # the model run, not the default
    assert result["settings"] == {"calibration": "64 x 256 tokens of emma (seed 0)", "block": 0, "model": model_dir}
    assert [(r["layer"], r["pattern"]) for r in result["rows"]] == [
        (Q, "unstructured 0.5"), (Q, "2:4"), ("mlp.up_proj", "unstructured 0.5"), ("mlp.up_proj", "2:4")]
    q, stats, (H, Wn, scale) = _block0_q(model_dir, 64, 256)
    for row, pattern in zip(result["rows"][:2], (Unstructured(0.5, "tensor"), NM(2, 4))):
        for column, method in (("sparsegpt", "sparsegpt"), ("alps", "alps")):
            weight = _pruned(q, stats, method, pattern)
            assert math.isclose(row[column], reconstruction_error(H, Wn, weight * scale), rel_tol=1e-3), column
        # magnitude on the normalised weights: |W_ij|·‖X_j‖ (Wn = W · scale)
        assert math.isclose(row["magnitude"], reconstruction_error(H, Wn, _magnitude(Wn, pattern)), rel_tol=1e-5)
        assert row["alps"] <= row["alps_admm"] and row["iterations"] >= 1
    more = studies.run("alps-layers", str(output), model=model_dir, block=0, layers=[Q, "mlp.up_proj"],
                       patterns=["0.5", "2:4", "4:8"])
    assert more["rows"][:4] == result["rows"]  # the rows that ran stay as they were, timings included
    assert [(r["layer"], r["pattern"]) for r in more["rows"][4:]] == [(Q, "4:8"), ("mlp.up_proj", "4:8")]
    kept = output.read_text()
    with pytest.raises(ValueError, match="was made with other settings: block 0 \\(now 1\\)"):
        studies.run("alps-layers", str(output), model=model_dir, block=1, layers=[Q], patterns=["0.5"])
    assert output.read_text() == kept  # a file of other settings is never overwritten


def test_alps_layers_refuses_a_block_or_layer_the_model_lacks(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="option block of study 'alps-layers' must be below the model's 2 decoder "
                                         "blocks; got 2"):
        studies.run("alps-layers", str(tmp_path / "x.json"), model=str(tiny_model_dir[0]), block=2)
    with pytest.raises(ValueError, match="option layers of study 'alps-layers': mlp.w1 is not a linear of block 0; "
                                         "allowed: self_attn.q_proj"):
        studies.run("alps-layers", str(tmp_path / "x.json"), model=str(tiny_model_dir[0]), block=0,
                    layers=["mlp.w1"])
    assert not (tmp_path / "x.json").exists()


#: A stand-in for the authors' alps.py: their class and call signatures, magnitude pruning inside,
#: and their hard-coded CUDA moves (which fail on a CPU-only torch unless the study maps them).
FAKE_ALPS = '''
import torch

dev = "cuda:0"
calls = []


class ALPS_prune:
    def __init__(self, layer, nsamples, seqlen):
        self.layer, self.rows = layer, 0
        calls.append(("init", nsamples, seqlen))

    def add_batch(self, inp, out):
        self.rows += inp.reshape(-1, inp.shape[-1]).shape[0]

    def ALPS_admm(self, sp, nm_n, nm_m, rho):
        W = self.layer.weight.data.clone().to("cuda:0")
        torch.cuda.synchronize()
        if nm_n:
            groups = W.abs().reshape(-1, nm_m)
            keep = torch.zeros_like(groups).scatter_(1, groups.topk(nm_n, dim=1).indices, 1.0).reshape(W.shape)
        else:
            keep = torch.zeros(W.numel())
            keep[W.abs().flatten().topk(W.numel() - round(sp * W.numel())).indices] = 1.0
            keep = keep.reshape(W.shape)
        self.layer.weight.data = W * keep
        calls.append(("admm", self.rows, sp, nm_n, nm_m, rho))
'''


def test_crosscheck_alps_compares_the_checkouts_alps_py_with_pyprunes(tiny_model_dir, tmp_path, monkeypatch,
                                                                      capsys):
    repo = tmp_path / "ALPS"
    repo.mkdir()
    (repo / "alps.py").write_text(FAKE_ALPS)
    loaded = []
    authors_module = crosscheck_alps.authors_module
    monkeypatch.setattr(crosscheck_alps, "authors_module", lambda path: loaded.append(authors_module(path))
                        or loaded[-1])
    model_dir = str(tiny_model_dir[0])
    output = tmp_path / "crosscheck.json"
    to = torch.Tensor.to
    result = studies.run("crosscheck-alps", str(output), alps_repo=str(repo), model=model_dir, block=0)
    assert result == json.loads(output.read_text())
    assert output.with_suffix(".md").read_text() == crosscheck_alps.markdown(result)
    assert model_dir in output.with_suffix(".md").read_text().splitlines()[0]  # the model run, not the default
    assert result["command"] == f"pyprune study crosscheck-alps --alps-repo {repo} --model {model_dir} --block 0"
    assert result["authors_code"] == {"repository": "mazumder-lab/ALPS", "commit": None, "files_sha256": {
        "alps.py": hashlib.sha256(FAKE_ALPS.encode()).hexdigest()}}
    assert [(r["layer"], r["pattern"]) for r in result["rows"]] == [
        (Q, "unstructured 0.7"), (Q, "2:4"), ("mlp.up_proj", "unstructured 0.7"), ("mlp.up_proj", "2:4")]
    # their ALPS_admm as their llama.py calls it, on all 16 x 256 calibration rows; CUDA moves ran on the CPU
    assert loaded[0].calls == [("init", 16, 256), ("admm", 16 * 256, 0.7, 0, 0, 0.1),
                               ("init", 16, 256), ("admm", 16 * 256, 0.5, 2, 4, 0.1)] * 2
    assert torch.Tensor.to is to  # the mapping ended with their code
    q, stats, (H, Wn, scale) = _block0_q(model_dir, 16, 256)
    for row, pattern in zip(result["rows"][:2], crosscheck_alps.PATTERNS):
        authors = _magnitude(q.weight.detach(), pattern)  # the stand-in prunes by |W|
        ours = _pruned(q, stats, "alps", pattern)
        assert math.isclose(row["error_authors"], reconstruction_error(H, Wn, authors * scale), rel_tol=1e-5)
        assert math.isclose(row["error_pyprune"], reconstruction_error(H, Wn, ours * scale), rel_tol=1e-3)
        assert row["mask_agreement"] == pytest.approx(float(((authors != 0) == (ours != 0)).float().mean()), abs=1e-3)
        pruned = round(pattern.sparsity * q.weight.numel())
        assert row["sparsity_authors"] == row["sparsity_pyprune"] == pytest.approx(pruned / q.weight.numel())
    assert "crosscheck-alps: self_attn.q_proj 2:4: error " in capsys.readouterr().out
    studies.run("crosscheck-alps", str(output), alps_repo=str(repo), model=model_dir, block=0,
                layers=["mlp.down_proj"])  # no resume: the file is replaced
    assert [r["layer"] for r in json.loads(output.read_text())["rows"]] == ["mlp.down_proj"] * 2


def test_crosscheck_alps_without_a_checkout_exits_2_at_once(tmp_path, capsys):
    assert cli.main(["study", "crosscheck-alps"]) == 2
    assert "option alps_repo of study 'crosscheck-alps' is required" in capsys.readouterr().err
    assert cli.main(["study", "crosscheck-alps", "--alps-repo", str(tmp_path)]) == 2
    assert f"{str(tmp_path)!r} is not a checkout of mazumder-lab/ALPS (no alps.py)" in capsys.readouterr().err
