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
from kerasdbg import rules
from kerasdbg import stats
from kerasdbg.determinism import deterministic
from kerasdbg.doctor import doctor
from kerasdbg.multi_output_model import MultiOutputModel
from kerasdbg.reader import load_run
from kerasdbg.rules.offline import check_run
from kerasdbg.tapping import insert_taps
from kerasdbg.tapping import strip_debug_layers
from kerasdbg.trace import TraceWriter
from kerasdbg.trace import compare_traces
from kerasdbg.trace import load_trace

__version__ = "0.1.0"

__all__ = (
    "MultiOutputModel",
    "TraceWriter",
    "callbacks",
    "check_run",
    "compare_traces",
    "deterministic",
    "doctor",
    "insert_taps",
    "layers",
    "load_run",
    "load_trace",
    "rules",
    "stats",
    "strip_debug_layers",
)
