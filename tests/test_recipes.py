"""Recipes (pyprune.recipes, ``pyprune run``): a recipe gives the same masks and perplexities as the
same CLI steps, the ``recipe.yaml`` every output holds reproduces it, on every family, and every bad
field is refused before a model loads, in one line naming its path, with nothing written."""
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import pyprune
from pyprune import cli, recipes
from pyprune.io.recipe_file import RECIPE
from tests.helpers import FAMILIES, FUSED_MOE, HYBRID, WORDS, tiny_decoder, tiny_tokenizer

CALIBRATION = {"nsamples": 4, "seqlen": 16, "seed": 3}


def _weights(directory) -> dict:
    tensors = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def _assert_same_model(first, second) -> None:
    """Same tensors, bit for bit (so the same masks), and the same perplexities."""
    a, b = _weights(first), _weights(second)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    reports = [json.loads((Path(d) / "pyprune.json").read_text())["report"] for d in (first, second)]
    evaluated = [report.get("eval") or report["eval_after"] for report in reports]  # recover's: eval_after
    assert [e["perplexity"] for e in evaluated[0]] == [e["perplexity"] for e in evaluated[1]] != []


def _two_stages(model, text, output) -> dict:
    return {"model": str(model), "batch_size": 2,
            "calibration": {"data": str(text), **CALIBRATION},
            "stages": [{"method": "wanda", "sparsity": 0.5},
                       {"method": "sparsegpt", "pattern": "2:4", "options": {"blocksize": 32}}],
            "evaluation": {"data": [str(text)], "seqlen": 16},
            "output": {"path": str(output)}}


def _cli_steps(model, text, tmp_path, quiet=True) -> Path:
    """The two stages of :func:`_two_stages` as two ``pyprune prune`` commands."""
    calib = ["--calib", str(text), "--nsamples", "4", "--seqlen", "16", "--seed", "3", "--batch-size", "2"]
    first, second = tmp_path / "cli-wanda", tmp_path / "cli-sparsegpt"
    assert cli.main(["prune", "--model", str(model), "--method", "wanda", "--sparsity", "0.5", *calib,
                     "--output", str(first), *(["--quiet"] if quiet else [])]) == 0
    assert cli.main(["prune", "--model", str(first), "--method", "sparsegpt", "--pattern", "2:4", "--blocksize", "32",
                     *calib, "--eval", str(text), "--eval-seqlen", "16", "--output", str(second), "--quiet"]) == 0
    return second


def test_a_two_stage_recipe_matches_the_cli_steps_and_its_saved_recipe_reproduces_it(tiny_model_dir, tmp_path):
    model, text = tiny_model_dir
    by_cli = _cli_steps(model, text, tmp_path)
    by_recipe = tmp_path / "recipe-run"
    report = pyprune.run_recipe(_two_stages(model, text, by_recipe), quiet=True)
    assert [stage["method"] for stage in report["stages"]] == ["wanda", "sparsegpt"]
    assert report["method"] == "sparsegpt" and report["pattern"] == "2:4"
    _assert_same_model(by_cli, by_recipe)
    saved = yaml.safe_load((by_recipe / RECIPE).read_text())
    assert [stage["method"] for stage in saved["stages"]] == ["wanda", "sparsegpt"]
    assert saved["stages"][1]["options"]["blocksize"] == 32 and saved["output"]["path"] == str(by_recipe)
    again = tmp_path / "again"
    assert cli.main(["run", str(by_recipe / RECIPE), "--output", str(again), "--quiet"]) == 0
    _assert_same_model(by_recipe, again)


def test_prune_and_recover_save_the_recipe_that_reproduces_them(tiny_model_dir, tmp_path):
    model, text = tiny_model_dir
    pruned, recovered = tmp_path / "pruned", tmp_path / "recovered"
    assert cli.main(["prune", "--model", str(model), "--method", "magnitude", "--pattern", "2:4", "--output",
                     str(pruned), "--eval", str(text), "--eval-seqlen", "16", "--quiet"]) == 0
    assert cli.main(["recover", "--model", str(pruned), "--calib", str(text), "--nsamples", "4", "--seqlen", "16",
                     "--batch-size", "2", "--steps", "2", "--rank", "4", "--eval", str(text), "--eval-seqlen", "16",
                     "--output", str(recovered), "--quiet"]) == 0
    saved = recipes.load(str(recovered))
    assert [stage.method for stage in saved.stages] == ["lora"]
    assert saved.stages[0].options["rank"] == 4 and saved.model == str(pruned)
    for directory in (pruned, recovered):
        again = tmp_path / f"{directory.name}-again"
        pyprune.run_recipe(str(directory), output=str(again), quiet=True)
        _assert_same_model(directory, again)
    weights = _weights(recovered)["model.layers.0.mlp.up_proj.weight"]
    assert weights.reshape(-1, 4).ne(0).sum(1).le(2).all()  # LoRA merged under the 2:4 masks


@pytest.mark.parametrize("family", FAMILIES + FUSED_MOE + HYBRID)
def test_a_saved_recipe_reproduces_a_prune_of_every_family(family, tiny_copy, places, tmp_path):
    """Every family the tests build, the fused-expert MoE layouts and the hybrids (a recurrent mixer
    beside attention; pruned 2:4) included: the saved recipe gives the same weights and perplexity."""
    model = tmp_path / family
    tiny_copy(family).save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    text = str(places / "text.txt")
    first = tmp_path / "first"
    pattern = {"pattern": "2:4"} if family in HYBRID else {"sparsity": 0.5}
    report = pyprune.run_recipe({"model": str(model), "calibration": {"data": text, "nsamples": 2, "seqlen": 8},
                                 "stages": [{"method": "wanda", **pattern}],
                                 "evaluation": {"data": [text], "seqlen": 8, "tokens": 64},
                                 "output": {"path": str(first)}}, quiet=True)
    assert report["sparsity"] == pytest.approx(0.5, abs=0.01)  # routers, gates, SSM parameters stay dense
    second = tmp_path / "second"
    pyprune.run_recipe(str(first / RECIPE), output=str(second), quiet=True)
    _assert_same_model(first, second)


def test_the_recipe_schema_is_the_method_declarations():
    """Every declared option of every method is a field of its stage, with the declared default."""
    for name, cls in pyprune.methods.METHODS.items():
        if "prune" not in cls.commands:
            continue
        pattern = {"Unstructured": {"sparsity": 0.5}, "NM": {"pattern": "2:4"},
                   "Structured": {"ratio": 0.25}}[cls.patterns[0].__name__]
        stage = recipes.from_dict({"model": "m", "calibration": {"data": "emma"},
                                   "stages": [{"method": name, **pattern}]}).stages[0]
        assert stage.options == {option.name: option.convert(option.default, name) for option in cls.options}


@pytest.mark.parametrize("page", ["docs/recipes.md", "README.md"])
def test_the_recipes_the_docs_show_are_valid(page, tmp_path):
    """Every YAML block of the page is a recipe whose fields pass (read as ``pyprune run`` reads a file)."""
    blocks = re.findall(r"```yaml\n(.*?)```", (Path(__file__).parent.parent / page).read_text(), re.S)
    assert blocks
    for index, block in enumerate(blocks):
        (tmp_path / f"{index}.yaml").write_text(block)
        assert recipes.load(str(tmp_path / f"{index}.yaml")).stages


# --- bad recipes: refused before any model loads -------------------------------------------------------------

@pytest.fixture(scope="module")
def places(tmp_path_factory):
    base = tmp_path_factory.mktemp("recipes")
    model = base / "tiny"
    tiny_decoder("llama", layers=2).save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    (base / "text.txt").write_text(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(300)))
    (base / "short.txt").write_text("the house is good")
    (base / "full").mkdir()
    (base / "full" / "file").write_text("x")
    return base


def _good(base: Path) -> dict:
    return {"model": str(base / "tiny"), "calibration": {"data": str(base / "text.txt"), "nsamples": 2, "seqlen": 8},
            "stages": [{"method": "wanda", "sparsity": 0.5, "options": {"owl": True}},
                       {"method": "lora", "options": {"steps": 1, "batch_size": 2}}],
            "evaluation": {"data": [str(base / "text.txt")], "seqlen": 8},
            "output": {"path": str(base / "out")}}


def _set(recipe: dict, path: str, value) -> dict:
    """``recipe`` with the field at ``path`` (``a.b``, ``stages[1].options.x``) set (or removed: value ...)."""
    keys = [int(key) if key.isdigit() else key for key in re.findall(r"[^.\[\]]+", path)]
    target = recipe
    for key in keys[:-1]:
        target = target[key]
    if value is ...:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value
    return recipe


#: (case id, field path, value (... removes it), the error's regex)
BAD_FIELDS = [
    ("unknown-method", "stages[0].method", "wandah", r"^stages\[0\]\.method: must be one of .*wanda.*; got 'wandah'$"),
    ("unknown-option", "stages[0].options.owll", True,
     r"^stages\[0\]\.options\.owll: method 'wanda' has no option owll; its options: owl, "),
    ("option-wrong-type", "stages[0].options.owl", "often", r"^stages\[0\]\.options\.owl: must be true or false"),
    ("option-bad-value", "stages[0].options.owl_m", -1.0, r"^stages\[0\]\.options\.owl_m: must be > 0; got -1\.0$"),
    ("lora-option-bad-value", "stages[1].options.rank", 0, r"^stages\[1\]\.options\.rank: must be >= 1; got 0$"),
    ("lora-batch-over-nsamples", "stages[1].options.batch_size", 3,
     r"^stages\[1\]\.options\.batch_size: 3 is larger than the stage's calibration nsamples 2$"),
    ("sparsity-wrong-type", "stages[0].sparsity", "half", r"^stages\[0\]\.sparsity: must be a finite number"),
    ("sparsity-out-of-range", "stages[0].sparsity", 1.5, r"^stages\[0\]: sparsity must be .*\[0, 1\); got 1\.5$"),
    ("pattern-unquoted", "stages[0].pattern", 124, r"^stages\[0\]\.pattern: write N:M in quotes"),
    ("two-patterns", "stages[0].ratio", 0.25, r"^stages\[0\]: give exactly one of sparsity S, pattern N:M, ratio R$"),
    ("pattern-the-method-cannot", "stages[0]", {"method": "slicegpt", "sparsity": 0.5},
     r"^stages\[0\]: method 'slicegpt' supports patterns Structured; got unstructured 0\.5: write ratio: 0\.5$"),
    ("unknown-top-field", "evalution", {}, r"^evalution: unknown field; a recipe has model, dtype, "),
    ("unknown-section-field", "calibration.samples", 4, r"^calibration\.samples: unknown field; calibration has "),
    ("no-model", "model", ..., r"^model: must be set; got None$"),
    ("no-stages", "stages", [], r"^stages: must be a non-empty list"),
    ("nsamples-0", "calibration.nsamples", 0, r"^calibration\.nsamples: must be >= 1; got 0$"),
    ("dtype", "dtype", "float8", r"^dtype: must be one of float32, bfloat16, float16; got 'float8'$"),
    ("no-calibration-text", "calibration.data", ..., r"^stages\[0\]: method 'wanda' needs a calibration text"),
    ("calibration-text-missing", "calibration.data", "nowhere.txt", r"^calibration\.data: .*nowhere\.txt"),
    ("eval-longer-than-the-model", "evaluation.seqlen", 4096,
     r"^evaluation\.seqlen: 4096 is longer than the model's 256 positions"),
    ("eval-shorter-than-a-window", "evaluation.data", ["{short.txt}"],
     r"^evaluation\.data .*short\.txt has 4 tokens, fewer than one window of evaluation\.seqlen 8$"),
    ("calibration-shorter-than-a-sample", "calibration.data", "{short.txt}", r"^calibration\.data .*short\.txt: "),
    ("output-not-empty", "output.path", "{full}", r"^pyprune run: error: output\.path .*full already exists"),
    ("sparse-layers-unstructured", "output.sparse_layers", True, r"^output\.sparse_layers: needs a last pruning "
                                                                 r"stage with pattern N:M"),
]


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", BAD_FIELDS, ids=[case[0] for case in BAD_FIELDS])
def test_a_bad_field_is_one_line_naming_its_path_before_loading(places, case, tmp_path, capsys, monkeypatch):
    _, path, value, message = case
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr("pyprune.inputs.models.load_model", refuse)
    value = [str(places / item[1:-1]) for item in value] if isinstance(value, list) else \
        str(places / value[1:-1]) if isinstance(value, str) and value.startswith("{") else value
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(_set(_good(places), path, value)))
    before = _snapshot(places)
    assert cli.main(["run", str(recipe_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    prefix = "pyprune run: error: "
    assert err.startswith(prefix) and re.search(message, err if message.startswith("^pyprune") else
                                                err[len(prefix):]), err
    assert _snapshot(places) == before
    assert sorted(os.listdir(tmp_path)) == ["recipe.yaml"]


def test_the_good_recipe_of_the_bad_cases_is_accepted():
    """The cases above each break one field of a recipe that passes the checks of the fields alone."""
    assert len(recipes.from_dict(_good(Path("/nowhere"))).stages) == 2


def test_a_bad_recipe_file_exits_2_in_one_line_from_the_command_line(places, tmp_path):
    """In a subprocess, as a user runs it: not YAML, then an unknown option; nothing written."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(yaml.safe_dump(_set(_good(places), "stages[0].options.sparsity", 0.7)))
    script = ("import sys; from pyprune import cli; "
              "sys.exit(max(cli.main(['run', path]) for path in sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", script, str(broken), str(unknown)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, done.stderr
    assert re.fullmatch(r"pyprune run: error: recipe .*broken\.yaml: not valid YAML \(line 2, column 1\): .*", lines[0])
    assert lines[1].startswith("pyprune run: error: stages[0].options.sparsity: method 'wanda' has no option sparsity")
    assert sorted(os.listdir(tmp_path)) == ["broken.yaml", "unknown.yaml"] and not (places / "out").exists()


@pytest.mark.slow
def test_a_two_stage_recipe_on_smollm2_matches_the_cli_steps_and_reproduces_itself(tmp_path):
    """OWL + Wanda 50%, then Wanda 2:4, on the real SmolLM2-135M (4 samples of 64 tokens): the
    recipe gives the masks and perplexity of the two ``pyprune prune`` commands."""
    calib = ["--calib", "emma", "--nsamples", "4", "--seqlen", "64"]
    evaluation = ["--eval", "pride_and_prejudice", "--eval-seqlen", "64", "--eval-tokens", "512"]
    first, by_cli = tmp_path / "cli-owl-wanda", tmp_path / "cli-wanda24"
    assert cli.main(["prune", "--model", "smollm2-135m", "--method", "wanda", "--owl", "true", "--sparsity", "0.5",
                     *calib, "--output", str(first), "--quiet"]) == 0
    assert cli.main(["prune", "--model", str(first), "--method", "wanda", "--pattern", "2:4", *calib, *evaluation,
                     "--output", str(by_cli), "--quiet"]) == 0
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
model: smollm2-135m
calibration: {{data: emma, nsamples: 4, seqlen: 64}}
stages:
  - method: wanda
    sparsity: 0.5
    options: {{owl: true}}
  - method: wanda
    pattern: '2:4'
evaluation: {{data: [pride_and_prejudice], seqlen: 64, tokens: 512}}
output: {{path: {tmp_path / 'by-recipe'}}}
""")
    assert cli.main(["run", str(recipe), "--quiet"]) == 0
    _assert_same_model(by_cli, tmp_path / "by-recipe")
    # re-running a saved recipe.yaml is tested on every family's tiny model (a fourth real run here would add
    # a minute of CI for the same property)
