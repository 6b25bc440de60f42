"""`AfterEachExecution`: a callback's work after each execution, off Keras's worker threads.

Keras's JAX and PyTorch loops call the batch-end hooks on a worker thread,
so that the loop goes on to the next step at once, when every callback of
the fit is `async_safe` (one that overrides a batch end without it makes
the whole list wait). kerasdbg's callbacks read and hand out their records
after executions; where the capture says so (`Capture.reads_at_batch_begin`)
they do it at the next batch's begin, which Keras calls on the fit's
thread, before that batch runs; their batch end does nothing. So they are
`async_safe`, and a stop decided there holds the batch about to run
(`Capture.hold_next_execution`): the fit ends where it would have ended at
the batch end. On TensorFlow, whose loop calls every hook on its thread,
the work stays at the batch end.
"""

from __future__ import annotations

import weakref
from typing import Optional

from kerasdbg import capture as _capture


class AfterEachExecution:
    """Mixin of kerasdbg's recording callbacks (see the module docstring).

    A callback calls `_begin_executions()` in `on_train_begin`, implements
    `_after_execution(batch)` (the work after an execution, on the fit's
    thread) and `_before_execution(batch)` (at a batch's begin), and calls
    `_executions_read()` before its own final read at an epoch's end."""

    async_safe = True
    """Keras may call the batch end on a worker thread: it does nothing there."""

    def _begin_executions(self) -> None:
        engine = _capture.engine_for(self.model)
        # Looked up once a fit (the batches ask it at every step); a weak
        # reference, which a copy of the callback (a tuner's) shares.
        self._engine_ref = weakref.ref(engine)
        self._at_begin = bool(engine.reads_at_batch_begin)
        # At a batch's begin: the batch that ran before it, whose end is to do.
        self._started: Optional[int] = None

    @property
    def _engine(self):
        """The model's capture (`kerasdbg.capture.engine_for`)."""
        ref = vars(self).get("_engine_ref")
        engine = ref() if ref is not None else None
        return engine if engine is not None else _capture.engine_for(self.model)

    def _executions_read(self) -> None:
        """The final read of an epoch's end covers the last execution."""
        self._started = None

    def _after_execution(self, batch: int) -> None:
        raise NotImplementedError

    def _before_execution(self, batch: int) -> None:
        pass

    def on_train_batch_begin(self, batch, logs=None):
        if getattr(self, "_at_begin", False):
            ran, self._started = self._started, batch
            if ran is not None:
                self._after_execution(ran)
        self._before_execution(batch)

    def on_train_batch_end(self, batch, logs=None):
        if not getattr(self, "_at_begin", False):
            self._after_execution(batch)
