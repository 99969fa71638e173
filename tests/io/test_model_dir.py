"""pyprune.save / pyprune.load: exact round trips of pruned models, plain from_pretrained when the
shapes fit the config, and atomic writes."""
import json
import os

import pytest
import torch

import pyprune
from pyprune.patterns import Structured
from tests.helpers import random_tokens, tiny_llama


def _llama(hidden=64, tied=False, layers=3):
    model = tiny_llama(hidden=hidden, layers=layers, heads=8, kv_heads=4, intermediate=128)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _calib():
    return random_tokens((4, 16))


def _tokens():
    return random_tokens((2, 24), seed=7)


def _logits(model):
    with torch.no_grad():
        return model(input_ids=_tokens()).logits


def _from_pretrained(directory):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_non_uniform_round_trip_is_exact(tmp_path, tied):
    model = _llama(tied=tied)
    report = pyprune.prune(model, "taylor", Structured(0.25), _calib(), progress=False, first_layer=1)
    assert report["config_compatible"] is False
    out = tmp_path / "pruned"
    manifest = pyprune.save(model, None, out, report)
    assert manifest["config_compatible"] is False
    saved = json.loads((out / "pyprune.json").read_text())
    assert saved["config_compatible"] is False
    assert [layer["heads"] for layer in saved["layers"]] == [8, 6, 6]
    assert saved["layers"][1]["shapes"]["mlp.down_proj"] == [64, 96]
    assert saved["report"]["method"] == "taylor"

    loaded, tokenizer = pyprune.load(out)
    assert tokenizer is None
    assert torch.equal(_logits(loaded), _logits(model))
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in model.parameters())
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    with pytest.raises(Exception):
        _from_pretrained(out)  # the config keeps the dense sizes: only pyprune.load can build it


@pytest.mark.parametrize("tied", [False, True])
def test_uniform_loads_with_plain_from_pretrained(tmp_path, tied):
    model = _llama(hidden=96, tied=tied)
    report = pyprune.prune(model, "taylor", Structured(0.25, uniform=True), _calib(), progress=False)
    assert report["config_compatible"] is True
    out = tmp_path / "pruned"
    pyprune.save(model, None, out, report)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"],
            config["head_dim"]) == (6, 3, 96, 12)
    expected = _logits(model)
    assert torch.equal(_logits(_from_pretrained(out)), expected)
    assert torch.equal(_logits(pyprune.load(out)[0]), expected)


def test_compatible_shapes_from_a_non_uniform_run_are_saved_as_a_config(tmp_path):
    model = _llama(hidden=96)
    report = pyprune.prune(model, "taylor", Structured(0.25), _calib(), progress=False)
    assert report["config_compatible"] is True  # every layer chose 3 KV groups of 2 heads
    pyprune.save(model, None, tmp_path / "out")
    assert torch.equal(_logits(_from_pretrained(tmp_path / "out")), _logits(model))


def test_nm_pruned_dense_shaped_model_round_trips(tmp_path):
    model = _llama()
    pyprune.prune(model, "magnitude", "2:4", progress=False)
    manifest = pyprune.save(model, None, tmp_path / "nm")
    assert manifest["config_compatible"] is True
    loaded, _ = pyprune.load(tmp_path / "nm")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(_logits(loaded), _logits(model))
    assert torch.equal(_logits(_from_pretrained(tmp_path / "nm")), _logits(model))


def test_bf16_round_trip_keeps_dtype(tmp_path):
    from transformers import AutoModelForCausalLM
    dense = _llama()
    # built in bf16 as from_pretrained(dtype=bf16) does: the RoPE buffer stays fp32 (a plain
    # .to(bf16) would round it too, and a non-persistent buffer is not saved)
    model = AutoModelForCausalLM.from_config(dense.config, dtype=torch.bfloat16).eval()
    model.load_state_dict(dense.state_dict())
    pyprune.prune(model, "taylor", Structured(0.25), _calib(), progress=False, last_layer=1)
    pyprune.save(model, None, tmp_path / "bf16")
    loaded, _ = pyprune.load(tmp_path / "bf16")
    assert loaded.model.layers[0].mlp.gate_proj.weight.dtype == torch.bfloat16
    assert torch.equal(_logits(loaded), _logits(model))
    loaded32, _ = pyprune.load(tmp_path / "bf16", dtype=torch.float32)
    assert loaded32.model.layers[0].mlp.gate_proj.weight.dtype == torch.float32


def test_tokenizer_is_saved_and_loaded(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(128)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")
    model = _llama()
    pyprune.save(model, tokenizer, tmp_path / "tok")
    _, loaded = pyprune.load(tmp_path / "tok")
    assert loaded is not None and loaded("t5 t7")["input_ids"] == [5, 7]


def test_refuses_a_non_empty_directory(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not empty"):
        pyprune.save(_llama(), None, out)
    assert os.listdir(out) == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp dir left behind
    with pytest.raises(FileExistsError, match="holds files pyprune did not write"):
        pyprune.save(_llama(), None, out, overwrite=True)  # overwrite replaces only a directory pyprune saved
    assert os.listdir(out) == ["keep.txt"]
    saved = tmp_path / "saved"
    pyprune.save(_llama(), None, saved)
    (saved / "keep.txt").write_text("stale")
    pyprune.save(_llama(), None, saved, overwrite=True)
    assert "keep.txt" not in os.listdir(saved) and "pyprune.json" in os.listdir(saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "saved"]


def test_saved_files_are_readable_by_the_group_and_others(tmp_path):
    """Every file pyprune.save writes has the umask's mode (safetensors alone would leave the weights 0600)."""
    previous = os.umask(0o022)
    try:
        pyprune.save(tiny_llama(), None, tmp_path / "out")
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def test_an_empty_directory_is_filled(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    pyprune.save(_llama(), None, out)
    assert (out / "pyprune.json").is_file()


def test_a_file_is_not_replaced(tmp_path):
    out = tmp_path / "file"
    out.write_text("x")
    with pytest.raises(FileExistsError):
        pyprune.save(_llama(), None, out, overwrite=True)
    assert out.read_text() == "x"


@pytest.mark.parametrize("overwrite", [False, True])
def test_failure_mid_save_leaves_no_output(tmp_path, monkeypatch, overwrite):
    model = _llama()
    out = tmp_path / "out"
    if overwrite:
        out.mkdir()
        (out / "old.txt").write_text("old")
        (out / "pyprune.json").write_text("{}")  # a directory pyprune saved: overwrite may replace it

    def broken(self, directory, **kwargs):
        (open(os.path.join(directory, "model.safetensors"), "wb")).write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        pyprune.save(model, None, out, overwrite=overwrite)
    if overwrite:
        assert sorted(os.listdir(out)) == ["old.txt", "pyprune.json"]  # the old directory is untouched
        assert [p.name for p in tmp_path.iterdir()] == ["out"]
    else:
        assert list(tmp_path.iterdir()) == []


def test_load_rejects_missing_or_mismatched(tmp_path):
    with pytest.raises(FileNotFoundError):
        pyprune.load(tmp_path / "nothing")
    model = _llama()
    pyprune.prune(model, "taylor", Structured(0.25), _calib(), progress=False, first_layer=1)
    pyprune.save(model, None, tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / "pyprune.json").read_text())
    manifest["layers"][1]["intermediate"] = 100
    manifest["layers"][1]["shapes"]["mlp.gate_proj"] = [100, 64]
    manifest["layers"][1]["shapes"]["mlp.up_proj"] = [100, 64]
    manifest["layers"][1]["shapes"]["mlp.down_proj"] = [64, 100]
    (tmp_path / "m" / "pyprune.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="shape"):
        pyprune.load(tmp_path / "m")


@pytest.mark.slow
@pytest.mark.parametrize("uniform", [False, True])
def test_smollm2_pruned_round_trip(tmp_path, uniform, smollm2_copy):
    model, tokenizer = smollm2_copy
    calib = random_tokens((4, 32), vocab=model.config.vocab_size)
    report = pyprune.prune(model, "taylor", Structured(0.2, uniform=uniform), calib, progress=False,
                           first_layer=0 if uniform else 1)
    assert report["config_compatible"] is uniform
    pyprune.save(model, tokenizer, tmp_path / "out", report)
    tokens = torch.tensor([tokenizer("It is a truth universally acknowledged")["input_ids"]])
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
        loaded, loaded_tokenizer = pyprune.load(tmp_path / "out")
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied embeddings stay tied
        assert loaded_tokenizer("It is")["input_ids"] == tokenizer("It is")["input_ids"]
        assert torch.equal(loaded(input_ids=tokens).logits, expected)
        if uniform:
            assert torch.equal(_from_pretrained(tmp_path / "out")(input_ids=tokens).logits, expected)


#: a checkpoint key transformers 5 writes for expert 0 of block 0 (its original format), per MoE family
_SAVED_EXPERT_KEY = {"mixtral": "model.layers.0.block_sparse_moe.experts.0.w1.weight",
                     "qwen2_moe": "model.layers.0.mlp.experts.0.gate_proj.weight"}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_pruned_moe_round_trips_through_load_and_from_pretrained(tmp_path, family):
    """save_pretrained writes the fused experts one tensor per expert (the family's original names);
    pyprune.load converts them back as transformers does, so both loaders give identical logits and
    the experts keep their 2:4 pattern."""
    from safetensors import safe_open

    from pyprune.nn.measure import sparsity_report
    from tests.helpers import tiny_decoder
    model = tiny_decoder(family)
    pyprune.prune(model, "wanda", "2:4", _calib(), progress=False)
    pyprune.save(model, None, tmp_path / "moe")
    with safe_open(str(tmp_path / "moe" / "model.safetensors"), framework="pt") as handle:
        assert _SAVED_EXPERT_KEY[family] in handle.keys()
    loaded, _ = pyprune.load(tmp_path / "moe")
    assert torch.equal(_logits(loaded), _logits(model))
    assert torch.equal(_logits(_from_pretrained(tmp_path / "moe")), _logits(model))
    for got, want in zip(loaded.state_dict().items(), model.state_dict().items()):
        assert got[0] == want[0] and torch.equal(got[1], want[1])
    report = sparsity_report(loaded)
    assert report["nm_valid"]["2:4"] and any(".mlp.experts.3.down_proj" in layer["name"] for layer in report["layers"])


def test_a_checkpoint_in_the_model_s_own_names_still_loads(tmp_path):
    """Weights saved without transformers' conversion (fused experts under their model names) load as they are."""
    from tests.helpers import tiny_decoder
    model = tiny_decoder("mixtral")
    model.save_pretrained(tmp_path / "own", save_original_format=False)
    loaded, _ = pyprune.load(tmp_path / "own")
    assert torch.equal(_logits(loaded), _logits(model))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_sparsified_moe_round_trips_with_sparse_experts_and_plain_transformers_refuses_it(tmp_path, family):
    """sparsify_ turns an N:M-pruned MoE's nn.Linear layers into SparseLinear and its fused experts into
    SparseExperts; pyprune.json records them, pyprune.load rebuilds them (identical logits, compressed
    weights), and plain from_pretrained refuses the directory rather than load dense experts at random."""
    from pyprune.nn import SparseLinear, sparsify_
    from pyprune.nn.sparse import SparseExperts
    from tests.helpers import tiny_decoder
    model = tiny_decoder(family, layers=2)
    pyprune.prune(model, "wanda", "2:4", _calib(), progress=False)
    replaced = sparsify_(model)
    assert isinstance(model.model.layers[1].mlp.experts, SparseExperts)
    manifest = pyprune.save(model, None, tmp_path / "sparse-moe")
    assert manifest["sparse_experts"] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert set(manifest["sparse_layers"]) == set(replaced) and manifest["config_compatible"] is False
    loaded, _ = pyprune.load(tmp_path / "sparse-moe")
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, SparseLinear)
    assert isinstance(loaded.model.layers[1].mlp.experts, SparseExperts)
    got, want = loaded.state_dict(), model.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[name], tensor) for name, tensor in want.items())
    assert torch.equal(_logits(loaded), _logits(model))
    with pytest.raises(ValueError, match="pyprune.load"):
        _from_pretrained(tmp_path / "sparse-moe")
