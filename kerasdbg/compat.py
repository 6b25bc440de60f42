"""Fixes for Keras where its own `fit` fails, and settings for training on
several machines.

`fix_multi_worker_fit()` makes Keras 3's `fit` work under
`tf.distribute.MultiWorkerMirroredStrategy` on two or more workers, which it
does not by itself (keras-team/keras#20585, open upstream), and with
`steps_per_execution > 1` under a collective all-reduce
(keras-team/keras#19246): it replaces three functions of Keras's TensorFlow
trainer, is idempotent, undone by `undo_multi_worker_fit()`, and changes
nothing elsewhere.

`set_worker_output()` chooses which workers write kerasdbg's records: only
the chief (the default), or each worker under its own directory.
"""

from __future__ import annotations

import warnings

from kerasdbg import _validation as check
from kerasdbg.sinks import workers as _workers

UPSTREAM_ISSUE = "https://github.com/keras-team/keras/issues/20585"
"""The Keras issue of multi-worker `fit` that `fix_multi_worker_fit` works around."""

LOOP_ISSUE = "https://github.com/keras-team/keras/issues/19246"
"""The Keras issue of `steps_per_execution > 1` under a collective all-reduce."""


def fix_multi_worker_fit() -> bool:
    """Makes Keras 3's `fit`, `evaluate` and `predict` work under
    `MultiWorkerMirroredStrategy` with several workers.

    Keras's TensorFlow trainer fails there twice (keras-team/keras#20585):
    its symbolic build reduces the first batch across workers, which the
    collective reduce cannot do ("Attempt to convert a value (PerReplica..."),
    and it averages the scalar logs along an axis they do not have ("Invalid
    reduction dimension 0 for input with 0 dimensions"). The fix builds from
    the first local batch (the build needs shapes only) and averages the
    logs over all replicas, as Keras does on one worker.

    With `steps_per_execution > 1`, Keras runs each step inside a `tf.cond`
    within its `tf.while_loop`, where a collective all-reduce fails ("You
    must feed a value for placeholder tensor", keras-team/keras#19246): under
    this strategy, and under `MirroredStrategy` with its default
    `cross_device_ops`. The fix runs the same steps on the same batches in a
    loop whose own condition says a batch is there, without the `tf.cond`
    (and without `unrolled_steps_per_execution`, a speed setting). A train
    step of your own that runs an all-reduce inside a `tf.cond` of its own
    still fails there (seen with two optimizers applied in one train step).

    Training is unchanged: two workers reach the weights of one process
    trained on the same global batches (tested at `steps_per_execution` 1
    and 4). Elsewhere (another strategy, one worker without the collective
    all-reduce, `steps_per_execution=1` for the loop) Keras's own code runs.

    Call it once, before `fit`, on every worker. Calling it again changes
    nothing; `undo_multi_worker_fit()` puts Keras's code back. On a Keras
    whose `fit` has neither bug, it changes nothing and warns so.

    Returns:
        Whether the fix is in place after the call.

    Raises:
        RuntimeError: Keras no longer has the functions the fix replaces (an
            upgrade moved them); nothing was changed.

    Examples:
        >>> import kerasdbg
        >>> kerasdbg.compat.fix_multi_worker_fit()
        True
        >>> kerasdbg.compat.undo_multi_worker_fit()
    """
    from kerasdbg.backends.tensorflow import multi_worker_fit

    if multi_worker_fit.multi_worker_fit_fixed():
        return True
    if not multi_worker_fit.multi_worker_fit_is_broken():
        import keras

        warnings.warn(
            f"kerasdbg.compat.fix_multi_worker_fit: Keras {keras.__version__}'s fit does not have "
            f"the multi-worker bugs ({UPSTREAM_ISSUE}, {LOOP_ISSUE}); nothing was changed.",
            UserWarning, stacklevel=2)
        return False
    multi_worker_fit.fix_multi_worker_fit()
    return True


def undo_multi_worker_fit() -> None:
    """Puts back the Keras code that `fix_multi_worker_fit()` replaced;
    nothing when it is not in place.

    Examples:
        >>> import kerasdbg
        >>> kerasdbg.compat.undo_multi_worker_fit()
    """
    from kerasdbg.backends.tensorflow import multi_worker_fit

    multi_worker_fit.undo_multi_worker_fit()


def set_worker_output(mode: str) -> None:
    """Chooses which workers of a multi-worker cluster write kerasdbg's
    records (TensorBoard events, `StepRecorder` files, printed lines).

    The records that describe a step (gradients after the all-reduce, the
    weights, the loss, the taps' records of the cluster's replicas) are the
    same on every worker, so by default only the chief writes them
    (`"chief"`); the other workers still compute them, keep them in
    `history` and take the same decisions. `"per_worker"` has every other
    worker write its own under `<log_dir>/worker_<i>`, and `PrintLayer` print
    on every worker (its own replicas with `replicas="all"`; with "first",
    replica 0 is the chief's, so only the chief prints). With one worker this
    setting changes nothing.

    Args:
        mode: `"chief"` or `"per_worker"`.

    Raises:
        ValueError: another `mode`.

    Examples:
        >>> import kerasdbg
        >>> kerasdbg.compat.set_worker_output("per_worker")
        >>> kerasdbg.compat.set_worker_output("chief")
    """
    check.one_of("set_worker_output", "mode", mode, _workers.OUTPUTS)
    _workers.set_output(mode)


__all__ = (
    "fix_multi_worker_fit",
    "set_worker_output",
    "undo_multi_worker_fit",
)
