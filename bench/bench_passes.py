"""The passes over the model's tensors that the statistics callbacks keep, each timed alone.

What a target of `bench_statistics.py` cannot go below: with the defaults,
every step computes the l2 norm (and from it the finiteness flags) of every
gradient and of every weight, two passes over the model's parameters. Here
each pass runs alone, as one `tf.function` call on tensors of the model's
weight shapes, and is printed in ms and as a fraction of the plain training
step measured in the same process (interleaved rounds, medians):

- "norms of N tensors": `l2_norm`, `nan_count`, `inf_count` (the every-step
  pass of `GradientStatistics()` and of `WeightStatistics()`; each callback
  pays one);
- "all statistics of N tensors": every scalar statistic (the pass of a step
  recorded in full, and of every step with `every_n_steps=1`);
- "update ratio and distance": what `WeightStatistics` adds on a full step:
  the difference from the previous and from the initial weights, and the
  copy of the weights for the next step.

Usage:
    python bench/bench_passes.py --models cnn resnet50 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from bench_statistics import _model  # noqa: E402
from kerasdbg import _graph_functions as graph_functions  # noqa: E402
from kerasdbg.stats import NORM_STATISTICS, STATISTICS  # noqa: E402

CALLS = 20


def _plain_step(model, x, y, batch):
    started = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    return (time.perf_counter() - started) / (len(x) // batch)


def _pass_time(function, *args):
    function(*args)  # trace and first execution
    started = time.perf_counter()
    for _ in range(CALLS):
        result = function(*args)
    tf.nest.map_structure(lambda t: t.numpy(), result)
    return (time.perf_counter() - started) / CALLS


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet50"], choices=["cnn", "resnet50"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=24, help="plain steps timed per round")
    args = parser.parse_args()
    for name in args.models:
        keras.utils.set_random_seed(0)
        model, shape, batch = _model(name)
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x = np.random.default_rng(0).normal(size=(batch * args.steps, *shape)).astype("float32")
        y = np.random.default_rng(1).integers(0, 10, batch * args.steps)
        _plain_step(model, x, y, batch)  # trace
        tensors = [tf.constant(np.random.default_rng(2).normal(size=w.shape).astype("float32"))
                   for w in model.trainable_weights]
        previous = [tf.Variable(t) for t in tensors]
        initial = [tf.Variable(t) for t in tensors]
        elements = sum(int(np.prod(t.shape)) for t in tensors)

        @tf.function
        def norms(ts):
            return graph_functions.statistics_table(ts, NORM_STATISTICS)

        @tf.function
        def everything(ts):
            return graph_functions.statistics_table(ts, STATISTICS)

        @tf.function
        def update_and_distance(ts):
            moved = [t - p for t, p in zip(ts, previous)]
            away = [t - i for t, i in zip(ts, initial)]
            table = graph_functions.statistics_table(moved + away, ("l2_norm",))
            for p, t in zip(previous, ts):
                p.assign(t)
            return table

        passes = {f"norms of {len(tensors)} tensors": norms,
                  f"all statistics of {len(tensors)} tensors": everything,
                  "update ratio and distance": update_and_distance}
        times = {"plain step": []} | {label: [] for label in passes}
        for _ in range(args.repeats):
            times["plain step"].append(_plain_step(model, x, y, batch))
            for label, function in passes.items():
                times[label].append(_pass_time(function, tensors))
        step = statistics.median(times["plain step"])
        print(f"\n{name}: {len(tensors)} trainable tensors, {elements:,} elements, "
              f"median of {args.repeats} rounds")
        for label, values in times.items():
            value = statistics.median(values)
            print(f"  {label:36s} {value * 1e3:8.2f} ms  {value / step:6.3f} of a plain step")


if __name__ == "__main__":
    main()
