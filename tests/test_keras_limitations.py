"""The Keras failures the matrix marks as xfail, shown on plain Keras without kerasdbg.

Each strict xfail in the suite stands for one of these: if a Keras upgrade fixes one, this
test fails and the xfail (strict) turns into an unexpected pass, both pointing here.
"""

import pytest
import tensorflow as tf

from tests.conftest import MIRRORED_COLLECTIVE_PATTERN, MIRRORED_JIT_PATTERN, make_strategy
from tests.helpers import BATCH, X, Y, make_mlp


def _plain_fit(strategy, spe, jit):
    with strategy.scope():
        model = make_mlp()
        model.compile("sgd", "mse", steps_per_execution=spe, jit_compile=jit)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def test_plain_keras_fails_mirrored_with_jit_compile():
    with pytest.raises(tf.errors.InvalidArgumentError, match=MIRRORED_JIT_PATTERN):
        _plain_fit(make_strategy("mirrored"), spe=1, jit=True)


def test_plain_keras_fails_mirrored_collective_with_steps_per_execution():
    # keras-team/keras#19246
    with pytest.raises(tf.errors.InvalidArgumentError, match=MIRRORED_COLLECTIVE_PATTERN):
        _plain_fit(make_strategy("mirrored", collective=True), spe=4, jit=False)


def test_the_workaround_runs_plain_keras_mirrored_with_steps_per_execution():
    _plain_fit(make_strategy("mirrored"), spe=4, jit=False)  # ReductionToOneDevice
