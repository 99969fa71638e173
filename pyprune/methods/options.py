"""Declared method options: each method lists its options once (name, type, default, help, check),
and ``pyprune.prune(**options)``, the CLI flags, ``--help`` and the report's ``options`` all come
from that declaration.

A check returns an error message or None; a method's :meth:`~pyprune.methods.base.Method.check_options`
adds the constraints between options (e.g. MoreauPruner's γ < ρ). Every error names the option
and what is allowed, and is raised before a model is loaded or touched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Option:
    """One method option. ``type`` is int, float, bool or str; ``default`` None means "unset"
    (allowed only where ``optional``); ``choices`` restricts a str option."""

    name: str
    type: type
    default: Any
    help: str
    check: Optional[Callable[[Any], Optional[str]]] = None
    choices: Tuple[str, ...] = ()
    optional: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def convert(self, value: Any, method: str) -> Any:
        """``value`` as this option's type, checked; ValueError naming the option otherwise."""
        where = f"option {self.name} of method {method!r}"
        if value is None:
            if self.optional:
                return None
            raise ValueError(f"{where} must be set; got None")
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


def resolve(declared: Sequence[Option], given: Dict[str, Any], method: str) -> Dict[str, Any]:
    """Every declared option's value: the given one (converted and checked) or the default.
    An option the method does not declare is an error that lists the ones it has."""
    by_name = {option.name: option for option in declared}
    unknown = sorted(set(given) - set(by_name))
    if unknown:
        allowed = ", ".join(by_name) if by_name else "none"
        raise ValueError(f"method {method!r} has no option {', '.join(unknown)}; its options: {allowed}")
    return {name: option.convert(given.get(name, option.default), method)
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


#: The block-wise methods' resume directory (:class:`pyprune.runtime.engine.BlockCheckpoint`).
BLOCK_CHECKPOINT = Option("checkpoint", str, None, "block-wise methods (wanda, sparsegpt, copal, safe): directory "
                          "where every finished block is saved; a rerun with the same settings, calibration and "
                          "model resumes after the last one", optional=True)
