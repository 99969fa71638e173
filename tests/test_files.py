"""The one write path (pyprune.files): what may be replaced, what is checked before any work, and
a cache that cannot be used named as PYPRUNE_CACHE."""
import json
import os
import stat

import pytest

from pyprune import files
from pyprune.files import (CacheError, DestinationError, atomic_path, cache_dir, check_destination, locked, write_json,
                           write_text)

ROOT = os.geteuid() == 0


def _tree(root):
    return sorted((str(p.relative_to(root)), p.is_symlink(), p.read_bytes() if p.is_file() and not p.is_symlink()
                   else None) for p in root.rglob("*") if not stat.S_ISFIFO(os.lstat(p).st_mode)) + \
        sorted(str(p.relative_to(root)) for p in root.rglob("*") if stat.S_ISFIFO(os.lstat(p).st_mode))


@pytest.fixture
def places(tmp_path):
    """A model directory, a regular file, a fifo, a link to a file elsewhere and one to a directory."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "file.txt").write_text("precious")
    os.mkfifo(tmp_path / "fifo")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "target.json").write_text("{}")
    os.symlink(elsewhere / "target.json", tmp_path / "link.json")
    os.symlink(elsewhere, tmp_path / "link-dir")
    return tmp_path


@pytest.mark.parametrize("path,directory,message", [
    ("", False, r"^--report is empty; give a path$"),
    ("   ", True, r"^--output is empty; give a path$"),
    ("/dev/null", False, r"^--report /dev/null is a device; pyprune writes regular files only"),
    ("{fifo}", False, r"^--report .*fifo is a fifo; pyprune writes regular files only"),
    ("{link.json}", False, r"^--report .*link.json is a symbolic link \(to .*target.json\).*give the real path$"),
    ("{link-dir}", True, r"^--output .*link-dir is a symbolic link"),
    ("{model}", False, r"^--report .*model is a directory; give the path of a file$"),
    ("{file.txt}", True, r"^--output .*file.txt exists and is not a directory$"),
    ("{file.txt}/out.json", False, r"^--report .*file.txt/out.json: .*file.txt is a file, not a directory$"),
    ("{file.txt}/a/b", True, r"^--output .*file.txt/a/b: .*file.txt is a file, not a directory$"),
    ("/proc/pyprune-test.json", False, r"^--report /proc/pyprune-test.json: cannot create files in /proc"),
    ("{model}/out", True, r"^--output .*model/out is inside the input model .*model; write somewhere else$"),
    ("{model}", True, r"^--output .*model is the input model"),
    ("{root}", True, r"^--output .* contains the input model .*model; write somewhere else$"),
], ids=["empty", "blank", "device", "fifo", "link-file", "link-dir", "directory-as-file", "file-as-directory",
        "under-a-file", "deep-under-a-file", "proc", "inside-input", "is-input", "parent-of-input"])
def test_refused_destinations_change_nothing(places, path, directory, message):
    path = path.replace("{root}", str(places)).replace("{", str(places) + "/").replace("}", "")
    before = _tree(places)
    flag = "--output" if directory else "--report"
    with pytest.raises(DestinationError, match=message):
        check_destination(path, flag, directory=directory, protect=[places / "model"])
    assert _tree(places) == before
    assert not list(places.rglob(f"*{files.TEMP_TAG}*"))


@pytest.mark.skipif(ROOT, reason="root writes into a mode-0555 directory; the read-only case is covered for root "
                                 "by the cases under a regular file and in /proc")
def test_a_read_only_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(DestinationError, match=r"cannot create files in .*locked \(Permission denied\)"):
            check_destination(locked / "report.json", "--report")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_accepted_destinations(places):
    assert check_destination(places / "new" / "deeper" / "r.json", "--report") == str(places / "new/deeper/r.json")
    assert check_destination(places / "file.txt", "--report") == str(places / "file.txt")
    assert check_destination(places / "elsewhere", "--output", directory=True, protect=[places / "model"])
    assert not (places / "new").exists()


@pytest.mark.parametrize("name", ["fifo", "link.json", "/dev/null"])
def test_atomic_writes_never_replace_a_special_node(places, name):
    """Even without the CLI's early check, a write refuses to replace a fifo, link or device node."""
    target = name if name.startswith("/") else str(places / name)
    before, kind = _tree(places), os.lstat(target).st_mode
    with pytest.raises(DestinationError, match="pyprune writes regular files only|symbolic link"):
        write_json(target, {"a": 1})
    assert os.lstat(target).st_mode == kind and _tree(places) == before
    assert json.loads((places / "elsewhere" / "target.json").read_text()) == {}


def test_a_node_appearing_during_the_write_is_not_replaced(tmp_path):
    target = tmp_path / "report.json"
    with pytest.raises(DestinationError, match="is a fifo"):
        with atomic_path(target) as tmp:
            open(tmp, "w").write("{}")
            os.mkfifo(target)  # another process put a fifo there meanwhile
    assert stat.S_ISFIFO(os.lstat(target).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_failed_cleanup_never_hides_the_error(tmp_path, monkeypatch):
    def unlink_fails(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)
    with pytest.raises(RuntimeError, match="the real error"):
        with atomic_path(tmp_path / "r.json"):
            monkeypatch.setattr(os, "unlink", unlink_fails)
            raise RuntimeError("the real error")


@pytest.mark.parametrize("setting,reason", [
    ("{file}/cache", "Not a directory"),
    ("/proc/pyprune-cache", "No such file or directory"),
])
def test_an_unusable_cache_is_named_by_pyprune_cache(tmp_path, monkeypatch, setting, reason):
    (tmp_path / "file").write_text("x")
    setting = setting.replace("{file}", str(tmp_path / "file"))
    monkeypatch.setenv("PYPRUNE_CACHE", setting)
    with pytest.raises(CacheError, match=rf"^PYPRUNE_CACHE={setting} is not usable: cannot write {setting}/models "
                                         rf"\({reason}\); set PYPRUNE_CACHE to a writable directory$"):
        cache_dir("models")
    assert (tmp_path / "file").read_text() == "x"


def test_the_cache_directory_is_created(tmp_path, monkeypatch):
    monkeypatch.setenv("PYPRUNE_CACHE", str(tmp_path / "cache"))
    assert cache_dir("models") == str(tmp_path / "cache" / "models")
    assert os.listdir(tmp_path / "cache" / "models") == []


def test_the_lock_admits_one_writer_at_a_time(tmp_path):
    import fcntl
    path = str(tmp_path / "rows.json")
    with locked(path):
        with open(f"{path}.lock", "w") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(f"{path}.lock", "w") as other:  # released on leaving the block
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_write_text_creates_the_directory_and_replaces_the_file_whole(tmp_path):
    path = tmp_path / "new" / "table.md"
    write_text(str(path), "| a |\n")
    write_text(str(path), "| b |\n")
    assert path.read_text() == "| b |\n" and os.listdir(tmp_path / "new") == ["table.md"]
    with pytest.raises(DestinationError):
        write_text(str(tmp_path / "new"), "x")  # a directory is never replaced


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_written_files_get_the_modes_of_the_umask(tmp_path):
    """safetensors creates its files 0600; what pyprune renames into place reads as any other file
    would under the umask (0644 / 0755 under 022, 0640 / 0750 under 027)."""
    from safetensors.torch import save_file
    import torch
    previous = os.umask(0o027)
    try:
        with atomic_path(tmp_path / "state.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, tmp)
        tree = tmp_path / "tree"
        (tree / "sub").mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(tree / "sub" / "model.safetensors"))
        os.chmod(tree / "sub", 0o700)
        assert _mode(tree / "sub" / "model.safetensors") == 0o600  # what the writer left
        files.standard_modes(str(tree))
    finally:
        os.umask(previous)
    assert _mode(tmp_path / "state.safetensors") == 0o640
    assert (_mode(tree), _mode(tree / "sub"), _mode(tree / "sub" / "model.safetensors")) == (0o750, 0o750, 0o640)
