"""The model card ``README.md`` of every format pyprune writes parses with ``huggingface_hub.ModelCard``
and states the base model (a hub id, with its license carried over from the base model's card), the
library, the tags, the pattern and measured sparsity, the evaluation the run measured, and how to load
it: plain ``from_pretrained`` where it can, ``pyprune.load`` and why where it cannot."""
import json

import pytest
from huggingface_hub import ModelCard

import pyprune
from pyprune import cli
from pyprune.inputs.models import load_model, resolve_model_dir
from pyprune.io import model_card, provenance, write_report
from pyprune.nn import sparsify_
from pyprune.patterns import Structured
from tests.helpers import WORDS, hub_snapshot, offline_hub, random_tokens, tiny_decoder, tiny_llama, tiny_tokenizer

COMMIT = "3" * 40
LICENSE_CARD = "---\nlicense: other\nlicense_name: tiny-terms\nlicense_link: LICENSE\n---\n# tiny\n"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-cache")
    hub_snapshot(root, "org/tiny", COMMIT, tiny_llama(hidden=64, heads=4, kv_heads=2), tiny_tokenizer(), ["main"],
                 LICENSE_CARD)
    hub_snapshot(root, "org/tiny-moe", COMMIT, tiny_decoder("mixtral", layers=2), tiny_tokenizer(), ["main"],
                 "---\nlicense: apache-2.0\n---\n")
    return root


@pytest.fixture
def hub(cache, monkeypatch):
    offline_hub(monkeypatch, cache)
    return cache


def _prune(repo, method, pattern, *, offload_dir=None, sparse=False, **method_options):
    model, tokenizer = load_model(repo, offload_dir=offload_dir)
    report = pyprune.prune(model, method, pattern, random_tokens((4, 16)), batch_size=4, progress=False,
                           **method_options)
    if sparse:
        assert sparsify_(model, pattern)
    return model, tokenizer, report


#: format -> (repo, method, pattern, keywords of _prune, whether plain from_pretrained reads it, why not)
FORMATS = {
    "plain safetensors (N:M zeros)": ("org/tiny", "wanda", "2:4", {}, True, None),
    "offloaded (one shard per block)": ("org/tiny", "magnitude", "2:4", {"offload_dir": True}, True, None),
    "uniform structured": ("org/tiny", "taylor", Structured(0.25, uniform=True), {}, True, None),
    "non-uniform structured": ("org/tiny", "taylor", Structured(0.25), {"last_layer": 0}, False, "different sizes"),
    "compressed 2:4 (SparseLinear)": ("org/tiny", "magnitude", "2:4", {"sparse": True}, False, "stored compressed"),
    "SliceGPT (residual rotations)": ("org/tiny", "slicegpt", Structured(0.25), {}, False, "shortcut rotations"),
    "MoE experts as SparseLinear": ("org/tiny-moe", "magnitude", "2:4", {"sparse": True}, False, "MoE experts"),
}


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_has_a_card_the_hub_parses(hub, tmp_path, name):
    repo, method, pattern, options, plain, why = FORMATS[name]
    if options.get("offload_dir"):
        options = dict(options, offload_dir=tmp_path / "offload")
    model, tokenizer, report = _prune(repo, method, pattern, **options)
    pyprune.save(model, tokenizer, tmp_path / "out", report)
    manifest = json.loads((tmp_path / "out" / "pyprune.json").read_text())
    assert manifest["config_compatible"] is plain

    card = ModelCard.load(tmp_path / "out" / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == repo and data["library_name"] == "pyprune"
    assert {"pruning", method, model_card._pattern_tag(str(report["pattern"]))} <= set(data["tags"])
    assert data["sparsity_pattern"] == str(report["pattern"])
    assert data["sparsity"] == pytest.approx(report["sparsity"], abs=1e-6) and data["sparsity"] > 0.05
    if repo == "org/tiny":
        assert (data["license"], data["license_name"], data["license_link"]) == ("other", "tiny-terms", "LICENSE")
    else:
        assert data["license"] == "apache-2.0"
    assert f"revision `{COMMIT}`" in card.text and "measured no evaluation" in card.text
    if plain:
        assert 'AutoModelForCausalLM.from_pretrained("out")' in card.text
        assert "A plain transformers checkpoint" in card.text
    else:
        assert 'pyprune.load("out")' in card.text and why in card.text and "from_pretrained(" not in card.text
    assert "recipe.yaml" not in card.text  # pyprune.save was given no recipe
    assert card.content == model_card.render(manifest, "out")  # written from pyprune.json alone


def test_the_report_written_after_the_save_rewrites_the_card_with_the_evaluation(hub, tmp_path):
    model, tokenizer, report = _prune("org/tiny", "wanda", "2:4")
    pyprune.save(model, tokenizer, tmp_path / "out", report)
    report["eval"] = [{"data": "emma", "perplexity": 123.4567, "tokens": 2048, "seqlen": 128, "bos": False}]
    report["tasks"] = {"piqa": {"acc": 0.625, "acc_norm": None, "stderr": {"acc": 0.01}, "n": 200, "num_fewshot": 0}}
    write_report(report, model_dir=str(tmp_path / "out"))
    card = ModelCard.load(tmp_path / "out" / "README.md")
    results = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert results == {("emma", "perplexity"): 123.4567, ("piqa", "accuracy"): 0.625}
    assert "| emma | 123.4567 | 2048 | 128 |" in card.text and "| piqa | 0.6250 | 200 |" in card.text


def test_a_command_line_prune_and_its_recovery_carry_the_base_model_and_say_what_was_done(hub, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(600)))
    pruned, recovered = tmp_path / "pruned", tmp_path / "recovered"
    assert cli.main(["prune", "--model", "org/tiny", "--method", "wanda", "--pattern", "2:4", "--calib", str(text),
                     "--nsamples", "4", "--seqlen", "16", "--eval", str(text), "--eval-seqlen", "16",
                     "--output", str(pruned), "--quiet"]) == 0
    card = ModelCard.load(pruned / "README.md")
    assert card.data.base_model == "org/tiny" and card.data.eval_results[0].metric_type == "perplexity"
    assert "Calibration: 4 × 16 tokens of" in card.text and "seed 0" in card.text
    assert (pruned / "recipe.yaml").is_file() and "`pyprune run pruned/` runs it again" in card.text
    assert cli.main(["recover", "--model", str(pruned), "--calib", str(text), "--nsamples", "4", "--seqlen", "16",
                     "--batch-size", "2", "--steps", "1", "--output", str(recovered), "--quiet"]) == 0
    data = ModelCard.load(recovered / "README.md").data.to_dict()
    assert data["base_model"] == "org/tiny" and data["license"] == "other"  # from the pruned model's manifest
    assert {"wanda", "2:4-sparsity", "lora-recovery"} <= set(data["tags"]) and data["sparsity"] == 0.5
    assert "LoRA recovery of" in ModelCard.load(recovered / "README.md").text


def test_a_local_model_of_unknown_origin_names_no_base_model(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    model, tokenizer = load_model(model_dir)
    pyprune.save(model, tokenizer, tmp_path / "out")
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert card.data.base_model is None and card.data.library_name == "pyprune"
    assert "a local model (no hub id known)" in card.text and "no prune report" in card.text


def test_an_alias_entry_gets_a_card_naming_its_original_and_license(tmp_path, tiny_model_dir):
    """A finished alias cache entry (its marker) built before cards were gets one on its next use."""
    model_dir, _ = tiny_model_dir
    entry = tmp_path / "cache" / "models" / "smollm2-135m"
    entry.parent.mkdir(parents=True)
    model_dir.rename(entry)
    files = sorted(p.name for p in entry.iterdir())
    (entry / ".pyprune-complete.json").write_text(json.dumps({"format": 1, "alias": "smollm2-135m", "files": files}))
    assert resolve_model_dir("smollm2-135m", cache_dir=tmp_path / "cache") == str(entry)
    data = ModelCard.load(entry / "README.md").data
    assert (data.base_model, data.license) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")
    model = tiny_llama(hidden=64, heads=4, kv_heads=2)
    model.config.name_or_path = str(entry)  # as load_model records where it read the model
    assert provenance.base_of(model) == {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0"}


def test_the_license_comes_from_the_config_when_the_card_states_none(tmp_path):
    snapshot = hub_snapshot(tmp_path, "org/plain", COMMIT, tiny_llama(), card="# no front matter\n")
    config = json.loads((snapshot / "config.json").read_text())
    (snapshot / "config.json").write_text(json.dumps(dict(config, license="mit")))
    model = tiny_llama()
    model.config.name_or_path = str(snapshot)
    assert provenance.base_of(model) == {"id": "org/plain", "revision": COMMIT, "license": "mit"}
