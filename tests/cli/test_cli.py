"""The command line: bad input gives a one-line error, exit status 2, and writes nothing."""
import os
import subprocess
import sys

import pytest

from pyprune import cli
from tests.helpers import kernel_dispatch_cache

EMMA = "emma"  # the embedded corpus


@pytest.mark.parametrize("args,message", [
    (["--method", "obs", "--pattern", "2:4"], "method must be one of"),
    (["--method", "wanda", "--pattern", "2:5:3"], "pattern must look like N:M"),
    (["--method", "wanda", "--pattern", "0.5"], "--pattern takes N:M"),
    (["--method", "wanda", "--sparsity", "1.2"], r"sparsity must be a number in \[0, 1\)"),
    (["--method", "wanda", "--sparsity", "0.5", "--pattern", "2:4"], "exactly one of"),
    (["--method", "wanda", "--ratio", "0.2"],
     "method 'wanda' supports patterns Unstructured, NM; got structured 0.2: write --sparsity 0.2 or --pattern 2:4$"),
    (["--method", "taylor", "--pattern", "2:4"], "method 'taylor' supports patterns Structured; got 2:4: write --ratio 0.5$"),
    (["--method", "wanda", "--pattern", "2:4", "--calib", "missing.txt"], "source='missing.txt' is neither"),
    (["--method", "wanda", "--pattern", "2:4", "--eval", "nope/"], "source='nope/' is neither"),
    (["--method", "wanda", "--pattern", "2:4", "--nsamples", "0"], "--nsamples must be >= 1"),
    (["--method", "wanda", "--sparsity", "0.5", "--sparse-layers"], "--sparse-layers needs --pattern N:M"),
    (["--method", "wanda", "--pattern", "2:4", "--calib", "emma:third_half"], "emma:third_half' is neither"),
])
def test_bad_prune_arguments(tmp_path, capsys, args, message):
    output = tmp_path / "out"
    argv = ["prune", "--model", str(tmp_path / "never-loaded"), "--calib", EMMA, "--output", str(output)] + args
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert __import__("re").search(message, err), err
    assert not output.exists()


def test_missing_parents_of_output_and_report_are_created(tiny_model_dir, tmp_path):
    """As ``mkdir -p``: --output and --report under folders that do not exist yet are written, the
    folders made when the results are written (never by a refused run: see test_bad_prune_arguments)."""
    model_dir, _ = tiny_model_dir
    output, report = tmp_path / "runs" / "a" / "out", tmp_path / "reports" / "b" / "r.json"
    assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "2:4", "--output",
                     str(output), "--report", str(report), "--quiet"]) == 0
    assert (output / "pyprune.json").is_file() and report.is_file()


def test_overwrite_replaces_only_a_directory_pyprune_saved(tiny_model_dir, tmp_path, capsys):
    import json
    model_dir, text = tiny_model_dir
    output, foreign = tmp_path / "out", tmp_path / "mine"
    prune = ["prune", "--model", str(model_dir), "--pattern", "2:4", "--quiet", "--output"]
    assert cli.main(prune + [str(output), "--method", "magnitude"]) == 0
    assert cli.main(prune + [str(output), "--method", "magnitude"]) == 2
    assert "already exists and is not an empty directory (--overwrite replaces" in capsys.readouterr().err
    assert cli.main(prune + [str(output), "--method", "wanda", "--calib", str(text), "--nsamples", "2",
                             "--seqlen", "16", "--overwrite"]) == 0
    assert json.loads((output / "pyprune.json").read_text())["report"]["method"] == "wanda"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    assert cli.main(prune + [str(foreign), "--method", "magnitude", "--overwrite"]) == 2
    assert "holds files pyprune did not write (no pyprune.json)" in capsys.readouterr().err
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_existing_output_is_refused(tmp_path, capsys):
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    argv = ["prune", "--model", "smollm2-135m", "--method", "wanda", "--pattern", "2:4",
            "--calib", EMMA, "--output", str(output)]
    assert cli.main(argv) == 2
    assert "already exists" in capsys.readouterr().err
    assert os.listdir(output) == ["keep.txt"]


def test_help_documents_every_command():
    out = subprocess.run([sys.executable, "-m", "pyprune.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("prune", "eval", "demo"):
        assert command in out
    prune_help = subprocess.run([sys.executable, "-m", "pyprune.cli", "prune", "--help"],
                                capture_output=True, text=True, check=True).stdout
    for flag in ("--model", "--method", "--sparsity", "--pattern", "--ratio", "--calib", "--nsamples",
                 "--seqlen", "--seed", "--eval", "--output", "--report", "--device", "--dtype"):
        assert flag in prune_help


def test_argparse_errors_exit_with_status_2():
    result = subprocess.run([sys.executable, "-m", "pyprune.cli", "prune", "--method", "wanda"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "required" in result.stderr


@pytest.mark.parametrize("method_args,check", [
    (["--method", "wanda", "--pattern", "2:4"], "2:4"),
    (["--method", "sparsegpt", "--sparsity", "0.5"], "unstructured 0.5"),
    (["--method", "taylor", "--ratio", "0.25"], "structured 0.25"),
    (["--method", "moreau-gs", "--ratio", "0.25", "--steps", "2"], "structured 0.25"),
    (["--method", "smoothgrad", "--ratio", "0.25", "--passes", "2"], "structured 0.25"),
    (["--method", "safe", "--sparsity", "0.5", "--epochs", "1", "--lr", "1e-3"], "unstructured 0.5"),
    (["--method", "safe+", "--pattern", "2:4", "--epochs", "1", "--dual-interval", "2", "--rho", "0.01",
      "--lam", "0.01"], "2:4"),
])
def test_prune_writes_a_loadable_model_and_a_report(tiny_model_dir, tmp_path, method_args, check):
    import json

    import pyprune
    model_dir, text = tiny_model_dir
    output, report_path = tmp_path / "out", tmp_path / "report.json"
    argv = ["prune", "--model", str(model_dir), *method_args, "--calib", str(text), "--nsamples", "4",
            "--seqlen", "16", "--eval", str(text), "--eval-seqlen", "16", "--output", str(output),
            "--report", str(report_path), "--quiet"]
    assert cli.main(argv) == 0
    report = json.loads(report_path.read_text())
    assert report["method"] == method_args[1] and report["pattern"] == check
    assert report["time_s"] >= 0 and 0 < report["sparsity"] < 1
    assert [e["data"] for e in report["eval"]] == [str(text)]
    assert report["eval"][0]["tokens"] > 0 and report["eval"][0]["perplexity"] > 1
    model, _ = pyprune.load(str(output))
    if check == "2:4":
        assert pyprune.nn.measure.sparsity_report(model)["nm_valid"]["2:4"]
    assert cli.main(["eval", "--model", str(output), "--data", str(text), "--seqlen", "16", "--quiet"]) == 0


def test_method_options_reach_the_method_and_the_report(tiny_model_dir, tmp_path):
    import json
    model_dir, text = tiny_model_dir
    report_path = tmp_path / "report.json"
    assert cli.main(["prune", "--model", str(model_dir), "--method", "moreau-gs", "--ratio", "0.5",
                     "--calib", str(text), "--nsamples", "4", "--seqlen", "16", "--steps", "2",
                     "--eta", "0.001", "--group", "columns", "--heads", "false", "--decay", "false",
                     "--average-last", "2", "--smooth", "all", "--operator", "released", "--report", str(report_path),
                     "--quiet"]) == 0
    report = json.loads(report_path.read_text())
    assert report["options"] == {"first_layer": 0, "last_layer": None, "heads": False, "channels": True,
                                 "structure": "groups",
                                 "loss_scaling": False, "rho": 0.2, "gamma": 0.0002, "steps": 2, "noise_draws": 1, "noise_std": 0.05,
                                 "noise_seed": 0, "eta": 0.001, "group": "columns", "decay": False,
                                 "average_last": 2, "smooth": "all", "operator": "released"}
    assert all(e["heads"] == 4 for e in report["structure"])  # heads=false kept every head


@pytest.mark.parametrize("given,value", [([], None), (["--owl"], True), (["--owl", "true"], True),
                                         (["--owl", "false"], False), (["--owl", "--owl-lambda", "0.1"], True)])
def test_a_bool_option_alone_is_true(given, value):
    """``--owl`` as a switch, as a new user writes it, besides ``--owl true`` / ``false``."""
    args = cli.build_parser("wanda", ["prune"]).parse_args(
        ["prune", "--model", "m", "--method", "wanda", "--sparsity", "0.5", *given])
    assert args.option_owl is value


@pytest.mark.parametrize("args,message", [
    (["--method", "taylor", "--ratio", "0.2", "--rho", "0.1"], "method 'taylor' has no option rho"),
    (["--method", "moreau", "--ratio", "0.2", "--gamma", "0.06"], "gamma of method 'moreau' must be < rho"),
    (["--method", "sparsegpt", "--pattern", "2:4", "--blocksize", "0"], "blocksize of method 'sparsegpt' must be >= 1"),
    (["--method", "safe", "--pattern", "2:4", "--dual-interval", "0"], "dual_interval of method 'safe' must be >= 1"),
    (["--method", "safe+", "--pattern", "2:4", "--lam", "-1"], "lam of method 'safe+' must be >= 0"),
    (["--method", "safe", "--pattern", "2:4", "--lr", "0"], "lr of method 'safe' must be > 0"),
    (["--method", "safe", "--pattern", "2:4", "--beta2", "1"], "beta2 of method 'safe' must be in [0, 1)"),
    (["--method", "safe+", "--pattern", "2:4", "--lam", "300"], "must have lr * lam <= 1 with penalty 'decoupled'"),
    (["--method", "safe", "--ratio", "0.2"], "method 'safe' supports patterns Unstructured, NM; got structured 0.2"),
    (["--method", "wanda", "--pattern", "2:4", "--scope", "tensor"], "--scope applies to --sparsity only; got it with "
                                                                      "--pattern"),
    (["--method", "wanda", "--sparsity", "0.5", "--uniform"], "--uniform applies to --ratio only; got it with --sparsity"),
    (["--method", "alps", "--pattern", "2:4", "--admm-iterations", "5"], "must have min_iterations <= admm_iterations"),
    (["--method", "wanda", "--pattern", "2:4"], "nothing would keep the pruned model or say how it did: give --output"),
])
def test_bad_method_options_fail_before_loading(tmp_path, capsys, args, message):
    argv = ["prune", "--model", str(tmp_path / "never-loaded"), "--calib", "emma", *args]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_method_option_choices_are_checked_by_argparse(tmp_path, capsys):
    argv = ["prune", "--model", str(tmp_path / "never-loaded"), "--calib", "emma", "--method", "moreau-gs",
            "--ratio", "0.2", "--group", "heads"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2 and "invalid choice: 'heads'" in capsys.readouterr().err


def test_magnitude_needs_no_calibration(tiny_model_dir, tmp_path):
    import json
    model_dir, text = tiny_model_dir
    report_path = tmp_path / "report.json"
    assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "2:4",
                     "--report", str(report_path), "--quiet"]) == 0
    report = json.loads(report_path.read_text())
    assert report["nm_valid"]["2:4"] is True and report["calib"] is None
    assert not {"nsamples", "seqlen", "seed"} & set(report), "settings of a calibration that never ran"


def test_calibrated_method_without_calib_is_refused(tmp_path, capsys):
    argv = ["prune", "--model", str(tmp_path / "never-loaded"), "--method", "wanda", "--pattern", "2:4"]
    assert cli.main(argv) == 2
    assert "method 'wanda' needs --calib" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_end_to_end():
    """The README's first command: Wanda 2:4 on SmolLM2-135M from the embedded Austen texts."""
    import re
    result = subprocess.run([sys.executable, "-m", "pyprune.cli", "demo", "--nsamples", "4",
                             "--eval-tokens", "2048", "--quiet"], capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "every linear layer of every block is 2:4 = True" in result.stdout
    dense, pruned = map(float, re.search(r"dense ([\d.]+) -> pruned ([\d.]+)", result.stdout).groups())
    assert 10 < dense < 60 and dense < pruned < 50 * dense


def test_prune_can_store_sparse_layers(tiny_model_dir, tmp_path):
    import json

    import pyprune
    from pyprune.nn import SparseLinear
    model_dir, text = tiny_model_dir
    output, report_path, eval_path = tmp_path / "out", tmp_path / "report.json", tmp_path / "eval.json"
    assert cli.main(["prune", "--model", str(model_dir), "--method", "wanda", "--pattern", "4:8",
                     "--calib", str(text), "--nsamples", "4", "--seqlen", "16", "--eval", str(text),
                     "--eval-seqlen", "16", "--output", str(output), "--report", str(report_path),
                     "--sparse-layers", "--quiet"]) == 0
    report = json.loads(report_path.read_text())
    model, _ = pyprune.load(str(output))
    layers = [m for m in model.modules() if isinstance(m, SparseLinear)]
    assert report["sparse_layers"] == len(layers) > 0 and all(str(m.pattern) == "4:8" for m in layers)
    assert cli.main(["eval", "--model", str(output), "--data", str(text), "--seqlen", "16",
                     "--report", str(eval_path), "--quiet"]) == 0
    evaluated = json.loads(eval_path.read_text())
    ppl = evaluated["eval"][0]["perplexity"]
    assert abs(ppl - report["eval"][0]["perplexity"]) < 1e-3 * ppl


def _help(*argv) -> str:
    out = subprocess.run([sys.executable, "-m", "pyprune.cli", *argv, "--help"], capture_output=True, text=True,
                         check=True).stdout
    return " ".join(out.split())


def test_a_subcommand_offers_only_the_named_methods_options():
    """Options belong to a method: none without --method, that method's alone with it."""
    assert "--rho" not in _help("prune") and "--channels" not in _help("prune")
    taylor = _help("prune", "--method", "taylor")
    assert "--channels" in taylor and "--rho" not in taylor and "DReSS" not in taylor
    dress = _help("prune", "--method", "dress")
    assert "--channels" in dress and "--heads" not in dress
    continual = _help("continual", "--method", "copal")
    assert "--epsilon" in continual and "--calib CALIB" not in continual and "--ratio" not in continual
    assert "--nsamples" in continual and "16 for copal" in continual


def test_calibration_defaults_are_listed_per_method():
    text = _help("prune")
    for name, cls in __import__("pyprune").methods.METHODS.items():
        assert f"{cls.calibration[0]} for" in text and name in text


def test_structured_channels_flag_is_a_bool_and_dress_channels_a_choice(tmp_path, capsys):
    """--channels true|false of the structured methods is no longer taken by DReSS's choices."""
    base = ["prune", "--model", str(tmp_path / "never-loaded"), "--calib", EMMA, "--report", str(tmp_path / "r.json")]
    assert cli.main(base + ["--method", "taylor", "--ratio", "0.2", "--channels", "false"]) == 2
    assert "never-loaded" in capsys.readouterr().err  # got past parsing, to the model check
    assert cli.main(base + ["--method", "dress", "--ratio", "0.2", "--channels", "last"]) == 2
    assert "never-loaded" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(base + ["--method", "dress", "--ratio", "0.2", "--channels", "false"])
    assert "invalid choice: 'false'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["continual", "--method", "safe", "--sparsity", "0.5", "--datasets", "emma", "persuasion"],
     "--method for continual must be one of copal, sparsegpt, wanda; got 'safe'"),
    (["robustness", "--method", "dress", "--ratio", "0.2", "--calib", "emma", "--eval", "emma"],
     "--method for robustness must be one of moreau, moreau-gs, smoothgrad, taylor; got 'dress'"),
    (["prune", "--method", "wanda", "--pattern", "2:4", "--calib", "emma", "--lam", "1"],
     "method 'wanda' has no option lam; its options: owl, owl_m, owl_lambda, dsnot, dsnot_cycles, dsnot_threshold, dsnot_var_power, dsnot_layers, checkpoint"),
    (["prune", "--method", "wanda", "--pattern", "2:4", "--calib", "emma", "--no-such-flag"],
     "unrecognized arguments: --no-such-flag"),
    (["continual", "--method", "copal", "--sparsity", "0.5", "--datasets", "emma", "persuasion", "--state", "s"],
     "the continual runner keeps COPAL's state in memory"),
])
def test_method_and_option_errors_name_what_is_allowed(tmp_path, capsys, argv, message):
    argv = argv + ["--model", str(tmp_path / "never-loaded")]
    if argv[0] != "prune":
        argv += ["--report", str(tmp_path / "r.json")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert os.listdir(tmp_path) == []


def test_a_method_is_registered_by_defining_it():
    """A new method is one module: subclassing Method with a name registers it for every entry point."""
    from pyprune import methods
    from pyprune.methods.magnitude import Magnitude

    class Halved(Magnitude):
        name = "test-halved"
        commands = ("prune", "continual")
    try:
        assert methods.get("test-halved").name == "test-halved"
        assert "test-halved" in methods.serving("continual") and "test-halved" not in methods.serving("robustness")
        with pytest.raises(ValueError, match="method name 'wanda' is taken by pyprune.methods.wanda.Wanda"):
            type("Clash", (Magnitude,), {"name": "wanda"})
    finally:
        methods.METHODS.pop("test-halved")


def test_generate_with_sparse_layers_prints_the_dense_models_text(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """``pyprune generate`` on a model saved with SparseLinear layers, run on the sparse kernel (this
    machine's dispatch cache naming it for every layer, so on every machine): the text the same
    weights give as plain dense linears, and the speed line."""
    import pyprune
    from pyprune.runtime.decode import greedy_generate
    from pyprune.nn import SparseLinear, dispatch
    model_dir, _ = tiny_model_dir
    output = tmp_path / "out"
    assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "2:4",
                     "--output", str(output), "--sparse-layers", "--quiet"]) == 0
    capsys.readouterr()
    model, tok = pyprune.load(str(output))
    shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, SparseLinear)}
    kernel_dispatch_cache(monkeypatch, tmp_path / "kernel-cache", shapes)
    prompt = "the man was good"
    assert cli.main(["generate", "--model", str(output), "--prompt", prompt, "--max-new-tokens", "5",
                     "--sparse-where", "all"]) == 0
    text, speed = capsys.readouterr().out.strip().splitlines()[-2:]
    # by default a layer without a measured sparse speed-up (here: an empty cache) runs dense
    monkeypatch.setattr(dispatch, "cache_root", lambda: str(tmp_path / "empty-cache"))
    assert cli.main(["generate", "--model", str(output), "--prompt", prompt, "--max-new-tokens", "5"]) == 0
    default_text, default_speed = capsys.readouterr().out.strip().splitlines()[-2:]
    assert default_text == text and "; 0 SparseLinear layers, 14 N:M layers as nn.Linear," in default_speed
    for name, module in list(model.named_modules()):
        if isinstance(module, SparseLinear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.to_dense())
    ids = tok(prompt, return_tensors="pt").input_ids
    expected = greedy_generate(model, ids, 5).tokens[0].tolist()
    assert text == tok.decode(ids[0].tolist() + expected, skip_special_tokens=True)
    assert speed.startswith("[5 new tokens; prefill of") and "tokens/s; 14 SparseLinear layers (2:4), 0 N:M layers" in speed


@pytest.mark.parametrize("args,message", [
    (["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "  "], "--prompt is empty"),
    (["--prompt", "a", "--threads", "0"], "--threads must be >= 1"),
])
def test_bad_generate_arguments(tmp_path, capsys, args, message):
    assert cli.main(["generate", "--model", str(tmp_path / "never-loaded")] + args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_tune_measures_a_models_shapes_prints_the_table_and_fills_the_cache(tiny_model_dir, tmp_path, capsys,
                                                                              monkeypatch):
    """``pyprune tune`` on a saved 2:4 model measures each (shape bucket, token bucket) once, even
    with on-the-fly tuning off (and then says nothing about turning it off); a matrix and its
    transpose are two rows; a second run reads the cache; ``generate`` then times only what the
    cache lacks, and says so."""
    import json
    import re

    import torch

    from pyprune.nn import dispatch
    model_dir, _ = tiny_model_dir
    output = tmp_path / "out"
    assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "2:4",
                     "--output", str(output), "--sparse-layers", "--quiet"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("PYPRUNE_TUNE", "0")
    assert cli.main(["tune", "--model", str(output), "--tokens", "1", "3"]) == 0
    out, err = capsys.readouterr()
    assert "PYPRUNE_TUNE" not in err and "timing SparseLinear" not in err, err  # asked for by name: no notice
    lines = out.strip().splitlines()
    assert lines[0] == f"machine {dispatch.device_key(torch.device('cpu'))}"  # then the environment, the table
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[4:-1]]
    # q/o 64x64, k/v 32x64, gate/up 128x64, down 64x128 (its own row): 4 buckets x 2 token counts
    assert sorted((r[0], r[1], r[4]) for r in rows) == sorted(
        (count, shape, tokens) for count, shape in (("4", "64×64"), ("4", "32×64"), ("4", "128×64"), ("2", "64×128"))
        for tokens in ("1", "3"))
    assert {r[8] for r in rows} <= {"kernel", "dense"} and {r[9] for r in rows} == {"measured"}
    assert all(float(r[5]) > 0 and float(r[6]) > 0 for r in rows)
    assert lines[-1].startswith("[8 cases measured in")
    entries = json.loads(open(dispatch.cache_path(torch.device("cpu")), encoding="utf-8").read())["entries"]
    assert len(entries) == 8 and all(k.endswith(("|1", "|4")) and k.startswith("float32|2:4|") for k in entries)
    assert cli.main(["tune", "--model", str(output), "--tokens", "1", "3"]) == 0
    again = capsys.readouterr().out.strip().splitlines()
    assert all(line.endswith("| cache |") for line in again[4:-1]) and "[0 cases measured" in again[-1]

    monkeypatch.setenv("PYPRUNE_TUNE", "1")
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", str(tmp_path / "no-table.json"))
    assert cli.main(["generate", "--model", str(output), "--prompt", "the man was good", "--max-new-tokens",
                     "2"]) == 0
    speed = capsys.readouterr().out.strip().splitlines()[-1]
    tuned = re.search(r"first-use tuning (\d+) cases (\d+) ms, (\d+) ms of it inside the prefill", speed)
    assert tuned is not None, speed
    entries = json.loads(open(dispatch.cache_path(torch.device("cpu")), encoding="utf-8").read())["entries"]
    assert len(entries) == 8 + int(tuned[1]) and int(tuned[3]) <= int(tuned[2])


def test_tune_prints_the_machine_its_environment_and_where_each_answer_came_from(tiny_model_dir, tmp_path, capsys,
                                                                                 monkeypatch):
    """At the top the machine key and the environment the answers are kept for (ISA flags,
    last-level cache, threads, torch); per case its source: this machine's cache, a shipped
    ``dense`` row of this very environment (prior), or a measurement taken now (a shipped ``kernel``
    row is measured, and so is a row of another CPU of the same name)."""
    import json

    import torch

    from pyprune.nn import dispatch
    model_dir, _ = tiny_model_dir
    output = tmp_path / "out"
    assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "2:4",
                     "--output", str(output), "--sparse-layers", "--quiet"]) == 0
    capsys.readouterr()
    cpu = torch.device("cpu")
    here = dispatch.environment(cpu)
    another = dict(here, machine=dict(here["machine"], flags=["avx2", "f16c", "fma"], model_number="1"))
    key = lambda out, tokens: dispatch.case_key(torch.float32, "2:4", out, 64, tokens)  # noqa: E731
    table = tmp_path / "table.json"  # q/o 64x64, k/v 32x64; one token
    table.write_text(json.dumps({"environments": [
        {"environment": here, "entries": {key(64, 1): {"implementation": "dense"}, key(32, 1): {"implementation": "kernel"}}},
        {"environment": another, "entries": {key(128, 1): {"implementation": "dense"}}}]}))
    monkeypatch.setenv("PYPRUNE_DISPATCH_TABLE", str(table))
    dispatch.record(cpu, {key(64, 3): {"implementation": "dense", "kernel_ms": 0.5, "dense_ms": 0.4}})
    assert cli.main(["tune", "--model", str(output), "--tokens", "1", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    machine = here["machine"]
    assert lines[0] == f"machine {dispatch.device_key(cpu)}" and lines[0].startswith(f"machine cpu/{machine['model']}/")
    assert lines[1] == (f"environment: flags {' '.join(machine['flags']) or 'none'}; last-level cache "
                        f"{machine['llc_bytes']} bytes; {here['threads']} threads; torch {torch.__version__}; "
                        f"pyprune {here['pyprune']}; native kernels {dispatch.native_kernels(cpu)}")
    sources = {(r[1], r[4]): r[9] for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[4:-1])}
    assert sources == {("64×64", "1"): "prior", ("64×64", "3"): "cache", ("32×64", "1"): "measured",
                       ("32×64", "3"): "measured", ("128×64", "1"): "measured", ("128×64", "3"): "measured",
                       ("64×128", "1"): "measured", ("64×128", "3"): "measured"}  # another CPU's row answers none
    assert lines[-1].startswith("[6 cases measured in")


def test_tune_refuses_a_model_without_n_m_layers(tiny_model_dir, capsys):
    """Known only once loaded (the flags' checks are in test_bad_input): one error line after the progress."""
    model_dir, _ = tiny_model_dir
    assert cli.main(["tune", "--model", str(model_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"pyprune tune: error: --model {model_dir} has no N:M sparse linear layers (prune it "
                       "with --pattern 2:4 or 4:8 first)"), err


def test_safe_with_fewer_steps_than_its_dual_interval_warns_once_in_one_line(tiny_model_dir, tmp_path, capsys):
    """4 samples in batches of 2 for 1 epoch are 2 steps a block, under the dual interval of 8: no
    ADMM dual update runs. Said in one line before the model loads (and not again), --quiet or not;
    the run still does what was asked and its report shows 0 dual updates."""
    import json
    model_dir, text = tiny_model_dir
    report_path = tmp_path / "report.json"
    argv = ["prune", "--model", str(model_dir), "--method", "safe", "--pattern", "2:4", "--epochs", "1",
            "--calib", str(text), "--nsamples", "4", "--seqlen", "16", "--report", str(report_path), "--quiet"]
    assert cli.main(argv) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == ["pyprune prune: warning: method 'safe': 4 calibration samples, 1 epochs of batches of 2 give "
                      "2 steps a block, fewer than dual_interval=8, so no dual update will run; raise nsamples or "
                      "epochs, or lower dual_interval"]
    assert json.loads(report_path.read_text())["dual_updates_per_block"] == 0
    assert cli.main(argv[:-1] + ["--dual-interval", "2"]) == 0  # two steps, one dual update: nothing to say
    assert "warning" not in capsys.readouterr().err


def test_left_dense_matrices_are_named_not_guessed(tiny_model_dir, tmp_path, capsys):
    """SliceGPT on a dense Llama leaves its shortcut rotations dense: the line names one of them and
    no longer calls them MoE routers."""
    model_dir, text = tiny_model_dir
    assert cli.main(["prune", "--model", str(model_dir), "--method", "slicegpt", "--ratio", "0.25", "--calib",
                     str(text), "--nsamples", "4", "--seqlen", "16", "--report", str(tmp_path / "r.json"),
                     "--quiet"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("left dense"))
    assert "MoE" not in line and ", e.g. model.layers." in line, line


def test_an_eval_report_of_a_pruned_model_says_how_it_was_pruned(tiny_model_dir, tmp_path):
    """``pyprune eval`` on a pyprune output records the prune's method, pattern and sparsity (from its
    pyprune.json), so ``compare`` labels the row by what was measured, not "dense"; a model pyprune
    did not prune records none."""
    import json
    from pyprune.studies import compare
    model_dir, text = tiny_model_dir
    assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "2:4", "--output",
                     str(tmp_path / "m24"), "--quiet"]) == 0
    for model, name in ((tmp_path / "m24", "pruned.json"), (model_dir, "dense.json")):
        assert cli.main(["eval", "--model", str(model), "--data", str(text), "--seqlen", "16", "--report",
                         str(tmp_path / name), "--quiet"]) == 0
    pruned, dense = (json.loads((tmp_path / name).read_text()) for name in ("pruned.json", "dense.json"))
    assert (pruned["method"], pruned["pattern"]) == ("magnitude", "2:4") and pruned["sparsity"] == pytest.approx(0.5)
    assert not {"method", "pattern", "sparsity"} & set(dense)
    labels = [(row["method"], row["pattern"]) for row in compare.rows([dense, pruned])]
    assert labels == [("dense", "-"), ("magnitude", "2:4")]


def test_generate_stops_at_the_models_end_of_sequence_token_unless_told_to_ignore_it(tiny_model_dir, tmp_path, capsys):
    """The tiny model's generation_config names two EOS ids, one of them the third token it generates
    greedily: ``generate`` stops there (EOS kept out of the text, the line says so); ``--ignore-eos``
    runs all --max-new-tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyprune.runtime.decode import greedy_generate
    model_dir, _ = tiny_model_dir
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    prompt = "the man was good"
    ids = tok(prompt, return_tensors="pt").input_ids
    free = greedy_generate(model, ids, 8).tokens[0].tolist()
    at = next(i for i, token in enumerate(free) if i >= 2 and token not in free[:i])  # its first appearance
    model.generation_config.eos_token_id = [tok.vocab_size + 7, free[at]]  # several, as Gemma's
    forced = tmp_path / "forced-eos"
    model.save_pretrained(forced)
    tok.save_pretrained(forced)
    assert cli.main(["generate", "--model", str(forced), "--prompt", prompt, "--max-new-tokens", "8"]) == 0
    text, speed = capsys.readouterr().out.strip().splitlines()[-2:]
    assert speed.startswith(f"[{at + 1} new tokens (stopped at the end-of-sequence token); prefill of"), speed
    assert text == tok.decode(ids[0].tolist() + free[:at + 1], skip_special_tokens=True)
    assert cli.main(["generate", "--model", str(forced), "--prompt", prompt, "--max-new-tokens", "8",
                     "--ignore-eos"]) == 0
    speed = capsys.readouterr().out.strip().splitlines()[-1]
    assert speed.startswith("[8 new tokens; prefill of"), speed


def test_generate_refuses_past_the_context_and_says_when_sparsify_converts_nothing(tiny_model_dir, tmp_path,
                                                                                 capsys, monkeypatch):
    """Tokens past max_position_embeddings (2048 here) are refused before the model loads, saying how
    many fit; ``--sparsify 2:4`` on a 4:8 model says in one line that it converts nothing and why."""
    model_dir, _ = tiny_model_dir
    monkeypatch.setattr("pyprune.inputs.models.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", "the man was good", "--max-new-tokens",
                     "2048"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pyprune generate: error: --max-new-tokens 2048 after a prompt of ") and \
        "passes the model's context of 2048 tokens; give at most 204" in err, err
    monkeypatch.undo()
    output = tmp_path / "m48"
    assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "4:8",
                     "--output", str(output), "--quiet"]) == 0
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(output), "--prompt", "the man", "--max-new-tokens", "1",
                     "--sparsify", "2:4", "--sparse-where", "all"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pyprune generate: --sparsify 2:4 converts nothing: no linear layer is 2:4 sparse (14 are 4:8; "
                   "--sparsify auto takes each layer's own pattern)"]
