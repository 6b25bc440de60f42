"""Trace time and memory of a model with many variables (issue 32, item 15).

A `Sequential` of N `Dense(8)` layers (2N variables), compiled with Adam,
fitted once for a few steps, plain and instrumented, each configuration in a
fresh process (so that neither inherits the other's traced functions or
memory). Per configuration:

- first fit: the wall time of the whole `fit` (the trace, TensorFlow's graph
  optimisation at the first execution, the steps);
- trace: the first execution's time minus the steady step time (the median
  of the executions after the first two);
- peak RSS of the process (VmHWM) and its resident memory (VmRSS) before the
  fit, after it, and after it plus `gc.collect()`; in MB.

Configurations: "plain" (no callback) and "instrumented"
(`GradientStatistics(log_dir)` + `WeightStatistics(log_dir)` with their
defaults + `StopOnRule(log_dir=..., action="warn")` with its default rules;
"warn": a verdict does not end the fit being timed).

Usage:
    python bench/bench_many_variables.py                  # N=1000
    python bench/bench_many_variables.py --layers 200 --steps 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CONFIGS = ("plain", "instrumented")


def _memory_mb():
    """`(VmRSS, VmHWM)` of this process, in MB."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def child(config: str, layers: int, steps: int) -> None:
    """Runs one fit in this process; prints its figures as one JSON line."""
    import keras
    import numpy as np

    from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics

    class Timer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.ends = [time.perf_counter()]

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    # Keras builds a Sequential's graph of layers recursively (one level per
    # layer and a few frames each): 1,000 layers pass Python's default limit.
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20 * layers + 1000))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(layers)])
    model.compile("adam", "mse")
    batch = 16
    x = np.random.default_rng(0).normal(size=(batch * steps, 8)).astype("float32")
    y = np.random.default_rng(1).normal(size=(batch * steps, 8)).astype("float32")
    weights_mb = sum(int(np.prod(v.shape)) * 4 for v in model.weights) / 2**20
    with tempfile.TemporaryDirectory() as log_dir:
        callbacks = [] if config == "plain" else [
            GradientStatistics(log_dir), WeightStatistics(log_dir),
            StopOnRule(log_dir=log_dir, action="warn", verbose=False)]
        timer = Timer()
        rss_before, _ = _memory_mb()
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                  callbacks=callbacks + [timer])
        first_fit = time.perf_counter() - start
        rss_after, peak = _memory_mb()
        timer_ends = timer.ends
        del callbacks, timer
        gc.collect()
        rss_collected, _ = _memory_mb()
    durations = [float(d) for d in np.diff(timer_ends)]
    print(json.dumps({"config": config, "layers": layers, "first_fit_s": first_fit,
                      "durations": durations, "rss_before_mb": rss_before,
                      "rss_after_fit_mb": rss_after, "rss_after_gc_mb": rss_collected,
                      "peak_mb": peak, "weights_mb": weights_mb}))


def run(config: str, layers: int, steps: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", config, "--layers", str(layers),
                          "--steps", str(steps)], capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{config} failed:\n{out.stderr[-4000:]}")
    result = json.loads(lines[-1])
    import numpy as np

    durations = np.asarray(result["durations"])
    steady = float(np.median(durations[2:])) if len(durations) > 2 else 0.0
    result["steady_step_s"] = steady
    result["trace_s"] = float(durations[0] - steady)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=1000, help="Dense(8) layers (N)")
    parser.add_argument("--steps", type=int, default=8, help="steps of the fit")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.layers, args.steps)
        return
    results = {c: run(c, args.layers, args.steps) for c in args.configs.split(",")}
    weights = next(iter(results.values()))["weights_mb"]
    print(f"{args.layers} Dense(8) layers ({2 * args.layers} variables, weights {weights:.2f} MB),"
          f" {args.steps} steps; seconds and MB")
    print(f"  {'configuration':14s} {'first fit':>10s} {'trace':>8s} {'step ms':>8s} "
          f"{'peak RSS':>9s} {'RSS before':>11s} {'after fit':>10s} {'after gc':>9s}")
    for config, r in results.items():
        print(f"  {config:14s} {r['first_fit_s']:10.1f} {r['trace_s']:8.1f} "
              f"{1000 * r['steady_step_s']:8.1f} {r['peak_mb']:9.0f} {r['rss_before_mb']:11.0f} "
              f"{r['rss_after_fit_mb']:10.0f} {r['rss_after_gc_mb']:9.0f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
