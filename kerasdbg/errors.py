"""kerasdbg's own errors.

An instrument that fails while training warns once and lets training go on;
with `strict=True` it raises one of these instead. They need neither
TensorFlow nor Keras.
"""

from __future__ import annotations

from typing import Optional, Sequence

EVENTS = "TensorBoard events to"
STORE = "the analysis store"
_CONSEQUENCES = {
    EVENTS: "the records stay in Python only (`history`), and training goes on.",
    STORE: "the event file goes on, and load_run reads it instead (slower on large runs); "
           "training goes on.",
}


def failure_message(owners: Sequence[str], what: str, path: str, error: BaseException,
                    consequence: Optional[str] = None) -> str:
    """The words of a failure to write: who (`owners`, the callbacks that lost
    records), what and where, what happens now, and the cause."""
    consequence = consequence or _CONSEQUENCES.get(what, "training goes on.")
    head = f"kerasdbg could not write {what} {path!r}"
    if owners:
        head = f"{', '.join(owners)} could not record: {head[0].lower()}{head[1:]}"
    return f"{head}; {consequence} Cause: {type(error).__name__}: {error}"


class RecordingError(RuntimeError):
    """A kerasdbg instrument with `strict=True` could not write its records.

    Raised in place of the warning that a failure to write gives otherwise
    (a full disk, a directory that became read-only or was removed): it
    names the callbacks that lost records and the path, and its `__cause__`
    is the error of the operating system or TensorFlow. What was written
    before stays readable, and no file is left open.

    Attributes:
        owners: the names of the callbacks writing there.
        path: the file or directory that could not be written.

    Examples:
        >>> from kerasdbg.errors import RecordingError
        >>> error = RecordingError(["GradientStatistics"], "TensorBoard events to",
        ...                        "logs/train", OSError(28, "No space left on device"))
        >>> str(error)  # doctest: +ELLIPSIS
        "GradientStatistics could not record: kerasdbg could not write TensorBoard events to 'logs/train'; ... Cause: OSError: [Errno 28] No space left on device"
        >>> error.owners, error.path
        (['GradientStatistics'], 'logs/train')
    """

    def __init__(self, owners: Sequence[str], what: str, path: str, cause: BaseException,
                 consequence: Optional[str] = None):
        self.owners = list(owners)
        self.path = path
        self._cause = cause
        super().__init__(failure_message(
            self.owners, what, path, cause,
            consequence or "the fit stops (`strict=True`)."))

    # Keras's traceback filter re-raises what ends `fit` `from None`, which
    # would clear the cause (keras/src/utils/traceback_utils.py): it is kept.
    @property
    def __cause__(self) -> BaseException:
        return self._cause

    @__cause__.setter
    def __cause__(self, value: Optional[BaseException]) -> None:
        if value is not None:
            self._cause = value


class UnsupportedBackendError(RuntimeError):
    """An instrument cannot run on the Keras backend in use.

    Raised when the instrument is made (or, for one made before, at the
    start of `fit`), never in the middle of training. The message names the
    backend and what works there.
    """
