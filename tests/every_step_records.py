"""A long fit with the default schedule, read back through every sink, for both backends.

Shared by tests/test_every_step_records.py (TensorFlow) and
tests/jax/test_every_step_records.py (JAX): nothing here imports a backend.

The fit runs 120 optimizer steps (two epochs of 60) of a small ReLU MLP with
the default schedule, so that the full statistics come at steps 1-10, 50 and
100 and the every-step ones (the l2 norms, the NaN/Inf counts, the global
norm, the loss, the taps) at each step, mixed in the same reads. What each
sink holds is checked against the steps the schedule names (written out
here, not taken from kerasdbg), against TensorBoard's own reader of the event
file, and against NumPy: the weights come from a plain model trained batch by
batch (`train_on_batch`), and the gradients, the loss and the activations of
each step are computed in float64 from the weights before it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Dict, List

import keras
import numpy as np
from tensorboard.backend.event_processing import event_accumulator

import kerasdbg
from kerasdbg.callbacks import (
    ActivationStatistics, GradientStatistics, StepTimer, StopOnRule, WeightStatistics,
)

BATCH, PER_EPOCH, EPOCHS = 8, 60, 2
STEPS = PER_EPOCH * EPOCHS
ALL_STEPS = list(range(1, STEPS + 1))
SCHEDULED = list(range(1, 11)) + [50, 100]
"""The default schedule's full statistics within 120 steps (steps 1-10, then every 50th)."""
EVERY_STEP = ("l2_norm", "nan_count", "inf_count")
PATHS = ("m/h/kernel", "m/h/bias", "m/o/kernel", "m/o/bias")

_rng = np.random.default_rng(11)
X = _rng.normal(size=(BATCH * PER_EPOCH, 4)).astype("float32")
Y = (X[:, :2].sum(1, keepdims=True) + 0.3 * _rng.normal(size=(BATCH * PER_EPOCH, 1))
     ).astype("float32")

HISTOGRAMS = 7
"""`GradientStatistics`' histograms, with all the instruments: between the scalars' rows."""
INSTRUMENTS = ("gradients", "weights", "stop", "taps", "all", "all+keras")
"""Each instrument alone, all of them (with `StepTimer`), and all of them beside
Keras's own callbacks (which make the callback list synchronous)."""


def make_model(spe: int, taps: bool, jit_compile="auto") -> keras.Model:
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(3, activation="relu", name="h"),
                              keras.layers.Dense(1, name="o")], name="m")
    if taps:
        model = kerasdbg.insert_taps(model)
    model.compile(keras.optimizers.Adam(0.01), "mse", steps_per_execution=spe,
                  jit_compile=jit_compile)
    return model


def reference() -> List[List[np.ndarray]]:
    """The weights after each of the 120 steps of plain Keras (index 0: before
    the first), `[kernel h, bias h, kernel o, bias o]` each."""
    model = make_model(1, taps=False)
    weights = [model.get_weights()]
    for _ in range(EPOCHS):
        for start in range(0, len(X), BATCH):
            model.train_on_batch(X[start:start + BATCH], Y[start:start + BATCH])
            weights.append(model.get_weights())
    return weights


def batch(step: int):
    start = ((step - 1) % PER_EPOCH) * BATCH
    return X[start:start + BATCH].astype(np.float64), Y[start:start + BATCH].astype(np.float64)


def forward_and_gradients(weights, step: int):
    """NumPy, float64: the loss of `step`'s batch on `weights`, the layers'
    outputs and the gradients (`PATHS`' order), by hand."""
    w1, b1, w2, b2 = (np.asarray(w, np.float64) for w in weights)
    x, y = batch(step)
    pre = x @ w1 + b1
    hidden = np.maximum(pre, 0.0)
    out = hidden @ w2 + b2
    loss = float(np.mean((out - y) ** 2))
    d_out = 2.0 * (out - y) / out.size
    d_pre = (d_out @ w2.T) * (pre > 0)
    grads = [x.T @ d_pre, d_pre.sum(0), hidden.T @ d_out, d_out.sum(0)]
    return loss, {"h_tap": hidden, "o_tap": out}, grads


def callbacks(which: str, log_dir: str) -> list:
    made = {
        "gradients": lambda: [GradientStatistics(log_dir)],
        "weights": lambda: [WeightStatistics(log_dir)],
        "stop": lambda: [StopOnRule(log_dir=log_dir)],
        "taps": lambda: [ActivationStatistics(log_dir)],
    }
    if which in made:
        return made[which]()
    every = [GradientStatistics(log_dir, histogram_every_n_steps=HISTOGRAMS),
             WeightStatistics(log_dir), StopOnRule(log_dir=log_dir),
             ActivationStatistics(log_dir), StepTimer(log_dir)]
    if which == "all+keras":
        every += [keras.callbacks.EarlyStopping("loss", patience=5),
                  keras.callbacks.ReduceLROnPlateau("loss", patience=5),
                  keras.callbacks.ModelCheckpoint(os.path.join(log_dir, "m.keras")),
                  keras.callbacks.CSVLogger(os.path.join(log_dir, "log.csv")),
                  keras.callbacks.TerminateOnNaN()]
    return every


def _tensorboard(run_dir: str) -> Dict[str, Dict[int, float]]:
    """Every scalar of the event files, as TensorBoard's reader gives them."""
    accumulator = event_accumulator.EventAccumulator(
        run_dir, size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    out: Dict[str, Dict[int, float]] = {}
    for tag in accumulator.Tags()["scalars"]:
        events = accumulator.Scalars(tag)
        out[tag] = {e.step: e.value for e in events}
        assert len(out[tag]) == len(events), f"{tag}: a step written twice"
    return out


def _close(got, want, what, rtol=2e-4, scale=1.0):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6 * scale, err_msg=what)


def read_back(log_dir: str):
    """`(recorded, board)`: `{tag: {step: value}}` of every scalar `load_run`
    reads, and of every one TensorBoard's reader finds in the event files,
    after checking that they agree tag by tag and step by step (TensorBoard's
    holding the values as float32), that TensorBoard has no tag but the
    views beside them, and that the reader sees no rollback."""
    run = kerasdbg.load_run(log_dir)
    frame = run.scalars(".*", run="train")
    recorded = {tag: dict(zip(part.step.tolist(), part.value.tolist()))
                for tag, part in frame.groupby("tag")}
    assert run.rollbacks().empty, run.rollbacks()

    # load_run holds what TensorBoard reads from the event file, tag by tag.
    board = _tensorboard(os.path.join(log_dir, "train"))
    for tag, values in recorded.items():
        assert sorted(values) == sorted(board.get(tag, {})), tag
        got = np.float32(list(values.values()))
        want = np.float32([board[tag][s] for s in values])
        np.testing.assert_array_equal(got, want, err_msg=tag)
    views = set(board) - set(recorded)
    assert all(tag.startswith("views/") for tag in views), sorted(views)

    return recorded, board


def assert_schedule(recorded, every_step: List[int], scheduled: List[int]) -> None:
    """The gradients' and weights' l2 norms, NaN/Inf counts and global norms
    at `every_step`, their other statistics at `scheduled`; the steps' own
    values and the taps' at `every_step`."""
    for tag, values in recorded.items():
        kind, statistic = tag.split("/")[0], tag.rsplit("/", 1)[1]
        if kind in ("gradients", "weights"):
            every = statistic in EVERY_STEP + ("global_norm",)
            assert sorted(values) == (every_step if every else scheduled), tag
        elif kind in ("step", "activations"):
            assert sorted(values) == every_step, tag


def check(which: str, spe: int, weights: List[List[np.ndarray]], jit_compile="auto") -> None:
    """Fits with the instruments `which` at `spe` and checks every sink."""
    log_dir = tempfile.mkdtemp(prefix="kerasdbg-every-step-")
    try:
        _check(which, spe, weights, log_dir, jit_compile)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def _check(which: str, spe: int, weights, log_dir: str, jit_compile) -> None:
    taps = which not in ("gradients", "weights", "stop")
    model = make_model(spe, taps, jit_compile)
    instruments = callbacks(which, log_dir)
    model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=instruments)
    # Training was plain Keras's, bitwise.
    plain = make_model(spe, False, jit_compile)
    plain.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    trained = [keras.ops.convert_to_numpy(v.value) for v in model.trainable_variables]
    assert len(trained) == len(weights[-1])
    for got, want in zip(trained, plain.get_weights()):
        np.testing.assert_array_equal(got, want)

    recorded, board = read_back(log_dir)

    # Each tag at exactly the steps it is recorded at.
    expected_tags = set()
    if which in ("gradients", "all", "all+keras"):
        expected_tags.add("gradients")
    if which in ("weights", "all", "all+keras"):
        expected_tags.add("weights")
    if which in ("stop", "all", "all+keras"):
        expected_tags.add("step")
    if taps:
        expected_tags.add("activations")
    assert expected_tags <= {tag.split("/")[0] for tag in recorded}, sorted(recorded)
    assert_schedule(recorded, ALL_STEPS, SCHEDULED)
    for tag, values in recorded.items():
        if tag.startswith("time/"):
            assert sorted(values) == list(range(spe, STEPS + 1, spe)), tag
    for view in ("views/gradients/global_norm/log10", "views/step/loss/log10"):
        if view.split("/")[1] in expected_tags:
            assert sorted(board[view]) == ALL_STEPS, view

    if which.startswith("all"):
        histograms = kerasdbg.load_run(log_dir).histograms("gradients/.*", run="train")
        accumulator = event_accumulator.EventAccumulator(
            os.path.join(log_dir, "train"), size_guidance={event_accumulator.TENSORS: 0})
        accumulator.Reload()
        assert sorted(set(histograms.tag)) == [f"gradients/{p}" for p in sorted(PATHS)]
        for tag, part in histograms.groupby("tag"):
            assert part.step.tolist() == list(range(HISTOGRAMS, STEPS + 1, HISTOGRAMS)), tag
            assert [e.step for e in accumulator.Tensors(tag)] == part.step.tolist(), tag

    # The values of every step against NumPy.
    for step in ALL_STEPS:
        loss, outputs, grads = forward_and_gradients(weights[step - 1], step)
        after = weights[step]
        full = step in SCHEDULED
        if "gradients" in expected_tags:
            total = np.sqrt(sum(np.sum(g ** 2) for g in grads))
            _close(recorded["gradients/global_norm"][step], total, f"global norm {step}")
            for path, grad in zip(PATHS, grads):
                _statistics(recorded, f"gradients/{path}", grad, step, full)
        if "weights" in expected_tags:
            for k, path in enumerate(PATHS):
                _statistics(recorded, f"weights/{path}", after[k], step, full)
                if full:
                    now, before = (np.asarray(w[k], np.float64) for w in (after, weights[step - 1]))
                    moved = np.linalg.norm(now - before)
                    base = np.linalg.norm(before)
                    ratio = moved / base if base else (np.inf if moved else 0.0)
                    _close(recorded[f"weights/{path}/update_ratio"][step], ratio, f"{path} ratio")
                    start = np.asarray(weights[0][k], np.float64)
                    _close(recorded[f"weights/{path}/distance_from_start"][step],
                           np.linalg.norm(now - start), f"{path} distance", scale=10)
        if "step" in expected_tags:
            _close(recorded["step/loss"][step], loss, f"loss at {step}", rtol=1e-5)
            assert recorded["step/frozen"][step] == 0 and recorded["step/fault"][step] == 0
        if taps:
            for tap, value in outputs.items():
                for statistic, want in (("mean", value.mean()), ("max", value.max()),
                                        ("min", value.min())):
                    _close(recorded[f"activations/{tap}/{statistic}"][step], want,
                           f"{tap} {statistic} at {step}", scale=np.abs(value).max())

    # The statistics callbacks' history: every step, the full statistics at the scheduled ones.
    for callback in instruments:
        if isinstance(callback, (GradientStatistics, WeightStatistics)):
            history = callback.history.set_index("step")
            assert history.index.tolist() == ALL_STEPS
            for path in PATHS:
                assert history[f"{path}/l2_norm"].notna().all(), path
                assert history.index[history[f"{path}/mean"].notna()].tolist() == SCHEDULED


def _statistics(recorded, prefix: str, value, step: int, full: bool) -> None:
    value = np.asarray(value, np.float64)
    scale = max(float(np.abs(value).max()), 1e-12)
    _close(recorded[f"{prefix}/l2_norm"][step], np.linalg.norm(value), f"{prefix} {step}",
           scale=scale)
    assert recorded[f"{prefix}/nan_count"][step] == recorded[f"{prefix}/inf_count"][step] == 0
    if full:
        for statistic, want in (("mean", value.mean()), ("std", value.std()),
                                ("min", value.min()), ("max", value.max()),
                                ("mean_abs", np.abs(value).mean())):
            _close(recorded[f"{prefix}/{statistic}"][step], want, f"{prefix}/{statistic} {step}",
                   scale=scale)


def assert_full_statistics_at_a_redone_scheduled_step() -> None:
    """A loss scaler skips step 50 (a batch that overflows float16) and the
    next batch makes step 50 again; with a read after every execution the
    host has just read the skipped step 50: the full statistics must still
    come at the redone step 50, and only at the scheduled steps (the caller
    sets mixed_float16)."""
    import kerasdbg
    from kerasdbg.callbacks import GradientStatistics

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    # A loss scale of 1: no overflow but the planted one.
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                                      initial_scale=1.0), "mse",
                  jit_compile=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(70 * 4, 4)).astype("float32")
    y = rng.normal(size=(70 * 4, 1)).astype("float32")
    x[49 * 4:50 * 4] = 6e4  # batch 50: the scaled loss overflows float16
    gradients = GradientStatistics()
    kerasdbg.set_read_interval(0)
    try:
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[gradients])
    finally:
        kerasdbg.set_read_interval(None)
    history = gradients.history
    skipped = history[history["skipped"]]["step"].tolist()
    assert skipped == [50], skipped
    kept = history[~history["skipped"]]
    full = kept["step"][kept.filter(like="/mean").notna().all(axis=1)].tolist()
    assert full == list(range(1, 11)) + [50], full
