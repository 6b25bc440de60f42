"""One worker of a test cluster: `python -m tests.multiworker.worker OUT SCENARIO...`.

Creates a `MultiWorkerMirroredStrategy` from `TF_CONFIG` (one per process:
TensorFlow configures collectives once), then runs each scenario in turn and
writes what it saw to `OUT/worker_<i>/<scenario>.json`: weights, histories,
records, verdicts, printed lines, warnings and the files it wrote. A scenario
that raises writes its error instead, and the worker goes on.
"""

import contextlib
import io
import json
import os
import sys
import traceback
import warnings

import numpy as np
import tensorflow as tf

STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402  (after the strategy: collectives first)

import kerasdbg  # noqa: E402
from tests.helpers import BATCH, LEARNING_RATE, X, Y, PerReplicaUpdates  # noqa: E402

TASK = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
OUT = sys.argv[1]
NAN_ROW = 2 * BATCH + BATCH - 2
"""A row of the third global batch in the second worker's half of it."""


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return _jsonable(value.tolist())
    if isinstance(value, float) and not np.isfinite(value):
        return repr(value)
    return value


def _frame(frame):
    return {column: frame[column].tolist() for column in frame.columns}


def _model(layers=()):
    """tests.helpers.make_mlp as a Functional model, with `layers` after `hidden`."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(5, activation="relu", name="hidden")(inputs)
    for layer in layers:
        x = layer(x)
    outputs = keras.layers.Dense(3, name="out")(x)
    return keras.Model(inputs, outputs)


def _compiled(layers=(), spe=1, jit=False):
    with STRATEGY.scope():
        model = _model(layers)
        model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe,
                      jit_compile=jit)
    return model


def _data(x=X, y=Y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def _files(directory):
    found = []
    for root, _, names in os.walk(directory):
        found += [os.path.relpath(os.path.join(root, n), directory) for n in names]
    return sorted(found)


def _trainable(model):
    """The trainable weights (debug layers keep buffers of their own)."""
    return [v.numpy().tolist() for v in model.trainable_variables]


def _fit(model, callbacks, data=None, epochs=1):
    printed = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
        warnings.simplefilter("always")
        history = model.fit(data if data is not None else _data(), epochs=epochs, verbose=0,
                            callbacks=callbacks)
    return {"history": history.history, "printed": printed.getvalue().splitlines(),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
            # kerasdbg's failures; its diagnoses (DiagnosisWarning, e.g. StepTimer's
            # input-bound on a busy machine) are findings, not failures.
            "failures": [f"{w.category.__name__}: {w.message}" for w in caught
                         if issubclass(w.category, RuntimeWarning)
                         and not issubclass(w.category, kerasdbg.rules.DiagnosisWarning)],
            "final": _trainable(model)}


# ------------------------------------------------------------ scenarios
def plain(spe):
    model = _compiled(spe=spe)
    initial = _trainable(model)
    return dict(_fit(model, []), initial=initial)


def instruments(spe, name, jit=False):
    log_dir = os.path.join(OUT, name)
    tap = kerasdbg.layers.TapLayer(name="hidden_tap")
    printer = kerasdbg.layers.PrintLayer(stats=["mean"], summarize=0, output_stream="stdout",
                                         name="hidden_print")
    # A wider buffer in the same gather: histogram and sample rows.
    wide = kerasdbg.layers.TapLayer(stats=["max"], histogram=True, sample_rows=2,
                                    name="hidden_wide_tap")
    model = _compiled([tap, printer, wide], spe=spe, jit=jit)
    initial = _trainable(model)
    gradients = kerasdbg.callbacks.GradientStatistics(log_dir, every_n_steps=1)
    weights = kerasdbg.callbacks.WeightStatistics(log_dir, every_n_steps=1)
    activations = kerasdbg.callbacks.ActivationStatistics(log_dir)
    stop = kerasdbg.callbacks.StopOnRule(log_dir=log_dir)
    recorder = kerasdbg.callbacks.StepRecorder(os.path.join(log_dir, "steps.npz"), steps=[1, 2])
    timer = kerasdbg.callbacks.StepTimer(log_dir)
    result = _fit(model, [gradients, weights, activations, stop, recorder, timer])
    return dict(result, initial=initial, gradients=_frame(gradients.history),
                weights=_frame(weights.history), activations=_frame(activations.history),
                verdicts=[v.reason for v in stop.verdicts], pid=os.getpid(),
                wide_rows=np.asarray(wide.latest_rows).tolist(),
                wide_histogram=np.asarray(wide.latest_histogram[0]).tolist(),
                log_dir=log_dir,
                files=_files(log_dir))


def evaluate_and_predict(spe):
    """evaluate, predict and validation_data through the fixed trainer."""
    model = _compiled(spe=spe)
    initial = _trainable(model)
    result = _fit(model, [kerasdbg.callbacks.GradientStatistics(every_n_steps=1)],
                  data=_data(), epochs=1)
    validation = model.fit(_data(), epochs=1, verbose=0, validation_data=_data()).history
    return dict(result, initial=initial, after_second=_trainable(model),
                evaluated=float(model.evaluate(_data(), verbose=0)),
                predicted=model.predict(_data(), verbose=0).tolist(),
                validation=validation)


def doctor_findings():
    """What `kerasdbg.doctor` says on a worker, without the fix and with it."""
    from kerasdbg.backends.tensorflow import multi_worker_fit

    with STRATEGY.scope():
        model = _model()
        model.compile("sgd", "mse", steps_per_execution=4)
    multi_worker_fit.undo_multi_worker_fit()
    try:
        unfixed = [(f.check, f.fix) for f in kerasdbg.doctor(strategy=STRATEGY, verbose=False)]
        unfixed_spe4 = [f.check for f in kerasdbg.doctor(model=model, strategy=STRATEGY,
                                                         verbose=False)]
    finally:
        kerasdbg.compat.fix_multi_worker_fit()
    fixed = [f.check for f in kerasdbg.doctor(model=model, strategy=STRATEGY, verbose=False)]
    return {"unfixed": unfixed, "unfixed_spe4": unfixed_spe4, "fixed": fixed}


def per_worker_output(spe, name):
    log_dir = os.path.join(OUT, name)
    kerasdbg.compat.set_worker_output("per_worker")
    try:
        # replicas="all": every worker prints its own replica (replica 0 is the chief's).
        printer = kerasdbg.layers.PrintLayer(stats=["mean"], summarize=0, output_stream="stdout",
                                             replicas="all", name="hidden_print")
        model = _compiled([printer], spe=spe)
        gradients = kerasdbg.callbacks.GradientStatistics(log_dir, every_n_steps=1)
        result = _fit(model, [gradients])
    finally:
        kerasdbg.compat.set_worker_output("chief")
    return dict(result, pid=os.getpid(), files=_files(log_dir))


def nan_on_one_shard(spe, name):
    x = X.copy()
    x[NAN_ROW, 0] = np.nan
    model = _compiled(spe=spe)
    initial = _trainable(model)
    stop = kerasdbg.callbacks.StopOnRule(log_dir=os.path.join(OUT, name))
    result = _fit(model, [stop], data=_data(x))
    iterations = int(model.optimizer.iterations.numpy())
    return dict(result, initial=initial, verdicts=[v.reason for v in stop.verdicts],
                steps=[v.step for v in stop.verdicts], iterations=iterations,
                stop_training=bool(model.stop_training))


def skip_on_one_shard(spe, name):
    """The NaN of `nan_on_one_shard`, skipped in the graph (`action="skip"`):
    every worker skips the same step and trains on."""
    x = X.copy()
    x[NAN_ROW, 0] = np.nan
    model = _compiled(spe=spe)
    initial = _trainable(model)
    stop = kerasdbg.callbacks.StopOnRule(kerasdbg.rules.NonFiniteLoss(), action="skip",
                                         log_dir=os.path.join(OUT, name))
    result = _fit(model, [stop], data=_data(x))
    return dict(result, initial=initial, verdicts=[v.reason for v in stop.verdicts],
                skipped=stop.skipped_steps, iterations=int(model.optimizer.iterations.numpy()),
                stop_training=bool(model.stop_training))


def dead_relu(spe, name):
    """A ReLU layer three of whose five units never fire (a bias of -50):
    the taps' records are the cluster's, so DeadReLU stops every worker at
    one step."""
    def bias(shape, dtype=None):
        return tf.constant([-50.0, -50.0, -50.0, 0.0, 0.0], dtype=dtype)

    with STRATEGY.scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(5, activation="relu", name="hidden",
                                    bias_initializer=bias)(inputs)
        tapped = kerasdbg.layers.TapLayer(activation="relu", min_examples=8,
                                          name="hidden_tap")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(3, name="out")(tapped))
        model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe)
    stop = kerasdbg.callbacks.StopOnRule(log_dir=os.path.join(OUT, name))
    activations = kerasdbg.callbacks.ActivationStatistics()
    class ChiefReads(keras.callbacks.Callback):
        """Reads the records on the chief alone, mid-fit: must not wait for worker 1."""

        def on_train_batch_end(self, batch, logs=None):
            if TASK == 0:
                self.seen = len(activations.history) + len(activations.latest)

    result = _fit(model, [activations, stop, ChiefReads()])
    return dict(result, verdicts=[v.reason for v in stop.verdicts],
                steps=[v.step for v in stop.verdicts], stop_training=bool(model.stop_training),
                iterations=int(model.optimizer.iterations.numpy()),
                activations=_frame(activations.history))


def tap_read_fails(spe, name):
    """Worker 1 cannot read its tap's buffers: both workers' taps stop
    recording together (no worker waits in a gather the other left) and
    training goes on."""
    from kerasdbg.backends.tensorflow import buffers as _buffers

    tap = kerasdbg.layers.TapLayer(name="hidden_tap")
    model = _compiled([tap], spe=spe)
    initial = _trainable(model)
    original = _buffers.read_replicas

    def failing(buffer, column=None):
        if TASK == 1 and tap._ring is not None and buffer is tap._ring.rows:
            raise OSError("the test's read failure")
        return original(buffer, column)

    _buffers.read_replicas = failing
    try:
        activations = kerasdbg.callbacks.ActivationStatistics()
        result = _fit(model, [activations])
    finally:
        _buffers.read_replicas = original
    return dict(result, initial=initial, activations=_frame(activations.history))


def replicas_drift(spe, name):
    """A train step that applies each worker's own gradient: the replica
    rule must stop both workers at the same comparison."""
    with STRATEGY.scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(5, activation="relu", name="hidden")(inputs)
        model = PerReplicaUpdates(inputs, keras.layers.Dense(3, name="out")(hidden))
        model.broken_from = 3
        model.steps_done = keras.Variable(0, dtype="int32", trainable=False,
                                          aggregation="only_first_replica")
        model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe)
    stop = kerasdbg.callbacks.StopOnRule(
        [kerasdbg.rules.ReplicaConsistency(every_n_steps=2)], log_dir=os.path.join(OUT, name))
    result = _fit(model, [stop])
    return dict(result, verdicts=[v.reason for v in stop.verdicts],
                steps=[v.step for v in stop.verdicts], stop_training=bool(model.stop_training))


SCENARIOS = {
    "replicas_drift_spe1": lambda: replicas_drift(1, "replicas_drift_spe1"),
    "evaluate_predict_spe1": lambda: evaluate_and_predict(1),
    "doctor": doctor_findings,
    "plain_spe1": lambda: plain(1),
    "instruments_spe1": lambda: instruments(1, "instruments_spe1"),
    "per_worker_spe1": lambda: per_worker_output(1, "per_worker_spe1"),
    "nan_on_one_shard_spe1": lambda: nan_on_one_shard(1, "nan_on_one_shard_spe1"),
    "plain_spe4": lambda: plain(4),
    "instruments_spe4": lambda: instruments(4, "instruments_spe4"),
    "nan_on_one_shard_spe4": lambda: nan_on_one_shard(4, "nan_on_one_shard_spe4"),
    "replicas_drift_spe4": lambda: replicas_drift(4, "replicas_drift_spe4"),
    "evaluate_predict_spe4": lambda: evaluate_and_predict(4),
    # TensorFlow fails this on CPU; run last, in case it leaves the collectives unusable.
    "instruments_spe4_xla": lambda: instruments(4, "instruments_spe4_xla", jit=True),
    "tap_read_fails_spe1": lambda: tap_read_fails(1, "tap_read_fails_spe1"),
    "skip_on_one_shard_spe1": lambda: skip_on_one_shard(1, "skip_on_one_shard_spe1"),
    "skip_on_one_shard_spe4": lambda: skip_on_one_shard(4, "skip_on_one_shard_spe4"),
    "dead_relu_spe1": lambda: dead_relu(1, "dead_relu_spe1"),
    "dead_relu_spe4": lambda: dead_relu(4, "dead_relu_spe4"),
}


def main(names):
    kerasdbg.compat.fix_multi_worker_fit()
    folder = os.path.join(OUT, f"worker_{TASK}")
    os.makedirs(folder, exist_ok=True)
    for name in names:
        try:
            result = SCENARIOS[name]()
        except Exception as error:  # noqa: BLE001 - reported to the test
            result = {"error": f"{type(error).__name__}: {error}",
                      "traceback": traceback.format_exc()}
        with open(os.path.join(folder, f"{name}.json"), "w") as handle:
            json.dump(_jsonable(result), handle)
        print(f"worker {TASK}: {name} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[2:])
    # Every result is on disk: skip TensorFlow's teardown, which can crash
    # natively after a failed XLA compilation of a collective.
    sys.stdout.flush()
    os._exit(0)
