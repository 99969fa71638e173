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


def test_a_tuple_option_takes_a_non_empty_list_each_item_converted_and_checked():
    from typing import Tuple
    from pyprune.methods.options import Option, resolve
    rates = option((1.0,), "rates", positive)
    kinds = option(("a",), "kinds", choices=("a", "b"))
    rates.name, kinds.name = "rates", "kinds"
    rates.bind(Tuple[float, ...])
    kinds.bind(Optional[Tuple[str, ...]])
    assert (rates.many, rates.type, rates.optional, kinds.many, kinds.optional) == (True, float, False, True, True)
    assert resolve([rates, kinds], {"rates": [1, 2.5]}, "s", "study") == {"rates": (1.0, 2.5), "kinds": ("a",)}
    for value, message in (([], "must be a non-empty list of float; got \\[\\]"),
                           ("1.0", "must be a non-empty list of float; got '1.0'"),
                           ([1.0, -1.0], "must be > 0; got -1.0")):
        with pytest.raises(ValueError, match=f"option rates of study 's' {message}"):
            resolve([rates], {"rates": value}, "s", "study")
    with pytest.raises(ValueError, match="option kinds of study 's' must be one of a, b; got 'c'"):
        kinds.convert(["a", "c"], "s", "study")
    assert kinds.convert(None, "s", "study") is None
    fixed = Option((1, 2), "a pair")
    fixed.name = "pair"
    with pytest.raises(TypeError, match=r"or Tuple\[type, \.\.\.\] of one\); got typing.Tuple\[int, int\]"):
        fixed.bind(Tuple[int, int])
