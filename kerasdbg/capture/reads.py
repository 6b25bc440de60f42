"""When the host reads the records: once per interval, not after every execution.

The compiled step writes its records into rings on the device (TensorFlow:
buffers of `RING_STEPS` rows; JAX: the step's packed outputs, kept until
read). Reading them stops nothing on the device, but each read costs the
host a transfer, and decoding and writing the rows costs it more: at a
millisecond a step, a read after every execution made training two to ten
times slower. So the host reads:

- after the first execution of a fit (an instrument that records nothing
  says so at once);
- when `interval()` seconds of training went by since the last read
  (`DEFAULT_SECONDS` unless set with `set_read_interval` or the environment
  variable `KERASDBG_READ_INTERVAL`);
- before the next execution could overwrite a row not read yet (the ring is
  `RING_STEPS` steps tall);
- at every epoch's end, at the fit's end, when a fit raises, and when a
  callback is asked for its records.

What must act at its step (the NaN/Inf freeze, the spike tests, a skip) is
decided in the compiled step; a rule judged on the host gives its verdict
at the read, naming the step it fired at. An interval of 0 reads after every
execution (the stop then comes right after the execution of the verdict's
step).
"""

from __future__ import annotations

import os
import time
from typing import Optional

DEFAULT_SECONDS = 0.1
"""The default time between two reads, in seconds of training."""
RING_STEPS = 256
"""Steps a ring holds: at most this many steps between two reads."""
ENVIRONMENT = "KERASDBG_READ_INTERVAL"
"""The environment variable that sets the interval (seconds, as a number),
looked up at a fit's start and once after each read."""

_set: dict = {"seconds": None, "generation": 0}


def set_read_interval(seconds: Optional[float]) -> None:
    """Sets how often the host reads the records, in seconds of training.

    The compiled step keeps its records on the device; the host reads them
    after a fit's first execution, then once per interval (and before a
    ring of `RING_STEPS` steps could overflow, at every epoch's end and at
    the fit's end), decodes them and writes them. A rule judged on the host
    gives its verdict at the read, naming its step; with `action="stop"` the
    fit stops after the read's last step, and the verdict says how many
    steps later that was. What must act at its step (the NaN/Inf freeze,
    the spike tests, a skip) is decided in the step, whatever the interval.

    Args:
        seconds: at most this many seconds between two reads (a number >= 0;
            0 reads after every execution), or None for the default
            (`KERASDBG_READ_INTERVAL` if set, else `DEFAULT_SECONDS`).

    Raises:
        TypeError: `seconds` is not a number or None.
        ValueError: `seconds` is negative or not finite.

    Examples:
        >>> import kerasdbg
        >>> kerasdbg.set_read_interval(0)      # after every execution: a stop at its step
        >>> kerasdbg.set_read_interval(None)   # back to the default, 0.1 s
    """
    if seconds is not None:
        _check(seconds, "set_read_interval: `seconds`")
        seconds = float(seconds)
    _set["seconds"] = seconds
    _set["generation"] += 1  # the clocks' deadlines are computed again


def _check(seconds, where: str) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"{where} must be a number of seconds >= 0 or None. "
                        f"Received: seconds={seconds!r}")
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{where} must be a finite number of seconds >= 0 (0: after every "
                         f"execution). Received: seconds={seconds!r}")


def interval() -> float:
    """The seconds between two reads now in force."""
    if _set["seconds"] is not None:
        return _set["seconds"]
    text = os.environ.get(ENVIRONMENT)
    if text:
        try:
            value = float(text)
            _check(value, ENVIRONMENT)
            return value
        except (TypeError, ValueError) as error:
            raise ValueError(f"kerasdbg: the environment variable {ENVIRONMENT} must be a "
                             f"number of seconds >= 0. Received: {text!r}") from error
    return DEFAULT_SECONDS


def ring_rows(steps_per_execution: int) -> int:
    """The rows of a ring: `RING_STEPS` rounded up to whole executions."""
    n = max(1, int(steps_per_execution))
    return n * -(-RING_STEPS // n)


class ReadClock:
    """Decides, at each execution's end, whether the host reads now.

    `executed()` counts an execution; `due(...)` says whether to read;
    `read()` notes a read. Counts what it decided (`reads`), for tests. A
    batch end where no read is due costs a few comparisons: the interval is
    looked up once after each read (and again after `set_read_interval`),
    not at every batch."""

    def __init__(self):
        self.reads = 0
        self._last: Optional[float] = None
        self._deadline = 0.0  # when the interval since the last read is over
        self._generation = -1  # `set_read_interval`'s, when the deadline was computed
        self._executions = 0  # since the last read
        self._batch: Optional[int] = None  # the batch end already decided

    def begin_fit(self) -> None:
        interval()  # a bad KERASDBG_READ_INTERVAL is said at the fit's start
        self._last = None
        self._executions = 0
        self._batch = None

    def first_at(self, batch: Optional[int]) -> bool:
        """Whether this is the first call at the end of batch `batch`: each
        callback collects there, and the first one decides for the others.
        None (no batch given) is always a first call."""
        if batch is None:
            return True
        if batch == self._batch:
            return False
        self._batch = batch
        return True

    def final(self) -> None:
        """A final read (an epoch's or the fit's end): the next batch is new."""
        self._batch = None

    def executed(self) -> None:
        self._executions += 1

    def waiting(self) -> int:
        """Executions since the last read."""
        return self._executions

    def due(self, waiting_steps: int, next_steps: int, rows: int,
            every_execution: bool = False) -> bool:
        """Whether to read now: at the first execution of the fit, when the
        interval went by, or when the `waiting_steps` not read yet and the
        next execution's `next_steps` would not fit in a ring of `rows`."""
        if self._last is None or every_execution:
            return True
        if waiting_steps + next_steps > rows:
            return True
        if self._generation != _set["generation"]:
            self._generation = _set["generation"]
            self._deadline = self._last + interval()
        return time.monotonic() >= self._deadline

    def read(self) -> None:
        self.reads += 1
        self._last = time.monotonic()
        self._generation = -1  # the deadline: at the next `due`
        self._executions = 0


__all__ = ("DEFAULT_SECONDS", "RING_STEPS", "ENVIRONMENT", "ReadClock", "interval",
           "ring_rows", "set_read_interval")
