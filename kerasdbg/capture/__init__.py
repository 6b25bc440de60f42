"""The capture: what the callbacks ask for, and how they get it, on every backend.

A callback that records per optimizer step describes what it wants in a
`Request` (which quantities of which variables, on which schedule, where
the records go) and attaches it to the one `Capture` of its model
(`engine_for`), which the model's backend implements
(`kerasdbg.backends.<name>`). The pieces here are the backend-neutral ones:

- `requests`: `Request`, `Freeze`, the records' columns and the schedule
  predicates the compiled step evaluates (with `kerasdbg.quantities.ops`).
- `interface`: `Capture`, `engine_for` (the backend chosen once from
  `keras.config.backend()`), `supported` (the clear error on a backend
  without a capture).
- `planner`: what rules need, turned into requests (`plan`).
- `step_rows`: the records of a fit merged into one row per step, in step
  order, for the rules (`StepRows`).
- `keras_objects`: the parts of Keras every backend shares (the model's
  optimizers, step counters, the loop running a model).
- `fit_end`: cleanups that run however a `fit` ends.
"""

from kerasdbg.capture import fit_end
from kerasdbg.capture.fit_end import cancel_fit_end, on_fit_end
from kerasdbg.capture.interface import Capture, engine_for, recordable, supported
from kerasdbg.capture.requests import (
    CLASS_COLUMNS, RECORDABLE, WEIGHT_EXTRA_STATISTICS, Freeze, Record, Request, Spike, unique_paths,
)

# Before any callback of kerasdbg exists: the `fit` that first uses one has
# resolved `Model.fit` before its callbacks run.
fit_end.install()

__all__ = [
    "CLASS_COLUMNS", "RECORDABLE", "WEIGHT_EXTRA_STATISTICS", "Capture", "Freeze", "Record", "Request",
    "Spike", "cancel_fit_end", "engine_for", "on_fit_end", "recordable", "supported", "unique_paths",
]
