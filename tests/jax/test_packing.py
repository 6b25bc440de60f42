"""The packed records of JAX's step: what leaves the step is what went in."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kerasdbg.backends.jax import packing


def records():
    return {
        "loss": jnp.asarray(0.25, jnp.float32),
        "step": jnp.asarray(7, jnp.int32),
        "frozen": jnp.asarray(True),
        "row": jnp.asarray([[1.5, np.nan], [np.inf, -2.0]], jnp.float32),
        "half": jnp.asarray([0.1, 65504.0], jnp.float16),
        "hist": (jnp.arange(6, dtype=jnp.float32).reshape(2, 3), jnp.ones((2, 2))),
        "flags": jnp.asarray([True, False, True]),
        "big": jnp.arange(packing.LARGEST + 1, dtype=jnp.float32),
    }


def assert_same(got, want):
    assert set(got) == set(want)
    for key in want:
        for g, w in zip(jax.tree_util.tree_leaves(got[key]), jax.tree_util.tree_leaves(want[key])):
            w = np.asarray(w)
            assert np.asarray(g).dtype == w.dtype, key
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=key)


def test_a_jitted_step_returns_its_records_in_two_arrays_and_the_host_gets_them_back():
    def step(state, carry, data):
        return {"loss": data}, state + 1, carry, dict(records(), data=data * 2)

    inner, call = packing.packed(step)
    jitted = jax.jit(inner)
    logs, state, carry, out = call(jitted, jnp.asarray(1.0), {}, jnp.asarray(3.0))
    arrays = out[packing.PACKED]
    # Floats, integers and booleans, and the one array too large to copy.
    assert len(arrays) == 3
    host = packing.unpack(dict(jax.device_get(out), added=1.5))
    assert host["added"] == 1.5  # what the host adds stays as it is
    del host["added"]
    assert_same(host, dict(records(), data=jnp.asarray(6.0)))
    assert float(state) == 2.0


def test_records_without_floats_or_integers_pack():
    for values in ({"a": jnp.asarray(1)}, {"a": jnp.asarray(1.0)}, {}):
        arrays, layout = packing.pack(values)
        host = packing.unpack({packing.PACKED: jax.device_get(arrays), packing.LAYOUT: layout})
        assert_same(host, values)


def test_unpacked_records_pass_through():
    plain = {"a": np.asarray(1.0)}
    assert packing.unpack(plain) is plain


def test_the_records_of_a_read_as_columns_are_the_records_of_each_step():
    # A read of several steps: each record as one array over the steps of a
    # layout, equal step by step to what each step recorded (packed steps of
    # two traces, steps run without jit, and what the host added to a step).
    def step(state, carry, data):
        return {}, state, carry, dict(records(), data=data * 2)

    def other(state, carry, data):  # another trace: another layout
        return {}, state, carry, {"loss": data, "row": jnp.stack([data, -data])}

    made = {}
    for function in (step, other):
        inner, call = packing.packed(function)
        made[function] = functools.partial(call, jax.jit(inner))
    calls = [made[step], made[step], made[other], made[step]]
    steps, want = [], []
    for k, call in enumerate(calls):
        out = call(jnp.asarray(0.0), {}, jnp.asarray(float(k)))[3]
        steps.append(dict(out, guess=k) if k == 1 else out)
        data = jnp.asarray(float(k))
        wanted = {"loss": data, "row": jnp.stack([data, -data])} if calls[k] is made[other] \
            else dict(records(), data=data * 2)
        want.append(dict(wanted, guess=k) if k == 1 else wanted)
    for value, guess in ((5.0, 9), (6.0, None)):  # run without jit
        recorded = step(0, {}, jnp.asarray(value))[3]
        steps.append(recorded if guess is None else dict(recorded, guess=guess))
        wanted = dict(records(), data=jnp.asarray(value * 2))
        want.append(wanted if guess is None else dict(wanted, guess=guess))
    got = packing.fetch_columns(steps, host=("guess",))
    assert [g.count for g in got] == [2, 1, 1, 2]
    found = [g.step(i) for g in got for i in range(g.count)]
    assert len(found) == len(want)
    for g, w in zip(found, want):
        w = dict(w)
        if "guess" in w:
            assert g.pop("guess") == w.pop("guess")
        assert_same(g, w)
    assert got[0].extras == [{}, {"guess": 1}] and got[3].extras == [{"guess": 9}, {}]
    assert got[0].columns["row"].shape == (2, 2, 2) and "guess" not in got[3]
