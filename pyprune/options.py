"""Declared options: a method, a study, a recipe section or LoRA recovery declares its options
once, as annotated class attributes (``lr: float = option(5e-3, "help", positive)``), and the
Python call, the CLI flags (:func:`pyprune.cli.flags.add_option_flags`), ``--help``, a recipe's
fields and the report's ``options`` all come from that declaration; ``method.lr`` reads the value
the method was built with, typed for a type checker by the annotation.

A check returns an error message or None; a method's :meth:`~pyprune.methods.base.Method.check_options`
adds the constraints between options (e.g. MoreauPruner's γ < ρ). Every error names the option
and what is allowed, and is raised before a model is loaded or touched. This module imports no
other part of pyprune, so that every layer may declare options (:mod:`pyprune.methods.options`
adds the checks only methods need).
"""
from __future__ import annotations

import math
import sys
import types
import typing
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

#: the types an option can have (a study's arms may also be a ``Tuple[type, ...]`` of one of them)
TYPES = (int, float, bool, str)


def option(default: Any, help: str, check: Optional[Callable[[Any], Optional[str]]] = None, *,
           choices: Tuple[str, ...] = ()) -> Any:
    """Declare an option of a method as a class attribute: ``name: type = option(default, help)``.
    Typed ``Any`` (as ``dataclasses.field``) so that the annotation is what a type checker sees."""
    return Option(default, help, check, choices)


class Option:
    """One method option: its ``name`` and ``type`` come from the class attribute that declares it
    (an ``Optional[...]`` annotation makes it ``optional``: None means "unset"); ``choices``
    restricts a str option. On a method object it reads the value the method was built with."""

    def __init__(self, default: Any, help: str, check: Optional[Callable[[Any], Optional[str]]] = None,
                 choices: Tuple[str, ...] = ()):
        self.default, self.help, self.check, self.choices = default, help, check, tuple(choices)
        self.name: str = ""
        self.type: type = object
        self.optional = False
        self.many = False  # a Tuple[type, ...] annotation: a non-empty sequence of values

    def __set_name__(self, owner: type, name: str) -> None:
        if self.name:
            raise TypeError(f"option {self.name} is declared twice ({owner.__qualname__}.{name}); build each "
                            "declaration with its own option(...) call")
        self.name = name

    def __get__(self, instance, owner=None):
        return self if instance is None else instance.settings[self.name]

    def __set__(self, instance, value) -> None:
        kind = getattr(instance, "kind", "method")  # a study says so
        raise AttributeError(f"option {self.name} of {kind} {instance.name!r} is set when the {kind} is built")

    def bind(self, annotation: Any) -> None:
        """Take this option's type from its class attribute's (evaluated) annotation."""
        kinds = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
            else (annotation,)
        self.optional = type(None) in kinds
        kinds = tuple(kind for kind in kinds if kind is not type(None))
        if len(kinds) == 1 and typing.get_origin(kinds[0]) is tuple:
            items = typing.get_args(kinds[0])
            self.many = len(items) == 2 and items[1] is Ellipsis
            kinds = items[:1] if self.many else kinds
        if len(kinds) != 1 or kinds[0] not in TYPES:
            raise TypeError(f"option {self.name} must be annotated with one of int, float, bool, str (or "
                            f"Optional of one, or Tuple[type, ...] of one); got {annotation!r}")
        self.type = kinds[0]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def convert(self, value: Any, method: str, kind: str = "method", where: Optional[str] = None) -> Any:
        """``value`` as this option's type, checked; ValueError naming the option (of the ``kind``
        ``method``: a method, or a study), or starting with ``where`` when given (a recipe's field
        path, e.g. ``stages[1].options.lr:``), otherwise. A ``many`` option takes a non-empty list
        or tuple and gives a tuple, each item converted and checked."""
        where = where or f"option {self.name} of {kind} {method!r}"
        if value is None:
            if self.optional:
                return None
            raise ValueError(f"{where} must be set; got None")
        if not self.many:
            return self._convert_one(value, where)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"{where} must be a non-empty list of {self.type.__name__}; got {value!r}")
        return tuple(self._convert_one(item, where) for item in value)

    def _convert_one(self, value: Any, where: str) -> Any:
        if self.type is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                value = value.lower() in ("true", "1", "yes")
            if not isinstance(value, bool):
                raise ValueError(f"{where} must be true or false; got {value!r}")
        elif self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where} must be an integer; got {value!r}")
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{where} must be a finite number; got {value!r}")
            value = float(value)
        elif self.type is str:
            if not isinstance(value, str):
                raise ValueError(f"{where} must be a string; got {value!r}")
        if self.choices and value not in self.choices:
            raise ValueError(f"{where} must be one of {', '.join(self.choices)}; got {value!r}")
        problem = self.check(value) if self.check is not None else None
        if problem:
            raise ValueError(f"{where} {problem}; got {value!r}")
        return value


def collect(cls: type, inherited: Sequence[Option]) -> Tuple[Option, ...]:
    """The options of the class ``cls``: the ``inherited`` ones of its base, each in its place or
    replaced there by a redeclaration in ``cls``, then the new ones of its body in their order.
    Each takes its type from its annotation."""
    options = {declared.name: declared for declared in inherited}
    annotations = cls.__dict__.get("__annotations__", {})
    module = vars(sys.modules[cls.__module__])
    for name, value in cls.__dict__.items():
        if name in options and not isinstance(value, Option):
            raise TypeError(f"{cls.__qualname__}.{name} hides the option {name} of its base; redeclare it "
                            "with option(...)")
        if isinstance(value, Option):
            if name not in annotations:
                raise TypeError(f"{cls.__qualname__}.{name}: declare an option with its type, e.g. "
                                f"{name}: float = option(...)")
            annotation = annotations[name]
            value.bind(eval(annotation, module) if isinstance(annotation, str) else annotation)
            options[name] = value
    return tuple(options.values())


def resolve(declared: Sequence[Option], given: Dict[str, Any], method: str, kind: str = "method") -> Dict[str, Any]:
    """Every declared option's value: the given one (converted and checked) or the default.
    An option the ``kind`` (method or study) does not declare is an error that lists the ones it has."""
    by_name = {option.name: option for option in declared}
    unknown = sorted(set(given) - set(by_name))
    if unknown:
        allowed = ", ".join(by_name) if by_name else "none"
        raise ValueError(f"{kind} {method!r} has no option {', '.join(unknown)}; its options: {allowed}")
    return {name: option.convert(given.get(name, option.default), method, kind)
            for name, option in by_name.items()}


# Checks shared by the declarations.
def positive(value) -> Optional[str]:
    return None if value > 0 else "must be > 0"


def nonnegative(value) -> Optional[str]:
    return None if value >= 0 else "must be >= 0"


def at_least_one(value) -> Optional[str]:
    return None if value >= 1 else "must be >= 1"


def fraction(value) -> Optional[str]:
    return None if 0 < value <= 1 else "must be in (0, 1]"


def nonempty(value) -> Optional[str]:
    return None if value.strip() else "must not be empty"


def shard_training() -> Any:
    """The ``shard_training`` option of the block-training methods, DReSS and LoRA recovery, declared
    once (:func:`pyprune.runtime.training.sharded_block`, :func:`pyprune.runtime.training.train`)."""
    return option(False, "training (safe, safe+, masked-recon, dress, LoRA recovery), under torchrun with 2 or more "
                  "ranks: "
                  "shard the trained weights, their gradients and the optimiser state over the ranks (PyTorch's "
                  "FSDP2), for a block or model whose training state does not fit one device")
