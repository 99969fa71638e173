"""Bad input to every CLI subcommand: exit status 2, one line naming the argument or file, nothing
written or modified, and (where the answer is on disk) decided before any model loads."""
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pyprune
import pyprune.methods
from pyprune import cli
from pyprune.io import storage
from pyprune.cli import steps
from pyprune.files import TEMP_TAG, write_json
from tests.helpers import WORDS, hub_snapshot, tiny_decoder, tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny saved model, broken copies of it, texts and states: what the cases below point at."""
    base = tmp_path_factory.mktemp("bad-input")
    model = base / "tiny"
    tiny_llama(hidden=64, heads=4, kv_heads=2).save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    text = base / "text.txt"
    text.write_text(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(600)))
    (base / "short.txt").write_text("the house is good")
    (base / "blank.txt").write_text(" \n\n\t  \n")
    (base / "one-line.txt").write_text("the house is good and the man is good " * 20)
    (base / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (base / "a-directory").mkdir()
    garbage = _copy_model(model, base / "garbage-config")
    (garbage / "config.json").write_text("{ this is not json")
    truncated = _copy_model(model, base / "truncated")
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    saved = base / "saved"
    pyprune.save(tiny_llama(hidden=64, heads=4, kv_heads=2), tiny_tokenizer(), saved)
    bad_manifest = _copy_model(saved, base / "bad-manifest")
    (bad_manifest / "pyprune.json").write_text('{"format": "pyprune", version: 2}')
    future = _copy_model(saved, base / "future-version")
    manifest = json.loads((future / "pyprune.json").read_text())
    (future / "pyprune.json").write_text(json.dumps(dict(manifest, version=99)))
    state = base / "copal-state"
    storage.save_state(str(state / "copal-state.safetensors"), {"G:x": torch.zeros(2)}, {
        "kind": "COPAL state", "format": 2, "steps": [],
        "key": {"settings": {"perturbation": "proportional", "epsilon": 0.5, "perturbation_seed": 0,
                             "propagate": "pruned", "pattern": "2:4", "scope": None}, "model": "elsewhere"}})
    cut_state = base / "cut-state"
    cut_state.mkdir()
    whole = (state / "copal-state.safetensors").read_bytes()
    (cut_state / "copal-state.safetensors").write_bytes(whole[:len(whole) - 4])
    dress = base / "dress-checkpoint"
    dress.mkdir()
    (dress / "dress-regularise.safetensors").write_bytes(b"\x80\x04K\x01.")  # a pickle, not a state
    (base / "block-checkpoint").mkdir()
    write_json(str(base / "block-checkpoint" / "blockwise.json"), {
        "key": {"method": "sparsegpt", "settings": {}, "pattern": "2:4", "scope": None, "model": "m",
                "calibration": "c"}, "finished": 1, "details": [None]})
    (base / "broken-checkpoint").mkdir()
    (base / "broken-checkpoint" / "blockwise.json").write_text("{ not json")
    gemma = base / "gemma3"
    tiny_decoder("gemma3", layers=2).save_pretrained(gemma)
    tiny_tokenizer().save_pretrained(gemma)
    (base / "continual.json").write_text("{ not json")
    (base / "report.json").write_text(json.dumps({"eval": [{"data": "x", "perplexity": 2.0}]}))
    hub_snapshot(base / "hf-cache", "org/tiny", "1" * 40, tiny_llama(hidden=64, heads=4, kv_heads=2), tiny_tokenizer(),
                 refs=["main"])
    (base / "recipe.yaml").write_text(f"model: {model}\nstages:\n  - {{method: magnitude, pattern: '2:4', "
                                      "options: {blocksize: 8}}\n")
    return base


def _copy_model(source: Path, target: Path) -> Path:
    target.mkdir()
    for item in source.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    return target


OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
NO_DEVICE = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
WANDA = ["--method", "wanda", "--pattern", "2:4"]
HUB = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "{hf-cache}"}  # the cache the files fixture lays out

#: (case id, argv with {placeholders} under the fixture's directory, the error's regex, environment)
CASES = [
    ("prune-eval-seqlen-0", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}", "--eval", "{text.txt}",
                             "--eval-seqlen", "0"], r"--eval-seqlen must be >= 1; got 0", {}),
    ("prune-eval-tokens-0", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}", "--eval", "{text.txt}",
                             "--eval-tokens", "0"], r"--eval-tokens must be >= 1; got 0", {}),
    ("prune-eval-shorter-than-a-window", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}", "--eval",
                                          "{short.txt}", "--eval-seqlen", "16"],
     r"--eval .*short.txt has 4 tokens, fewer than one window of --eval-seqlen 16", {}),
    ("prune-eval-dataset-offline", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}", "--eval", "wikitext2"],
     r"--eval wikitext2: dataset 'wikitext2' (could not be loaded|needs the 'datasets' package)", OFFLINE),
    ("prune-calib-dataset-offline", ["prune", "--model", "{tiny}", *WANDA, "--calib", "ptb"],
     r"--calib ptb: dataset 'ptb' (could not be loaded|needs the 'datasets' package)", OFFLINE),
    ("prune-device-missing", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}", "--device", NO_DEVICE],
     rf"--device {NO_DEVICE}: (this torch build .* has no usable cuda device|there are \d+ cuda devices)", {}),
    ("prune-device-nonsense", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}", "--device", "gpu0"],
     r"--device 'gpu0' is not a torch device", {}),
    ("prune-garbage-config", ["prune", "--model", "{garbage-config}", *WANDA, "--calib", "{text.txt}"],
     r"garbage-config/config.json is not a valid model config", {}),
    ("prune-truncated-weights", ["prune", "--model", "{truncated}", *WANDA, "--calib", "{text.txt}"],
     r"truncated/model.safetensors is truncated", {}),
    ("prune-report-directory", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}", "--report",
                                "{a-directory}"], r"--report .*a-directory is a directory", {}),
    ("run-unknown-option", ["run", "{recipe.yaml}"],
     r"stages\[0\]\.options\.blocksize: method 'magnitude' has no option blocksize; its options: ", {}),
    ("run-missing-recipe", ["run", "{nowhere.yaml}"], r"recipe .*nowhere\.yaml: no such file$", {}),
    ("prune-invalid-manifest", ["prune", "--model", "{bad-manifest}", *WANDA, "--calib", "{text.txt}"],
     r"bad-manifest/pyprune.json is not valid JSON", {}),
    ("prune-future-manifest", ["prune", "--model", "{future-version}", *WANDA, "--calib", "{text.txt}"],
     r"future-version/pyprune.json has version 99; this pyprune reads versions 1, 2, 3", {}),
    ("prune-binary-calib", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{binary.txt}"],
     r"binary.txt is not UTF-8 text", {}),
    ("prune-pattern-not-dividing-a-layer", ["prune", "--model", "{tiny}", "--method", "wanda", "--pattern", "2:5",
                                            "--calib", "{text.txt}"], r"2:5 .*(64|128)", {}),
    ("prune-slicegpt-on-gemma", ["prune", "--model", "{gemma3}", "--method", "slicegpt", "--ratio", "0.25",
                                 "--calib", "{text.txt}", "--seqlen", "16"], r"(Gemma|norm|\(1 \+ w\))", {}),
    ("prune-ratio-0", ["prune", "--model", "{tiny}", "--method", "taylor", "--ratio", "0", "--calib", "{text.txt}"],
     r"--ratio must be in \(0, 1\): 0 removes nothing", {}),
    ("prune-copal-state-other-settings", ["prune", "--model", "{tiny}", "--method", "copal", "--pattern", "2:4",
                                          "--calib", "{text.txt}", "--state", "{copal-state}"],
     r"COPAL state .*copal-state was made with other settings: epsilon 0.5 \(now 0.01\)", {}),
    ("prune-copal-state-truncated", ["prune", "--model", "{tiny}", "--method", "copal", "--pattern", "2:4",
                                     "--calib", "{text.txt}", "--state", "{cut-state}"],
     r"cut-state/copal-state.safetensors is not a readable safetensors state", {}),
    ("prune-dress-checkpoint-pickle", ["prune", "--model", "{tiny}", "--method", "dress", "--ratio", "0.25",
                                       "--calib", "{text.txt}", "--checkpoint", "{dress-checkpoint}"],
     r"dress-regularise.safetensors is not a readable safetensors state", {}),
    ("prune-block-checkpoint-other-method", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}",
                                             "--checkpoint", "{block-checkpoint}"],
     r"checkpoint .*block-checkpoint was made with other settings: method 'sparsegpt' \(now 'wanda'\)", {}),
    ("prune-block-checkpoint-invalid-json", ["prune", "--model", "{tiny}", "--method", "safe", "--pattern", "2:4",
                                             "--calib", "{text.txt}", "--checkpoint", "{broken-checkpoint}"],
     r"checkpoint manifest .*broken-checkpoint/blockwise.json is not valid JSON", {}),
    ("prune-shard-training-in-one-process", ["prune", "--model", "{tiny}", "--method", "safe+", "--pattern", "2:4",
                                             "--calib", "{text.txt}", "--shard-training"],
     r"option shard_training of method 'safe\+' shards a block's training over the ranks of a torch.distributed "
     r"group: run under torchrun --nproc-per-node N with N >= 2 .*; got one process$", {}),
    ("prune-dress-shard-training-in-one-process", ["prune", "--model", "{tiny}", "--method", "dress", "--ratio",
                                                   "0.25", "--calib", "{text.txt}", "--shard-training"],
     r"option shard_training of method 'dress' shards its regularised training over the ranks of a "
     r"torch.distributed group: .*; got one process$", {}),
    ("recover-shard-training-in-one-process", ["recover", "--model", "{tiny}", "--calib", "{text.txt}", "--steps", "1",
                                               "--output", "{new}", "--shard-training"],
     r"setting shard_training of LoRA recovery shards its training over the ranks .*; got one process$", {}),
    ("prune-shard-training-of-a-method-that-does-not-train", ["prune", "--model", "{tiny}", *WANDA, "--calib",
                                                              "{text.txt}", "--shard-training"],
     r"method 'wanda' has no option shard_training; its options: owl, ", {}),
    ("prune-offload-without-output", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}", "--offload"],
     r"--offload needs --output", {}),
    ("prune-offload-gradient-method", ["prune", "--model", "{tiny}", "--method", "taylor", "--ratio", "0.25", "--calib",
                                       "{text.txt}", "--offload", "--output", "{new}"],
     r"--offload: method 'taylor' cannot prune an offloaded model: it computes gradients through the whole model", {}),
    ("prune-offload-eval", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}", "--offload", "--output",
                            "{new}", "--eval", "{text.txt}"], r"--offload evaluates nothing", {}),
    ("eval-seqlen-0", ["eval", "--model", "{tiny}", "--data", "{text.txt}", "--seqlen", "0"],
     r"--seqlen must be >= 1; got 0", {}),
    ("eval-old-max-tokens-0", ["eval", "--model", "{tiny}", "--data", "{text.txt}", "--max-tokens", "0"],
     r"--eval-tokens must be >= 1; got 0", {}),
    ("eval-data-shorter-than-a-window", ["eval", "--model", "{tiny}", "--data", "{short.txt}", "--seqlen", "16"],
     r"--data .*short.txt has 4 tokens, fewer than one window of --seqlen 16", {}),
    ("eval-data-offline", ["eval", "--model", "{tiny}", "--data", "c4"],
     r"--data c4: dataset 'c4' (could not be loaded|needs the 'datasets' package)", OFFLINE),
    ("eval-report-directory", ["eval", "--model", "{tiny}", "--data", "{text.txt}", "--report", "{a-directory}"],
     r"--report .*a-directory is a directory", {}),
    ("eval-device-missing", ["eval", "--model", "{tiny}", "--data", "{text.txt}", "--device", NO_DEVICE],
     rf"--device {NO_DEVICE}", {}),
    ("eval-garbage-config", ["eval", "--model", "{garbage-config}", "--data", "{text.txt}"],
     r"config.json is not a valid model config", {}),
    ("eval-future-manifest", ["eval", "--model", "{future-version}", "--data", "{text.txt}"],
     r"pyprune.json has version 99", {}),
    ("recover-eval-seqlen-0", ["recover", "--model", "{tiny}", "--calib", "{text.txt}", "--steps", "1", "--eval",
                               "{text.txt}", "--eval-seqlen", "0", "--output", "{new}"], r"--eval-seqlen must be >= 1", {}),
    ("recover-binary-calib", ["recover", "--model", "{tiny}", "--calib", "{binary.txt}", "--steps", "1", "--seqlen",
                              "16", "--output", "{new}"], r"binary.txt is not UTF-8 text", {}),
    ("recover-truncated-weights", ["recover", "--model", "{truncated}", "--calib", "{text.txt}", "--steps", "1",
                                   "--output", "{new}"], r"model.safetensors is truncated", {}),
    ("recover-report-directory", ["recover", "--model", "{tiny}", "--calib", "{text.txt}", "--steps", "1", "--output",
                                  "{new}", "--report", "{a-directory}"], r"is a directory", {}),
    ("robustness-ratio-0", ["robustness", "--model", "{tiny}", "--method", "taylor", "--ratio", "0", "--calib",
                            "{text.txt}", "--eval", "{text.txt}", "--report", "{new}.json"],
     r"--ratio must be in \(0, 1\): 0 removes nothing", {}),
    ("robustness-eval-shorter-than-a-window", ["robustness", "--model", "{tiny}", "--method", "taylor", "--ratio",
                                               "0.25", "--calib", "{text.txt}", "--eval", "{short.txt}", "--report",
                                               "{new}.json"], r"fewer than one window of --eval-seqlen 128", {}),
    ("robustness-device-missing", ["robustness", "--model", "{tiny}", "--method", "taylor", "--ratio", "0.25",
                                   "--calib", "{text.txt}", "--eval", "{text.txt}", "--report", "{new}.json", "--device",
                                   NO_DEVICE], rf"--device {NO_DEVICE}", {}),
    ("continual-invalid-report", ["continual", "--model", "{tiny}", "--method", "wanda", "--sparsity", "0.5",
                                  "--datasets", "emma", "persuasion", "--report", "{continual.json}"],
     r"--report .*continual.json is not valid JSON", {}),
    ("continual-eval-seqlen-0", ["continual", "--model", "{tiny}", "--method", "wanda", "--sparsity", "0.5",
                                 "--datasets", "emma", "persuasion", "--eval-seqlen", "0", "--report", "{new}.json"],
     r"--eval-seqlen must be >= 1", {}),
    ("continual-eval-shorter-than-a-window", ["continual", "--model", "{tiny}", "--method", "wanda", "--sparsity",
                                              "0.5", "--datasets", "{text.txt}", "emma", "--eval", "{short.txt}", "{text.txt}",
                                              "--eval-seqlen", "16", "--seqlen", "8", "--nsamples", "2",
                                              "--report", "{new}.json"],
     r"--eval .*short.txt has 4 tokens, fewer than one window", {}),
    ("continual-garbage-config", ["continual", "--model", "{garbage-config}", "--method", "wanda", "--sparsity",
                                  "0.5", "--datasets", "emma", "persuasion", "--report", "{new}.json"],
     r"config.json is not a valid model config", {}),
    ("compare-missing-report", ["compare", "{report.json}", "{nowhere.json}", "--output", "{new}"],
     r"nowhere.json", {}),
    ("compare-output-is-a-file", ["compare", "{report.json}", "--output", "{text.txt}"],
     r"--output .*text.txt exists and is not a directory", {}),
    ("generate-max-new-tokens-0", ["generate", "--model", "{tiny}", "--prompt", "hello", "--max-new-tokens", "0"],
     r"--max-new-tokens must be >= 1; got 0", {}),
    ("generate-empty-prompt", ["generate", "--model", "{tiny}", "--prompt", "  "], r"--prompt is empty", {}),
    ("generate-garbage-config", ["generate", "--model", "{garbage-config}", "--prompt", "hello"],
     r"config.json is not a valid model config", {}),
    ("generate-device-missing", ["generate", "--model", "{tiny}", "--prompt", "hello", "--device", NO_DEVICE],
     rf"--device {NO_DEVICE}", {}),
    ("tune-tokens-0", ["tune", "--model", "{tiny}", "--tokens", "8", "0"], r"--tokens must be token counts >= 1",
     {}),
    ("tune-threads-0", ["tune", "--model", "{tiny}", "--threads", "0"], r"--threads must be >= 1; got 0", {}),
    ("tune-garbage-config", ["tune", "--model", "{garbage-config}"], r"config.json is not a valid model config", {}),
    # OWL's lambda: 2 blocks at 0.9 +- 0.2, whatever their outlier ratios, reach 1.1 (pyprune.methods.owl.check_spread)
    ("prune-owl-lambda-beyond-any-allocation", ["prune", "--model", "{tiny}", "--method", "wanda", "--sparsity", "0.9",
                                                "--owl", "--owl-lambda", "0.2", "--calib", "{text.txt}"],
     r"option owl_lambda=0.2 spreads the 2 block sparsities over 2 x 0.2 around 0.9, which leaves \[0, 1\) whatever "
     r"the outlier ratios; give owl_lambda < 0.1$", {}),
    ("demo-nsamples-0", ["demo", "--nsamples", "0"], r"--nsamples must be >= 1; got 0", {}),
    ("demo-eval-tokens-0", ["demo", "--eval-tokens", "0"], r"--eval-tokens must be >= 1; got 0", {}),
    # Inputs that are accepted but would mean nothing: a text of whitespace, a window longer than the
    # model's positions, a token limit shorter than a window, a thread count of 0.
    ("prune-whitespace-calib", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{blank.txt}", "--seqlen", "16"],
     r"--calib .*blank.txt: .*blank.txt holds only whitespace; give a text", {}),
    ("eval-whitespace-data", ["eval", "--model", "{tiny}", "--data", "{blank.txt}", "--seqlen", "16"],
     r"--data .*blank.txt: .*blank.txt holds only whitespace", {}),
    ("recover-whitespace-calib", ["recover", "--model", "{tiny}", "--calib", "{blank.txt}", "--steps", "1", "--seqlen",
                                  "16", "--eval-seqlen", "16", "--output", "{new}"], r"holds only whitespace", {}),
    ("continual-whitespace-half", ["continual", "--model", "{tiny}", "--method", "wanda", "--sparsity", "0.5",
                                   "--datasets", "{one-line.txt}", "emma", "--seqlen", "4", "--eval-seqlen", "16",
                                   "--report", "{new}.json"], r"one-line.txt:second_half holds only whitespace", {}),
    ("prune-seqlen-beyond-positions", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}", "--seqlen", "4096"],
     r"--seqlen 4096 is longer than the model's 2048 positions \(max_position_embeddings of --model .*tiny\)", {}),
    ("prune-eval-seqlen-beyond-positions", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}", "--seqlen",
                                            "16", "--eval", "{text.txt}", "--eval-seqlen", "2049"],
     r"--eval-seqlen 2049 is longer than the model's 2048 positions", {}),
    ("eval-seqlen-beyond-positions", ["eval", "--model", "{tiny}", "--data", "{text.txt}", "--seqlen", "4096"],
     r"--seqlen 4096 is longer than the model's 2048 positions", {}),
    ("robustness-seqlen-beyond-positions", ["robustness", "--model", "{tiny}", "--method", "taylor", "--ratio", "0.25",
                                            "--calib", "{text.txt}", "--eval", "{text.txt}", "--seqlen", "4096",
                                            "--report", "{new}.json"], r"--seqlen 4096 is longer than the model's", {}),
    ("eval-tokens-shorter-than-a-window", ["eval", "--model", "{tiny}", "--data", "emma", "--seqlen", "64",
                                           "--eval-tokens", "10"],
     r"error: --eval-tokens 10 is fewer than one window of --seqlen 64$", {}),
    ("prune-old-eval-max-tokens-shorter-than-a-window", ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}",
                                                         "--seqlen", "16", "--eval", "emma", "--eval-seqlen", "64",
                                                         "--eval-max-tokens", "10"],
     r"error: --eval-tokens 10 is fewer than one window of --eval-seqlen 64$", {}),
    ("generate-threads-0", ["generate", "--model", "{tiny}", "--prompt", "hello", "--threads", "0"],
     r"--threads must be >= 1; got 0", {}),
    ("compare-threads-negative", ["compare", "{report.json}", "--threads", "-2"], r"--threads must be >= 1; got -2", {}),
    # A hub id the Hugging Face cache cannot serve offline (HF_HUB_OFFLINE=1: no connection is opened).
    ("prune-hub-id-not-cached", ["prune", "--model", "org/missing", *WANDA, "--calib", "{text.txt}", "--output", "{new}"],
     r"error: hub model org/missing is not in the Hugging Face cache .*hf-cache and HF_HUB_OFFLINE=1 forbids", HUB),
    ("eval-hub-revision-not-cached", ["eval", "--model", "org/tiny@v9", "--data", "{text.txt}"],
     r"error: hub model org/tiny@v9: revision 'v9' is not in the Hugging Face cache .*\(cached: main, 111111111111\)",
     HUB),
    # A study's settings are its declared options: checked, with the allowed values, before anything loads.
    ("study-ratio-out-of-range", ["study", "robustness", "--model", "{tiny}", "--ratios", "0.2", "2"],
     r"option ratios of study 'robustness' must be in \(0, 1\]; got 2.0$", {}),
    ("study-hidden-middle", ["study", "robustness", "--structure", "hidden", "--layers", "middle"],
     r"option structure of study 'robustness': hidden .* takes layers 'all' and no eta_sweep$", {}),
    ("study-output-a-directory", ["study", "robustness", "--model", "{tiny}", "--output", "{a-directory}"],
     r"the results file .*a-directory is a directory; give the path of a file$", {}),
    ("study-continual-order-outside-the-protocol", ["study", "continual", "--orders", "austen,python"],
     r"option orders of study 'continual': austen,python is not an order of datasets austen moby_dick python "
     r"with permutations all; allowed: ", {}),
    ("study-seeds-missing-input", ["study", "continual-seeds", "--inputs", "{nowhere.json}", "--output", "{new}.json"],
     r"option inputs of study 'continual-seeds': .*nowhere.json is not a file$", {}),
]


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading a model fails the test: every case here is decided before."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr("pyprune.inputs.models.load_model", refuse)
    monkeypatch.setattr("pyprune.io.load", refuse)


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(files, case, capsys, monkeypatch, no_model_loads,
                                                           tmp_path):
    _, argv, message, env = case
    for name, value in env.items():
        monkeypatch.setenv(name, re.sub(r"\{([^}]+)\}", lambda m: str(files / m.group(1)), value))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    argv = [re.sub(r"\{([^}]+)\}", lambda m: str(files / m.group(1)), arg) for arg in argv]
    if argv[0] == "prune" and not {"--output", "--report", "--eval", "--tasks"} & set(argv):
        argv += ["--report", str(tmp_path / "report.json")]  # a prune must keep its result somewhere
    before = _snapshot(files)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.search(message, err), err
    assert err.startswith(f"pyprune {argv[0]}: error: ")
    assert _snapshot(files) == before
    assert not list(files.rglob(f"*{TEMP_TAG}*"))


def test_the_table_covers_every_subcommand():
    commands = {case[1][0] for case in CASES}
    subparsers = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert commands == set(subparsers.choices)
    print(f"{len(CASES)} bad-input cases over {len(commands)} subcommands")


def test_ctrl_c_is_one_line_with_status_130_and_writes_nothing(files, capsys, monkeypatch, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("pyprune.inputs.models.load_model", interrupted)
    output = tmp_path / "out"
    assert cli.main(["prune", "--model", str(files / "tiny"), *WANDA, "--calib", str(files / "text.txt"),
                     "--output", str(output), "--report", str(tmp_path / "r.json")]) == 130
    assert capsys.readouterr().err.strip() == "pyprune prune: interrupted"
    assert os.listdir(tmp_path) == []


def test_a_failing_evaluation_keeps_the_saved_prune(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The model is saved before it is evaluated: an evaluation that fails leaves a loadable prune."""
    model_dir, text = tiny_model_dir
    output = tmp_path / "out"

    def broken(*args, **kwargs):
        raise ValueError("evaluation failed")
    monkeypatch.setattr(steps, "evaluate", broken)
    assert cli.main(["prune", "--model", str(model_dir), *WANDA, "--calib", str(text), "--nsamples", "2",
                     "--seqlen", "16", "--eval", str(text), "--eval-seqlen", "16", "--output", str(output),
                     "--quiet"]) == 2
    assert "evaluation failed" in capsys.readouterr().err
    model, _ = pyprune.load(output)
    assert pyprune.nn.measure.sparsity_report(model)["nm_valid"]["2:4"]


@pytest.mark.parametrize("change,message", [
    ({"version": 99}, "has version 99; this pyprune reads versions 1, 2, 3, 4, 5"),
    ({"format": "other"}, "is not a pyprune manifest"),
])
def test_load_refuses_an_unknown_format_or_version(files, tmp_path, change, message):
    directory = _copy_model(files / "saved", tmp_path / "saved")
    manifest = json.loads((directory / "pyprune.json").read_text())
    (directory / "pyprune.json").write_text(json.dumps(dict(manifest, **change)))
    with pytest.raises(ValueError, match=message):
        pyprune.load(directory)


def test_reports_record_the_run(tiny_model_dir, tmp_path):
    """prune and eval reports: device, dtype, batch size, thread count, pyprune and torch versions."""
    model_dir, text = tiny_model_dir
    prune_report, eval_report = tmp_path / "prune.json", tmp_path / "eval.json"
    assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "2:4",
                     "--batch-size", "3", "--report", str(prune_report), "--quiet"]) == 0
    assert cli.main(["eval", "--model", str(model_dir), "--data", str(text), "--seqlen", "16", "--dtype",
                     "bfloat16", "--report", str(eval_report), "--quiet"]) == 0
    expected = {"device": "cpu", "batch_size": 3, "threads": torch.get_num_threads(),
                "pyprune": pyprune.__version__, "torch": torch.__version__, "dtype": "float32"}
    report = json.loads(prune_report.read_text())
    assert {key: report[key] for key in expected} == expected
    report = json.loads(eval_report.read_text())
    assert {key: report[key] for key in expected} == dict(expected, batch_size=8, dtype="bfloat16")


@pytest.mark.parametrize("argv", [[], ["--help"], ["--version"], ["frobnicate"], ["prnue", "--model", "x"]])
def test_help_and_a_missing_or_unknown_command_are_answered_without_importing_torch(argv):
    """The top-level parser is built from names and summaries alone: no subcommand module loads."""
    script = ("import sys\nfrom pyprune import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
              "    code = e.code\nprint('torch' in sys.modules, code)")
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(Path(pyprune.__file__).parents[1])))
    answered = argv in (["--help"], ["--version"])
    assert done.stdout.strip().splitlines()[-1] == f"False {0 if answered else 2}", done.stderr
    if argv == ["--version"]:
        assert done.stdout.splitlines()[0] == f"pyprune {pyprune.__version__}"
    elif not answered:  # one line, as every refusal: no usage block
        assert done.stderr.startswith("pyprune: error: ") and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.endswith("(`pyprune --help` lists the arguments)\n")


@pytest.mark.parametrize("argv,message", [
    (["prune", "--model", "m", "--method", "magnitude", "--sparsity", "50%"],
     "argument --sparsity: invalid float value: '50%'"),
    (["compare"], "the following arguments are required: reports"),
    (["generate", "--model", "m", "--prompt", "hi", "--sparsify", "3:4"], "argument --sparsify: invalid choice: '3:4'"),
    (["prune", "--model", "m", "--method", "wanda", "--owl", "maybe"], "argument --owl: expected true or false")])
def test_a_flag_argparse_refuses_is_one_line_without_the_usage_block(argv, message):
    """A value of the wrong type, a missing argument, a choice outside the allowed: one line, exit 2,
    naming the flag and pointing at --help (the usage block argparse prints first is gone)."""
    done = subprocess.run([sys.executable, "-m", "pyprune", *argv], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(Path(pyprune.__file__).parents[1])))
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"pyprune {argv[0]}: error: "), done.stderr
    assert message in done.stderr and done.stderr.endswith(f"(`pyprune {argv[0]} --help` lists the arguments)\n")


@pytest.mark.parametrize("argv", [["prune", "--method", "nope", "--help"], ["prune", "--method=nope", "-h"],
                                  ["robustness", "--method", "wanda", "--help"]])
def test_help_with_a_method_that_does_not_serve_the_command_is_an_error(argv, capsys):
    """``--help`` is answered for a method's own flags, so a method that is unknown, or does not serve
    the command, is refused first: one line, exit 2, never the generic help with exit 0."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "--method" in captured.err


@pytest.mark.parametrize("method", [None, *sorted(pyprune.methods.METHODS)])
def test_every_flag_of_every_subcommand_says_what_it_does(method):
    subparsers = next(a for a in cli.build_parser(method)._actions if a.dest == "command")
    for command, parser in subparsers.choices.items():
        silent = [action.option_strings or action.dest for action in parser._actions
                  if not (action.help or "").strip()]
        assert not silent, f"pyprune {command} (--method {method}): flags without help: {silent}"


def test_threads_and_quiet_hold_for_the_run_only(tiny_model_dir, tmp_path, capsys):
    """--threads sets torch's threads for the run (the report records them), --quiet silences
    transformers' loading bar; both are undone when the command returns."""
    model_dir, text = tiny_model_dir
    argv = ["eval", "--model", str(model_dir), "--data", str(text), "--seqlen", "16"]
    threads = torch.get_num_threads()
    assert cli.main(argv) == 0
    assert "Loading weights" in capsys.readouterr().err  # what --quiet takes away
    report = tmp_path / "eval.json"
    assert cli.main(argv + ["--quiet", "--threads", str(threads + 1), "--report", str(report)]) == 0
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "%|" not in err, err
    assert json.loads(report.read_text())["threads"] == threads + 1
    assert torch.get_num_threads() == threads
    assert cli.main(argv) == 0
    assert "Loading weights" in capsys.readouterr().err
