"""Hub ids: ``load_model`` and ``--model`` read ``org/name[@REV]`` from a Hugging Face cache the tests lay
out themselves (``models--org--name/snapshots/<commit>``, ``refs/main``, a tag of a second commit),
offline (HF_HUB_OFFLINE=1; any socket connection fails the test), and a missing id or revision is one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pyprune
from pyprune.inputs import hub
from pyprune.inputs.models import load_model, resolve_model_dir
from pyprune.io import memory
from tests.helpers import WORDS, hub_snapshot, offline_hub, tiny_llama, tiny_tokenizer

MAIN = "1" * 40  # the commit refs/main names
TAGGED = "2" * 40  # a second revision, tagged v1
CARD = "---\nlicense: mit\n---\n# tiny\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding org/tiny at two commits (different weights), offline."""
    root = tmp_path / "hf-cache"
    for commit, seed, refs in ((MAIN, 0, ["main"]), (TAGGED, 1, ["v1"])):
        hub_snapshot(root, "org/tiny", commit, tiny_llama(seed=seed), tiny_tokenizer(), refs=refs, card=CARD)
    offline_hub(monkeypatch, root)
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    return root


def _weight(model):
    return model.model.layers[0].mlp.down_proj.weight


@pytest.mark.parametrize("name, expected", [
    ("org/name", hub.HubId("org/name")), ("org/name@v1.2", hub.HubId("org/name", "v1.2")),
    ("org/name@refs/pr/3", hub.HubId("org/name", "refs/pr/3")),
    ("smollm2-135m", None), ("./org/name", None), ("/org/name", None), ("~/name", None), ("a/b/c", None),
    ("org/na me", None), ("org/name@", None), ("org--x/name", None)])
def test_what_is_a_hub_id(name, expected):
    assert hub.parse(name) == expected


def test_an_id_loads_the_commit_main_names(cache):
    model, tokenizer = load_model("org/tiny")
    assert model.config.name_or_path == str(cache / "models--org--tiny" / "snapshots" / MAIN)
    assert torch.equal(_weight(model), _weight(tiny_llama(seed=0)))
    assert tokenizer("the man").input_ids == tiny_tokenizer()("the man").input_ids


@pytest.mark.parametrize("revision", ["v1", TAGGED])
def test_an_id_with_a_revision_loads_that_revision(cache, revision):
    model, _ = load_model(f"org/tiny@{revision}")
    assert torch.equal(_weight(model), _weight(tiny_llama(seed=1)))
    assert not torch.equal(_weight(model), _weight(tiny_llama(seed=0)))


def test_a_missing_id_is_one_line_naming_it(cache):
    with pytest.raises(hub.HubError) as error:
        load_model("org/missing")
    message = str(error.value)
    assert "\n" not in message and "org/missing" in message and "HF_HUB_OFFLINE" in message
    assert str(cache) in message


def test_a_missing_revision_is_one_line_naming_it_and_the_cached_ones(cache):
    with pytest.raises(hub.HubError) as error:
        load_model("org/tiny@v9")
    message = str(error.value)
    assert "\n" not in message and "org/tiny@v9" in message and "'v9'" in message
    assert "main" in message and "v1" in message and "HF_HUB_OFFLINE" in message


def test_an_existing_directory_wins_over_the_hub_id_it_spells(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_llama(seed=2).save_pretrained(tmp_path / "org" / "tiny")
    assert resolve_model_dir("org/tiny") == str(tmp_path / "org" / "tiny")


@pytest.mark.parametrize("error, expected", [
    ("GatedRepoError", "is gated: accept its terms on https://huggingface.co/org/tiny and log in"),
    ("RepositoryNotFoundError", "was not found on the Hugging Face hub"),
    ("RevisionNotFoundError", "has no revision 'v9'")])
def test_what_the_hub_answers_is_one_line_naming_the_id(cache, monkeypatch, error, expected):
    """The hub's refusals (stood in for: snapshot_download raises what it raises for them)."""
    import httpx2
    import huggingface_hub
    from huggingface_hub import errors
    response = httpx2.Response(403, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/tiny"))

    def answer(*args, **kwargs):
        raise getattr(errors, error)("a long\nanswer", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", answer)
    with pytest.raises(hub.HubError) as raised:
        load_model("org/tiny@v9")
    assert "\n" not in str(raised.value) and str(raised.value).startswith("hub model org/tiny@v9")
    assert expected in str(raised.value)


def test_a_hub_model_is_checked_for_memory_before_it_loads_and_offloads_like_a_directory(cache, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: memory.RUNTIME // 2)
    with pytest.raises(memory.NotEnoughMemory, match="loading .*models--org--tiny"):
        load_model("org/tiny")
    monkeypatch.undo()
    offline_hub(monkeypatch, cache)
    offloaded, tokenizer = load_model("org/tiny", offload_dir=tmp_path / "offload")
    assert all(p.is_meta for p in offloaded.model.layers.parameters())
    pyprune.prune(offloaded, "magnitude", "2:4", progress=False)
    pyprune.save(offloaded, tokenizer, tmp_path / "offloaded")
    in_memory, _ = load_model("org/tiny")
    pyprune.prune(in_memory, "magnitude", "2:4", progress=False)
    reloaded, _ = pyprune.load(tmp_path / "offloaded")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), in_memory.state_dict().values()))


def test_the_command_line_checks_memory_before_it_asks_for_the_weights(cache, tmp_path, monkeypatch, capsys):
    """A prune that does not fit is refused having fetched the config, tokenizer and card alone."""
    import huggingface_hub
    from pyprune import cli
    asked, download = [], huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        asked.append(kwargs["allow_patterns"])
        return download(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    monkeypatch.setattr(memory, "available_bytes", lambda: memory.RUNTIME // 2)
    assert cli.main(["prune", "--model", "org/tiny", "--method", "magnitude", "--pattern", "2:4",
                     "--output", str(tmp_path / "out")]) == 2
    assert "needs about" in capsys.readouterr().err
    assert asked and all(hub.WEIGHTS[0] not in patterns and "config.json" in patterns for patterns in asked)


def test_an_output_may_not_go_inside_the_hub_model_it_reads(cache):
    from pyprune.cli import checks
    assert checks.input_dirs("org/tiny@v1") == [str(cache / "models--org--tiny")]
    with pytest.raises(checks.UsageError, match="--output"):
        checks.check_output(str(cache / "models--org--tiny" / "pruned"), "--output", "org/tiny")


def _cli(cache, *args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache),
               PYTHONPATH=str(Path(pyprune.__file__).parents[1]))
    assert env["HF_HUB_OFFLINE"] == "1"  # huggingface_hub in the child opens no connection
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)


def test_the_command_line_prunes_a_hub_revision_and_refuses_missing_ones_in_one_line(cache, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(600)))
    out = tmp_path / "out"
    done = _cli(cache, "-m", "pyprune.cli", "prune", "--model", "org/tiny@v1", "--method", "wanda", "--pattern", "2:4",
                "--calib", str(text), "--nsamples", "4", "--seqlen", "16", "--output", str(out), "--quiet")
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "pyprune.json").read_text())["base_model"] == {"id": "org/tiny", "revision": TAGGED,
                                                                           "license": "mit"}
    # the two refusals in one process (each pyprune.cli.main, as `pyprune prune` runs it)
    never = str(tmp_path / "never")
    script = ("import sys\nfrom pyprune import cli\nprint(*[cli.main(['prune', '--model', model, '--method', "
              "'magnitude', '--pattern', '2:4', '--output', sys.argv[1]]) for model in sys.argv[2:]])")
    failed = _cli(cache, "-c", script, never, "org/missing", "org/tiny@v9")
    assert failed.stdout.split() == ["2", "2"], failed.stderr
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("pyprune prune: error: hub model ") for line in lines), lines
    assert "org/missing" in lines[0] and "'v9'" in lines[1]
    assert not (tmp_path / "never").exists()
