"""pyprune.nn's modules import without a cycle: the model description (pyprune.nn.layout) is
imported by compaction (copies) and slicing (views), neither by the other."""
import ast
import pathlib

import pytest

import pyprune.nn
from pyprune.nn import SlicedLinear, layout
from tests.helpers import tiny_llama

NN = pathlib.Path(pyprune.nn.__file__).parent


def _imports(module: str) -> set:
    """The pyprune.nn modules ``module`` imports (relative imports of its package, anywhere in it)."""
    tree = ast.parse((NN / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module] if node.module else [alias.name for alias in node.names])
    return found


def test_compact_and_sliced_share_the_layout_and_not_each_other():
    assert "layout" in _imports("compact") and "layout" in _imports("sliced")
    assert "sliced" not in _imports("compact") and "compact" not in _imports("sliced")
    assert not _imports("layout") & {"compact", "sliced"}


def test_views_are_refused_by_the_hidden_stream():
    model = tiny_llama(layers=1)
    model.model.layers[0].mlp.up_proj = SlicedLinear(model.model.layers[0].mlp.up_proj)
    with pytest.raises(ValueError, match="SlicedLinear"):
        layout.hidden_stream(model)
