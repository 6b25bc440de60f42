"""The host's choice of the step's variant, call by call (`_Variants`).

After a fit's first read the host works out the calls up to the next read
at once, as arrays (`scheduled_in`), not one call at a time: the choices
are those of the call-by-call rule (`scheduled_between`, `wanted_at`) at
every call, with reads moving the anchors, optimizers with several applies
a call, a loss scaler that skips steps, and every kind of schedule.
"""

import types

import numpy as np
import pytest

from kerasdbg.backends.jax import engine as jax_engine
from kerasdbg.capture.requests import scheduled_between, scheduled_in
from kerasdbg.schedule import Schedule


def random_requests(rng):
    requests = []
    for _ in range(rng.integers(1, 4)):
        last = None if rng.random() < 0.6 else int(rng.integers(1, 400))
        schedule = Schedule(every_n_steps=int(rng.integers(1, 80)),
                            first_steps=int(rng.integers(0, 15)), last_step=last)
        every = 0 if rng.random() < 0.5 else int(rng.integers(1, 60))
        requests.append(types.SimpleNamespace(schedule=schedule, histogram_every_n_steps=every))
    return requests


@pytest.mark.parametrize("seed", range(8))
def test_the_choice_of_many_calls_at_once_is_that_of_each_call(seed):
    rng = np.random.default_rng(seed)
    requests = random_requests(rng)
    low = rng.integers(1, 600, 2000)
    high = low + rng.integers(0, 5, 2000)
    found = scheduled_in(requests, low, high)
    assert found.tolist() == [scheduled_between(requests, int(a), int(b))
                              for a, b in zip(low.tolist(), high.tolist())]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("reads", [0.02, 0.5])
def test_the_window_of_calls_chooses_as_each_call_would(seed, reads):
    rng = np.random.default_rng(100 + seed)
    hooks = {number: types.SimpleNamespace(
        number=number, applies=int(rng.integers(0, 3)),
        scale_index=None if rng.random() < 0.5 else 0) for number in range(rng.integers(1, 3))}
    engine = types.SimpleNamespace(hooks=hooks, _fit_start={
        number: int(rng.integers(0, 30)) for number in hooks})
    variants = jax_engine._Variants(engine, random_requests(rng))
    steps = dict(engine._fit_start)
    windows = 0
    for call in range(1, 1500):
        chosen = variants.wanted()
        windows += variants._window is not None
        assert chosen == variants.wanted_at(call), call
        variants.called()
        for number, hook in hooks.items():
            # A skipped step (a loss scaler's) does not move the optimizer.
            steps[number] += max(hook.applies, 1) - (hook.scale_index is not None and
                                                     rng.random() < 0.1)
        if rng.random() < reads:  # a read: the records say where each optimizer stands
            for number in hooks:
                variants.seen(number, call, steps[number])
    if reads < 0.1:
        assert windows > 600  # most calls chose from a window
    else:
        assert windows < 50  # reads every few calls: call by call
