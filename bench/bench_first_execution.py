"""Where the first execution's time goes, per instrument: trace, lowering, compile.

Each configuration runs in a fresh process: build the model, one `fit` of a
few steps, timed from `fit`'s call to the end of the first batch (the trace,
the compile and the first step: what a user waits for before training
starts). On JAX, `jax.monitoring`'s duration events split it into the
tracing to a jaxpr, the lowering to MLIR and XLA's compile (summed over
every function compiled from `on_train_begin` to the first batch's end,
kerasdbg's and Keras's); on
TensorFlow, the first batch alone (its trace and XLA/graph build are one
call). The configurations take the instruments apart: each statistics
callback alone, `StopOnRule` with and without the replay that locates a
NaN (`locate_nan`), and the defaults.

Usage:
    KERAS_BACKEND=jax python bench/bench_first_execution.py --models mlp cnn
    python bench/bench_first_execution.py --models mlp --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS = ("plain", "gradients", "weights", "defaults", "stop-no-locate", "stop",
           "stop+defaults")
# jax.monitoring's duration events of a compile, and what the table calls them.
JAX_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}


def _callbacks(config, log_dir):
    from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics

    defaults = [GradientStatistics(log_dir), WeightStatistics(log_dir)]
    return {
        "plain": [],
        "gradients": defaults[:1],
        "weights": defaults[1:],
        "defaults": defaults,
        "stop-no-locate": [StopOnRule(log_dir=log_dir, action="warn", verbose=False,
                                      locate_nan=False)],
        "stop": [StopOnRule(log_dir=log_dir, action="warn", verbose=False)],
        "stop+defaults": [StopOnRule(log_dir=log_dir, action="warn", verbose=False)] + defaults,
    }[config]


def child(model_name: str, config: str, spe: int) -> None:
    """One fit in this process; prints the first batch's seconds (and on
    JAX the compile's parts) as JSON."""
    import keras
    import numpy as np

    from bench_statistics import _model

    parts = {name: 0.0 for name in JAX_EVENTS.values()}
    seen = {}  # "begin", "first": the window timed (the compiles inside it counted)
    if keras.backend.backend() == "jax":
        import jax

        def listen(event, duration, **kwargs):
            if event in JAX_EVENTS and "begin" in seen and "first" not in seen:
                parts[JAX_EVENTS[event]] += duration

        jax.monitoring.register_event_duration_secs_listener(listen)

    keras.utils.set_random_seed(0)
    model, shape, batch = _model(model_name)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    steps = 4 * spe
    x = np.random.default_rng(0).normal(size=(batch * steps, *shape)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, batch * steps)

    class FirstBatch(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen["begin"] = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            seen.setdefault("first", time.perf_counter())

    with tempfile.TemporaryDirectory() as log_dir:
        # Last in the list: its begin comes after every other callback's.
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                  callbacks=_callbacks(config, log_dir) + [FirstBatch()])
    print(json.dumps({"first": seen["first"] - seen["begin"], **parts}))


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=["mlp", "cnn", "resnet50"])
    parser.add_argument("--spe", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    args = parser.parse_args()
    import keras

    backend = keras.backend.backend()
    configs = ["plain"] + [c for c in args.configs if c != "plain"]
    for model_name in args.models:
        runs = {c: [] for c in configs}
        for _ in range(args.repeats):  # interleaved: a busy moment spreads over all
            for config in configs:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", model_name, config, str(args.spe)],
                    capture_output=True, text=True, check=True)
                runs[config].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"\n{backend}: {model_name}, steps_per_execution={args.spe}: the first batch of "
              f"the first fit, seconds (median of {args.repeats}, each in a fresh process)")
        names = ["first"] + (list(JAX_EVENTS.values()) if backend == "jax" else [])
        print(f"  {'configuration':16s}" + "".join(f"{n:>10s}" for n in names)
              + f"{'/ plain':>10s}")
        median = {c: {n: sorted(r[n] for r in runs[c])[len(runs[c]) // 2] for n in names}
                  for c in configs}
        for config in configs:
            print(f"  {config:16s}" + "".join(f"{median[config][n]:10.2f}" for n in names)
                  + f"{median[config]['first'] / median['plain']['first']:10.2f}")


if __name__ == "__main__":
    main()
