"""Argument validation shared by every public constructor.

Each helper raises ``ValueError`` for a bad value and ``TypeError`` for a bad
type, naming the owner, the argument, what is allowed and what was received.
"""

from __future__ import annotations

import numbers
import os
import re
import warnings
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(owner: str, name: str, value: Any) -> int:
    """Returns `value` if it is an int >= 1, else raises."""
    if not _is_int(value):
        raise TypeError(
            f"{owner}: `{name}` must be a positive int. "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(
            f"{owner}: `{name}` must be a positive int. Received: {name}={value!r}"
        )
    return value


def optional_positive_int(owner: str, name: str, value: Any) -> Optional[int]:
    """Returns `value` if it is None or an int >= 1, else raises."""
    if value is None:
        return None
    if not _is_int(value):
        raise TypeError(
            f"{owner}: `{name}` must be None or a positive int. "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(
            f"{owner}: `{name}` must be None or a positive int. "
            f"Received: {name}={value!r}"
        )
    return value


def non_negative_int(owner: str, name: str, value: Any) -> int:
    """Returns `value` if it is an int >= 0, else raises."""
    if not _is_int(value):
        raise TypeError(
            f"{owner}: `{name}` must be a non-negative int. "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    if value < 0:
        raise ValueError(
            f"{owner}: `{name}` must be a non-negative int. "
            f"Received: {name}={value!r}"
        )
    return value


def optional_regex(owner: str, name: str, value: Any) -> Optional[str]:
    """Returns `value` if it is None or a string that compiles as a regex."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(
            f"{owner}: `{name}` must be None or a regular expression string. "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    try:
        re.compile(value)
    except re.error as error:
        raise ValueError(
            f"{owner}: `{name}` is not a valid regular expression ({error}). "
            f"Received: {name}={value!r}"
        ) from None
    return value


def choices(
    owner: str, name: str, value: Any, allowed: Sequence[str], allow_empty: bool = False
) -> tuple:
    """Returns `value` as a tuple of unique names, each one of `allowed`."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(
            f"{owner}: `{name}` must be a list or tuple of names from "
            f"{', '.join(allowed)}. Received: {name}={value!r}"
        )
    names = tuple(value)
    if (not names and not allow_empty) or [v for v in names if v not in allowed]:
        raise ValueError(
            f"{owner}: `{name}` must be a {'' if allow_empty else 'non-empty '}list of names from "
            f"{', '.join(allowed)}. Received: {name}={value!r}"
        )
    return tuple(dict.fromkeys(names))


def optional_path(owner: str, name: str, value: Any) -> Optional[str]:
    """Returns `value` as a string path if it is None, a str or a PathLike."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{owner}: `{name}` must be None, a str or an os.PathLike. "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    value = os.fspath(value)
    if not value:
        raise ValueError(f"{owner}: `{name}` must not be empty. Received: {name}=''")
    return value


def log_dir(owner: str, name: str, value: Any) -> Optional[str]:
    """`optional_path`, refusing a path that exists and is not a directory
    (or whose `train` run is not one): what can be seen before `fit`."""
    value = optional_path(owner, name, value)
    if value is None or "://" in value:
        return value
    for path in (value, os.path.join(value, "train")):
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(
                f"{owner}: `{name}` must be a directory (TensorBoard writes event files "
                f"into it); {path!r} is a file. Received: {name}={value!r}"
            )
    return value


def boolean(owner: str, name: str, value: Any) -> bool:
    """Returns `value` if it is a bool, else raises TypeError."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{owner}: `{name}` must be a bool. "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    return value


def one_of(owner: str, name: str, value: Any, allowed: Sequence[Any]) -> Any:
    """Returns `value` if it is one of `allowed`, else raises ValueError."""
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(
            f"{owner}: `{name}` must be one of "
            f"{', '.join(repr(a) for a in allowed)}. Received: {name}={value!r}"
        )
    return value


def number(
    owner: str, name: str, value: Any, minimum: Optional[float] = None,
    maximum: Optional[float] = None, exclusive_minimum: bool = False,
) -> float:
    """Returns `value` as a float if it is a finite real number within the bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{owner}: `{name}` must be a number. "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    value = float(value)
    low_ok = minimum is None or (value > minimum if exclusive_minimum else value >= minimum)
    high_ok = maximum is None or value <= maximum
    if value != value or value in (float("inf"), float("-inf")) or not (low_ok and high_ok):
        bounds = []
        if minimum is not None:
            bounds.append(f"{'>' if exclusive_minimum else '>='} {minimum:g}")
        if maximum is not None:
            bounds.append(f"<= {maximum:g}")
        allowed = " and ".join(bounds) if bounds else "finite"
        raise ValueError(
            f"{owner}: `{name}` must be a finite number {allowed}. Received: {name}={value!r}"
        )
    return value


def from_percent(value: Any) -> Any:
    """A percent as a fraction (a value that is not a number is left for the
    new argument's validation to refuse)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return float(value) / 100.0


Rename = Tuple[Optional[str], Optional[Callable[[Any], Any]], str]
"""`(new name or None when removed, conversion or None, what changed)`."""


def deprecated(owner: str, given: Dict[str, Any], renames: Mapping[str, Rename],
               current: Mapping[str, Tuple[Any, Any]]) -> Dict[str, Any]:
    """Pops the deprecated arguments out of `given` (a `**kwargs` dict).

    Each one warns (FutureWarning, shown by default) with its new name and
    the converted value, and its value comes back under the new name; a
    removed one warns that it is ignored and why. `current` maps each new
    name to `(value given, its default)`: a new argument set to another
    value than its default together with its old name is a ValueError.

    Examples:
        >>> import warnings
        >>> from kerasdbg import _validation as check
        >>> given = {"threshold": 50}
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     check.deprecated("AllZero", given, {"threshold": ("zero_fraction",
        ...         check.from_percent, "a fraction 0-1, not a percent")}, {})
        {'zero_fraction': 0.5}
        >>> str(caught[0].message)
        'AllZero: `threshold` is deprecated; use `zero_fraction` (a fraction 0-1, not a percent): threshold=50 is zero_fraction=0.5.'
    """
    found: Dict[str, Any] = {}
    for old, (new, convert, how) in renames.items():
        if old not in given:
            continue
        value = given.pop(old)
        if new is None:
            warnings.warn(f"{owner}: `{old}` is deprecated and ignored: {how}.",
                          FutureWarning, stacklevel=3)
            continue
        given_new, default = current.get(new, (None, None))
        if given_new != default:
            raise ValueError(f"{owner}: give `{new}` or its deprecated name `{old}`, not both. "
                             f"Received: {new}={given_new!r}, {old}={value!r}")
        found[new] = convert(value) if convert is not None else value
        warnings.warn(f"{owner}: `{old}` is deprecated; use `{new}` ({how}): "
                      f"{old}={value!r} is {new}={found[new]!r}.", FutureWarning, stacklevel=3)
    return found


def no_other_arguments(owner: str, given: Mapping[str, Any]) -> None:
    """Raises TypeError, as Python does, for a keyword argument nobody took."""
    if given:
        name = sorted(given)[0]
        raise TypeError(f"{owner}: unexpected keyword argument `{name}`. Received: "
                        f"{name}={given[name]!r}")



def layer_selection(owner: str, name: str, value: Any) -> Any:
    """Returns `value` if it is a layer selection (`insert_taps`'s `layers`
    forms): None, a regular expression, a list of layer names or paths, or a
    callable `layer -> bool`."""
    if value is None or callable(value):
        return value
    if isinstance(value, str):
        return optional_regex(owner, name, value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise TypeError(
        f"{owner}: `{name}` must be None, a regular expression, a non-empty list of layer "
        f"names or a callable `layer -> bool`. Received: {name}={value!r}")
