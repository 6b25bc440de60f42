"""What kerasdbg adds under MultiWorkerMirroredStrategy: collectives per step
and step time, on two worker processes of this machine.

    python bench/bench_multi_worker.py [--rounds 7] [--steps 40] [--spe 1]

Starts two workers (TF_CONFIG on 127.0.0.1, one replica each) that train the
tutorial CNN of the demo with `kerasdbg.compat.fix_multi_worker_fit()`, once
per configuration, interleaved: every round fits each configuration for one
epoch of `--steps` steps. The step time is the median time between batch ends from the 4th step of
a fit on (the steady step; with `--spe` N > 1, between the ends of executions from the second
on, divided by N); the ratios are to plain `fit` in the same round,
with their median (and range) over the rounds, the first round left out.
The first step of each fit is reported apart: kerasdbg's callbacks install
their capture for the fit and remove it after, so each `fit` with them
traces the step again (plain `fit` traces once per model).

Collectives are counted in the functions TensorFlow traced for each
configuration's first fit (the ops `Collective*` of every function that fit
registered, with one replica per worker one op per collective), with the
bytes of their static input shapes; those kerasdbg adds are the difference
to plain `fit`. Host-side gathers (the replica comparison, NaN localisation)
are counted by wrapping `kerasdbg.backends.tensorflow.buffers.gather_workers` during the timed fits.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["plain", "gradients", "weights", "stop", "taps", "all"]
"""plain `fit`; `GradientStatistics` (every step); `WeightStatistics` (every
step); `StopOnRule()` with the default rules; `insert_taps` +
`ActivationStatistics` + `StopOnRule()`; all of them."""


def _ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch(args) -> dict:
    out = tempfile.mkdtemp(prefix="kerasdbg-bench-mw-")
    ports = _ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    processes = []
    for index in range(2):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT,
                   TF_CONFIG=json.dumps({"cluster": cluster,
                                         "task": {"type": "worker", "index": index}}))
        processes.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", out,
             "--rounds", str(args.rounds), "--steps", str(args.steps), "--spe", str(args.spe)],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=3600)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process, output in zip(processes, outputs):
        if process.returncode != 0:
            raise SystemExit(f"a worker failed:\n{output[-5000:]}")
    with open(os.path.join(out, "worker_0.json")) as handle:
        return json.load(handle)


# ------------------------------------------------------------ one worker
def worker(out, rounds, steps, spe):
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    import keras
    from tensorflow.python.eager import context
    from tensorflow.python.framework import function_def_to_graph

    import kerasdbg
    from kerasdbg.demo import make_data, make_model

    kerasdbg.compat.fix_multi_worker_fit()
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    batch = 64  # global
    images, labels = make_data(samples=batch * steps)
    data = tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch)
    logs = tempfile.mkdtemp(prefix=f"kerasdbg-bench-mw-{task}-")

    def build(name):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = make_model()
            if name in ("taps", "all"):
                model = kerasdbg.insert_taps(model)
            model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy",
                          steps_per_execution=spe)
        log_dir = os.path.join(logs, name)
        callbacks = []
        if name in ("gradients", "all"):
            callbacks.append(kerasdbg.callbacks.GradientStatistics(log_dir, every_n_steps=1))
        if name in ("weights", "all"):
            callbacks.append(kerasdbg.callbacks.WeightStatistics(log_dir, every_n_steps=1))
        if name in ("taps", "all"):
            callbacks.append(kerasdbg.callbacks.ActivationStatistics(log_dir))
        if name in ("stop", "taps", "all"):
            # "warn": a verdict must not end the fit being timed (the demo's
            # model has dead ReLU units by design).
            callbacks.append(kerasdbg.callbacks.StopOnRule(log_dir=log_dir, verbose=False,
                                                           action="warn"))
        return model, callbacks

    def collectives(names):
        found = []
        for name in sorted(names):
            try:
                definition = context.context().get_function_def(name)
            except tf.errors.NotFoundError:  # a function TensorFlow already dropped
                continue
            if not any(n.op.startswith("Collective") for n in definition.node_def):
                continue
            try:
                graph = function_def_to_graph.function_def_to_graph(definition)
            except Exception:  # noqa: BLE001 - a function TF cannot rebuild: ops only
                found += [{"op": n.op, "function": name, "bytes": None, "shape": "?",
                           "dtype": "?"} for n in definition.node_def if n.op.startswith("Collective")]
                continue
            for op in graph.get_operations():
                if op.type.startswith("Collective"):
                    tensor = op.inputs[0]
                    elements = tensor.shape.num_elements()
                    found.append({"op": op.type, "function": name,
                                  "bytes": None if elements is None else elements * tensor.dtype.size,
                                  "shape": str(tensor.shape), "dtype": tensor.dtype.name})
        return found

    gathers = {"count": 0, "bytes": 0}
    from kerasdbg.backends.tensorflow import buffers as _buffers
    original_gather = _buffers.gather_workers

    def counting_gather(local, strategy):
        gathers["count"] += 1
        gathers["bytes"] += int(np.asarray(local).nbytes)  # what this worker sends
        return original_gather(local, strategy)

    _buffers.gather_workers = counting_gather

    class Clock(keras.callbacks.Callback):
        """Batch-end times of one fit: the steady step, and the first
        execution (which holds the trace when the fit traces)."""

        def on_train_begin(self, logs=None):
            self.ends = [time.perf_counter()]

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    clock = Clock()
    models, found, times, host = {}, {}, {c: [] for c in CONFIGS}, {}
    first = {c: [] for c in CONFIGS}
    for name in CONFIGS:
        models[name] = build(name)
        before = set(context.context().list_function_names())
        model, callbacks = models[name]
        model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
        found[name] = collectives(set(context.context().list_function_names()) - before)
    for _ in range(rounds):
        for name in CONFIGS:
            model, callbacks = models[name]
            gathers.update(count=0, bytes=0)
            model.fit(data, epochs=1, verbose=0, callbacks=callbacks + [clock])
            steps_taken = np.diff(clock.ends)
            times[name].append(float(np.median(steps_taken[3 if spe == 1 else 1:])) / spe)
            first[name].append(float(steps_taken[0]))
            host.setdefault(name, {"count": 0, "bytes": 0, "fits": 0})
            host[name]["count"] += gathers["count"]
            host[name]["bytes"] += gathers["bytes"]
            host[name]["fits"] += 1
    if task == 0:
        with open(os.path.join(out, "worker_0.json"), "w") as handle:
            json.dump({"collectives": found, "times": times, "first": first,
                       "host_gathers": host,
                       "steps": steps, "batch": batch, "spe": spe,
                       "parameters": int(sum(np.prod(v.shape) for v in models["plain"][0].trainable_variables))},
                      handle)


def step_collectives(ops):
    """The collectives one train step runs: those of the step function, and
    one of each pair of `cond` branches (kerasdbg's freeze moves Keras's
    gradient all-reduce into a cond: either branch runs it, never both)."""
    kept, pairs = [], set()
    for op in ops:
        function = op["function"]
        if "one_step_on_data" in function:
            kept.append(op)
        elif function.startswith("cond_"):
            key = (re.sub(r"_(true|false)_\d+$", "", function), op["shape"], op["dtype"])
            if key not in pairs:
                pairs.add(key)
                kept.append(op)
    return kept


def added_by_kerasdbg(ops, plain):
    """`ops` less one match for each of plain fit's (same dtype; same shape,
    or a shape that is only known at run time)."""
    left = list(ops)
    for mine in plain:
        for i, op in enumerate(left):
            if op["dtype"] == mine["dtype"] and (op["shape"] == mine["shape"] or "None" in
                                                 op["shape"] or "None" in mine["shape"]):
                del left[i]
                break
    return left


def report(result) -> str:
    plain = step_collectives(result["collectives"]["plain"])
    lines = [f"CNN of the demo, {result['parameters']} parameters, global batch "
             f"{result['batch']}, {result['steps']} steps per fit, steps_per_execution "
             f"{result['spe']}, 2 workers x 1 replica, "
             f"{len(result['times']['plain'])} rounds (the first left out)", "",
             f"| configuration | collectives per step | added by kerasdbg | bytes added per step "
             f"| host gathers per fit (mean), bytes each | steady step-time ratio to plain, median (range) "
             f"| first execution of a fit, s |",
             "|---|---|---|---|---|---|---|"]
    times = result["times"]
    for name in CONFIGS:
        ops = step_collectives(result["collectives"][name])
        added = added_by_kerasdbg(ops, plain) if name != "plain" else []
        nbytes = sum(o["bytes"] or 0 for o in added)
        shapes = ", ".join(f"{o['shape']} {o['dtype']}" for o in added) or "none"
        ratios = [t / p for t, p in zip(times[name][1:], times["plain"][1:])]
        gather = result["host_gathers"].get(name, {})
        lines.append(
            f"| {name} | {len(ops)} | {len(added)} ({shapes}) | {nbytes} | "
            f"{gather.get('count', 0) / max(gather.get('fits', 1), 1):.2f}, "
            f"{gather.get('bytes', 0) // max(gather.get('count', 1), 1)} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
            f"{statistics.median(result['first'][name][1:]):.2f} |")
    plain_ms = statistics.median(times["plain"][1:]) * 1e3
    lines.append(f"\nplain step: {plain_ms:.1f} ms (median over the timed rounds)")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=7, help="at least 2 (the first is left out)")
    parser.add_argument("--steps", type=int, default=40, help="steps per fit, at least 5")
    parser.add_argument("--spe", type=int, default=1,
                        help="steps_per_execution (with N > 1, --steps at least 3 N)")
    args = parser.parse_args()
    if args.spe > 1 and (args.steps % args.spe or args.steps < 3 * args.spe):
        parser.error(f"--steps must be a multiple of --spe and at least 3 x --spe; "
                     f"received --steps {args.steps} --spe {args.spe}")
    if args.worker:
        worker(args.worker, args.rounds, args.steps, args.spe)
        return
    print(report(launch(args)))


if __name__ == "__main__":
    main()
