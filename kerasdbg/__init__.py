"""kerasdbg: debugging instruments for Keras 3 training.

The names below are imported on first use. `kerasdbg.rules` (the rules and
their verdicts) needs neither TensorFlow nor Keras: a recorded run can be
judged where neither is installed. The callbacks, the reader (`load_run`,
`check_run`, `kerasdbg report`), the event files, the traces, the layers and
the model tools (`insert_taps`, `strip_debug_layers`, `MultiOutputModel`)
import without TensorFlow, on every Keras backend; what works only through
TensorFlow (`deterministic`, `doctor`) needs it, and asking for it without
it raises an `ImportError` that says how to install it.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.1.0"

# name -> (module, attribute or None for the module itself, needs TensorFlow)
_EXPORTS = {
    "MultiOutputModel": ("kerasdbg.multi_output_model", "MultiOutputModel", False),
    "RecordingError": ("kerasdbg.errors", "RecordingError", False),
    "TraceWriter": ("kerasdbg.trace", "TraceWriter", False),
    "calibrate": ("kerasdbg.calibration", "calibrate", False),
    "callbacks": ("kerasdbg.callbacks", None, False),
    "check_run": ("kerasdbg.offline", "check_run", False),
    "compat": ("kerasdbg.compat", None, False),
    "compare_runs": ("kerasdbg.run_comparison", "compare_runs", False),
    "compare_traces": ("kerasdbg.trace", "compare_traces", False),
    "deterministic": ("kerasdbg.determinism", "deterministic", True),
    "doctor": ("kerasdbg.doctor", "doctor", False),
    "insert_taps": ("kerasdbg.tapping", "insert_taps", False),
    "layers": ("kerasdbg.layers", None, False),
    "load_run": ("kerasdbg.reader", "load_run", False),
    "load_trace": ("kerasdbg.trace", "load_trace", False),
    "rules": ("kerasdbg.rules", None, False),
    "set_read_interval": ("kerasdbg.capture.reads", "set_read_interval", False),
    "stats": ("kerasdbg.stats", None, False),
    "strip_debug_layers": ("kerasdbg.tapping", "strip_debug_layers", False),
}
# "needs TensorFlow": the name's module imports it; without it, the error
# says how to install it (not a bare "No module named 'tensorflow'").

__all__ = tuple(sorted(_EXPORTS))


def _require_tensorflow(name: str) -> None:
    try:
        import tensorflow  # noqa: F401
    except ImportError as error:  # depends on the install
        raise ImportError(
            f"kerasdbg.{name} needs TensorFlow >= 2.16. Install it with "
            "`pip install kerasdbg[cpu]` (CPU build) or `pip install kerasdbg[and-cuda]`, "
            "or keep the TensorFlow build you already have. Without TensorFlow (the JAX "
            "backend: `pip install kerasdbg[jax]`), the callbacks, the layers, doctor, "
            "load_run, kerasdbg check and report work."
        ) from error


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kerasdbg' has no attribute {name!r}")
    module_name, attribute, needs_tensorflow = _EXPORTS[name]
    if needs_tensorflow and "tensorflow" not in sys.modules:
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


# ------------------------------------------------- the layers and Keras's loader
# A `.keras` file that holds a TapLayer or a PrintLayer names their classes by
# the names under which `kerasdbg.layers` registers them with Keras; Keras does
# not import a package outside its own to find a class. So the layers are
# registered as soon as Keras is loaded, on the backends they record on
# (TensorFlow, JAX): at once when it already is, else right after its import
# ends, through the finder below. `import kerasdbg` alone imports no framework
# (the rules run without one).
_REGISTRATION_NEEDS = ("keras",)
_LAYER_BACKENDS = ("tensorflow", "jax")


def _loaded(name: str, finishing: str) -> bool:
    """Whether module `name` is fully imported (`finishing` is the one whose
    import is ending now: its spec still says it is initializing)."""
    module = sys.modules.get(name)
    if module is None:
        return False
    return name == finishing or not getattr(getattr(module, "__spec__", None),
                                            "_initializing", False)


def _register_layers(finishing: str = "") -> None:
    """Imports `kerasdbg.layers` (which registers TapLayer and PrintLayer with
    Keras's serialization) once Keras is loaded, on the backends the layers
    record on; a failure warns, it never fails the user's import."""
    global _REGISTERED
    if _REGISTERED or not all(_loaded(name, finishing) for name in _REGISTRATION_NEEDS):
        return
    # The finder stays on `sys.meta_path`, inert from now on: removing it while
    # another thread imports could make that thread skip a finder.
    _REGISTERED = True
    try:
        if sys.modules["keras"].config.backend() not in _LAYER_BACKENDS:
            return  # elsewhere the layers refuse to be made
        importlib.import_module("kerasdbg.layers")
    except Exception as error:  # noqa: BLE001 - never break the user's `import keras`
        import warnings

        warnings.warn(
            "kerasdbg could not register TapLayer and PrintLayer with Keras, so a model "
            "file that holds them loads only after `import kerasdbg.layers`. "
            f"Cause: {type(error).__name__}: {error}", RuntimeWarning, stacklevel=2)


class _RegisterLayersOnImport:
    """A finder on `sys.meta_path` that finds nothing itself: it takes the
    spec the other finders give for `keras` and has its loader call
    `_register_layers` when the module's code has run."""

    def find_spec(self, name, path=None, target=None):
        if _REGISTERED or name not in _REGISTRATION_NEEDS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        execute = getattr(loader, "exec_module", None)
        # Only a loader object of this module alone (a package's source files):
        # a zip or frozen importer serves every module, and stays untouched
        # (there the layers register at `import kerasdbg.layers`).
        if execute is not None and type(loader) is importlib.machinery.SourceFileLoader:
            def exec_module(module):
                execute(module)
                _register_layers(finishing=name)

            loader.exec_module = exec_module
        return spec


_REGISTERED = False
if all(name in sys.modules for name in _REGISTRATION_NEEDS):
    _register_layers()
if not _REGISTERED and not any(isinstance(f, _RegisterLayersOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterLayersOnImport())
