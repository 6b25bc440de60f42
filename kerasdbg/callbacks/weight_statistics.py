"""`WeightStatistics`: per-variable weight statistics at every step."""

from __future__ import annotations

from typing import Optional, Sequence

from kerasdbg import capture as _capture
from kerasdbg import stats as stats_lib
from kerasdbg.callbacks._statistics import StatisticsCallback

WEIGHT_STATISTICS = stats_lib.STATISTICS + _capture.WEIGHT_EXTRA_STATISTICS
"""Statistics `WeightStatistics` records by default, in order."""
ALLOWED_WEIGHT_STATISTICS = WEIGHT_STATISTICS + tuple(stats_lib.QUANTILES)
"""Statistics `WeightStatistics` can record (the quantiles sort each tensor)."""


class WeightStatistics(StatisticsCallback):
    """Records statistics of the weights after each optimizer step.

    For each trainable float variable (filtered by `include` / `exclude`) and
    each recorded step, the statistics of `kerasdbg.stats.STATISTICS` of the
    weights after the update, plus:

    - `update_ratio`: ||w_after - w_before|| / ||w_before|| of this step's
      update (0 when nothing moved, inf when a zero tensor moved);
    - `distance_from_start`: ||w_after - w_start||, with `w_start` the
      weights when the current `fit()` began.

    These two keep copies of the weights (one model's size each, shared by
    every callback) in the strategy's devices; the copy for `update_ratio`
    is taken only at the recorded steps. Leave them out of `stats` to save
    that memory.

    The weights are described after the updates that happened: with several
    optimizers, each variable at the steps of the one that applies it
    (`history`'s `optimizer` column); with gradient accumulation, at the
    steps that apply the accumulated update; not at the steps a fault froze
    (`StopOnRule`).

    Same execution support and TensorBoard layout as `GradientStatistics`,
    under the tags `weights/<variable path>/<stat>` and histograms
    `weights/<variable path>`.

    Args:
        log_dir: TensorBoard log directory, or None to keep the records in
            Python only. Defaults to `None`.
        every_n_steps: record `stats` at steps divisible by this (and at
            steps `1..first_steps`); other steps skip the computation. None
            for the default schedule (`kerasdbg.schedule.DEFAULT`): `stats`
            at steps 1-10 and every 50th step, and their l2 norms and
            NaN/Inf counts (`EVERY_STEP_STATISTICS`) at every step.
            `every_n_steps=1` records all of `stats` at every step. Defaults
            to `None`.
        histogram_every_n_steps: record histograms at steps divisible by this,
            or None for none. Defaults to `None`.
        include: regular expression; only variable paths it matches.
            Defaults to `None` (all).
        exclude: regular expression; leaves out the paths it matches.
            Defaults to `None`.
        stats: which statistics to record, from `ALLOWED_WEIGHT_STATISTICS`.
            Defaults to `WEIGHT_STATISTICS` (all but the quantiles).
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
        >>> from kerasdbg.callbacks import WeightStatistics
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="dense")],
        ...                          name="model")
        >>> model.compile("sgd", "mse")
        >>> weights = WeightStatistics(stats=["l2_norm", "update_ratio"], include="kernel")
        >>> _ = model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2,
        ...               epochs=1, verbose=0, callbacks=[weights])
        >>> list(weights.history.columns)
        ['step', 'skipped', 'model/dense/kernel/l2_norm', 'model/dense/kernel/update_ratio']
    """

    kind = "weights"
    allowed_stats = ALLOWED_WEIGHT_STATISTICS

    def __init__(
        self,
        log_dir: Optional[str] = None,
        every_n_steps: Optional[int] = None,
        histogram_every_n_steps: Optional[int] = None,
        include: Optional[str] = None,
        exclude: Optional[str] = None,
        stats: Sequence[str] = WEIGHT_STATISTICS,
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
