"""Repeated fits: the cost of a `fit` with kerasdbg after the first, as ratios to plain `fit`.

A loop of short fits on one model (KerasTuner's trials, a notebook's cell run
again, a GAN or active-learning script) pays a fit's fixed costs at every
fit. Each configuration trains its own copy of a small CNN (the same
weights); the fits run interleaved, one fit of each configuration per round
(plain, callbacks, plain+taps, ...), each `fit(epochs=1)` over a few batches
with NEW callback instances of the same configuration.

Per fit: its wall time, and its first execution (from the first callback's
`on_train_batch_begin` of batch 0 to the last callback's `on_train_batch_end`
of batch 0: kerasdbg's own batch hooks included). Printed: the first (cold)
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
from kerasdbg import _capture  # noqa: E402
from kerasdbg._capture import engine as engine_module  # noqa: E402
from kerasdbg.callbacks import (  # noqa: E402
    ActivationStatistics, GradientStatistics, StopOnRule, WeightStatistics,
)
from kerasdbg.layers import TapLayer  # noqa: E402

CONFIGS = ("plain", "callbacks", "callbacks_retraced", "plain+taps", "callbacks+taps")
BATCH = 64


class _First(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.begin = time.perf_counter()


class _Last(keras.callbacks.Callback):
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
    times = {c: {"fit": [], "first": []} for c in configs}
    with tempfile.TemporaryDirectory() as root:
        for round_ in range(fits + 1):
            for config in configs:
                model = models[config]
                if config == "callbacks_retraced":
                    engine_module._pop_traced(model.train_function)
                first, last = _First(), _Last()
                log_dir = os.path.join(root, config, str(round_))
                start = time.perf_counter()
                model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
                          callbacks=[first] + _callbacks(config, log_dir) + [last])
                times[config]["fit"].append(time.perf_counter() - start)
                times[config]["first"].append(last.end - first.begin)
    traces = {c: _capture.engine_for(models[c]).trace_count for c in configs
              if not c.startswith("plain")}
    return times, traces


def report(times, traces, configs, fits, steps):
    print(f"\n{fits} fits after the first, {steps} batches of {BATCH} each, small CNN")
    print(f"{'configuration':<22}{'cold fit s':>11}{'fit s':>9}{'first exec s':>14}"
          f"{'fit ratio':>11}{'first ratio':>13}{'traces':>8}")
    for config in configs:
        base = "plain+taps" if "taps" in config else "plain"
        mine = {k: np.array(v[1:]) for k, v in times[config].items()}
        row = f"{config:<22}{times[config]['fit'][0]:>11.3f}{np.median(mine['fit']):>9.3f}" \
              f"{np.median(mine['first']):>14.4f}"
        if base in times and base != config:
            plain = {k: np.array(v[1:]) for k, v in times[base].items()}
            row += f"{np.median(mine['fit'] / plain['fit']):>11.2f}" \
                   f"{np.median(mine['first'] / plain['first']):>13.2f}"
        else:
            row += f"{'':>11}{'':>13}"
        row += f"{traces.get(config, ''):>8}"
        print(row)


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
