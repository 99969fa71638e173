"""The files pyprune owns: nothing read from a user path is unpickled, writes are atomic, temporaries
of dead runs are removed (never a live run's), and a state of another run is refused."""
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pyprune
from pyprune.files import temp_path, write_json
from pyprune.io import storage
from pyprune.patterns import Structured
from tests.helpers import random_tokens, tiny_llama

ROOT = Path(__file__).resolve().parents[2]


class _CreatesMarker:
    """Unpickling this creates ``marker``: the proof that a file's code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _malicious_pickle(path, marker):
    with open(path, "wb") as handle:
        pickle.dump({"key": {}, "step": 1, "payload": _CreatesMarker(marker)}, handle)


def test_the_malicious_pickle_of_these_tests_does_run_code(tmp_path):
    """The control: unpickled, the file below does create its marker."""
    marker = tmp_path / "ran"
    _malicious_pickle(tmp_path / "evil.pt", marker)
    with open(tmp_path / "evil.pt", "rb") as handle:
        pickle.Unpickler(handle).load()
    assert marker.exists()


def test_a_pickle_at_the_old_dress_checkpoint_path_is_ignored_and_never_executed(tmp_path):
    marker = tmp_path / "ran"
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    _malicious_pickle(checkpoint / "dress-regularise.pt", marker)
    model = tiny_llama(seed=0)
    pyprune.prune(model, "dress", Structured(0.25), random_tokens((4, 16), seed=1), progress=False, steps=2,
                  checkpoint=str(checkpoint), checkpoint_every=1)
    assert not marker.exists()
    assert (checkpoint / "dress-regularise.safetensors").is_file()


@pytest.mark.parametrize("name", ["dress-regularise.safetensors", "copal-state.safetensors"])
def test_a_pickle_in_place_of_a_state_is_refused_and_never_executed(tmp_path, name):
    marker = tmp_path / "ran"
    directory = tmp_path / "state"
    directory.mkdir()
    _malicious_pickle(directory / name, marker)
    before = (directory / name).read_bytes()
    model = tiny_llama(seed=0)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if name.startswith("dress"):
        call = dict(method="dress", pattern=Structured(0.25), options=dict(steps=2, checkpoint=str(directory)))
    else:
        call = dict(method="copal", pattern="2:4", options=dict(state=str(directory)))
    with pytest.raises(ValueError, match=re.escape(str(directory / name)) + " is not a readable safetensors state"):
        pyprune.prune(model, call["method"], call["pattern"], random_tokens((4, 16), seed=1), progress=False,
                      **call["options"])
    assert not marker.exists()
    assert (directory / name).read_bytes() == before
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_nothing_in_the_package_unpickles():
    """No pickle loading in pyprune/ (the Triton kernels included): torch.load only with weights_only=True."""
    forbidden = re.compile(r"weights_only\s*=\s*False|pickle\.loads?\b|import pickle|\bdill\b|joblib\.load|"
                           r"numpy\.load|np\.load|allow_pickle")
    offenders, loads = [], 0
    for folder in ("pyprune",):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in forbidden.finditer(text)]
            for call in re.finditer(r"torch\.load\(", text):
                loads += 1
                depth, end = 0, call.end() - 1
                for end in range(call.end() - 1, len(text)):
                    depth += {"(": 1, ")": -1}.get(text[end], 0)
                    if depth == 0:
                        break
                if not re.search(r"weights_only\s*=\s*True", text[call.start():end]):
                    offenders.append(f"{path.relative_to(ROOT)}: torch.load without weights_only=True")
    assert offenders == []
    print(f"checked {len(list((ROOT / 'pyprune').rglob('*.py')))} package files, {loads} torch.load calls")


def test_the_package_scan_finds_what_it_forbids(tmp_path, monkeypatch):
    """The scan above is not blind: a planted offender in a copy of the tree is found."""
    (tmp_path / "pyprune").mkdir()
    (tmp_path / "pyprune" / "bad.py").write_text("import torch\nx = torch.load(\n    'a.pt', weights_only=False)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError):
        test_nothing_in_the_package_unpickles()
    (tmp_path / "pyprune" / "bad.py").write_text("import torch\nx = torch.load('a.pt')\n")
    with pytest.raises(AssertionError):
        test_nothing_in_the_package_unpickles()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _temp_name(target, pid):
    return os.path.basename(temp_path(str(target))).replace(f"-{os.getpid()}-", f"-{pid}-")


def test_the_next_write_removes_temporaries_of_dead_runs_only(tmp_path):
    dead, live = _dead_pid(), os.getppid()
    stale_dir = tmp_path / _temp_name(tmp_path / "model", dead)
    stale_dir.mkdir()
    (stale_dir / "model.safetensors").write_bytes(b"\0" * 1024)
    stale_file = tmp_path / _temp_name(tmp_path / "report.json", dead)
    stale_file.write_text("{")
    running = tmp_path / _temp_name(tmp_path / "model", live)
    running.mkdir()
    mine = tmp_path / _temp_name(tmp_path / "model", os.getpid())
    mine.mkdir()
    other = tmp_path / ".model.tmp-12345"  # not a name pyprune gives: never touched
    other.mkdir()
    write_json(str(tmp_path / "report.json"), {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [running.name, mine.name, other.name, "report.json"])


def test_a_failed_atomic_write_leaves_the_target_and_no_temporary(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_json(str(target), {"not json": object()})
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["report.json"]


def test_a_save_killed_midway_is_cleaned_by_the_next_save(tmp_path):
    """A SIGKILLed pyprune.save leaves its temporary directory; the next save next to it removes it."""
    script = ("import os, signal, sys, pyprune\n"
              "from tests.helpers import tiny_llama\n"
              "model = tiny_llama()\n"
              "original = model.save_pretrained\n"
              "def killed(*args, **kwargs):\n"
              "    original(*args, **kwargs)\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n"
              "model.save_pretrained = killed\n"
              f"pyprune.save(model, None, {str(tmp_path / 'a')!r})\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True)
    assert result.returncode == -9
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and ".pyprune-tmp-" in left[0] and not (tmp_path / "a").exists()
    pyprune.save(tiny_llama(), None, tmp_path / "b")
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


def test_a_state_of_another_run_is_refused_naming_what_differs(tmp_path):
    path = str(tmp_path / "s.safetensors")
    key = {"settings": {"lam": 1.0, "norm": "l2"}, "model": "abc", "calibration": "123"}
    storage.save_state(path, {"w": torch.ones(2)}, {"kind": "test state", "format": 1, "key": key})
    meta = storage.read_state_meta(path, "test state", (1,))
    storage.check_key("state", meta["key"], key)
    with pytest.raises(ValueError, match=r"other settings: lam 1.0 \(now 0.5\); another model"):
        storage.check_key("state", meta["key"], dict(key, settings={"lam": 0.5, "norm": "l2"}, model="x"))
    storage.check_key("state", meta["key"], dict(key, model="x"), parts=["settings"])  # model not compared
    with pytest.raises(ValueError, match="format 1; this pyprune reads format 2"):
        storage.read_state_meta(path, "test state", (2,))
    with pytest.raises(ValueError, match="is not a pyprune other file"):
        storage.read_state_meta(path, "other", (1,))
    Path(path).write_bytes(Path(path).read_bytes()[:-3])  # truncated
    with pytest.raises(ValueError, match="is not a readable safetensors state"):
        storage.read_state_meta(path, "test state", (1,))


def test_tied_tensors_are_stored_once_and_restored_tied(tmp_path):
    path = str(tmp_path / "s.safetensors")
    shared = torch.arange(6.0).reshape(2, 3)
    storage.save_state(path, {"a": shared, "b": shared, "c": shared[0]}, {"kind": "k", "format": 1, "key": {}})
    tensors, meta = storage.load_state(path, "k", (1,))
    assert torch.equal(tensors["a"], shared) and tensors["b"] is tensors["a"] and torch.equal(tensors["c"], shared[0])
