"""Method options are typed class attributes: collected in order (a redeclaration keeps its
place), typed by their annotation, read from the settings the method was built with, and a bad
declaration is refused when its class is made."""
from typing import Optional

import pytest

from pyprune.methods.base import Method
from pyprune.methods.options import option, positive


class _Base(Method):  # no name: not registered
    rate: float = option(0.5, "a rate", positive)
    directory: Optional[str] = option(None, "a directory")

    def _prune(self, model, pattern, calib, *, batch_size, progress):
        return {}


class _Child(_Base):
    flag: bool = option(False, "a flag")
    rate: float = option(2.0, "a rate, other default", positive)


def test_options_are_collected_in_order_and_typed_by_their_annotation():
    declared = [(o.name, o.type, o.optional, o.default, o.flag) for o in _Child.options]
    assert declared == [("rate", float, False, 2.0, "--rate"), ("directory", str, True, None, "--directory"),
                        ("flag", bool, False, False, "--flag")]
    assert [o.default for o in _Base.options] == [0.5, None]


def test_an_option_reads_the_value_the_method_was_built_with_and_is_not_reassigned():
    child = _Child(flag="yes", rate=3)
    assert (child.rate, child.directory, child.flag) == (3.0, None, True)
    assert child.settings == {"rate": 3.0, "directory": None, "flag": True}
    assert _Child().rate == 2.0 and _Base().rate == 0.5
    with pytest.raises(AttributeError, match="option rate of method '' is set when the method is built"):
        child.rate = 1.0
    with pytest.raises(ValueError, match="option rate of method '' must be > 0; got -1.0"):
        _Child(rate=-1)
    with pytest.raises(ValueError, match="has no option lr; its options: rate, directory, flag"):
        _Child(lr=1)


def test_a_bad_declaration_is_refused_when_its_class_is_made():
    with pytest.raises(TypeError, match="declare an option with its type"):
        type("Untyped", (_Base,), {"extra": option(1, "extra")})
    with pytest.raises(TypeError, match="must be annotated with one of int, float, bool, str"):
        type("Listed", (_Base,), {"__annotations__": {"extra": list}, "extra": option([], "extra")})
    with pytest.raises(TypeError, match="hides the option rate of its base"):
        type("Hiding", (_Base,), {"rate": 1.0})
