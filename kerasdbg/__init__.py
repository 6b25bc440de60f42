"""kerasdbg: debugging instruments for Keras 3 training (TensorFlow backend)."""

try:
    import tensorflow as _tf  # noqa: F401
except ImportError as _error:  # pragma: no cover - depends on the install
    raise ImportError(
        "kerasdbg needs TensorFlow >= 2.16. Install it with "
        "`pip install kerasdbg[cpu]` (CPU build) or `pip install kerasdbg[and-cuda]`, "
        "or keep the TensorFlow build you already have."
    ) from _error

from kerasdbg import callbacks
from kerasdbg import layers
from kerasdbg import stats
from kerasdbg.reader import load_run

__version__ = "0.1.0"

__all__ = (
    "callbacks",
    "layers",
    "load_run",
    "stats",
)
