"""Tests for pyprune.inputs.data: text sources, token streams, calibration windows.

They read the corpora the package embeds (by name, and written out to a temporary directory to
test paths) and use a small word-level tokenizer trained here on a slice of Emma, so no
downloaded model (and no network) is needed.
"""
import logging
import lzma
from pathlib import Path

import pytest
import torch

from pyprune.inputs import data

AUSTEN_NAMES = ["emma", "mansfield_park", "northanger_abbey", "persuasion", "pride_and_prejudice",
                "sense_and_sensibility"]


@pytest.fixture(scope="module")
def DATA(tmp_path_factory):
    """The embedded corpora written out as plain files in the ``$PYPRUNE_DATA`` layout."""
    root = tmp_path_factory.mktemp("corpora")
    for name, files in data.EMBEDDED.items():
        if len(files) == 1:
            (root / files[0]).parent.mkdir(parents=True, exist_ok=True)
            (root / files[0]).write_text(data.load_text(name), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def EMMA(DATA):
    return DATA / "austen" / "emma.txt"


@pytest.fixture(scope="module")
def MOBY(DATA):
    return DATA / "moby_dick.txt"


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=4000, special_tokens=["[UNK]", "[BOS]"])
    text = data.load_text("emma")[:200_000]
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    bos = tok.token_to_id("[BOS]")
    # A post-processor that adds BOS, so the tests can check that no special tokens are added.
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", bos)]
    )
    # A small model_max_length: tokenizing a whole book must not warn about it.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", model_max_length=512
    )


# ------------------------------------------------------------------------------------- text


def test_load_text_file(MOBY):
    assert data.load_text(str(MOBY)) == MOBY.read_text(encoding="utf-8")
    assert data.load_text(MOBY) == MOBY.read_text(encoding="utf-8")  # os.PathLike accepted
    # a local file gives the same text for both splits
    assert data.load_text(str(MOBY), split="calib") == data.load_text(str(MOBY))


def test_load_text_directory_sorted(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "c.md").write_text("not text", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "0.txt").write_text("nested", encoding="utf-8")
    assert data.load_text(str(tmp_path)) == "first\n\nsecond"


def test_load_text_real_directory_order(DATA, EMMA):
    austen = DATA / "austen"
    files = sorted(austen.glob("*.txt"))
    assert [f.name for f in files][0] == "emma.txt"
    text = data.load_text(str(austen))
    assert text == "\n\n".join(f.read_text(encoding="utf-8") for f in files)
    assert text.startswith(EMMA.read_text(encoding="utf-8"))


def test_empty_directory(tmp_path):
    with pytest.raises(ValueError, match="source"):
        data.load_text(str(tmp_path))


@pytest.mark.parametrize("content,source", [("", "{path}"), (" \n\t\n  ", "{path}"),
                                            ("words\n" + " " * 40, "{path}:second_half")])
def test_a_text_of_only_whitespace_is_refused(tmp_path, content, source):
    """Its tokens (spaces, newlines) would calibrate and score as if they were a text."""
    path = tmp_path / "blank.txt"
    path.write_text(content)
    source = source.format(path=path)
    with pytest.raises(ValueError, match=rf"{source} holds only whitespace; give a text"):
        data.load_text(source)


@pytest.mark.parametrize("relative", ["moby_dick.txt", "python_stdlib.py.txt", "austen/emma.txt"])
def test_halves_partition_file(DATA, relative):
    path = DATA / relative
    whole = path.read_text(encoding="utf-8")
    first = data.load_text(f"{path}:first_half")
    second = data.load_text(f"{path}:second_half")
    assert first + second == whole
    mid = len(whole) // 2
    assert len(first) > mid and first.endswith("\n")
    # the cut is at the first newline at or after the midpoint
    assert "\n" not in whole[mid : len(first) - 1]
    # deterministic
    assert data.load_text(f"{path}:first_half") == first


def test_halves_without_newline(tmp_path):
    f = tmp_path / "one_line.txt"
    f.write_text("no newline here at all", encoding="utf-8")
    assert data.load_text(f"{f}:first_half") == "no newline here at all"
    with pytest.raises(ValueError, match="second_half holds only whitespace"):  # it is empty
        data.load_text(f"{f}:second_half")


def test_missing_source_error():
    with pytest.raises(FileNotFoundError) as err:
        data.load_text("/nonexistent/definitely_missing.txt")
    msg = str(err.value)
    assert "source" in msg and "definitely_missing.txt" in msg
    for name in ("wikitext2", "c4", "ptb", "emma", "moby_dick", "python", "first_half"):
        assert name in msg
    with pytest.raises(FileNotFoundError, match="emma"):
        data.check_source("emmma")


# ---------------------------------------------------------------------------- embedded corpora


def test_embedded_corpora_shipped():
    """Every named corpus is in the package, compressed, with the Python licence beside it."""
    corpora = Path(data.__file__).parent / "corpora"
    for files in data.EMBEDDED.values():
        for name in files:
            assert (corpora / f"{name}.xz").is_file()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in (corpora / "PYTHON_LICENSE.txt").read_text()


def test_embedded_names(monkeypatch):
    monkeypatch.delenv("PYPRUNE_DATA", raising=False)
    emma = data.load_text("emma")
    assert emma.lstrip().startswith("EMMA") and "Woodhouse" in emma[:2000]
    assert len(emma) > 800_000
    assert "Call me Ishmael" in data.load_text("moby_dick")[:50_000]
    assert "def " in data.load_text("python")
    assert data.load_text("Emma") == emma  # names are case-insensitive
    assert data.load_text("emma", split="calib") == emma
    austen = data.load_text("austen")
    assert austen == "\n\n".join(data.load_text(n) for n in AUSTEN_NAMES)
    data.check_source("pride_and_prejudice:second_half")


@pytest.mark.parametrize("name", ["emma", "moby_dick", "python"])
def test_embedded_halves(name):
    first, second = data.load_text(f"{name}:first_half"), data.load_text(f"{name}:second_half")
    assert first + second == data.load_text(name)
    assert first.endswith("\n") and abs(len(first) - len(second)) < 0.01 * len(first)


def test_pyprune_data_override(tmp_path, monkeypatch):
    """$PYPRUNE_DATA with the same layout replaces a named corpus; without the file, the embedded
    copy is used."""
    (tmp_path / "austen").mkdir()
    (tmp_path / "austen" / "emma.txt").write_text("a different emma", encoding="utf-8")
    monkeypatch.setenv("PYPRUNE_DATA", str(tmp_path))
    assert data.load_text("emma") == "a different emma"
    packed = Path(data.__file__).parent / "corpora" / "moby_dick.txt.xz"
    assert data.load_text("moby_dick") == lzma.decompress(packed.read_bytes()).decode("utf-8")


def test_path_wins_over_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "emma").write_text("a local file called emma", encoding="utf-8")
    assert data.load_text("emma") == "a local file called emma"


def test_embedded_matches_compressed_bytes():
    """The loader decodes exactly the shipped bytes (no newline or encoding changes)."""
    packed = Path(data.__file__).parent / "corpora" / "moby_dick.txt.xz"
    raw = lzma.decompress(packed.read_bytes()).decode("utf-8")
    assert data.load_text("moby_dick") == raw


def test_bad_split(MOBY):
    with pytest.raises(ValueError, match="split"):
        data.load_text(str(MOBY), split="train")


@pytest.mark.parametrize("name", ["wikitext2", "c4", "ptb"])
def test_known_dataset_offline(name, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(data, "_DATASET_TEXT", {})
    with pytest.raises(RuntimeError) as err:
        data.load_text(name)
    msg = str(err.value)
    assert "\n" not in msg
    assert name in msg and "offline" in msg and ".txt" in msg


# ----------------------------------------------------------------------------------- tokens


def test_eval_tokens(tokenizer, MOBY):
    text = MOBY.read_text(encoding="utf-8")
    stream = data.eval_tokens(tokenizer, str(MOBY))
    assert stream.dtype == torch.long and stream.dim() == 1
    expected = tokenizer(text, add_special_tokens=False, verbose=False).input_ids
    assert stream.tolist() == expected
    assert stream[0].item() != tokenizer.bos_token_id  # no special tokens added
    head = data.eval_tokens(tokenizer, str(MOBY), max_tokens=100)
    assert head.shape == (100,) and torch.equal(head, stream[:100])
    # max_tokens beyond the stream keeps everything
    assert torch.equal(data.eval_tokens(tokenizer, str(MOBY), max_tokens=10**9), stream)
    with pytest.raises(ValueError, match="max_tokens"):
        data.eval_tokens(tokenizer, str(MOBY), max_tokens=0)


def test_eval_tokens_no_length_warning(tokenizer, EMMA):
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        data.eval_tokens(tokenizer, f"{EMMA}:second_half")
    finally:
        logger.removeHandler(handler)
    assert not any("sequence length is longer" in m for m in records)


def _is_slice(stream, row):
    seqlen = row.numel()
    return bool((stream.unfold(0, seqlen, 1) == row).all(dim=1).any())


def test_calibration_samples(tokenizer, MOBY):
    source = f"{MOBY}:first_half"
    stream = data.eval_tokens(tokenizer, source)
    s = data.calibration_samples(tokenizer, source, nsamples=8, seqlen=64, seed=0)
    assert s.shape == (8, 64) and s.dtype == torch.long
    bos = data.window_bos(tokenizer)  # this tokenizer starts texts with [BOS]: so does every window
    assert bos is not None
    for row in s:
        assert row[0] == bos and _is_slice(stream, row[1:])
    again = data.calibration_samples(tokenizer, source, nsamples=8, seqlen=64, seed=0)
    assert torch.equal(s, again)
    other = data.calibration_samples(tokenizer, source, nsamples=8, seqlen=64, seed=1)
    assert not torch.equal(s, other)
    for row in other:
        assert row[0] == bos and _is_slice(stream, row[1:])


def test_calibration_samples_exact_fit(tokenizer, tmp_path):
    # seqlen + 1 tokens: the only valid window starts at 0
    f = tmp_path / "tiny.txt"
    f.write_text("the the of and to", encoding="utf-8")
    stream = data.eval_tokens(tokenizer, str(f))
    assert stream.numel() == 5
    s = data.calibration_samples(tokenizer, str(f), nsamples=3, seqlen=4, seed=7)
    window = torch.cat([torch.tensor([data.window_bos(tokenizer)]), stream[:3]])
    assert torch.equal(s, window.expand(3, 4))


def test_calibration_errors(tokenizer, tmp_path, MOBY):
    with pytest.raises(ValueError, match="nsamples"):
        data.calibration_samples(tokenizer, str(MOBY), nsamples=0, seqlen=16)
    with pytest.raises(ValueError, match="seqlen"):
        data.calibration_samples(tokenizer, str(MOBY), nsamples=4, seqlen=0)
    short = tmp_path / "short.txt"
    short.write_text("Emma Woodhouse , handsome , clever , and rich", encoding="utf-8")
    with pytest.raises(ValueError, match="too few") as err:
        data.calibration_samples(tokenizer, str(short), nsamples=1, seqlen=9)
    assert "seqlen" in str(err.value)
    with pytest.raises(FileNotFoundError, match="source"):
        data.calibration_samples(tokenizer, "no_such_corpus.txt", nsamples=1, seqlen=8)


def test_windows():
    t = torch.arange(10)
    w = data.windows(t, 3)
    assert w.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert data.windows(t, 5).shape == (2, 5)
    assert data.windows(t, 11).shape == (0, 11)
    with pytest.raises(ValueError, match="seqlen"):
        data.windows(t, 0)
    with pytest.raises(ValueError, match="tokens"):
        data.windows(t.reshape(2, 5), 2)


def test_windows_of_eval_stream(tokenizer, EMMA):
    stream = data.eval_tokens(tokenizer, str(EMMA), max_tokens=1000)
    w = data.windows(stream, 128)
    assert w.shape == (7, 128)
    assert torch.equal(w.reshape(-1), stream[: 7 * 128])


def test_windows_start_with_bos_exactly_where_the_tokenizer_starts_texts_with_it(tmp_path):
    """Calibration windows follow the tokenizer: a tokenizer that prepends BOS (Gemma's convention)
    gets BOS and seqlen - 1 text tokens per window, the same text tokens the plain windows start
    with; a tokenizer without one gets plain text windows (SmolLM2's, unchanged)."""
    from tests.helpers import WORDS, tiny_bos_tokenizer, tiny_tokenizer
    text = tmp_path / "words.txt"
    text.write_text(" ".join(WORDS[i * 5 % len(WORDS)] for i in range(400)))
    plain, with_bos = tiny_tokenizer(), tiny_bos_tokenizer()
    assert data.window_bos(plain) is None and data.window_bos(with_bos) == 1
    base = data.calibration_samples(plain, str(text), nsamples=6, seqlen=16, seed=3)
    bos = data.calibration_samples(with_bos, str(text), nsamples=6, seqlen=16, seed=3)
    assert bos.shape == base.shape == (6, 16)
    assert torch.equal(bos[:, 0], torch.ones(6, dtype=torch.long))
    assert torch.equal(bos[:, 1:], base[:, :-1])
    assert not (base == 1).any()
