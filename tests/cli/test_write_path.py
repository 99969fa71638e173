"""Where the CLI writes: every destination (--output, --report, a method's directories, compare's
files) is checked before the model loads; a refused one exits 2 with one line and changes nothing;
and a finished prune is never lost to a late write error."""
import json
import os
import re
import stat

import pytest

import pyprune
from pyprune import cli
from pyprune.cli import steps
from pyprune.files import TEMP_TAG
from tests.helpers import WORDS, tiny_llama, tiny_tokenizer

WANDA = ["--method", "wanda", "--pattern", "2:4"]


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """A tiny model, a text, a fifo, a regular file, links, a compare report."""
    base = tmp_path_factory.mktemp("write-path")
    model = base / "tiny"
    tiny_llama(hidden=64, heads=4, kv_heads=2).save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    (base / "text.txt").write_text(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(600)))
    os.mkfifo(base / "fifo")
    (base / "elsewhere").mkdir()
    (base / "elsewhere" / "report.json").write_text("{}")
    os.symlink(base / "elsewhere" / "report.json", base / "link.json")
    os.symlink(base / "elsewhere", base / "link-dir")
    (base / "report.json").write_text(json.dumps({"eval": [{"data": "x", "perplexity": 2.0}]}))
    return base


def _tree(root):
    """Every entry under ``root``: its kind, link target or content."""
    out = {}
    for path in sorted(root.rglob("*")):
        mode = os.lstat(path).st_mode
        out[str(path.relative_to(root))] = (os.readlink(path) if stat.S_ISLNK(mode) else "fifo" if stat.S_ISFIFO(mode)
                                            else path.read_bytes() if stat.S_ISREG(mode) else "dir")
    return out


PRUNE = ["prune", "--model", "{tiny}", *WANDA, "--calib", "{text.txt}"]
RECOVER = ["recover", "--model", "{tiny}", "--calib", "{text.txt}", "--steps", "1"]
CONTINUAL = ["continual", "--model", "{tiny}", "--method", "wanda", "--sparsity", "0.5", "--datasets", "emma",
             "persuasion"]
ROBUSTNESS = ["robustness", "--model", "{tiny}", "--method", "taylor", "--ratio", "0.25", "--calib", "{text.txt}",
              "--eval", "{text.txt}"]

#: (case id, argv, the error's regex, environment): one per class of destination
CASES = [
    ("prune-report-device", PRUNE + ["--report", "/dev/null"], r"--report /dev/null is a device", {}),
    ("prune-report-fifo", PRUNE + ["--report", "{fifo}"], r"--report .*fifo is a fifo", {}),
    ("prune-report-symlink", PRUNE + ["--report", "{link.json}"], r"--report .*link.json is a symbolic link", {}),
    ("prune-report-under-a-file", PRUNE + ["--report", "{text.txt}/r.json"], r"text.txt is a file, not a directory",
     {}),
    ("prune-report-in-proc", PRUNE + ["--report", "/proc/pyprune-report.json"],
     r"--report /proc/pyprune-report.json: cannot create files in /proc", {}),
    ("prune-report-is-output", PRUNE + ["--output", "{new}", "--report", "{new}"], r"--report .*new is also --output",
     {}),
    ("prune-output-empty", PRUNE + ["--output", ""], r"--output is empty; give a path", {}),
    ("prune-output-symlink", PRUNE + ["--output", "{link-dir}"], r"--output .*link-dir is a symbolic link", {}),
    ("prune-output-inside-input", PRUNE + ["--output", "{tiny}/pruned"],
     r"--output .*tiny/pruned is inside the input model", {}),
    ("prune-output-parent-of-input", PRUNE + ["--output", "{.}"], r"--output .* contains the input model", {}),
    ("prune-output-under-a-file", PRUNE + ["--output", "{text.txt}/out"], r"text.txt is a file, not a directory",
     {}),
    ("prune-checkpoint-inside-input", PRUNE + ["--checkpoint", "{tiny}/ck", "--eval", "{text.txt}"],
     r"--checkpoint .*tiny/ck is inside the input model", {}),
    ("prune-checkpoint-a-file", PRUNE + ["--checkpoint", "{text.txt}"],
     r"option checkpoint of method 'wanda' must be a directory pyprune can write", {}),
    ("prune-cache-under-a-file", ["prune", "--model", "smollm2-135m", *WANDA, "--calib", "{text.txt}", "--eval",
                                  "{text.txt}"],
     r"PYPRUNE_CACHE=.*text.txt/cache is not usable: .*set PYPRUNE_CACHE to a writable directory",
     {"PYPRUNE_CACHE": "{text.txt}/cache"}),
    ("prune-cache-in-proc", ["prune", "--model", "smollm2-135m", *WANDA, "--calib", "{text.txt}", "--eval",
                             "{text.txt}"],
     r"PYPRUNE_CACHE=/proc/pyprune-cache is not usable", {"PYPRUNE_CACHE": "/proc/pyprune-cache"}),
    ("eval-report-device", ["eval", "--model", "{tiny}", "--data", "{text.txt}", "--report", "/dev/null"],
     r"--report /dev/null is a device", {}),
    ("eval-report-inside-input", ["eval", "--model", "{tiny}", "--data", "{text.txt}", "--report", "{tiny}/r.json"],
     r"--report .*tiny/r.json is inside the input model", {}),
    ("eval-tasks-cache-under-a-file", ["eval", "--model", "{tiny}", "--tasks", "austen_continuation"],
     r"--tasks: PYPRUNE_CACHE=.*text.txt/cache is not usable", {"PYPRUNE_CACHE": "{text.txt}/cache"}),
    ("tune-cache-under-a-file", ["tune", "--model", "{tiny}", "--tokens", "1"],
     r"PYPRUNE_CACHE=.*text.txt/cache is not usable: cannot write .*text.txt/cache/dispatch",
     {"PYPRUNE_CACHE": "{text.txt}/cache"}),
    ("recover-output-empty", RECOVER + ["--output", ""], r"--output is empty", {}),
    ("recover-output-inside-input", RECOVER + ["--output", "{tiny}/r"], r"is inside the input model", {}),
    ("recover-report-fifo", RECOVER + ["--output", "{new}", "--report", "{fifo}"], r"--report .*fifo is a fifo", {}),
    ("continual-report-symlink", CONTINUAL + ["--report", "{link.json}"], r"--report .*link.json is a symbolic link",
     {}),
    ("robustness-report-device", ROBUSTNESS + ["--report", "/dev/null"], r"--report /dev/null is a device", {}),
    ("compare-output-symlink", ["compare", "{report.json}", "--output", "{link-dir}"],
     r"--output .*link-dir is a symbolic link", {}),
    ("compare-output-under-a-file", ["compare", "{report.json}", "--output", "{text.txt}/cmp"],
     r"text.txt is a file, not a directory", {}),
    ("compare-name-is-a-fifo", ["compare", "{report.json}", "--output", "{.}", "--name", "fifo-stem"],
     r"--output/--name .*fifo-stem.md is a fifo", {}),
]


def _fill(arg: str, base) -> str:
    return re.sub(r"\{([^}]*)\}", lambda m: str(base / m.group(1)) if m.group(1) != "." else str(base), arg)


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_a_refused_destination_exits_2_in_one_line_before_loading(places, case, capsys, monkeypatch):
    _, argv, message, env = case
    if not (places / "fifo-stem.md").exists():
        os.mkfifo(places / "fifo-stem.md")
    for name, value in env.items():
        monkeypatch.setenv(name, _fill(value, places))
    if "PYPRUNE_CACHE" in env:  # the dispatch cache follows PYPRUNE_CACHE again (conftest moves it per test)
        monkeypatch.setattr("pyprune.nn.dispatch.cache_root", pyprune.files.cache_root)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr("pyprune.inputs.models.load_model", refuse)
    monkeypatch.setattr("pyprune.io.load", refuse)
    argv = [_fill(arg, places) for arg in argv]
    before = _tree(places)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"pyprune {argv[0]}: error: ") and re.search(message, err), err
    assert _tree(places) == before
    assert not list(places.rglob(f"*{TEMP_TAG}*"))


def test_a_report_that_cannot_be_written_says_where_the_model_is(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The model is written first; a report error afterwards names the saved model, which loads."""
    model_dir, text = tiny_model_dir
    output = tmp_path / "out"

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "r.json"))
    monkeypatch.setattr(steps, "write_report", full_disk)
    assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "2:4", "--output",
                     str(output), "--report", str(tmp_path / "r.json"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar
    assert err == (f"pyprune prune: error: the pruned model is saved in {output}, but the report could not be "
                   f"written ([Errno 28] No space left on device: '{tmp_path / 'r.json'}')")
    model, _ = pyprune.load(output)
    assert pyprune.nn.measure.sparsity_report(model)["nm_valid"]["2:4"]


def test_two_prunes_to_one_output_get_a_cli_message(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The output filled by another run while this one pruned: a CLI-worded line, nothing replaced."""
    model_dir, _ = tiny_model_dir
    output = tmp_path / "out"
    save = pyprune.io.save

    def other_run_first(model, tok, directory, **kwargs):
        os.makedirs(directory)
        (output / "theirs.txt").write_text("the other run")
        return save(model, tok, directory, **kwargs)
    monkeypatch.setattr(pyprune.io, "save", other_run_first)
    assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "2:4", "--output",
                     str(output), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar
    assert err == (f"pyprune prune: error: --output {output} was filled by another run while this one worked; "
                   "nothing was replaced and the pruned model was not saved: rerun with another --output")
    assert os.listdir(output) == ["theirs.txt"] and sorted(os.listdir(tmp_path)) == ["out", "text.txt", "tiny"]


def test_the_report_records_config_compatible(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir
    for extra, expected in (([], True), (["--sparse-layers"], False)):
        out, report = tmp_path / f"out{len(extra)}", tmp_path / f"r{len(extra)}.json"
        assert cli.main(["prune", "--model", str(model_dir), "--method", "magnitude", "--pattern", "2:4", "--output",
                         str(out), "--report", str(report), "--quiet", *extra]) == 0
        assert json.loads(report.read_text())["config_compatible"] is expected
        assert json.loads((out / "pyprune.json").read_text())["config_compatible"] is expected
