"""The quantities every capture computes, written once for every backend.

`kerasdbg.stats` (the statistics of tensors) and `reductions` (the one
global norm and the one finite test) compute with the functions of `ops`
only (reductions, elementwise ops, `cond`, segment sums, ...), so they
import and read without any framework; `ops` resolves each name, on first
use, from the module of the backend the capture runs in
(`kerasdbg.backends.<name>.ops`, the same names in each). The backend is
Keras's (`keras.config.backend()`, read when Keras is already imported, else
`KERAS_BACKEND`, else TensorFlow), chosen once.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Optional

BACKENDS = {
    "tensorflow": "kerasdbg.backends.tensorflow.ops",
    "jax": "kerasdbg.backends.jax.ops",
}
"""The backend modules of the array functions, by Keras backend name."""

_name: Optional[str] = None


def name() -> str:
    """The backend whose tensors the statistics take (Keras's, chosen once)."""
    global _name
    if _name is None:
        keras = sys.modules.get("keras")
        config = getattr(keras, "config", None)
        _name = (config.backend() if config is not None
                 else os.environ.get("KERAS_BACKEND", "tensorflow"))
    return _name


class _Ops:
    """The functions of the current backend module, resolved on first use."""

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        backend = name()
        if backend not in BACKENDS:
            raise ImportError(
                f"kerasdbg computes statistics on the backends {', '.join(BACKENDS)}; "
                f"Keras runs on {backend!r}.")
        module = importlib.import_module(BACKENDS[backend])
        value = getattr(module, attribute)
        setattr(self, attribute, value)  # later look-ups are plain attribute reads
        return value


ops = _Ops()
"""`ops.reduce_sum(x)`, `ops.cond(p, a, b)`, ...: see `kerasdbg.backends.tensorflow.ops`."""
