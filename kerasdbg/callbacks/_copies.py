"""What a copy of a kerasdbg callback is: the callback built again.

KerasTuner deep-copies every callback for each trial (and refuses one that
cannot be copied); Ray and multiprocessing pickle them. A callback that has
run holds per-run state that cannot and must not be copied: event writers,
the engine's requests, the model, the records of that run. So a copy is a
fresh instrument: the constructor called again with the arguments the
original received (copied alike), as if the user had written it twice.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Tuple


def _snapshot(value: Any) -> Any:
    # A list the caller mutates after the construction (rules appended)
    # must not change what a later copy receives.
    if isinstance(value, (list, dict, set)):
        return copy.copy(value)
    return value


def _rebuild(cls: type, args: tuple, kwargs: Dict[str, Any]):
    """Unpickles a callback: its constructor called with its arguments."""
    return cls(*args, **kwargs)


class CopiedAsNew:
    """Mixin of the callbacks: `copy.copy`, `copy.deepcopy` and `pickle` give
    the callback built again from the arguments its constructor received.

    A copy keeps the configuration (what `get_config` returns, plus what
    cannot be put in a config: a rule object, a callable `action`) and
    nothing of a run: no model, no event writer, no engine request, and an
    empty `history` (`verdicts`, `latest`, ...) until it runs itself. This
    holds before and after a `fit`, also one that raised. `copy.deepcopy`
    deep-copies the arguments (rule objects), `copy.copy` passes the same
    objects; `pickle` pickles them (a lambda `action` cannot be pickled).
    """

    _arguments: Tuple[tuple, Dict[str, Any]]

    def __new__(cls, *args, **kwargs):
        instance = super().__new__(cls)
        # Set before __init__, whatever the subclass's signature.
        instance._arguments = (tuple(_snapshot(a) for a in args),
                               {k: _snapshot(v) for k, v in kwargs.items()})
        return instance

    def __copy__(self):
        args, kwargs = self._arguments
        return type(self)(*args, **kwargs)

    def __deepcopy__(self, memo: dict):
        args, kwargs = copy.deepcopy(self._arguments, memo)
        duplicate = type(self)(*args, **kwargs)
        memo[id(self)] = duplicate
        return duplicate

    def __reduce__(self):
        args, kwargs = self._arguments
        return _rebuild, (type(self), args, kwargs)
