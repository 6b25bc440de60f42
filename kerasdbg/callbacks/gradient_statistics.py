"""`GradientStatistics`: per-variable gradient statistics at every step."""

from __future__ import annotations

from typing import Optional, Sequence

from kerasdbg import stats as stats_lib
from kerasdbg.callbacks._statistics import StatisticsCallback


class GradientStatistics(StatisticsCallback):
    """Records statistics of the gradients the optimizer applies, per step.

    For each trainable float variable (filtered by `include` / `exclude`) and
    each recorded step: `l2_norm`, `mean`, `std`, `min`, `max`, `mean_abs`,
    `zero_fraction`, `nan_count`, `inf_count` (see `kerasdbg.stats`), plus the
    global norm of all the gradients the step applies. The gradient described
    is the one the model produced for the optimizer, summed over replicas
    under a `tf.distribute` strategy and unscaled under mixed precision.

    Every optimizer the train step applies is instrumented, wherever the
    model keeps it: `model.optimizer` with Keras's own `train_step`, and in a
    custom `train_step` the optimizers of a GAN (`self.d_optimizer`,
    `self.g_optimizer`), in lists or dicts, behind a `LossScaleOptimizer`,
    on sub-models. Each variable is described at each step of the optimizer
    that applies it: `step` is that optimizer's `iterations` after the update
    (an optimizer applied three times per train step, as a WGAN-GP critic,
    has three steps per train step). With several optimizers, `history` has
    an `optimizer` column (where the model keeps it: `d_optimizer`) and each
    one has its own global norm, `gradients/<optimizer>/global_norm`.

    With gradient clipping (`clipnorm`, `clipvalue`, `global_clipnorm`) the
    gradient before clipping is under `gradients/...` (what the rules read),
    what is applied under `applied_gradients/...`, and `gradients/clipped` is
    1 at the steps where clipping changed the gradient (`clipped_steps`
    counts them). With gradient accumulation (`gradient_accumulation_steps=N`)
    every batch's gradient is recorded, at the step `iterations` counts in
    batches (Keras's `optimizer.iterations` counts updates, step // N); the
    update is applied at the steps divisible by N (`history`'s `applied`
    column), where `applied_gradients/...` describe the averaged gradient.

    Works with any `steps_per_execution` (one record per optimizer step),
    with `jit_compile` on or off, under `OneDeviceStrategy` and
    `MirroredStrategy`, and with models built inside `fit` (a subclassed
    model without `Input`). The statistics are computed in the compiled
    train step and written once per execution; callbacks that record the
    same statistics at the same steps share one computation.

    TensorBoard tags (events under `<log_dir>/train`, shareable with
    `keras.callbacks.TensorBoard`): `gradients/<variable path>/<stat>`,
    `gradients/global_norm`, histograms `gradients/<variable path>`, and under
    a `LossScaleOptimizer` `gradients/skipped_updates` (updates skipped so far).
    Variables that get no gradient are left out. Steps the loss scaler skipped
    are kept in `history` with `skipped=True`, not written to TensorBoard. A
    norm over a gradient holding NaN or Inf is NaN or Inf (the counts say
    how many).

    When it records nothing in a `fit` (no optimizer applied gradients, no
    variable matches `include`, nothing is trainable), it says why in a
    warning after the first execution; training goes on.

    Args:
        log_dir: TensorBoard log directory, or None to keep the records in
            Python only; one that cannot be written at run time (permission,
            full disk) warns once and records in Python only. Defaults to
            `None`.
        every_n_steps: record `stats` at steps divisible by this (and at
            steps `1..first_steps`); other steps skip the computation. None
            for the default schedule (`kerasdbg.schedule.DEFAULT`): `stats`
            at steps 1-10 and every 50th step, and their l2 norms and
            NaN/Inf counts (`EVERY_STEP_STATISTICS`) at every step.
            `every_n_steps=1` records all of `stats` at every step. Defaults
            to `None`.
        histogram_every_n_steps: record histograms at steps divisible by this,
            or None for none. Defaults to `None`.
        include: regular expression; only variable paths it matches (by
            `re.search`). Defaults to `None` (all).
        exclude: regular expression; leaves out the paths it matches.
            Defaults to `None`.
        stats: which statistics to record, from `kerasdbg.stats.ALL_STATISTICS`.
            Defaults to `kerasdbg.stats.STATISTICS` (all but the quantiles,
            which sort each tensor).
        histogram_bins: number of histogram bins. Defaults to `30`.
        history_size: how many recorded steps `history` keeps. Defaults to
            `1000`.
        strict: raise, instead of warning and going on, when kerasdbg itself
            fails during training. Defaults to `False`.
        first_steps: also record `stats` at every step up to this one; None
            for 10 with the default schedule, else 0. Defaults to `None`.

    Raises:
        ValueError: for a bad argument value (a `log_dir` that is a file
            included), and with `strict=True` when it records nothing.
        TypeError: for an argument of the wrong type.

    Examples:
        >>> import keras, numpy as np
        >>> from kerasdbg.callbacks import GradientStatistics
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="dense")],
        ...                          name="model")
        >>> model.compile("sgd", "mse")
        >>> grads = GradientStatistics(stats=["l2_norm", "zero_fraction"])
        >>> _ = model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2,
        ...               epochs=1, verbose=0, callbacks=[grads])
        >>> grads.history["step"].tolist()
        [1, 2]
        >>> sorted(grads.latest)
        ['global_norm', 'model/dense/bias/l2_norm', 'model/dense/bias/zero_fraction',
         'model/dense/kernel/l2_norm', 'model/dense/kernel/zero_fraction', 'step']
    """

    kind = "gradients"
    allowed_stats = stats_lib.ALL_STATISTICS

    def __init__(
        self,
        log_dir: Optional[str] = None,
        every_n_steps: Optional[int] = None,
        histogram_every_n_steps: Optional[int] = None,
        include: Optional[str] = None,
        exclude: Optional[str] = None,
        stats: Sequence[str] = stats_lib.STATISTICS,
        histogram_bins: int = stats_lib.DEFAULT_HISTOGRAM_BINS,
        history_size: int = 1000,
        strict: bool = False,
        first_steps: Optional[int] = None,
    ):
        super().__init__(
            log_dir=log_dir,
            every_n_steps=every_n_steps,
            first_steps=first_steps,
            histogram_every_n_steps=histogram_every_n_steps,
            include=include,
            exclude=exclude,
            stats=stats,
            histogram_bins=histogram_bins,
            history_size=history_size,
            strict=strict,
        )
