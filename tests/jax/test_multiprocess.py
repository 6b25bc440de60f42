"""Multi-process JAX (`jax.distributed`, two local CPU processes): one writer,
the statistics of the global gradient, a NaN in one process's shard stops
both at its step.

Each case starts two Python processes that join one JAX cluster over gloo on
127.0.0.1 (a free port), train the same model under `DataParallel` over the
cluster's two devices, each on its own shard of every batch, and save what
the test compares: the expected values come from `jax.value_and_grad` of
`model.stateless_call` here, on both shards' rows of the first batch.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import keras
import numpy as np

from kerasdbg import load_run

BATCH, STEPS, BAD = 16, 6, 4  # rows per process and step; the step whose batch holds a NaN

WORKER = textwrap.dedent("""
    import json, os, sys, warnings
    os.environ["KERAS_BACKEND"] = "jax"
    port, index, out, nan = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "nan"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=index, initialization_timeout=60)
    import keras, numpy as np
    from kerasdbg.callbacks import GradientStatistics, StopOnRule

    distribution = keras.distribution.DataParallel(devices=jax.devices())
    distribution.auto_shard_dataset = False  # each process feeds its own shard
    keras.distribution.set_distribution(distribution)
    BATCH, STEPS, BAD = %d, %d, %d
    rng = np.random.default_rng(10 + index)
    x = rng.normal(size=(BATCH * STEPS, 6)).astype("float32")
    y = (x[:, :2].sum(1, keepdims=True)).astype("float32")
    if nan and index == 1:
        x[(BAD - 1) * BATCH + 3, 2] = np.nan  # one row of process 1's shard of step BAD

    def make():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
        return model

    def fit(model, callbacks):
        return model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                         callbacks=callbacks)

    result = {}
    if not nan:
        plain = make()
        fit(plain, [])
        result["plain"] = [w.tolist() for w in plain.get_weights()]
    model = make()
    result["start"] = [w.tolist() for w in model.get_weights()]
    gradients = GradientStatistics(os.path.join(out, "run"))
    stop = StopOnRule(log_dir=os.path.join(out, "run"), verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, [gradients, stop])
    result["warnings"] = [str(w.message) for w in caught if "kerasdbg" in str(w.message)]
    result["weights"] = [w.tolist() for w in model.get_weights()]
    result["x"] = x[:BATCH].tolist()
    result["y"] = y[:BATCH].tolist()
    result["steps"] = [int(s) for s in gradients.history["step"]]
    result["norms"] = {c: float(gradients.history[c].iloc[0])
                       for c in gradients.history.columns if c.endswith("/l2_norm")}
    result["verdicts"] = [(v.rule, int(v.step)) for v in stop.verdicts]
    with open(os.path.join(out, f"result_{index}.json"), "w") as stream:
        json.dump(result, stream)
""" % (BATCH, STEPS, BAD))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cluster(tmp_path, nan: bool):
    """Runs the two processes to the end (bounded); returns their results."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # On CPUs whatever the machine: on a one-GPU machine both processes took the
    # GPU (NCCL: "Duplicate GPU detected").
    # Read after every execution: each process stops after the NaN's execution.
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", KERASDBG_READ_INTERVAL="0",
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    port = _free_port()
    processes = [subprocess.Popen(
        [sys.executable, str(script), str(port), str(index), str(tmp_path),
         "nan" if nan else "healthy"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for index in (0, 1)]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=240)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    return [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in (0, 1)]


def test_two_jax_processes_record_the_global_gradient_once_with_one_writer(tmp_path):
    results = run_cluster(tmp_path, nan=False)
    for result in results:
        assert result["steps"] == list(range(1, STEPS + 1))
        # Training bitwise what plain Keras does in the same cluster.
        for a, b in zip(result["plain"], result["weights"]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert result["verdicts"] == []
    # Both processes hold the same records: the global step's.
    assert results[0]["norms"] == results[1]["norms"]
    # One writer: process 0 writes, process 1 says once that it does not.
    assert results[0]["warnings"] == []
    assert len(results[1]["warnings"]) == 2, results[1]["warnings"]
    assert all("worker_1 of 2 writes nothing" in w for w in results[1]["warnings"])
    run = load_run(str(tmp_path / "run"))
    steps = run.scalars(r"gradients/.*/l2_norm").groupby("tag")["step"].apply(list)
    assert all(s == list(range(1, STEPS + 1)) for s in steps), steps  # once per step
    # The global gradient of step 1: both shards' rows, by jax.value_and_grad.
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    trainable = [jnp.asarray(np.asarray(w, "float32")) for w in results[0]["start"]]
    x = np.concatenate([np.asarray(r["x"], "float32") for r in results])
    y = np.concatenate([np.asarray(r["y"], "float32") for r in results])

    def loss(weights):
        prediction, _ = model.stateless_call(weights, [], x)
        return jnp.mean(jnp.square(prediction - y))

    _, grads = jax.value_and_grad(loss)(trainable)
    # The recorded columns, in the variables' order: kernel and bias of each layer.
    recorded = list(results[0]["norms"].values())
    assert len(recorded) == len(grads)
    for got, gradient in zip(recorded, grads):
        np.testing.assert_allclose(got, np.linalg.norm(np.asarray(gradient, np.float64)),
                                   rtol=1e-5)


def test_a_nan_in_one_processs_shard_stops_both_at_its_step(tmp_path):
    results = run_cluster(tmp_path, nan=True)
    for result in results:
        assert ("NonFiniteLoss", BAD) in [tuple(v) for v in result["verdicts"]]
        assert result["steps"][-1] == BAD
    # The same weights in both processes: those of the step before the NaN.
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
