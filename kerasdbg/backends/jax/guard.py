"""The guard of JAX's step: the in-graph spike tests and `action="skip"`.

What `kerasdbg.backends.tensorflow.faults` does at each optimizer apply,
for Keras's stateless JAX step: pure functions over explicit state (optax's
`init` / `update` shape), whose state rides in the engine's `carry`:

- per optimizer and spike test (`Spike`), the window of accepted values and
  how many were accepted (a ring: the oldest value is overwritten);
- per optimizer, the skip and spike flags of its last `skip_window` steps
  (the skip budget, `step/spike_fraction`) and the steps it counted.

With `action="rollback"` the batches after a rollback are skipped by every
apply whatever they hold (`forced`), outside the skip budget, as on
TensorFlow.

`update` takes, for each apply of the train step in order, its fault test
(`Apply`) and decides, as TensorFlow does per apply: the spike tests
against the windows, then `skip = skip_fault & ~stop_fault & ~frozen_before
& (skips among the last skip_window < max_skips)`, else a fault freezes; a
value enters its window only when its apply had no fault of any kind and
the weights were not frozen before it. The engine then returns the state
the step was given for what a skip or a freeze throws away.

Without `jax_enable_x64` JAX has no float64 (it truncates a request with a
warning): the windows hold float32 and their mean and deviation are
float32 sums, where TensorFlow's graph and the host rule
(`kerasdbg.rules.spike_rules`, in float64 from the same recorded float32
values) sum in float64. The decisions differ only for a value within a few
float32 ulps of a threshold (mean + sigmas x std, factor x largest); there
the step and the rule on the records may disagree.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import jax.numpy as jnp

from kerasdbg.capture.requests import MIN_RELATIVE_STD, Freeze, Spike

WINDOWS, FLAGS = "windows", "flags"
"""The keys of the guard's carry."""


class Apply(NamedTuple):
    """The fault test of one optimizer apply of the train step."""

    number: int
    """The optimizer's number (the engine's `_Hook.number`)."""
    nonfinite: object
    """Whether its gradients held NaN/Inf (a fault the freeze watches)."""
    over: Optional[object]
    """Whether their global norm exceeded `max_gradient_norm` (None: no limit)."""
    norm: object
    """Their global norm (unscaled), float32."""


class Outcome(NamedTuple):
    """What `update` decided for one train step."""

    state: dict
    """The guard's new carry."""
    frozen: object
    """Whether the weights are frozen from this step on."""
    fault: object
    """Whether any apply had a fault (a spike, a NaN/Inf, a norm above the limit)."""
    nonfinite: object
    """Whether a fault was a NaN/Inf (of the loss or of gradients)."""
    skips: Dict[int, object]
    """Per optimizer number: whether its step is skipped."""
    values: List[tuple]
    """`(name, number, value)`: `skipped`, `gradient_norm`, `spike_fraction` per apply."""


def armed(freeze: Optional[Freeze]) -> bool:
    """Whether `freeze` arms a spike test, a skip or a rollback's skips."""
    return freeze is not None and bool(freeze.spikes or freeze.skip or freeze.rollback)


def window_key(test: Spike) -> str:
    """The key of a spike test's window, per optimizer (tests of one
    quantity over the same window share it, as on TensorFlow)."""
    return f"{test.quantity}/{test.window}"


def init(freeze: Freeze, kept: Dict[int, dict]) -> dict:
    """The guard's carry for the optimizers numbered in `kept`: each one's
    state kept from an earlier fit (`split`'s, by optimizer), else empty
    windows and flags."""
    windows, flags = {}, {}
    for number, earlier in kept.items():
        for test in freeze.spikes:
            key = window_key(test)
            windows[f"{number}/{key}"] = earlier.get(WINDOWS, {}).get(key) or (
                jnp.zeros([test.window], jnp.float32), jnp.zeros([], jnp.int32))
        flags[str(number)] = earlier.get(FLAGS, {}).get(freeze.skip_window) or (
            jnp.zeros([freeze.skip_window, 2], jnp.int32), jnp.zeros([], jnp.int32))
    return {WINDOWS: windows, FLAGS: flags}


def split(state: dict) -> Dict[int, dict]:
    """The guard's carry by optimizer number, for `init` in a later fit
    (the flags by their `skip_window`)."""
    out: Dict[int, dict] = {}
    for key, value in state[WINDOWS].items():
        number, _, rest = key.partition("/")
        out.setdefault(int(number), {WINDOWS: {}, FLAGS: {}})[WINDOWS][rest] = tuple(value)
    for number, value in state[FLAGS].items():
        skip_window = int(value[0].shape[0])
        out.setdefault(int(number), {WINDOWS: {}, FLAGS: {}})[FLAGS][skip_window] = tuple(value)
    return out


def spikes(test: Spike, value, window, count):
    """Whether `value` spikes against the window of `test` (float32): more
    than `sigmas` standard deviations (the population's, at least
    `MIN_RELATIVE_STD` x |mean|) above the window's mean, or more than
    `factor` x its largest value when that is positive; never before the
    window is full, never for a NaN/Inf (that is another fault)."""
    mean = jnp.mean(window)
    spike = jnp.asarray(False)
    if test.sigmas is not None:
        std = jnp.sqrt(jnp.mean(jnp.square(window - mean)))
        std = jnp.maximum(std, MIN_RELATIVE_STD * jnp.abs(mean))
        spike = spike | (value > mean + test.sigmas * std)
    if test.factor is not None:
        largest = jnp.max(window)
        spike = spike | ((largest > 0) & (value > test.factor * largest))
    return (count >= test.window) & jnp.isfinite(value) & spike


def update(freeze: Freeze, state: dict, frozen, loss, loss_nonfinite,
           applies: List[Apply], forced=None) -> Outcome:
    """The spike tests and skips of one train step's `applies`, in order
    (see the module). `frozen`: whether the weights were frozen before the
    step; `loss`: the step's loss (float32) or None; `loss_nonfinite`: the
    loss's NaN/Inf fault (False when not watched); `forced`: whether the
    step is one of the batches skipped after a rollback (None: no rollback
    armed), skipped by every apply whatever it holds, counted in no skip
    budget, its values entering no window (as on TensorFlow)."""
    windows, flags = dict(state[WINDOWS]), dict(state[FLAGS])
    no = jnp.asarray(False)
    any_fault, any_nonfinite = no, no
    skips: Dict[int, object] = {}
    values: List[tuple] = []
    norm_watched = freeze.max_gradient_norm is not None or any(
        t.quantity == "gradient_norm" for t in freeze.spikes)
    for apply in applies:
        before = frozen
        nonfinite = apply.nonfinite | loss_nonfinite
        faults = {"nonfinite": nonfinite, "max_gradient_norm": apply.over}
        quantities = {"loss": loss, "gradient_norm": jnp.asarray(apply.norm, jnp.float32)}
        spike = no
        tested = []
        for test in freeze.spikes:
            value = quantities.get(test.quantity)
            if value is None:
                continue
            key = f"{apply.number}/{window_key(test)}"
            window, count = windows[key]
            found = spikes(test, value, window, count)
            kind = f"{test.quantity}_spike"
            faults[kind] = found if faults.get(kind) is None else faults[kind] | found
            spike = spike | found
            tested.append((test, key, value))
        skipping = [faults[k] for k in sorted(freeze.skip) if faults.get(k) is not None]
        stopping = [flag for k, flag in faults.items()
                    if flag is not None and k not in freeze.skip]
        skip_fault = jnp.any(jnp.stack(skipping)) if skipping else no
        stop_fault = jnp.any(jnp.stack(stopping)) if stopping else no
        fault = skip_fault | stop_fault
        recent, steps = flags[str(apply.number)]
        skip = skip_fault & ~stop_fault & ~before & (jnp.sum(recent[:, 0]) < freeze.max_skips)
        frozen = before | (fault & ~skip)
        # Only the apply's own faults are the step's (a forced skip is none).
        any_fault = any_fault | fault
        any_nonfinite = any_nonfinite | (nonfinite & fault)
        budgeted = skip
        if forced is not None:
            frozen = frozen & ~forced
            fault = fault | forced
            skip = skip | forced
        # A value enters its window when its apply had no fault and the
        # weights were not frozen before it.
        accept = ~(fault | before)
        for test, key, value in tested:
            window, count = windows[key]
            take = accept & jnp.isfinite(value)
            position = jnp.mod(count, test.window)
            window = jnp.where(take, window.at[position].set(value), window)
            windows[key] = (window, count + take.astype(jnp.int32))
        row = jnp.stack([budgeted.astype(jnp.int32), spike.astype(jnp.int32)])
        recent = recent.at[jnp.mod(steps, freeze.skip_window)].set(row)
        flags[str(apply.number)] = (recent, steps + 1)
        # The fraction of spiky steps among the last `skip_window` (fewer at first).
        seen = jnp.minimum(steps + 1, freeze.skip_window).astype(jnp.float32)
        fraction = jnp.sum(recent[:, 1]).astype(jnp.float32) / seen
        skips[apply.number] = skip if apply.number not in skips else skips[apply.number] | skip
        if freeze.skip or forced is not None:
            values.append(("skipped", apply.number, skip.astype(jnp.float32)))
        if forced is not None:
            values.append(("skipped_after_rollback", apply.number, forced.astype(jnp.float32)))
        if norm_watched:
            values.append(("gradient_norm", apply.number, apply.norm))
        if freeze.spikes:
            values.append(("spike_fraction", apply.number, fraction))
    return Outcome({WINDOWS: windows, FLAGS: flags}, frozen, any_fault, any_nonfinite,
                   skips, values)
