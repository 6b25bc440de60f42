"""The program a JAX fit runs at every step, read off XLA's optimized HLO.

kerasdbg jits two variants of its step where a schedule takes some
statistics at some steps only: the full one (the scheduled statistics and
histograms, kept at the scheduled steps by a select) and the every-step one,
which runs at every other step. Counted here, for a 6-variable MLP and a
122-variable one, beside plain Keras's step (`jax.jit(model.train_step)` on
the same state): the `conditional`s of each variant (on a GPU each one makes
the host wait for the device) and the fusions the every-step variant adds.
The programs are taken by bench/step_program.py, which also times them.
"""

import importlib.util
import pathlib
import threading

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("step_program", ROOT / "bench" / "step_program.py")
program = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(program)

X, Y = program.data(12)  # steps 1-10 run the full variant, 11 and 12 the every-step one
_PLAIN = {}


def plain_fusions(depth):
    if depth not in _PLAIN:
        counted = program.counts(program.hlo(*program.plain_program(program.mlp(depth), X, Y)))
        assert counted["conditionals"] == 0
        _PLAIN[depth] = counted["fusions"]
    return _PLAIN[depth]


def variants(config, depth):
    """`[(conditionals, fusions added to plain's)]` of the full, then the every-step variant."""
    callbacks, taps = program.callbacks_of(config)  # verdicts that stop nothing
    taken = program.programs(program.mlp(depth, taps=taps), callbacks, X, Y)
    out = []
    for jitted, args in taken:
        counted = program.counts(program.hlo(jitted, args))
        out.append((counted["conditionals"], counted["fusions"] - plain_fusions(depth)))
    return out


# The fusions the every-step variant adds to plain Keras's 44 on the 6-variable MLP, at most:
# 40 (measured 21, 23 and 30: the gradients' and the weights' norms and counts are one table,
# `engine._joint_tables`).
ADDED_AT_MOST = {"defaults": 40, "stop": 40, "stop+defaults": 40}


@pytest.mark.parametrize("config", list(ADDED_AT_MOST))
def test_the_every_step_program_adds_a_few_fusions_and_no_condition_but_the_freeze(config):
    # The one condition left with StopOnRule: the freeze's choice of the state
    # (a select there changes how XLA contracts the update; see `engine._selected`).
    freeze = 0 if config == "defaults" else 1
    added = {}
    for depth in (2, 60):
        (full_conditionals, _), (conditionals, added[depth]) = variants(config, depth)
        assert conditionals == full_conditionals == freeze, depth
    assert added[2] <= ADDED_AT_MOST[config], added
    # The kernels kerasdbg adds do not grow with the variables (6 -> 122).
    assert added[60] - added[2] <= 12, added


def test_every_statistic_at_every_step_is_one_program_with_no_condition_and_few_kernels():
    added = {}
    for depth in (2, 60):
        taken = variants("every_step", depth)
        assert len(taken) == 1 and taken[0][0] == 0
        added[depth] = taken[0][1]
    # The weights' update and distance from the start: the packed tensors' differences,
    # not one kernel per variable (before: +140 and +386).
    assert added[60] - added[2] <= 12, added


# The fusions each tapped layer adds to the every-step program, at most: its
# statistics as two stacks of terms reduced along their rows
# (`stats._raw_stacked`), its health, its counters and its row (measured 18;
# 31 with a reduction a statistic and a mask written out before each count).
PER_TAP_AT_MOST = 20


def test_taps_with_the_defaults_hold_no_condition_and_a_few_fusions_a_tap():
    added, taps = {}, {}
    for depth in (2, 20):
        (full_conditionals, _), (conditionals, added[depth]) = variants("taps+defaults", depth)
        assert full_conditionals == conditionals == 0
        taps[depth] = depth + 1  # a tap after each hidden layer and the logits
    per_tap = (added[20] - added[2]) / (taps[20] - taps[2])
    assert per_tap <= PER_TAP_AT_MOST, added



def test_the_variant_not_needed_first_is_compiled_ahead_and_run_as_compiled(monkeypatch):
    # The every-step variant is compiled on a thread after the fit's first
    # call, and its calls run that program: its jitted function never traces
    # in the loop. (A copy of Keras's settings there raised on a defaultdict,
    # and the variant was traced at its first call instead.)
    from kerasdbg.backends.jax import engine as engine_lib

    prepared, raised = [], []
    original_prepare = engine_lib._Jitted.prepare

    def prepare(self, model, arguments):
        prepared.append(self)
        return original_prepare(self, model, arguments)

    monkeypatch.setattr(engine_lib._Jitted, "prepare", prepare)
    monkeypatch.setattr(threading, "excepthook", raised.append)
    callbacks, _ = program.callbacks_of("defaults")
    program.mlp(2).fit(X, Y, batch_size=program.BATCH, epochs=1, verbose=0, shuffle=False,
                       callbacks=callbacks)
    assert not raised, [str(r.exc_value) for r in raised]
    assert len(prepared) == 1 and prepared[0].variant is False
    prepared[0].wait()
    assert prepared[0].ahead is not None
    assert prepared[0].jitted._cache_size() == 0


@pytest.mark.parametrize("distribution", ["default", "data_parallel"])
def test_each_variant_is_compiled_once_across_the_steps_and_fits_that_pass_it_the_others_state(
        distribution):
    # The full variant runs at steps 1-10 and 50 of each fit, after the
    # every-step one (compiled ahead): called with that one's outputs, with
    # a later fit's state (which Keras commits to its devices) and with a
    # fresh carry, it keeps the one program it compiled first.
    import jax
    import keras

    from kerasdbg.backends.jax import engine as engine_lib

    if distribution == "data_parallel":
        devices = jax.devices("cpu")
        assert len(devices) == 2, "tests/conftest.py gives JAX two CPU devices"
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
        try:
            return _compiled_once(engine_lib)
        finally:
            keras.distribution.set_distribution(None)
    _compiled_once(engine_lib)


def _compiled_once(engine_lib):

    made = {}
    original_prepare = engine_lib._Jitted.prepare

    def prepare(self, model, arguments):
        made[False] = self
        return original_prepare(self, model, arguments)

    model = program.mlp(2)
    x, y = program.data(64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_lib._Jitted, "prepare", prepare)
        for _ in range(2):
            callbacks, _ = program.callbacks_of("defaults")
            model.fit(x, y, batch_size=program.BATCH, epochs=1, verbose=0, shuffle=False,
                      callbacks=callbacks)
    every_step = made[False]
    engine = engine_lib.engine_for(model)
    full = engine._kept[engine._kept_key]["step"][True]
    assert full.variant is True and every_step.variant is False
    # Never compiled twice (the regression: 2-3). In the full suite the full
    # variant's jit cache was seen empty (it ran a kept program), cause not found.
    assert full.jitted._cache_size() <= 1
    assert every_step.jitted._cache_size() == 0 and every_step.ahead is not None


def test_a_later_fit_of_another_batch_size_keeps_its_own_programs_and_runs_them_first_time():
    # Each variant keeps the program of each shape it met: a fit at batch 64,
    # then two at batch 32, and the last runs every step on a kept program at
    # the first try (before, every call of the later fits failed over to the
    # jitted function).
    from kerasdbg.backends.jax import engine as engine_lib

    model = program.mlp(2)
    x, y = program.data(64)
    failed = []

    def fit(batch):
        callbacks, _ = program.callbacks_of("defaults")
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                  callbacks=callbacks)

    fit(program.BATCH)
    fit(program.BATCH // 2)
    engine = engine_lib.engine_for(model)
    variants = engine._kept[engine._kept_key]["step"]
    for variant in variants.values():
        original = variant.call

        def call(function, *arguments, _original=original):
            try:
                return _original(function, *arguments)
            except (TypeError, ValueError):
                failed.append(function)
                raise

        variant.call = call
    fit(program.BATCH // 2)
    assert failed == []
    assert all(len(v.programs) == 2 for v in variants.values())


def test_a_fit_compiles_no_program_of_kerasdbg_s_own_beside_its_step():
    # kerasdbg's host code puts its arrays on the device as they are: the
    # first carry, the weights kept for distance_from_start. A `jnp` call
    # on them compiled a small program each (a copy per variable shape, a
    # staging of each scalar: about 40 ms before a fit's first step). Shapes
    # no other test uses, so that no compiled program is cached already.
    import traceback

    import jax
    import keras

    from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics

    own = []

    def listen(event, duration, **kwargs):
        step = kwargs.get("fun_name") == "jit(inner)"  # a variant of kerasdbg's step
        if step or not event.endswith("backend_compile_duration"):
            return
        frames = [f for f in traceback.extract_stack()
                  if "/kerasdbg/" in f.filename.replace("\\", "/")]
        # Keras's own programs run under kerasdbg's wrapper of `fit`, called from it.
        if frames and not frames[-1].filename.endswith("keras_objects.py"):
            own.append((kwargs.get("fun_name"), f"{frames[-1].filename}:{frames[-1].lineno}"))

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((13,)), keras.layers.Dense(37, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    x = np.random.default_rng(0).normal(size=(16 * 6, 13)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16 * 6, 3)).astype("float32")
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
                  callbacks=[GradientStatistics(), WeightStatistics(),
                             StopOnRule(verbose=False, action="warn")])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert own == []


def test_fits_that_alternate_their_instruments_trace_and_compile_each_step_once():
    # An engine keeps the steps of its last graphs (KEPT_GRAPHS), not the last
    # one only: a model fitted with the defaults, then StopOnRule, then the
    # defaults again (a bench's interleaved rounds, trials on one model) made
    # and compiled its step at every fit (1.8 s each on the MLP).
    from kerasdbg.backends.jax import engine as engine_lib

    model = program.mlp(2)
    x, y = program.data(64)
    made = []
    original = engine_lib.Engine._compiled

    def compiled(self, model, step):
        made.append(step)
        return original(self, model, step)

    def traces():
        engine = engine_lib.engine_for(model)
        return sorted(function.jitted._cache_size() for kept in engine._kept.values()
                      for function in kept["step"].values())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_lib.Engine, "_compiled", compiled)
        counted = []
        for fit in range(6):
            callbacks, _ = program.callbacks_of("defaults" if fit % 2 == 0 else "stop")
            model.fit(x, y, batch_size=program.BATCH, epochs=1, verbose=0, shuffle=False,
                      callbacks=callbacks)
            counted.append((len(made), traces()))
    engine = engine_lib.engine_for(model)
    assert len(engine._kept) == 2
    made_after_two = counted[1][0]
    assert made_after_two >= 2
    # No step made after the first fit of each; after one more round (the
    # defaults meet the skipped-step count a StopOnRule fit left on the
    # optimizer, one new argument structure), no trace either.
    assert [n for n, _ in counted[2:]] == [made_after_two] * 4
    assert counted[3][1] == counted[5][1]
    assert max(counted[5][1]) <= 2
