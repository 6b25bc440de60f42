"""`calibrate`: rules whose thresholds are learned from a healthy run."""

from __future__ import annotations

import math
import os
from typing import Dict, List, Sequence, Tuple, Union

import numpy as np

from kerasdbg import _validation as check
from kerasdbg.offline import recorded_pairs
from kerasdbg.reader import Run, load_run
from kerasdbg.records import tags as _tags
from kerasdbg.rules._construction import RATIO, layer_of
from kerasdbg.rules.learned_range import (DEFAULT_FIRST_STEPS, DEFAULT_MARGIN, FRACTIONS,
                                          Bounds, LearnedRange, Measurement)

CALIBRATED = (
    (_tags.GRADIENTS, "l2_norm"),
    (_tags.WEIGHTS, "l2_norm"),
    (_tags.WEIGHTS, "update_ratio"),
    (_tags.ACTIVATIONS, "dead_fraction"),
    (_tags.ACTIVATIONS, "saturated_fraction"),
    (_tags.ACTIVATIONS, "zero_fraction"),
)
"""The `(collection, statistic)` pairs `calibrate` learns ranges of, when the run
holds them: one `LearnedRange` each, in this order."""
CLEARANCE = 2.0
"""A lower bound is learned for a tensor whose smallest value is at least this
many times the width of its range (largest - smallest)."""


def calibrate(
    log_dir: Union[str, os.PathLike, Run], margin: float = DEFAULT_MARGIN,
    first_steps: int = DEFAULT_FIRST_STEPS, every_step: bool = True, run: str = "train",
) -> List[LearnedRange]:
    """Rules whose thresholds are the ranges a healthy run gave each tensor.

    Reads a healthy run of a model and returns one `LearnedRange` per
    statistic it holds of `CALIBRATED`: the l2 norms of the gradients and of
    the weights, the weights' update ratios (`GradientStatistics`,
    `WeightStatistics`), the dead, saturated and zero fractions of the taps
    (`TapLayer` + `ActivationStatistics`). Each holds the range of every
    tensor, and fires on the next runs of the same model (online with
    `StopOnRule(rules)`, offline with `kerasdbg.check_run`) at the first
    step where a value leaves its range widened by `margin` (see
    `LearnedRange`).

    How the range of a tensor is learned:

    - the steps up to `first_steps` are judged against the range of the
      whole run: at its first steps a healthy training is unlike its later
      ones (a zero-initialised bias has an infinite update ratio at step 1,
      gradients are larger) and unlike another seed's first steps; the
      later steps against the range of the steps after `first_steps`, from
      which a fault's jump stands out;
    - the upper bound is the largest value; inf (a zero tensor that moved)
      leaves that side unchecked;
    - the lower bound is the smallest value, only for a tensor that stayed
      clear of zero: its smallest value positive and at least `CLEARANCE`
      (2) times the width of its range over the whole run. Gradients and
      update ratios shrink as a healthy run converges, and a bias starts at
      zero (a one-unit bias passes near it again in another seed's run), so
      they get no lower bound; the norm of a kernel does, which catches
      weights that were zeroed;
    - tensors zero up to rounding are left out: those whose largest value
      is 0, or whose largest is below a thousandth of a sibling's in the
      same layer (the bias of a layer followed by a normalization, see
      `VanishingGradient`);
    - NaN is left out (`NonFiniteLoss` and `ExplodingTensor` watch it).

    The default margin of 10 was measured on the MLP of
    `tests/test_calibration.py` (two ReLU layers with taps, SGD and Adam,
    five seeds each, 80 and 160 steps, each seed calibrated on and checked
    against every other): a healthy run left another's range by a factor
    of at most 4.2 (the update ratio of a bias, at step 13); a learning
    rate 100 times larger left it by 38 or more at its step, a kernel
    zeroed by 21 or more (and an infinite update ratio), inputs 100 times
    too large by 880 at step 1. 10 lies between, about 2.4 times above the
    one and 4 times below the other.

    Calibrate on a run as long as those it will judge, recorded at every
    step (`every_n_steps=1`: by default the update ratios are recorded at
    steps 1-10 and every 50th step only, and a range of few values is
    narrow). The tensors are named by their paths; where the next run's
    names differ only by the numbers Keras adds (a second `Sequential` of a
    process is `sequential_1`, its layers `dense_2`, ...), its tensors are
    matched by their place in the model (`LearnedRange`).

    Args:
        log_dir: a log directory written by kerasdbg's statistics callbacks,
            or a `Run` from `kerasdbg.load_run`.
        margin: the factor (at least 1) by which each range is widened.
            Defaults to `10.0`.
        first_steps: the steps `1..first_steps` are judged against the whole
            run's range. Defaults to `10`.
        every_step: whether `StopOnRule` records what the rules read at
            every step (see `LearnedRange`). Defaults to `True`.
        run: which run of the directory. Defaults to `"train"`.

    Returns:
        The rules, one per `(collection, statistic)` of `CALIBRATED` the run holds.

    Raises:
        TypeError, ValueError: for bad arguments; ValueError when the run
            holds none of the statistics of `CALIBRATED`.
        FileNotFoundError: `log_dir` is not a directory.
        KeyError: the directory has no scalars for `run` (lists the tags).

    Examples:
        >>> import keras, numpy as np, tempfile
        >>> import kerasdbg
        >>> from kerasdbg.callbacks import GradientStatistics
        >>> log_dir = tempfile.mkdtemp()
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, name="d")],
        ...                          name="m")
        >>> model.compile("sgd", "mse")
        >>> _ = model.fit(np.ones((4, 1)), np.ones((4, 1)), batch_size=1, epochs=1, verbose=0,
        ...               callbacks=[GradientStatistics(log_dir, every_n_steps=1)])
        >>> [rule] = kerasdbg.calibrate(log_dir)
        >>> rule.collection, rule.statistic, sorted(rule.ranges)
        ('gradients', 'l2_norm', ['m/d/bias', 'm/d/kernel'])
        >>> kerasdbg.check_run(log_dir, [rule])  # its own run is in range
        []
    """
    owner = "calibrate"
    if not isinstance(log_dir, (str, os.PathLike, Run)):
        raise TypeError(f"{owner}: `log_dir` must be a log directory (str or os.PathLike) or a "
                        f"kerasdbg.reader.Run. Received: log_dir={log_dir!r} of type "
                        f"{type(log_dir).__name__}")
    margin = check.number(owner, "margin", margin, minimum=1.0)
    first_steps = check.non_negative_int(owner, "first_steps", first_steps)
    every_step = check.boolean(owner, "every_step", every_step)
    if not isinstance(run, str) or not run:
        raise TypeError(f"{owner}: `run` must be the name of a run of the directory (a "
                        f"non-empty str). Received: run={run!r} of type {type(run).__name__}")
    source = log_dir if isinstance(log_dir, Run) else load_run(log_dir)
    tags = source.tags(run=run)
    if not tags:
        source.scalars(".*", run=run)  # the KeyError that lists what the run holds
    present = recorded_pairs(tags)
    pairs = [pair for pair in CALIBRATED if pair in present]
    if not pairs:
        wanted = ", ".join(_tags.tag_pattern(c, s) for c, s in CALIBRATED)
        raise ValueError(
            f"{owner}: run {run!r} of {source.log_dir!r} holds none of the statistics it "
            f"learns ranges of: {wanted}. Record them with GradientStatistics, "
            "WeightStatistics or TapLayer + ActivationStatistics (their `stats`).")
    series = _measured(source, run, pairs)
    rules = []
    for pair in pairs:
        kept = _without_rounding(pair, series[pair])
        if not kept:
            continue
        clear = {name: _clear(values) for name, values in kept.items()}
        whole = {name: _bounds(values, clear[name]) for name, values in kept.items()}
        later = {name: _bounds([(s, v) for s, v in values if s > first_steps] or values,
                               clear[name]) for name, values in kept.items()}
        rules.append(LearnedRange(*pair, ranges=later,
                                  first_ranges=whole if first_steps else None,
                                  first_steps=first_steps, margin=margin,
                                  every_step=every_step))
    return rules


Series = Dict[str, List[Tuple[int, float]]]
"""tensor -> `(step, value)` in step order, NaN left out."""


def _measured(source: Run, run: str, pairs: Sequence[Tuple[str, str]]) -> Dict[tuple, Series]:
    """The values each pair's `LearnedRange` would compare, step by step:
    only the tags they read are read."""
    read = set(pairs) | ({(_tags.WEIGHTS, "l2_norm")} if (_tags.WEIGHTS, "update_ratio")
                         in pairs else set())
    table = source.scalar_table(_tags.any_pattern(
        [_tags.statistic_pattern(c, s) for c, s in sorted(read)]), run=run)
    measures = {pair: Measurement(*pair) for pair in pairs}
    series: Dict[tuple, Series] = {pair: {} for pair in pairs}
    columns = list(table.columns)
    for step, row in zip(table.index, table.to_numpy(dtype=np.float64)):
        # NaN is a value not written at this step (or NaN written): left out alike.
        record = {tag: value for tag, value in zip(columns, row.tolist()) if not math.isnan(value)}
        for pair, measure in measures.items():
            for name, value in measure(int(step), record).items():
                if not math.isnan(value):
                    series[pair].setdefault(name, []).append((int(step), value))
    return series


def _without_rounding(pair: Tuple[str, str], series: Series) -> Series:
    """`series` without the tensors zero up to rounding: a scale whose
    largest value is 0, and a gradient or weight whose largest finite value
    is below a sibling's (same layer) over `RATIO`."""
    if pair[1] in FRACTIONS:
        return series
    largest = {name: max([v for _, v in values if math.isfinite(v)] or [0.0])
               for name, values in series.items()}
    top: Dict[str, float] = {}
    if pair[0] != _tags.ACTIVATIONS:
        for name, value in largest.items():
            top[layer_of(name)] = max(top.get(layer_of(name), 0.0), value)
    return {name: values for name, values in series.items()
            if max(v for _, v in values) > 0.0
            and not largest[name] * RATIO < top.get(layer_of(name), 0.0)}


def _bounds(values: List[Tuple[int, float]], clear: bool) -> Bounds:
    """`(low, high)` of one tensor's values (see `calibrate`); `clear`:
    whether it has a lower bound."""
    array = np.array([v for _, v in values], np.float64)
    high = float(array.max())
    return [float(array.min()) if clear else None, high if math.isfinite(high) else None]


def _clear(values: List[Tuple[int, float]]) -> bool:
    """Whether a tensor stayed clear of zero over the whole run: its
    smallest value is positive and at least `CLEARANCE` times the width of
    its range."""
    array = np.array([v for _, v in values], np.float64)
    low, high = float(array.min()), float(array.max())
    return len(array) > 1 and math.isfinite(high) and low > 0.0 and low >= CLEARANCE * (high - low)
