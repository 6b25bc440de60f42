"""The array backend of kerasdbg's statistics: the one place they meet TensorFlow.

`kerasdbg.stats` computes with the functions of `ops` only (reductions,
elementwise ops, `cond`, segment sums, ...), so it imports and reads without
TensorFlow; `ops` resolves them, on first use, from the backend module that
implements them for the framework the capture runs in. TensorFlow's is
`kerasdbg.backends.tensorflow.ops` (the only capture so far); a JAX capture adds
`kerasdbg.quantities.jax` with the same names.
"""

from __future__ import annotations

import importlib

BACKENDS = {"tensorflow": "kerasdbg.backends.tensorflow.ops"}
"""The backend modules, by framework name."""

_name = "tensorflow"


class _Ops:
    """The functions of the current backend module, resolved on first use."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        module = importlib.import_module(BACKENDS[_name])
        value = getattr(module, name)
        setattr(self, name, value)  # later look-ups are plain attribute reads
        return value


ops = _Ops()
"""`ops.reduce_sum(x)`, `ops.cond(p, a, b)`, ...: see `kerasdbg.backends.tensorflow.ops`."""


def name() -> str:
    """The framework whose tensors the statistics take."""
    return _name
