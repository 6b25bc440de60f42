"""PrintLayer and TapLayer in fit across the execution matrix, against NumPy."""

import re

import keras
import numpy as np
import pytest

from kerasdbg.layers import PrintLayer, TapLayer
from tests.conftest import make_strategy, matrix, only_upstream_failure, reference_stats
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training

STEPS = 10  # 80 samples, batch 8: with steps_per_execution 4 the last execution is partial


def _tapped_mlp(print_path):
    mlp = make_mlp()
    hidden, out = mlp.get_layer("hidden"), mlp.get_layer("out")
    inputs = keras.Input((6,))
    h = hidden(inputs)
    h = TapLayer(activation="relu", stats=list(reference_stats([1.0]).keys()), name="tap")(h)
    h = PrintLayer("hidden", stats=["mean", "max"], summarize=2, output_stream=print_path,
                   name="print")(h)
    return keras.Model(inputs, out(h), name="tapped"), mlp


def _expected_hidden(reference, step, replicas):
    """relu(x @ W0 + b0) of the batch of `step` (1-based), replica 0's slice."""
    weights = reference[step - 1]["before"]
    i = (step - 1) % (len(X) // BATCH)
    xb = X[i * BATCH:(i + 1) * BATCH]
    hidden = np.maximum(xb @ weights[0] + weights[1], 0)
    return hidden[: BATCH // replicas]


@pytest.mark.parametrize("strategy_name, spe, jit", matrix())
def test_tap_and_print_record_every_step_with_reference_values(tmp_path, strategy_name, spe, jit):
    strategy = make_strategy(strategy_name)
    print_path = str(tmp_path / "print.txt")
    with strategy.scope():
        model, mlp = _tapped_mlp(print_path)
        model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe,
                      jit_compile=jit)
    initial = [w.numpy() for w in mlp.weights]
    with only_upstream_failure(strategy_name, jit):
        model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    reference = reference_training(initial, STEPS)
    replicas = strategy.num_replicas_in_sync

    history = model.get_layer("tap").history
    assert history.step.tolist() == list(range(1, STEPS + 1))
    assert set(history["mode"]) == {"fit"}
    for _, row in history.iterrows():
        hidden = _expected_hidden(reference, int(row.step), replicas)
        want = reference_stats(hidden)
        for name, value in want.items():
            np.testing.assert_allclose(row[name], value, rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {row.step} {name}")
        dead = float(np.mean(np.all(hidden == 0, axis=0)))
        assert row["dead_fraction"] == pytest.approx(dead), row.step

    lines = open(print_path).read().splitlines()
    assert len(lines) == STEPS
    for step, line in enumerate(lines, start=1):
        match = re.fullmatch(
            rf"kerasdbg fit step {step} replica 0 \| hidden \| shape \({BATCH // replicas}, 5\) "
            r"\| mean=(\S+) max=(\S+) \| \[(.*)\]", line)
        assert match, line
        hidden = _expected_hidden(reference, step, replicas)
        np.testing.assert_allclose(float(match[1]), hidden.mean(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(match[2]), hidden.max(), rtol=1e-5, atol=1e-6)
        shown = match[3].split(" ")
        flat = hidden.ravel()
        assert shown[2] == "..."
        np.testing.assert_allclose([float(v) for v in shown[:2] + shown[3:]],
                                   np.concatenate([flat[:2], flat[-2:]]), rtol=1e-5, atol=1e-6)
