"""kerasdbg: debugging instruments for Keras 3 training (TensorFlow backend).

The names below are imported on first use. `kerasdbg.rules` (the rules and
their verdicts) needs neither TensorFlow nor Keras: a recorded run can be
judged where neither is installed. The instruments, the reader and the
tools need TensorFlow; asking for one without it raises an `ImportError`
that says how to install it.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

# name -> (module, attribute or None for the module itself, needs TensorFlow)
_EXPORTS = {
    "MultiOutputModel": ("kerasdbg.multi_output_model", "MultiOutputModel", True),
    "TraceWriter": ("kerasdbg.trace", "TraceWriter", True),
    "callbacks": ("kerasdbg.callbacks", None, True),
    "check_run": ("kerasdbg.offline", "check_run", True),
    "compat": ("kerasdbg.compat", None, False),
    "compare_traces": ("kerasdbg.trace", "compare_traces", True),
    "deterministic": ("kerasdbg.determinism", "deterministic", True),
    "doctor": ("kerasdbg.doctor", "doctor", True),
    "insert_taps": ("kerasdbg.tapping", "insert_taps", True),
    "layers": ("kerasdbg.layers", None, True),
    "load_run": ("kerasdbg.reader", "load_run", True),
    "load_trace": ("kerasdbg.trace", "load_trace", True),
    "rules": ("kerasdbg.rules", None, False),
    "stats": ("kerasdbg.stats", None, False),
    "strip_debug_layers": ("kerasdbg.tapping", "strip_debug_layers", True),
}

__all__ = tuple(sorted(_EXPORTS))


def _require_tensorflow(name: str) -> None:
    try:
        import tensorflow  # noqa: F401
    except ImportError as error:  # depends on the install
        raise ImportError(
            f"kerasdbg.{name} needs TensorFlow >= 2.16. Install it with "
            "`pip install kerasdbg[cpu]` (CPU build) or `pip install kerasdbg[and-cuda]`, "
            "or keep the TensorFlow build you already have."
        ) from error


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kerasdbg' has no attribute {name!r}")
    module_name, attribute, needs_tensorflow = _EXPORTS[name]
    if needs_tensorflow:
        _require_tensorflow(name)
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """Keeps an exported function ahead of the sub-module of the same name
    (`kerasdbg.doctor`): importing a sub-module sets it on its package."""

    def __setattr__(self, name: str, value: Any) -> None:
        export = _EXPORTS.get(name)
        if export and export[1] is not None and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
