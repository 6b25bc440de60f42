"""Cost of kerasdbg's instruments, as ratios to plain `fit` in the same run.

For each model and steps_per_execution, the configurations run in interleaved
rounds, each between two plain fits (plain, defaults, plain, all, plain, ...),
each a fresh `fit` (and a fresh trace) on the same compiled model, so the
optimizer's step goes on across fits and a default schedule is measured as in
a long run. Per fit:

- steady-state step time: the wall time of the executions after the first
  two, divided by their steps (a mean: the steps a schedule records in full
  count at their share);
- trace time: the first execution's time minus the steady-state execution time,
  plus the same for the execution where kerasdbg's step compiled its second
  variant (the every-step one: once per fit shape, and this bench makes a
  fresh train function for every fit; TensorFlow traces it at its first call,
  JAX compiles it ahead on a thread and the loop may wait for it there); that
  execution is left out of the steady state, as the first is (on a 2-core
  machine the compile thread also slows the executions beside it, which
  stay in).

Configurations:
- "defaults": `GradientStatistics(log_dir)` + `WeightStatistics(log_dir)` with
  their defaults (l2 norms and NaN/Inf counts every step, all statistics at
  steps 1-10 and every 50th);
- "all": every statistic of every gradient and weight at every step
  (`every_n_steps=1`); "all+histograms" adds histograms every 100 steps;
- "stop+defaults": `StopOnRule(log_dir=..., action="warn")` with the default
  rules (NaN guard armed: loss, fault test, freeze, NaN localisation) +
  "defaults" (warn: a verdict does not end the fit being timed); "stop": the
  same `StopOnRule` alone;
- "taps+defaults": the model from `kerasdbg.insert_taps` with a `TapLayer`
  after every layer (recording every 10th step) + "defaults" +
  `ActivationStatistics`; "taps": the same model without any callback (what the
  taps alone cost, in step and trace time);
- "nan_guard": `StopOnRule(NonFiniteLoss())` alone; "terminate_on_nan":
  Keras's `TerminateOnNaN`; "keras_tensorboard": Keras's `TensorBoard` with
  histograms every epoch; "step_timer": `StepTimer`; "step_recorder":
  `StepRecorder(steps=3)`, whose steady state pays only the test of the step;
- "skip+defaults": "defaults" + `StopOnRule([LossSpike(), GradientNormSpike()],
  action="skip")` (the in-graph guard: the NaN/Inf test, the two spike
  windows, the skip); printed beside it, its step time over "defaults"'s;
- "rollback+defaults": the same with `action="rollback"` and a snapshot every
  100 steps (`rollback_every=100`); printed beside it, the time each snapshot
  took (the host copy of the weights and the optimizer's variables).

Printed: median over rounds of each configuration's step time divided by the
mean step time of the plain fits right before and after it (a shared
machine's speed drifts by 10-20% over minutes; the neighbours cancel most
of it), and its extra trace seconds over theirs.

On JAX (`KERAS_BACKEND=jax`) the same rounds run the same configurations
(`JAX_CONFIGS`), with two more columns per configuration beside plain's: the first
execution's time (trace + compile + first run) in the first fit of a train
function, and in a later fit of the same compiled model. Keras's JAX trainer
keeps its jitted train function across fits, and kerasdbg's capture keeps
the step it jitted for the last fit, run again by a later fit whose requests
build the same step: so each JAX run is a fit on a fresh train function
(`make_train_function(force=True)` and kerasdbg's kept step dropped, as
`graph_functions.clear()` does on TensorFlow; its steady step and trace
time give the ratio and the extra trace), then a short later fit
(`LATER_EXECUTIONS` executions) of the same model and configuration without
either, whose first execution shows what a later fit re-traces, if anything.

`--memory` measures instead the resident memory (RSS) of a process that
builds the model and runs one `fit` per configuration given, each in a fresh
process, and prints each one's minus plain's, in MB and in copies of the
model's weights: the peak of the whole process; the TensorFlow variables the
fit created (counted from the variables: the state kerasdbg keeps; on JAX,
the bytes of the live JAX arrays); the
resident memory before the first step; its peak after the first step (the
trace and the first execution); and the resident memory at the end. A fit
of 2000 steps or more also prints its resident memory every 1000 batches and
its growth from the 1000th on (`--models mlp --mlp-steps 10000`: a long run's).

Usage:
    python bench/bench_statistics.py                       # everything
    python bench/bench_statistics.py --models cnn --repeats 5
    python bench/bench_statistics.py --models resnet50 --memory --configs all
    KERAS_BACKEND=jax python bench/bench_statistics.py --models cnn --repeats 5
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdbg  # noqa: E402
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, WeightStatistics  # noqa: E402
from kerasdbg.callbacks import StepRecorder, StepTimer, StopOnRule  # noqa: E402
from kerasdbg.rules import GradientNormSpike, LossSpike, NonFiniteLoss  # noqa: E402
from kerasdbg.layers import TapLayer  # noqa: E402

CONFIGS = ("plain", "defaults", "all", "all+histograms", "stop", "stop+defaults", "taps", "taps+defaults",
           "keras_tensorboard", "terminate_on_nan", "nan_guard", "step_timer", "step_recorder",
           "skip+defaults", "rollback+defaults")
# What runs on JAX: every configuration (Keras's TensorBoard callback writes
# through TensorFlow, which must be installed for that one).
JAX_CONFIGS = CONFIGS
TAP_EVERY = 10
LATER_EXECUTIONS = 4  # the executions of a JAX "later fit"
BACKEND = keras.backend.backend()


class _Timer(keras.callbacks.Callback):
    """The end of each execution, and the executions that traced a variant
    of kerasdbg's step other than the first (once per fit shape: on
    TensorFlow the every-step one, traced at its first call; on JAX the one
    compiled ahead on a thread, where the loop waited for it)."""

    def on_train_begin(self, logs=None):
        self.ends = [time.perf_counter()]
        self.traced: List[int] = []
        self._made = self._variants_made()

    def _variants_made(self) -> int:
        """How many programs kerasdbg's variants compiled so far (TensorFlow:
        variants made; JAX: programs its jitted variants compiled, and the
        variants whose compilation ahead the loop waited for)."""
        if BACKEND == "jax":
            from kerasdbg.backends.jax import engine

            steps = getattr(engine.engine_for(self.model), "_step_function", None)
            if not isinstance(steps, dict) or len(steps) < 2:
                return 0
            return sum(step.jitted._cache_size() + (step.waited > 1e-3)
                       for step in steps.values() if isinstance(step, engine._Jitted))
        functions = getattr(self.model.train_function, "functions", None)
        if not isinstance(functions, dict):
            return 0
        return sum(function is not None for function in functions.values())

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())
        made = self._variants_made()
        if made > self._made and len(self.ends) > 2:
            self.traced.append(len(self.ends) - 2)  # the index of this execution's duration
        self._made = made


def _model(name):
    if name == "mlp":
        # A step under a millisecond on a CPU: the proxy of a GPU's step,
        # where what costs is the host's work per step, not the statistics.
        model = keras.Sequential([
            keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
        return model, (32,), 64
    if name == "cnn":
        model = keras.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
            keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10)])
        return model, (28, 28, 1), 64
    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10,
                                         classifier_activation=None)
    return model, (64, 64, 3), 16


def _callbacks(config, log_dir):
    if config in ("plain", "taps"):
        return []
    if config == "terminate_on_nan":
        return [keras.callbacks.TerminateOnNaN()]
    if config == "nan_guard":
        return [StopOnRule(NonFiniteLoss(), log_dir=log_dir)]
    if config == "step_timer":
        return [StepTimer(log_dir)]
    if config == "step_recorder":  # full tensors of steps 1-3, then only the step test
        return [StepRecorder(os.path.join(log_dir, "trace.npz"), steps=3)]
    if config == "keras_tensorboard":
        return [keras.callbacks.TensorBoard(log_dir, histogram_freq=1)]
    if config in ("skip+defaults", "rollback+defaults"):
        action = config.partition("+")[0]
        return [StopOnRule([LossSpike(), GradientNormSpike()], action=action, rollback_every=100,
                           log_dir=log_dir, verbose=False),
                GradientStatistics(log_dir), WeightStatistics(log_dir)]
    if config == "stop":  # StopOnRule's default rules alone (see "stop+defaults")
        return [StopOnRule(log_dir=log_dir, action="warn", verbose=False)]
    defaults = [GradientStatistics(log_dir), WeightStatistics(log_dir)]
    if config == "defaults":
        return defaults
    if config == "stop+defaults":
        # "warn": the bench's fits go on over hundreds of steps on a few
        # hundred random examples, which the model learns by heart until its
        # gradients vanish (VanishingGradient is right to fire, and a stop
        # would end the fit being timed).
        return [StopOnRule(log_dir=log_dir, action="warn", verbose=False)] + defaults
    if config == "taps+defaults":
        return defaults + [ActivationStatistics(log_dir)]
    histograms = 100 if config == "all+histograms" else None
    return [GradientStatistics(log_dir, every_n_steps=1, histogram_every_n_steps=histograms),
            WeightStatistics(log_dir, every_n_steps=1, histogram_every_n_steps=histograms)]


def _drop_jax_step(model):
    """Drops the step JAX's capture kept from the model's last fit, so that
    the next fit traces and compiles its own (the bench's "first fit")."""
    from kerasdbg.backends.jax import engine

    capture = engine.engine_for(model)
    if hasattr(capture, "_kept"):  # a private of the engine: the bench only
        capture._kept.clear()
        capture._kept_key = None


def bench(model_name, spe, steps, repeats, configs):
    keras.utils.set_random_seed(0)
    model, shape, batch = _model(model_name)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    x = np.random.default_rng(0).normal(size=(batch * steps, *shape)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, batch * steps)
    # "taps+defaults": a TapLayer after every layer, recording every TAP_EVERY
    # steps, in a model that shares the compiled model's layers and optimizer.
    tapped = kerasdbg.insert_taps(model, tap=TapLayer(every_n_steps=TAP_EVERY)) if (
        "taps" in configs or "taps+defaults" in configs) else None
    results = {c: {"step": [], "trace": [], "ratio": [], "extra": [], "first": [], "later": [],
                   "snapshots": []} for c in configs}

    def fit(config, fitted, examples):
        with tempfile.TemporaryDirectory() as log_dir:
            timer = _Timer()
            callbacks = _callbacks(config, log_dir)
            fitted.fit(x[:examples], y[:examples], batch_size=batch, epochs=1, verbose=0,
                       shuffle=False, callbacks=callbacks + [timer])
        for callback in callbacks:
            results[config]["snapshots"] += list(getattr(callback, "snapshot_seconds", []))
        return np.diff(timer.ends), timer.traced

    def run(config):
        fitted = tapped if config.startswith("taps") else model
        # A fresh train function for every fit, so plain pays its trace too,
        # and no function the taps share kept from an earlier fit.
        fitted.make_train_function(force=True)
        if BACKEND == "tensorflow":
            from kerasdbg.backends.tensorflow import graph_functions

            graph_functions.clear()
        else:
            _drop_jax_step(fitted)
        durations, traced = fit(config, fitted, len(x))
        # The steady state leaves out the first two executions and those that
        # traced the second variant (its trace counts with the first's).
        steady_part = np.delete(durations, [0, 1] + [i for i in traced if i > 1])
        steady = float(np.mean(steady_part))
        trace = float(durations[0] - steady + sum(durations[i] - steady for i in traced))
        later = np.nan
        if BACKEND == "jax":
            # A later fit of the same compiled model: plain Keras runs the
            # function it jitted above; kerasdbg jits its step again.
            later = float(fit(config, fitted, batch * spe * LATER_EXECUTIONS)[0][0])
        return steady / spe, trace, float(durations[0]), later

    for _ in range(repeats):
        # Each configuration between two plain fits: P A P B P ...; its ratio
        # is to the mean of its two neighbours, so that the drift of a shared
        # machine's speed over a round cancels out.
        before = run("plain")
        for config in configs:
            if config == "plain":
                continue
            mine = run(config)
            after = run("plain")
            for value, kind in ((before, "plain"), (after, "plain"), (mine, config)):
                for key, figure in zip(("step", "trace", "first", "later"), value):
                    results[kind][key].append(figure)
            results[config]["ratio"].append(mine[0] / ((before[0] + after[0]) / 2))
            results[config]["extra"].append(mine[1] - (before[1] + after[1]) / 2)
            before = after
    return results


def report(model_name, spe, results, configs):
    plain_steps = np.array(results["plain"]["step"])
    print(f"\n{BACKEND}: {model_name}, steps_per_execution={spe}: plain step "
          f"{1000 * np.median(plain_steps):.1f} ms, trace "
          f"{np.median(results['plain']['trace']):.1f} s (median of {len(plain_steps)})")
    jax_columns = BACKEND == "jax"
    header = f"  {'configuration':22s} {'step ratio':>10s} {'min-max':>13s} {'extra trace s':>14s}"
    if jax_columns:
        # The first execution (trace + compile + first run), in seconds: in
        # the first fit of a train function, and in a later fit.
        header += f" {'1st exec, 1st fit s':>20s} {'1st exec, later fit s':>22s}"
    print(header)
    for config in configs:
        ratios, extra = np.array(results[config]["ratio"]), np.array(results[config]["extra"])
        if config == "plain":
            line = f"  {config:22s} {'':10s} {'':13s} {'':14s}"
        else:
            line = (f"  {config:22s} {np.median(ratios):10.3f} {ratios.min():6.3f}-{ratios.max():6.3f}"
                    f" {np.median(extra):14.2f}")
        if jax_columns:
            line += (f" {np.median(results[config]['first']):20.3f}"
                     f" {np.median(results[config]['later']):22.3f}")
        if config == "skip+defaults" and "defaults" in results:
            # Paired by round: each round's ratio over that round's "defaults".
            pairs = np.array(results[config]["ratio"]) / np.array(results["defaults"]["ratio"])
            line += f"   over defaults {np.median(pairs):.3f} ({pairs.min():.3f}-{pairs.max():.3f})"
        snapshots = results[config]["snapshots"]
        if snapshots:
            line += (f"   snapshot {1000 * np.median(snapshots):.1f} ms "
                     f"(max {1000 * max(snapshots):.1f}, {len(snapshots)} taken)")
        if config != "plain" or jax_columns:
            print(line)


class _MemoryProbe(keras.callbacks.Callback):
    """Resident memory (VmRSS) and its peak so far (VmHWM), in MB, before
    the first step (after every callback's `on_train_begin`), after it (the
    trace and the first execution) and at the end of the fit."""

    SAMPLE_EVERY = 1000

    def __init__(self):
        super().__init__()
        self.phases = {}
        self.samples = []  # (batches done, VmRSS) every SAMPLE_EVERY batches
        self._batches = 0

    @staticmethod
    def _read():
        found = {}
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0]) / 1024
        return found

    def on_train_batch_begin(self, batch, logs=None):
        self.phases.setdefault("before_first_step", self._read())

    def on_train_batch_end(self, batch, logs=None):
        self.phases.setdefault("after_first_step", self._read())
        self._batches += 1
        if self._batches % self.SAMPLE_EVERY == 0:
            self.samples.append((self._batches, self._read()["VmRSS"]))

    def on_train_end(self, logs=None):
        self.phases["end"] = self._read()


def _variable_megabytes():
    """The bytes of every TensorFlow variable alive in the process, in MB
    (counted from the variables themselves, not from the process's memory);
    on JAX, of every live JAX array (the state and what kerasdbg keeps)."""
    import gc

    if BACKEND == "jax":
        import jax

        return sum(a.nbytes for a in jax.live_arrays()) / 2**20
    import tensorflow as tf

    seen, total = set(), 0
    for thing in gc.get_objects():
        if isinstance(thing, tf.Variable) and id(thing) not in seen:
            seen.add(id(thing))
            if thing.shape.is_fully_defined():
                total += thing.shape.num_elements() * thing.dtype.size
    return total / 2**20


def peak_memory(model_name, config, steps):
    """Runs one fit in this process; prints, as JSON, the memory of each
    phase (`_MemoryProbe`), the variables created by the fit (MB) and the
    weights' size (MB)."""
    import json

    keras.utils.set_random_seed(0)
    model, shape, batch = _model(model_name)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(batch * steps, *shape)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, batch * steps)
    variables_before = _variable_megabytes()  # before the taps: their buffers count
    fitted = kerasdbg.insert_taps(model, tap=TapLayer(every_n_steps=TAP_EVERY)) if (
        config.startswith("taps")) else model
    probe = _MemoryProbe()
    with tempfile.TemporaryDirectory() as log_dir:
        callbacks = _callbacks(config, log_dir)
        fitted.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                   callbacks=callbacks + [probe])
        # While the callbacks are alive: the variables they keep.
        variables = _variable_megabytes() - variables_before
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables) / 2**20
    print(json.dumps({"phases": probe.phases, "samples": probe.samples,
                      "variables": variables, "weights": weights,
                      "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def memory(model_name, configs, steps):
    import json

    found = {}
    for config in configs:
        out = subprocess.run([sys.executable, __file__, "--peak-memory", model_name, config,
                              str(steps)], capture_output=True, text=True, check=True)
        found[config] = json.loads(out.stdout.strip().splitlines()[-1])
    weights = found["plain"]["weights"]
    plain = found["plain"]
    print(f"\n{BACKEND}: {model_name}: memory of one fit of {steps} steps, in MB; weights {weights:.1f} MB. "
          "Each column is the configuration's value minus plain's (in weight copies).")
    print(f"  {'configuration':16s} {'peak':>15s} {'variables':>15s} {'before step 1':>15s} "
          f"{'peak at step 1':>15s} {'end (resident)':>15s}")

    def cell(value):
        return f"{value:7.1f} ({value / weights:4.1f})"

    print(f"  {'plain':16s} {plain['peak']:15.1f} {plain['variables']:15.1f} "
          f"{plain['phases']['before_first_step']['VmRSS']:15.1f} "
          f"{plain['phases']['after_first_step']['VmHWM']:15.1f} "
          f"{plain['phases']['end']['VmRSS']:15.1f}")
    for config in configs:
        if config == "plain":
            continue
        mine = found[config]
        print(f"  {config:16s} {cell(mine['peak'] - plain['peak']):>15s} "
              f"{cell(mine['variables'] - plain['variables']):>15s} "
              f"{cell(mine['phases']['before_first_step']['VmRSS'] - plain['phases']['before_first_step']['VmRSS']):>15s} "
              f"{cell(mine['phases']['after_first_step']['VmHWM'] - plain['phases']['after_first_step']['VmHWM']):>15s} "
              f"{cell(mine['phases']['end']['VmRSS'] - plain['phases']['end']['VmRSS']):>15s}")
    if len(plain["samples"]) >= 2:
        # A long fit: the resident memory from its 1000th batch on, and its growth.
        print(f"\n  resident memory (MB) every {_MemoryProbe.SAMPLE_EVERY} batches, and its growth "
              f"from batch {plain['samples'][0][0]} to the end (MB per 1000 batches)")
        for config in configs:
            samples = found[config]["samples"]
            first, last = samples[0], samples[-1]
            growth = 1000 * (last[1] - first[1]) / max(last[0] - first[0], 1)
            print(f"  {config:16s} " + " ".join(f"{rss:7.1f}" for _, rss in samples)
                  + f"   growth {growth:+.2f}")


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--peak-memory":
        peak_memory(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet50"], choices=["mlp", "cnn", "resnet50"])
    parser.add_argument("--spe", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--mlp-steps", type=int, default=480)
    parser.add_argument("--cnn-steps", type=int, default=320)
    parser.add_argument("--resnet-steps", type=int, default=48)
    parser.add_argument("--memory", action="store_true",
                        help="peak RSS of one fit per configuration, each in its own process")
    args = parser.parse_args()
    configs = ["plain"] + [c for c in args.configs if c != "plain"]
    if BACKEND == "jax":
        left_out = [c for c in configs if c not in JAX_CONFIGS]
        if left_out:
            print(f"jax: left out (JAX's capture refuses them): {', '.join(left_out)}")
        configs = [c for c in configs if c in JAX_CONFIGS]
    elif BACKEND != "tensorflow":
        sys.exit(f"bench_statistics: the {BACKEND} backend has no capture; "
                 "run it with KERAS_BACKEND=tensorflow or jax.")
    if args.memory:
        for model_name in args.models:
            memory(model_name, configs, {"mlp": args.mlp_steps, "cnn": args.cnn_steps}.get(
                model_name, args.resnet_steps))
        return
    for model_name in args.models:
        for spe in args.spe:
            steps = {"mlp": args.mlp_steps, "cnn": args.cnn_steps}.get(model_name, args.resnet_steps)
            steps = max(steps, 4 * spe)
            report(model_name, spe, bench(model_name, spe, steps, args.repeats, configs), configs)


if __name__ == "__main__":
    main()
