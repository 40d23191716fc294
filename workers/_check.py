"""Checking arguments and options: one way, used by every option class and public call.

Each check names what it checks (``what``: ``"SaveOptions.lease_secs"``, ``"step"``...),
returns the value when it is right and otherwise raises an error that says what was given and
what is expected: ``TypeError`` for a value of the wrong type, ``ValueError`` for one out of
range. ``error=`` raises that type for every bad value instead (the training policies report
every bad argument as a ``ValueError``); ``expect=`` replaces the words of what is expected.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, NoReturn

_Error = type[Exception]


def _fail(
    what: str, value: Any, expected: str, default: _Error, error: _Error | None, shown: str = ""
) -> NoReturn:
    kind = f" ({type(value).__name__})" if default is TypeError else ""
    raise (error or default)(f"{what} must be {expected}, got {shown or repr(value)}{kind}")


def flag(value: Any, what: str, *, error: _Error | None = None) -> bool:
    """``value`` is True or False (not 0, 1 or another truthy value)."""
    if not isinstance(value, bool):
        _fail(what, value, "True or False", TypeError, error)
    return value


def integer(
    value: Any,
    what: str,
    *,
    minimum: int | None = None,
    optional: bool = False,
    error: _Error | None = None,
    expect: str | None = None,
) -> Any:
    """``value`` is an int (not a bool) of at least ``minimum`` (or None, if ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(what, value, expect or ("an int or None" if optional else "an int"), TypeError, error)
    if minimum is not None and value < minimum:
        _fail(what, value, expect or f"at least {minimum}", ValueError, error, str(value))
    return value


def index(value: Any, what: str, *, error: _Error | None = None, expect: str | None = None) -> int:
    """``value`` is a non-negative integer of any integer type (``__index__``), not a bool."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        _fail(what, value, expect or "a non-negative int", TypeError, error)
    n = int(value.__index__())
    if n < 0:
        _fail(what, value, expect or "a non-negative int", ValueError, error, str(n))
    return n


def number(
    value: Any,
    what: str,
    *,
    minimum: float | None = None,
    positive: bool = False,
    optional: bool = False,
    error: _Error | None = None,
    expect: str | None = None,
) -> Any:
    """``value`` is a finite real number (int or float, not a bool), positive or at least
    ``minimum`` when asked (or None, if ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(what, value, expect or "a number", TypeError, error)
    if (
        not math.isfinite(value)
        or (positive and value <= 0)
        or (minimum is not None and value < minimum)
    ):
        bound = "positive and finite" if positive else "finite"
        if minimum is not None and not positive:
            bound = f"a finite number >= {minimum:g}"
        _fail(what, value, expect or bound, ValueError, error)
    return value


def seconds(value: Any, what: str, *, zero: bool = False, optional: bool = False) -> Any:
    """A number of seconds: positive and finite (``zero``: or 0)."""
    if value is None and optional:
        return None
    if zero and value == 0 and not isinstance(value, bool):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(what, value, "a number of seconds", TypeError, None)
    if not math.isfinite(value) or value <= 0:
        _fail(what, value, "a positive, finite number of seconds", ValueError, None)
    return value


def one_of(value: Any, what: str, choices: Collection[Any], *, error: _Error | None = None) -> Any:
    """``value`` is one of ``choices`` (compared with ``==``; a wrong value is a ValueError)."""
    if value not in choices:
        shown = " or ".join(repr(c) for c in choices)
        _fail(what, value, shown, ValueError, error)
    return value


def text(
    value: Any,
    what: str,
    *,
    optional: bool = False,
    error: _Error | None = None,
    expect: str | None = None,
) -> Any:
    """``value`` is a non-empty str (or None, if ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        expected = expect or ("a non-empty str" + (" or None" if optional else ""))
        _fail(what, value, expected, TypeError, error)
    return value


def instance(value: Any, what: str, kind: type | tuple[type, ...], expected: str) -> Any:
    """``value`` is an instance of ``kind`` (runtime-checkable protocols too); ``expected``
    says what that is, with an example."""
    if not isinstance(value, kind):
        raise TypeError(f"{what}={value!r} is not {expected}")
    return value
