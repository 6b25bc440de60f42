"""One verdict per run on JAX, whichever way it is read, at `steps_per_execution` > 1.

A verdict decided on the host (`WeightUpdateRatio` after step 2) stops the fit at
the end of its execution: the execution's later steps ran. Their records are all
there (the step's loss as the gradients and weights), and `kerasdbg.check_run` on
the records judges exactly what `StopOnRule` judged online.
"""

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics

RNG = np.random.default_rng(0)
X = RNG.normal(size=(256, 8)).astype("float32")
Y = RNG.integers(0, 3, size=(256,))


@pytest.mark.parametrize("spe", [1, 4])
@pytest.mark.parametrize("rate", [50.0, 5000.0], ids=["ratio-only", "ratio-then-nan"])
def test_online_and_offline_verdicts_and_every_steps_records_agree(tmp_path, spe, rate):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,))] + [
        keras.layers.Dense(16, activation="relu") for _ in range(3)] + [keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(rate),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    log_dir = str(tmp_path)
    stop = StopOnRule(log_dir=log_dir, verbose=False)
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0,
              callbacks=[GradientStatistics(log_dir), WeightStatistics(log_dir), stop])
    online = [(v.rule, v.step, v.severity) for v in stop.verdicts]
    assert ("WeightUpdateRatio", 2, "fault") in online, online
    offline = [(v.rule, v.step, v.severity)
               for v in kerasdbg.check_run(log_dir, stop.rules, skip_missing=True)]
    assert offline == online
    # The steps that ran are recorded whole: the step's loss as its gradients (a step
    # a freeze threw away has no weights row: the weights did not change).
    run = kerasdbg.load_run(log_dir)
    every_step = ("/l2_norm", "/nan_count", "/inf_count", "/global_norm")
    steps = {}
    for tag in run.tags():  # what the default schedule records at every step
        if tag.startswith(("gradients/", "weights/")) and tag.endswith(every_step):
            steps.setdefault(tag.partition("/")[0], set()).add(
                tuple(run.scalars(tag).step.tolist()))
    loss = tuple(run.scalars("step/loss").step.tolist())
    assert steps["gradients"] == {loss}
    [weights] = steps["weights"]
    assert weights == loss[:len(weights)]
    frozen = run.scalars("step/frozen")
    assert weights[-1] == max([s for s, v in zip(frozen.step, frozen.value) if v == 0])
    if rate == 50.0 and spe == 4:
        assert loss == (1, 2, 3, 4)  # stopped at the end of the verdict's execution
