"""Module-level objects (classes, functions) by their qualified names, for configs."""

from __future__ import annotations

import importlib
from typing import Any


def name_of(owner: str, argument: str, obj: Any) -> str:
    """`"module.qualname"` of a class or function that importing that name gives
    back, else a TypeError: a lambda, a nested function or a bound method
    cannot be written in a JSON config.

    Examples:
        >>> from kerasdbg import _qualified
        >>> _qualified.name_of("StopOnRule", "action", _qualified.name_of)
        'kerasdbg._qualified.name_of'
    """
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if module and qualname and "<" not in qualname:
        try:
            if resolve(f"{module}.{qualname}") is obj:
                return f"{module}.{qualname}"
        except (ImportError, AttributeError):
            pass
    raise TypeError(
        f"{owner}: get_config cannot write `{argument}`={obj!r}: only a module-level class or "
        "function, which from_config imports by its name, can be saved in a config.")


def resolve(name: str) -> Any:
    """The object a `name_of` name designates (imports its module)."""
    module, _, qualname = name.rpartition(".")
    parts = qualname.split(".")
    # Nested qualified names (Outer.Inner) live under a module with fewer dots.
    while module:
        try:
            obj = importlib.import_module(module)
            break
        except ImportError:
            module, _, head = module.rpartition(".")
            parts.insert(0, head)
    else:
        raise ImportError(f"no module in {name!r}")
    for part in parts:
        obj = getattr(obj, part)
    return obj
