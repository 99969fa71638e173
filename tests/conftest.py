"""Test set-up: without a GPU every Triton kernel runs in the interpreter on CPU tensors.

TRITON_INTERPRET must be set before Triton defines a kernel, so it is set here, before any
pyprune kernel module is imported (pyprune imports them lazily).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's `pytest -n 2`) the workers share the cores: each takes its share of
# torch's threads rather than all of them, so the workers do not oversubscribe the CPU.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# SparseLinear(backend="auto") would otherwise time unmeasured cases on first use and pick by the
# timing: the suite stays deterministic, and the tuning tests turn it on themselves.
os.environ.setdefault("PYPRUNE_TUNE", "0")


@pytest.fixture
def cpu_extension_is_built():
    """pyprune._C is part of the install: the cpu cases fail (never skip) without it. Files of C++
    kernel tests use it with ``pytestmark = pytest.mark.usefixtures("cpu_extension_is_built")``."""
    from pyprune.ops.library import native
    if native("cpu") is None:
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



def _fingerprint(model):
    return [float(p.detach().double().sum()) for p in model.parameters()]


@pytest.fixture(scope="module")
def tiny_copy():
    """``tiny_copy(family)``: a fresh copy of the family's 2-block random-weight model, each family built
    once per test module."""
    import copy
    from tests.helpers import tiny_decoder
    built = {}

    def get(family):
        if family not in built:
            built[family] = tiny_decoder(family, layers=2)
        return copy.deepcopy(built[family])
    return get


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M and its tokenizer, loaded once per test session and shared: a test that
    changes the model takes ``smollm2_copy``. The session ends with a check that nobody changed it."""
    from pyprune.inputs.models import load_model
    model, tokenizer = load_model("smollm2-135m")
    before = _fingerprint(model)
    yield model, tokenizer
    assert _fingerprint(model) == before, "a test changed the shared SmolLM2 model; use smollm2_copy"


@pytest.fixture
def smollm2_copy(smollm2):
    """A private copy of the session's SmolLM2-135M (to prune, slice or cut), and its tokenizer."""
    import copy
    model, tokenizer = smollm2
    return copy.deepcopy(model), tokenizer


@pytest.fixture(autouse=True)
def dispatch_cache_per_test(tmp_path, monkeypatch):
    """SparseLinear's per-user measurement cache in the test's own directory: a user's cache never
    changes what a test sees, and no test writes into it."""
    from pyprune.nn import dispatch
    root = str(tmp_path / "pyprune-cache")
    monkeypatch.setattr(dispatch, "cache_root", lambda: root)
    return root
