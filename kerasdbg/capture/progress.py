"""A line while the first execution of an instrumented train step runs long.

The first execution of a fit traces the instrumented train step (and compiles
it, with XLA or on JAX): about two minutes for a ResNet50 on a CPU, during
which neither Keras nor kerasdbg prints anything. A capture arms a
`FirstExecution` when a fit attaches to it, `begin`s it before the first
batch and `end`s it when it first collects. When the execution is still
running after `AFTER` seconds, a timer thread prints
`kerasdbg: tracing and compiling the instrumented train step ...`; `end`
then prints how long it took (or that the fit ended during it). A fast
first execution prints nothing. Both lines go to stderr, as other progress
and log lines of the frameworks do: stdout stays the user's (a program that
prints its results there, or a pipe that parses them, sees no more lines
when its first step is slow).

The timer thread prints while the main thread is inside the first
execution, before Keras's progress bar draws its first batch (it draws at a
batch's end), so the line does not break the bar; the closing line is
printed by the main thread. Any failure here is swallowed: a progress line
never breaks a fit.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Optional

AFTER = 5.0
"""Seconds of a first execution after which its progress line is printed."""


def _taps(model) -> int:
    """The `TapLayer`s of `model`, nested models included, a tap per tensor of
    a structure (as `ActivationStatistics` finds them; told by their marks,
    so that the capture imports no layer)."""
    count, stack = 0, list(getattr(model, "layers", None) or [])
    while stack:
        layer = stack.pop()
        if getattr(layer, "kerasdbg_debug_layer", False) and getattr(layer, "KIND", "") == "tap":
            count += len(getattr(layer, "parts", None) or {}) or 1
        else:
            stack.extend(getattr(layer, "layers", None) or [])
    return count


def describe(model) -> str:
    """`'name' (N variables, M taps)`: what the instrumented step covers."""
    variables = len(getattr(model, "trainable_variables", ()) or ())
    taps = _taps(model)
    return (f"{getattr(model, 'name', 'model')!r} ({variables} trainable variable"
            f"{'' if variables == 1 else 's'}, {taps} tap{'' if taps == 1 else 's'})")


def of(engine) -> "FirstExecution":
    """The `FirstExecution` of a capture (made at its first use)."""
    found = vars(engine).get("_first_execution")
    if found is None:
        found = engine._first_execution = FirstExecution()
    return found


class FirstExecution:
    """The progress line of one model's first instrumented execution per fit.

    Args:
        after: seconds before the line is printed; None for `AFTER` (read
            at `begin`). Defaults to `None`.
    """

    def __init__(self, after: Optional[float] = None):
        self.after = after
        self._lock = threading.Lock()
        self._armed = False
        self._timer: Optional[threading.Timer] = None
        self._started = 0.0
        self._said = False
        self._what = ""

    def arm(self) -> None:
        """A fit attached: its next `begin` times the first execution."""
        self._armed = True

    def begin(self, model) -> None:
        """Before the first batch of an armed fit: starts the timer (on the
        process that prints, the chief under several workers)."""
        if not self._armed:
            return
        self._armed = False
        self.end()  # a timer left by a fit that ended without collecting
        try:
            from kerasdbg.sinks import workers as _workers

            if not _workers.writes(getattr(model, "distribute_strategy", None)):
                return
            self._what = describe(model)
            after = AFTER if self.after is None else self.after
            with self._lock:
                self._said = False
                self._started = time.perf_counter()
                self._timer = threading.Timer(after, self._say)
                self._timer.daemon = True
                self._timer.start()
        except Exception:  # noqa: BLE001 - a progress line never breaks a fit
            self._timer = None

    def _say(self) -> None:
        with self._lock:
            if self._timer is None:
                return  # ended meanwhile
            self._said = True
            try:
                print(f"kerasdbg: tracing and compiling the instrumented train step of "
                      f"{self._what} ...", file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001 - a closed stream
                pass

    def cancel(self) -> None:
        """Stops the timer without a closing line: the instrumented step
        gave way to Keras's own (whose warning says why)."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def end(self, finished: bool = True) -> None:
        """After the first execution (`finished`) or as the fit ends (not
        `finished`: it may have ended during the first execution, which
        raised or was interrupted): stops the timer; prints how long it took
        when the progress line was printed."""
        if self._timer is None:
            return
        with self._lock:
            timer, self._timer = self._timer, None
            said = self._said
        timer.cancel()
        if said:
            seconds = time.perf_counter() - self._started
            line = (f"kerasdbg: traced and compiled; the first step took {seconds:.1f} s"
                    if finished else
                    f"kerasdbg: the fit ended {seconds:.1f} s into its first step, before the "
                    f"step completed")
            try:
                print(line, file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001 - a closed stream
                pass
