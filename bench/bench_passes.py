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

`--memory` measures instead what each pass adds to the peak resident memory
(VmHWM) of a fresh process that holds the tensors (and, for the update
ratio and distance, the two weight copies): its temporaries and its traced
function, in MB and in copies of the model's weights.

Usage:
    python bench/bench_passes.py --models cnn resnet50 --repeats 7
    python bench/bench_passes.py --models resnet50 --memory
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
from kerasdbg.backends.tensorflow import graph_functions  # noqa: E402
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


def _peak_mb():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pass_memory(name, label):
    """In this (fresh) process: the tensors of `name`'s weights, then one
    pass; prints the peak before and after it, and the weights' MB."""
    model, _, _ = _model(name)
    tensors = [tf.constant(np.random.default_rng(2).normal(size=w.shape).astype("float32"))
               for w in model.trainable_weights]
    weights = sum(int(np.prod(t.shape)) * 4 for t in tensors) / 2**20
    functions = _passes(tensors)
    before = _peak_mb()
    for _ in range(3):
        tf.nest.map_structure(lambda t: t.numpy(), functions[label](tensors))
    print(before, _peak_mb(), weights)


def _passes(tensors):
    previous = [tf.Variable(t) for t in tensors]
    initial = [tf.Variable(t) for t in tensors]

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

    return {"norms": norms, "all statistics": everything,
            "update ratio and distance": update_and_distance}


def memory(name):
    import subprocess

    print(f"\n{name}: what one pass adds to the peak resident memory")
    for label in ("norms", "all statistics", "update ratio and distance"):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-pass", name,
                              label], capture_output=True, text=True, check=True)
        before, after, weights = map(float, out.stdout.split()[-3:])
        print(f"  {label:28s} {after - before:8.1f} MB  {(after - before) / weights:5.2f} "
              f"weight copies (weights {weights:.1f} MB)")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--memory-pass":
        pass_memory(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet50"], choices=["cnn", "resnet50"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=24, help="plain steps timed per round")
    parser.add_argument("--memory", action="store_true",
                        help="peak memory of each pass alone, each in a fresh process")
    args = parser.parse_args()
    if args.memory:
        for name in args.models:
            memory(name)
        return
    for name in args.models:
        keras.utils.set_random_seed(0)
        model, shape, batch = _model(name)
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x = np.random.default_rng(0).normal(size=(batch * args.steps, *shape)).astype("float32")
        y = np.random.default_rng(1).integers(0, 10, batch * args.steps)
        _plain_step(model, x, y, batch)  # trace
        tensors = [tf.constant(np.random.default_rng(2).normal(size=w.shape).astype("float32"))
                   for w in model.trainable_weights]
        elements = sum(int(np.prod(t.shape)) for t in tensors)
        functions = _passes(tensors)
        passes = {f"norms of {len(tensors)} tensors": functions["norms"],
                  f"all statistics of {len(tensors)} tensors": functions["all statistics"],
                  "update ratio and distance": functions["update ratio and distance"]}
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
