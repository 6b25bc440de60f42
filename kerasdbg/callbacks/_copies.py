"""What a copy of a kerasdbg callback is: the callback built again.

KerasTuner deep-copies every callback for each trial (and refuses one that
cannot be copied); Ray and multiprocessing pickle them. A callback that has
run holds per-run state that cannot and must not be copied: event writers,
the engine's requests, the model, the records of that run. So a copy is a
fresh instrument: the constructor called again with the arguments the
original received (copied alike), as if the user had written it twice, and
with the current value of each public attribute named after a constructor
argument that the user changed since (`callback.every_n_steps = 5`): the
copy is configured as the original is now.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Dict, Optional, Tuple


def _snapshot(value: Any) -> Any:
    # A list the caller mutates after the construction (rules appended)
    # must not change what a later copy receives.
    if isinstance(value, (list, dict, set)):
        return copy.copy(value)
    return value


def _rebuild(cls: type, args: tuple, kwargs: Dict[str, Any], kept: Optional[dict] = None):
    """Unpickles a callback: its constructor called with its arguments, then
    what it keeps besides them (`CopiedAsNew._kept_on_copy`)."""
    duplicate = cls(*args, **kwargs)
    for name, value in (kept or {}).items():
        setattr(duplicate, name, value)
    return duplicate


def _parameters(cls: type) -> Tuple[str, ...]:
    """The names of `cls`'s constructor arguments that can be passed by name."""
    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(name for name, p in signature.parameters.items()
                 if p.kind in kinds and name != "self" and not name.startswith("_"))


def _changed(now: Any, built: Tuple[Any, Any]) -> bool:
    """Whether an attribute differs from what the constructor left in it:
    another object, or the same list, dict or set with other contents."""
    value, contents = built
    if now is not value:
        return True
    return contents is not None and now != contents


class CopiedAsNew:
    """Mixin of the callbacks: `copy.copy`, `copy.deepcopy` and `pickle` give
    the callback built again from the arguments its constructor received,
    each public attribute named after an argument taken at its current value
    when the user changed it after the construction.

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

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            depth = self.__dict__.get("_init_depth", 0)
            self.__dict__["_init_depth"] = depth + 1
            try:
                init(self, *args, **kwargs)
            finally:
                self.__dict__["_init_depth"] = depth
            if depth == 0:
                # What the constructor made of each argument, to tell later what
                # the user changed (the outermost constructor only: a subclass's
                # runs its parent's inside it).
                self.__dict__["_built"] = {
                    name: (getattr(self, name), _snapshot(getattr(self, name))
                           if isinstance(getattr(self, name), (list, dict, set)) else None)
                    for name in _parameters(type(self)) if hasattr(self, name)}

        cls.__init__ = __init__

    def _current_arguments(self) -> Tuple[tuple, Dict[str, Any]]:
        """The constructor's arguments, with the attributes changed since."""
        args, kwargs = self._arguments
        built = self.__dict__.get("_built", {})
        changed = {name: getattr(self, name) for name, before in built.items()
                   if hasattr(self, name) and _changed(getattr(self, name), before)}
        if not changed:
            return args, kwargs
        bound = inspect.signature(type(self).__init__).bind(self, *args, **kwargs)
        for name, value in changed.items():
            bound.arguments[name] = _snapshot(value)
        return tuple(bound.args[1:]), dict(bound.kwargs)

    _kept_on_copy: Tuple[str, ...] = ()
    """Attributes a copy takes as they are, beside the constructor's arguments
    (what the constructor made of an argument that the user then changed:
    `StopOnRule.default_rules` after rules were added to the defaults)."""

    def _attributes_kept(self) -> dict:
        return {name: getattr(self, name) for name in self._kept_on_copy if hasattr(self, name)}

    def __copy__(self):
        args, kwargs = self._current_arguments()
        return _rebuild(type(self), args, kwargs, self._attributes_kept())

    def __deepcopy__(self, memo: dict):
        args, kwargs = copy.deepcopy(self._current_arguments(), memo)
        duplicate = _rebuild(type(self), args, kwargs, copy.deepcopy(self._attributes_kept(), memo))
        memo[id(self)] = duplicate
        return duplicate

    def __reduce__(self):
        args, kwargs = self._current_arguments()
        return _rebuild, (type(self), args, kwargs, self._attributes_kept())
