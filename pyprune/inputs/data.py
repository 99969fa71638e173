"""Calibration samples and evaluation token streams for LLM pruning.

A *source* names some text. It is one of

* a local ``.txt`` file, or a directory (every ``*.txt`` file in it, in sorted order, joined by
  ``"\\n\\n"``);
* the name of a corpus the package carries (:data:`EMBEDDED`, stored xz-compressed in
  ``pyprune/inputs/corpora``): ``"emma"``, ``"pride_and_prejudice"`` and the other Austen novels,
  ``"austen"`` (all six), ``"moby_dick"``, ``"python"`` (CPython 3.11 standard-library source, PSF
  licence in ``pyprune/inputs/corpora/PYTHON_LICENSE.txt``).  When ``$PYPRUNE_DATA`` names a directory
  holding the same layout (``austen/emma.txt``, ``moby_dick.txt``, ...), a named corpus is read
  from there instead;
* a dataset name: ``"wikitext2"``, ``"c4"`` or ``"ptb"`` (loaded with the ``datasets`` library;
  see :func:`load_text` for the protocol each one follows);
* any of the above followed by ``":first_half"`` or ``":second_half"``, which keeps that half
  of the text.  The text is cut at the first newline at or after the character midpoint (the
  newline stays with the first half), so the two halves partition the text exactly and the cut
  is deterministic.  This gives the fixed calibration / evaluation splits the project uses:
  ``"emma"`` / ``"pride_and_prejudice"``, ``"moby_dick:first_half"`` / ``"moby_dick:second_half"``,
  ``"python:first_half"`` / ``"python:second_half"``.

Public functions:

* :func:`load_text` -- the text of a source;
* :func:`eval_tokens` -- the 1-D token stream of a source's evaluation text;
* :func:`calibration_samples` -- ``[nsamples, seqlen]`` random windows of a source's calibration
  text;
* :func:`windows` -- non-overlapping ``[n, seqlen]`` windows of a token stream (for perplexity).
"""
from __future__ import annotations

import contextlib
import hashlib
import lzma
import os
import sys
import urllib.error
import urllib.request
from collections import OrderedDict
from pathlib import Path

import torch

__all__ = ["load_text", "eval_tokens", "calibration_samples", "windows", "check_source",
           "EMBEDDED", "KNOWN_DATASETS"]

#: Corpora carried by the package, by name: their files, relative to ``pyprune/inputs/corpora`` (stored
#: as ``FILE.xz``) or to ``$PYPRUNE_DATA`` when that directory holds them.
EMBEDDED = {
    "emma": ("austen/emma.txt",),
    "mansfield_park": ("austen/mansfield_park.txt",),
    "northanger_abbey": ("austen/northanger_abbey.txt",),
    "persuasion": ("austen/persuasion.txt",),
    "pride_and_prejudice": ("austen/pride_and_prejudice.txt",),
    "sense_and_sensibility": ("austen/sense_and_sensibility.txt",),
    "moby_dick": ("moby_dick.txt",),
    "python": ("python_stdlib.py.txt",),
}
EMBEDDED["austen"] = tuple(files[0] for name, files in EMBEDDED.items() if files[0].startswith("austen/"))

#: Dataset names :func:`load_text` loads from the Hugging Face hub.
KNOWN_DATASETS = ("wikitext2", "c4", "ptb")

_CORPORA_DIR = Path(__file__).resolve().parent / "corpora"

_SPLITS = ("eval", "calib")
_SLICES = ("first_half", "second_half")

# allenai/c4 (English) shards used by the usual GPTQ / SparseGPT / Wanda protocol.
_C4_EVAL_FILE = "en/c4-validation.00000-of-00008.json.gz"
_C4_CALIB_FILE = "en/c4-train.00000-of-01024.json.gz"
_C4_EVAL_DOCS = 1100  # first 1100 validation documents, joined by " "
_C4_CALIB_DOCS = 5000  # first 5000 train documents (~11 MB), joined by "\n\n"

_PROBE_TIMEOUT_S = 3.0
_TRUE = {"1", "ON", "YES", "TRUE"}


# --------------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------------


def load_text(source: str | os.PathLike, *, split: str = "eval") -> str:
    """Return the text named by ``source``.

    Args:
        source: a local ``.txt`` file; a directory (all ``*.txt`` files in it, sorted by name,
            joined by ``"\\n\\n"``); an embedded corpus name from :data:`EMBEDDED`; or a
            dataset name from :data:`KNOWN_DATASETS`.  A suffix
            ``":first_half"`` / ``":second_half"`` keeps that half of the text (cut at the first
            newline at or after the character midpoint; ``first + second == whole``).
        split: ``"eval"`` (default) or ``"calib"``.  It picks the split of a dataset; a local
            path gives the same text for both (use the half suffixes to separate them).

    Datasets (the protocols common in the pruning literature -- GPTQ, SparseGPT, Wanda):

    * ``"wikitext2"``: ``wikitext`` / ``wikitext-2-raw-v1``, the ``test`` split for ``"eval"`` and
      ``train`` for ``"calib"``; the ``text`` rows joined by ``"\\n\\n"``.
    * ``"c4"``: ``allenai/c4`` English.  ``"eval"`` is the first 1100 documents of the validation
      shard ``c4-validation.00000-of-00008.json.gz`` joined by ``" "`` (the usual evaluation
      protocol); ``"calib"`` is the first 5000 documents of the train shard
      ``c4-train.00000-of-01024.json.gz`` joined by ``"\\n\\n"``.
    * ``"ptb"``: ``ptb_text_only``, the ``sentence`` field of the ``test`` split (``"eval"``) or
      ``train`` split (``"calib"``) joined by ``" "`` (the common protocol).

    Raises:
        FileNotFoundError: ``source`` is neither an existing path nor a known corpus or dataset name.
        ValueError: bad ``split``, a directory without ``*.txt`` files, or a text (or half) that is
            empty or whitespace only.
        RuntimeError: a dataset could not be loaded (e.g. offline with nothing cached).
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    base, part = _parse_source(source)
    text = _load_whole(base, split)
    if part is not None:
        first, second = _halves(text)
        text = first if part == "first_half" else second
    if not text.strip():  # its tokens (newlines, spaces) would calibrate and score as if a text
        raise ValueError(f"{os.fspath(source)} holds only whitespace; give a text")
    return text


def check_source(source: str | os.PathLike) -> None:
    """Raise the error :func:`load_text` would raise for a missing file, directory or unknown
    name, without reading or downloading anything."""
    base, _ = _parse_source(source)
    path = Path(base).expanduser()
    name = base.strip().lower()
    if path.exists() or name in EMBEDDED or name in KNOWN_DATASETS:
        return
    raise _not_found(source)


def _embedded_text(name: str) -> str:
    """The text of an embedded corpus (its files joined by ``"\\n\\n"``), from ``$PYPRUNE_DATA``
    when that directory has every file, else from the package's compressed copy."""
    override = os.environ.get("PYPRUNE_DATA")
    files = EMBEDDED[name]
    if override and all((Path(override) / f).is_file() for f in files):
        return "\n\n".join((Path(override) / f).read_text(encoding="utf-8") for f in files)
    texts = []
    for f in files:
        packed = _CORPORA_DIR / f"{f}.xz"
        with lzma.open(packed, "rt", encoding="utf-8") as handle:
            texts.append(handle.read())
    return "\n\n".join(texts)


def _parse_source(source) -> tuple[str, str | None]:
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise TypeError(f"source must be a str or path, got {type(source).__name__}")
    if not source:
        raise ValueError(f"source must not be empty; {_known_hint()}")
    # A path that exists as written wins over the slice syntax.
    if os.path.exists(source):
        return source, None
    head, sep, tail = source.rpartition(":")
    if sep and tail in _SLICES and head:
        return head, tail
    return source, None


def _halves(text: str) -> tuple[str, str]:
    """Split ``text`` at the first newline at or after its midpoint (the newline stays first)."""
    mid = len(text) // 2
    cut = text.find("\n", mid)
    cut = len(text) if cut < 0 else cut + 1
    return text[:cut], text[cut:]


def _not_found(source) -> FileNotFoundError:
    return FileNotFoundError(f"source={source!r} is neither an existing .txt file or directory nor "
                             f"a known name ({_known_hint()})")


def _known_hint() -> str:
    return ("embedded corpora: " + ", ".join(EMBEDDED) + "; hub datasets: " + ", ".join(KNOWN_DATASETS)
            + "; any of them may end in :first_half or :second_half")


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start}); give a text file") from None


def _load_whole(source: str, split: str) -> str:
    path = Path(source).expanduser()
    if path.is_file():
        return _read_utf8(path)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.txt") if p.is_file())
        if not files:
            raise ValueError(f"source={source!r} is a directory with no *.txt files")
        return "\n\n".join(_read_utf8(p) for p in files)
    name = source.strip().lower()
    if name in EMBEDDED:
        return _embedded_text(name)
    if name in KNOWN_DATASETS:
        return _dataset_text(name, split)
    raise _not_found(source)


# --------------------------------------------------------------------------------------------
# datasets (hub)
# --------------------------------------------------------------------------------------------

_DATASET_TEXT: dict[tuple[str, str], str] = {}


def _env_offline() -> bool:
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in _TRUE:
            return True
    return False


def _hub_reachable() -> bool:
    """A quick HEAD request to the hub endpoint (3 s timeout); any HTTP answer counts."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        req = urllib.request.Request(endpoint, method="HEAD")
        with urllib.request.urlopen(req, timeout=_PROBE_TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _forced_offline():
    """Make ``datasets`` / ``huggingface_hub`` use only the local cache (no network, no retries).

    Both libraries read the offline environment variables at import time, so setting them now
    may be too late; their module-level flags are patched instead and restored afterwards.
    """
    patches = []
    for modname, attrs in (
        ("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
        ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")),
    ):
        mod = sys.modules.get(modname)
        if mod is None:
            continue
        for attr in attrs:
            if hasattr(mod, attr):
                patches.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, True)
    try:
        yield
    finally:
        for mod, attr, old in reversed(patches):
            setattr(mod, attr, old)


def _dataset_text(name: str, split: str) -> str:
    key = (name, split)
    if key in _DATASET_TEXT:
        return _DATASET_TEXT[key]
    offline = _env_offline() or not _hub_reachable()
    try:
        import datasets  # noqa: F401  (imported here: heavy, and only needed for hub datasets)
        import datasets.config  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"dataset {name!r} needs the 'datasets' package ({exc}); pass a local .txt path instead"
        ) from None
    try:
        ctx = _forced_offline() if offline else contextlib.nullcontext()
        with ctx:
            text = _fetch_dataset_text(name, split)
    except Exception as exc:  # datasets raises ConnectionError, FileNotFoundError, ...
        if offline:
            msg = (
                f"dataset {name!r} could not be loaded offline (the Hugging Face hub is unreachable "
                f"or HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set, and it is not cached); pass a local "
                f".txt path as source instead"
            )
        else:
            reason = " ".join(str(exc).split())[:300]
            msg = (
                f"dataset {name!r} could not be loaded ({type(exc).__name__}: {reason}); "
                f"pass a local .txt path as source instead"
            )
        raise RuntimeError(msg) from None
    _DATASET_TEXT[key] = text
    return text


def _fetch_dataset_text(name: str, split: str) -> str:
    from datasets import load_dataset

    if name == "wikitext2":
        ds = load_dataset("wikitext", "wikitext-2-raw-v1", split="test" if split == "eval" else "train")
        return "\n\n".join(ds["text"])
    if name == "ptb":
        ds = load_dataset("ptb_text_only", "penn_treebank", split="test" if split == "eval" else "train")
        return " ".join(ds["sentence"])
    if name == "c4":
        if split == "eval":
            ds = load_dataset("allenai/c4", data_files={"validation": _C4_EVAL_FILE}, split="validation")
            return " ".join(ds.select(range(min(_C4_EVAL_DOCS, len(ds))))["text"])
        ds = load_dataset("allenai/c4", data_files={"train": _C4_CALIB_FILE}, split="train")
        return "\n\n".join(ds.select(range(min(_C4_CALIB_DOCS, len(ds))))["text"])
    raise AssertionError(name)  # unreachable: names are checked by the caller


# --------------------------------------------------------------------------------------------
# tokens
# --------------------------------------------------------------------------------------------

_TOKEN_CACHE: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_TOKEN_CACHE_SIZE = 8


def _tokenize(tokenizer, text: str) -> torch.Tensor:
    """The whole text as one 1-D int64 stream, without special tokens.

    Cached in-process when the tokenizer has a ``name_or_path`` (key: name, class, vocabulary
    size and a hash of the text, so edited files are re-tokenized).
    """
    name = getattr(tokenizer, "name_or_path", "") or ""
    key = None
    if name:
        try:
            vocab = len(tokenizer)
        except TypeError:
            vocab = None
        digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()
        key = (name, type(tokenizer).__qualname__, vocab, digest)
        hit = _TOKEN_CACHE.get(key)
        if hit is not None:
            _TOKEN_CACHE.move_to_end(key)
            return hit
    try:
        # verbose=False: no "sequence length is longer than the model maximum" warning.
        enc = tokenizer(text, add_special_tokens=False, verbose=False)
    except TypeError:
        enc = tokenizer(text, add_special_tokens=False)
    ids = enc["input_ids"]
    stream = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if key is not None:
        _TOKEN_CACHE[key] = stream
        while len(_TOKEN_CACHE) > _TOKEN_CACHE_SIZE:
            _TOKEN_CACHE.popitem(last=False)
    return stream


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def window_bos(tokenizer) -> int | None:
    """The BOS id that this tokenizer puts at the start of a text (Gemma's ``<bos>``), or None when
    it puts none (SmolLM2, Llama-2-style GGUF tokenizers here). Calibration and evaluation windows
    follow the same convention: a model trained with BOS first sees it first in every window
    (measured on Gemma 3 270M: dense perplexity about 27 with it, about 128 without)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        ids = tokenizer("a", verbose=False)["input_ids"]
    except TypeError:
        ids = tokenizer("a")["input_ids"]
    return int(bos) if len(ids) > 0 and ids[0] == bos else None


def eval_tokens(tokenizer, source: str | os.PathLike, *, max_tokens: int | None = None) -> torch.LongTensor:
    """The 1-D token stream (int64) of the evaluation text of ``source``.

    The whole text is tokenized at once, with no special tokens (no BOS/EOS), and the stream is
    truncated to its first ``max_tokens`` tokens when that is given.  See :func:`load_text` for
    what ``source`` may be.
    """
    if max_tokens is not None:
        _check_positive_int("max_tokens", max_tokens)
    stream = _tokenize(tokenizer, load_text(source, split="eval"))
    if max_tokens is not None:
        stream = stream[:max_tokens]
    return stream.clone()


def calibration_samples(
    tokenizer,
    source: str | os.PathLike,
    *,
    nsamples: int,
    seqlen: int,
    seed: int = 0,
) -> torch.LongTensor:
    """``[nsamples, seqlen]`` random windows of the tokenized calibration text of ``source``; where
    the tokenizer starts texts with BOS (:func:`window_bos`), each window is BOS and ``seqlen - 1``
    text tokens.

    Start positions are drawn independently and uniformly from ``0 .. len(stream) - seqlen - 1``
    (so one token always follows a window, as in the GPTQ / SparseGPT protocol) with a
    ``torch.Generator`` seeded by ``seed``: the same seed gives the same samples.

    Raises:
        ValueError: ``nsamples`` or ``seqlen`` below 1, or a text with fewer than ``seqlen + 1``
            tokens.
    """
    _check_positive_int("nsamples", nsamples)
    _check_positive_int("seqlen", seqlen)
    stream = _tokenize(tokenizer, load_text(source, split="calib"))
    n = stream.numel()
    if n < seqlen + 1:
        raise ValueError(
            f"source={os.fspath(source)!r} has {n} tokens, too few for calibration windows of "
            f"seqlen={seqlen} (needs at least seqlen + 1 = {seqlen + 1})"
        )
    gen = torch.Generator().manual_seed(int(seed))
    starts = torch.randint(0, n - seqlen, (nsamples,), generator=gen)
    index = starts[:, None] + torch.arange(seqlen)[None, :]
    samples = stream[index]
    bos = window_bos(tokenizer)
    if bos is not None:
        samples = torch.cat([torch.full((nsamples, 1), bos, dtype=samples.dtype), samples[:, :-1]], dim=1)
    return samples


def windows(tokens: torch.LongTensor, seqlen: int) -> torch.LongTensor:
    """Non-overlapping ``[n, seqlen]`` windows of a 1-D token stream; the tail shorter than
    ``seqlen`` is dropped (``n = len(tokens) // seqlen``, possibly 0).  Returns a view."""
    _check_positive_int("seqlen", seqlen)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        raise ValueError(
            f"tokens must be a 1-D tensor, got "
            f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}"
        )
    n = tokens.numel() // seqlen
    return tokens[: n * seqlen].reshape(n, seqlen)
