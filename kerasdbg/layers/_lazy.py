"""Modules imported on first use, so that `kerasdbg.layers` imports on every
Keras backend and without TensorFlow installed.

The debug layers record through the backend's side
(`kerasdbg.backends.tensorflow` or `kerasdbg.backends.jax`), imported on
first use; on another backend they refuse to be made
(`DebugLayer.BACKENDS`) before anything here is touched, and on JAX
TensorFlow is never imported.
`tests/test_boundaries.py` reads `module("...")` calls as imports.
"""

from __future__ import annotations

import importlib
import types


class _Module(types.ModuleType):
    """Stands for module `name`: an attribute read imports it (once; Python
    keeps it in `sys.modules`) and reads the module's attribute, so a test
    that patches the module is seen here."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["_module"] = None

    def __getattr__(self, attribute: str):
        module = self.__dict__["_module"]
        if module is None:
            module = self.__dict__["_module"] = importlib.import_module(self.__name__)
        return getattr(module, attribute)


def module(name: str) -> types.ModuleType:
    """Module `name`, imported when one of its attributes is first read.

    Examples:
        >>> json = module("json")
        >>> json.dumps([1])
        '[1]'
    """
    return _Module(name)
