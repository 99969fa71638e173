"""Pruning with the decoder blocks offloaded to disk (pyprune.io.offload) gives the model pruned in
memory, to the bit; a run whose estimated memory exceeds what is available is refused before it
starts (pyprune.io.memory); bad offload arguments are refused naming them."""
import os
import re

import pytest
import torch

import pyprune
from pyprune import cli
from pyprune.io import memory
from pyprune.io import offload
from pyprune.evaluation.perplexity import perplexity
from pyprune.inputs.models import load_model
from pyprune.patterns import Structured
from pyprune.nn import anatomy
from tests.helpers import FAMILIES, WORDS, random_tokens, tiny_decoder, tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A saved tiny Llama (3 blocks, tied embeddings, fp32) with its tokenizer."""
    directory = tmp_path_factory.mktemp("source")
    tiny_llama(seed=0, layers=3, tie_word_embeddings=True).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def _state(model):
    return {name: tensor for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("method,dtype", [("wanda", torch.float32), ("sparsegpt", torch.float32),
                                          ("magnitude", torch.bfloat16)])
def test_offloaded_prune_is_the_in_memory_prune(source, tmp_path, method, dtype):
    calib = random_tokens((4, 16), vocab=27, seed=1)
    in_memory, _ = load_model(source, dtype=dtype)
    report = pyprune.prune(in_memory, method, "2:4", calib, progress=False)
    offloaded, tokenizer = load_model(source, dtype=dtype, offload_dir=tmp_path / "offload")
    offloaded_report = pyprune.prune(offloaded, method, "2:4", calib, progress=False)
    assert all(p.is_meta for p in offloaded.model.layers.parameters())  # no block left in memory
    pyprune.save(offloaded, tokenizer, tmp_path / "out", report=offloaded_report)
    saved, _ = pyprune.load(tmp_path / "out")
    expected, got = _state(in_memory), _state(saved)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == dtype and torch.equal(got[name], tensor), name
    assert offloaded_report["sparsity"] == report["sparsity"] == 0.5
    assert offloaded_report["layers"] == report["layers"]
    tokens = random_tokens((96,), vocab=27, seed=2)
    assert perplexity(saved, tokens, 32, progress=False) == perplexity(in_memory, tokens, 32, progress=False)


def _needs(source):
    """(bytes of the whole model's weights, bytes with one block in memory) of ``source``."""
    model = offload.skeleton(str(source), torch.float32)
    return memory.weight_bytes(model, offloaded=False), memory.weight_bytes(model, offloaded=True)


def test_a_model_larger_than_the_memory_is_refused_before_loading(source, tmp_path, monkeypatch):
    whole, one_block = _needs(source)
    assert one_block < whole
    monkeypatch.setattr(memory, "available_bytes", lambda: memory.RUNTIME + (whole + one_block) // 2)
    with pytest.raises(memory.NotEnoughMemory) as error:
        load_model(source)
    message = str(error.value)
    assert "\n" not in message and f"loading {source}" in message
    assert f"needs about {memory.gib(memory.RUNTIME + whole)}" in message and "offload_dir" in message
    load_model(source, offload_dir=tmp_path / "offload")  # one block fits


def test_an_offloaded_prune_that_does_not_fit_is_refused_before_any_block(source, tmp_path, monkeypatch):
    model, _ = load_model(source, offload_dir=tmp_path / "offload")
    calib = random_tokens((4, 16), vocab=27, seed=1)
    need = memory.prune_need(model, pyprune.methods.get("sparsegpt"), 4, 16, 8)
    monkeypatch.setattr(memory, "available_bytes", lambda: need.total - memory.resident_bytes(model) - 1)
    with pytest.raises(memory.NotEnoughMemory, match=r"pruning with sparsegpt needs about .* available$"):
        pyprune.prune(model, "sparsegpt", "2:4", calib, progress=False)
    assert os.listdir(tmp_path / "offload") == []
    monkeypatch.setattr(memory, "available_bytes", lambda: need.total - memory.resident_bytes(model))
    pyprune.prune(model, "sparsegpt", "2:4", calib, progress=False)
    assert len(os.listdir(tmp_path / "offload")) == 3


@pytest.mark.parametrize("method,reason", [("taylor", "gradients through the whole model"),
                                           ("copal", "dense weights across calls")])
def test_methods_that_need_the_whole_model_refuse_an_offloaded_one(source, tmp_path, method, reason):
    model, _ = load_model(source, offload_dir=tmp_path / "offload")
    pattern = Structured(0.25) if method == "taylor" else "2:4"
    with pytest.raises(ValueError, match=f"method '{method}' cannot prune an offloaded model: .*{reason}"):
        pyprune.prune(model, method, pattern, random_tokens((2, 16), vocab=27), progress=False)
    assert os.listdir(tmp_path / "offload") == []


def test_an_accumulating_method_refuses_an_offloaded_model(source, tmp_path):
    model, _ = load_model(source, offload_dir=tmp_path / "offload")
    runner = pyprune.methods.get("wanda").accumulate_across_calls()
    with pytest.raises(ValueError, match="cannot prune an offloaded model: .*accumulate_across_calls"):
        pyprune.prune(model, runner, "2:4", random_tokens((2, 16), vocab=27), progress=False)


def test_bad_offload_arguments_are_refused(source, tmp_path):
    with pytest.raises(TypeError, match="offload_dir must be a directory path"):
        load_model(source, offload_dir=3)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="offload_dir .* exists and is not a directory"):
        load_model(source, offload_dir=tmp_path / "file")
    with pytest.raises(ValueError, match="offload_dir works on the CPU; got device 'meta'"):
        load_model(source, device="meta", offload_dir=tmp_path / "offload")
    assert not (tmp_path / "offload").exists()
    model, _ = load_model(source, offload_dir=tmp_path / "offload")
    with pytest.raises(ValueError, match="perplexity needs the whole model in memory"):
        perplexity(model, random_tokens((64,), vocab=27), 32, progress=False)


def test_the_cli_offloaded_prune_is_the_in_memory_prune(source, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(400)))
    argv = ["prune", "--model", str(source), "--method", "sparsegpt", "--pattern", "2:4", "--calib", str(text),
            "--nsamples", "4", "--seqlen", "16", "--quiet", "--output"]
    assert cli.main(argv + [str(tmp_path / "in-memory")]) == 0
    assert cli.main(argv + [str(tmp_path / "offloaded"), "--offload"]) == 0
    expected, got = _state(pyprune.load(tmp_path / "in-memory")[0]), _state(pyprune.load(tmp_path / "offloaded")[0])
    assert got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())
    assert pyprune.io.read_manifest(tmp_path / "offloaded")["report"]["offload"] is True
    assert sorted(os.listdir(tmp_path)) == ["in-memory", "offloaded", "text.txt"]  # the offload directory is gone


def test_the_cli_refuses_a_prune_that_does_not_fit_before_loading(source, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(memory, "available_bytes", lambda: memory.RUNTIME // 2)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr("pyprune.inputs.models.load_model", refuse)
    assert cli.main(["prune", "--model", str(source), "--method", "magnitude", "--pattern", "2:4",
                     "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.match(rf"pyprune prune: error: --model {re.escape(str(source))} with magnitude needs about "
                    r"[0-9.]+ GiB of memory \(weights .*\), 0\.3 GiB available; with --offload \(weights on "
                    r"disk, one block in memory\) it needs about [0-9.]+ GiB$", err), err
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def family_sources(tmp_path_factory):
    """A saved tiny model (2 blocks) with a tokenizer of every family the tests build; MoE experts are
    saved one tensor per expert, as transformers 5 writes them."""
    directories = {}
    for family in FAMILIES:
        directories[family] = tmp_path_factory.mktemp(family)
        tiny_decoder(family, layers=2).save_pretrained(directories[family])
        tiny_tokenizer().save_pretrained(directories[family])
    return directories


FAMILY_CASES = [(family, "2:4") for family in FAMILIES] + [("mixtral", "0.5"), ("qwen2_moe", "0.5")]


@pytest.mark.parametrize("family,pattern", FAMILY_CASES)
def test_an_offloaded_prune_is_the_in_memory_prune_on_every_family(family_sources, tmp_path, family, pattern):
    """Each block's tensors are read (MoE: per-expert tensors fused as the model holds them): Wanda gives
    exactly the in-memory masks and weights, and the saved model loads (pyprune.load, from_pretrained)
    with identical logits."""
    calib = random_tokens((4, 16), seed=1)
    in_memory, _ = load_model(family_sources[family])
    report = pyprune.prune(in_memory, "wanda", pattern, calib, progress=False)
    offloaded, _ = load_model(family_sources[family], offload_dir=tmp_path / "offload")
    offloaded_report = pyprune.prune(offloaded, "wanda", pattern, calib, progress=False)
    assert all(p.is_meta for block in anatomy.decoder_blocks(offloaded) for p in block.parameters())
    assert offloaded_report["layers"] == report["layers"] and offloaded_report["sparsity"] == report["sparsity"]
    pyprune.save(offloaded, None, tmp_path / "out")
    saved, _ = pyprune.load(tmp_path / "out")
    expected, got = _state(in_memory), _state(saved)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())
    tokens = random_tokens((2, 12), seed=2)
    from transformers import AutoModelForCausalLM
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(saved(input_ids=tokens).logits, in_memory(input_ids=tokens).logits)
        assert torch.equal(plain(input_ids=tokens).logits, in_memory(input_ids=tokens).logits)
