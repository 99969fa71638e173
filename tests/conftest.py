"""Test set-up: without a GPU every Triton kernel runs in the interpreter on CPU tensors.

TRITON_INTERPRET must be set before Triton defines a kernel, so it is set here, before any
pyprune kernel module is imported (pyprune imports them lazily).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def cpu_extension_is_built():
    """pyprune._C is part of the install: the cpu cases fail (never skip) without it. Files of C++
    kernel tests use it with ``pytestmark = pytest.mark.usefixtures("cpu_extension_is_built")``."""
    from pyprune import backend
    if backend.native_module("cpu") is None:
        pytest.fail("pyprune._C is not built", pytrace=False)


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A saved tiny random Llama with its tokenizer, and a text file of its words."""
    from tests.helpers import WORDS, tiny_llama, tiny_tokenizer
    model_dir = tmp_path / "tiny"
    tiny_llama(hidden=64, heads=4, kv_heads=2).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(600)))
    return model_dir, text

