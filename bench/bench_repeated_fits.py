"""Repeated fits: the cost of a `fit` with kerasdbg after the first, as ratios to plain `fit`.

A loop of short fits on one model (KerasTuner's trials, a notebook's cell run
again, a GAN or active-learning script) pays a fit's fixed costs at every
fit. Each configuration trains its own copy of a small CNN (the same
weights); the fits run interleaved, one fit of each configuration per round
(plain, callbacks, plain+taps, ...), each `fit(epochs=1)` over a few batches
with NEW callback instances of the same configuration.

Per fit: its wall time; its batch 0 (from the first callback's
`on_train_batch_begin` of batch 0 to the last callback's `on_train_batch_end`:
kerasdbg's own batch hooks included, its prepare and its first read of the
buffers); and its first execution alone (from the last callback's
`on_train_batch_begin` to the first callback's `on_train_batch_end`). Printed: the first (cold)
fit of each configuration, then over the later fits the median of each
round's ratio to the plain fit of the same round (plain model for
"callbacks", tapped model for "callbacks+taps"), and the traces kerasdbg
made.

Configurations:
- "plain": no callback; "plain+taps": the model with a `TapLayer` after every
  layer (`kerasdbg.insert_taps`, every 10th step), no callback;
- "callbacks": `GradientStatistics` + `WeightStatistics` + `StopOnRule` (its
  default rules, action "warn"); "callbacks+taps": the same plus
  `ActivationStatistics` on the tapped model;
- "callbacks_retraced": "callbacks" with the kept instrumented function
  dropped before each fit, i.e. every fit traces again (what each fit paid
  before kerasdbg reused the function).

Usage:
    python bench/bench_repeated_fits.py                  # 30 fits after the first
    python bench/bench_repeated_fits.py --fits 10 --steps 4
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdbg  # noqa: E402
from kerasdbg import capture as _capture  # noqa: E402
from kerasdbg.backends.tensorflow import engine as engine_module  # noqa: E402
from kerasdbg.callbacks import (  # noqa: E402
    ActivationStatistics, GradientStatistics, StopOnRule, WeightStatistics,
)
from kerasdbg.layers import TapLayer  # noqa: E402

CONFIGS = ("plain", "callbacks", "callbacks_retraced", "plain+taps", "callbacks+taps")
BATCH = 64


class _Edge(keras.callbacks.Callback):
    """The times of batch 0's begin and end hooks (one first, one last in the list)."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.end = time.perf_counter()


def _cnn():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10)])


def _model(config):
    model = _cnn()
    if "taps" in config:
        model = kerasdbg.insert_taps(model, tap=TapLayer(every_n_steps=10))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _callbacks(config, log_dir):
    if config.startswith("plain"):
        return []
    callbacks = [GradientStatistics(log_dir), WeightStatistics(log_dir),
                 StopOnRule(log_dir=log_dir, action="warn", verbose=False)]
    if "taps" in config:
        callbacks.append(ActivationStatistics(log_dir))
    return callbacks


def bench(fits, steps, configs):
    x = np.random.default_rng(0).normal(size=(BATCH * steps, 28, 28, 1)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, BATCH * steps)
    models = {c: _model(c) for c in configs}
    times = {c: {"fit": [], "first": [], "execution": []} for c in configs}
    with tempfile.TemporaryDirectory() as root:
        for round_ in range(fits + 1):
            for config in configs:
                model = models[config]
                if config == "callbacks_retraced":
                    engine_module._pop_traced(model.train_function)
                first, last = _Edge(), _Edge()
                log_dir = os.path.join(root, config, str(round_))
                start = time.perf_counter()
                model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
                          callbacks=[first] + _callbacks(config, log_dir) + [last])
                times[config]["fit"].append(time.perf_counter() - start)
                # The batch's hooks included (kerasdbg's prepare and first read), and
                # the execution alone (from the last begin hook to the first end hook).
                times[config]["first"].append(last.end - first.begin)
                times[config]["execution"].append(first.end - last.begin)
    traces = {c: _capture.engine_for(models[c]).trace_count for c in configs
              if not c.startswith("plain")}
    return times, traces


def report(times, traces, configs, fits, steps):
    print(f"\n{fits} fits after the first, {steps} batches of {BATCH} each, small CNN")
    print("s: median seconds over the later fits; ratio: median of each round's ratio to plain's")
    columns = (("fit", "fit"), ("first", "batch 0"), ("execution", "1st execution"))
    header = f"{'configuration':<20}{'cold fit s':>11}"
    for _, name in columns:
        header += f"{name + ' s':>16}{'ratio':>7}"
    print(header + f"{'traces':>8}")
    for config in configs:
        base = "plain+taps" if "taps" in config else "plain"
        row = f"{config:<20}{times[config]['fit'][0]:>11.3f}"
        for key, _ in columns:
            mine = np.array(times[config][key][1:])
            row += f"{np.median(mine):>16.4f}"
            if base in times and base != config:
                plain = np.array(times[base][key][1:])
                row += f"{np.median(mine / plain):>7.2f}"
            else:
                row += f"{'':>7}"
        print(row + f"{traces.get(config, ''):>8}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fits", type=int, default=30)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    args = parser.parse_args()
    times, traces = bench(args.fits, args.steps, args.configs)
    report(times, traces, args.configs, args.fits, args.steps)


if __name__ == "__main__":
    main()
