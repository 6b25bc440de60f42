"""The program a TensorFlow fit runs at every execution, counted.

kerasdbg traces Keras's train function in two variants where a schedule
takes some statistics at some steps only (`backends.tensorflow.variants`):
the full one, which the host runs at a fit's first execution and at those
that may hold a scheduled step, and the every-step one, which runs at all
the others. Counted here beside plain Keras's, with bench/tf_step_program.py
(which also times them): the conditions of the every-step variant (XLA's
`conditional`s of the jit-compiled step; the traced graph's `If`/`Case` ops,
its function library included, where jit is off) and the fusions it adds,
on a 6-variable and a 122-variable MLP; and which variant each execution
ran, against the schedule.
"""

import keras
import numpy as np
import pytest

from kerasdbg.backends.tensorflow import graph_functions
from kerasdbg.backends.tensorflow import variants as variants_lib
from kerasdbg.callbacks import GradientStatistics, WeightStatistics
from tests.helpers import tf_step_program

program = tf_step_program()
_PLAIN = {}


def _plain(depth, jit):
    if (depth, jit) not in _PLAIN:
        _PLAIN[depth, jit] = program.counts(program.variants("plain", depth, jit)[None], jit)
    return _PLAIN[depth, jit]


# With StopOnRule two conditions stay in the every-step program: the frozen
# step's skip of the update (what acts at its step; XLA makes it a select),
# and the replay that finds a fault's first non-finite layer output (taken
# at a fit's first fault).
CONDITIONS_LEFT = {("defaults", True): 0, ("defaults", False): 0,
                   ("stop", True): 1, ("stop", False): 2,
                   ("stop+defaults", True): 1, ("stop+defaults", False): 2}


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "nojit"])
@pytest.mark.parametrize("config", ["defaults", "stop", "stop+defaults"])
def test_the_every_step_variant_holds_no_condition_of_the_schedule(config, jit):
    plain_conditions, _ = _plain(2, jit)
    assert plain_conditions == 0
    functions = program.variants(config, 2, jit)
    assert set(functions) == {True, False}
    full = program.counts(functions[True], jit)
    every = program.counts(functions[False], jit)
    assert every[0] == CONDITIONS_LEFT[config, jit], every
    # The full variant holds the schedule's conditions besides.
    assert full[0] > every[0]


# The fusions the every-step variant adds to plain Keras's 40 on the 6-variable
# MLP, outside the conditionals' branches, at most (23, 21 and 34 today).
ADDED_AT_MOST = {"defaults": 40, "stop": 40, "stop+defaults": 40}


@pytest.mark.parametrize("config", list(ADDED_AT_MOST))
def test_the_every_step_variant_adds_fusions_that_do_not_grow_with_the_variables(config):
    added = {}
    for depth in (2, 60):
        _, plain_fusions = _plain(depth, True)
        _, fusions = program.counts(program.variants(config, depth)[False])
        added[depth] = fusions - plain_fusions
    assert added[2] <= ADDED_AT_MOST[config], added
    assert added[60] - added[2] <= 12, added



# The fusions each tapped layer adds to the jit-compiled step, at most: its
# statistics as stacks of terms whose rows XLA sums as one product
# (`stats._raw_stacked`), its health, its counters and its row (measured 23;
# 44 with a reduction a statistic).
PER_TAP_AT_MOST = 26


def test_taps_with_the_defaults_hold_no_condition_and_a_few_fusions_a_tap():
    added = {}
    for depth in (2, 6):
        _, plain_fusions = _plain(depth, True)
        functions = program.variants("taps+defaults", depth)
        conditions, fusions = program.counts(next(iter(functions.values())))
        assert conditions == 0
        added[depth] = fusions - plain_fusions
    # A tap after each hidden layer and the logits: depth + 1.
    assert (added[6] - added[2]) / 4 <= PER_TAP_AT_MOST, added


def _graph_ops(functions) -> dict:
    """The op types of a variant's traced graphs (function libraries included), counted."""
    found = {}
    for function in functions:
        for concrete in function._list_all_concrete_functions():
            graph = concrete.graph.as_graph_def()
            for node in list(graph.node) + [n for f in graph.library.function
                                            for n in f.node_def]:
                found[node.op] = found.get(node.op, 0) + 1
    return found


def test_a_fit_with_jit_and_one_without_each_take_their_own_form_of_the_statistics():
    """kerasdbg's statistics are traced once per shapes into a function every
    fit shares; under XLA their ops take another form (fewer kernels on a
    CPU). A fit without jit on the same shapes first, then one with: the
    jit-compiled step adds no more fusions than in a fresh process; and a
    fit without jit after both traces what it traces alone (on the commit
    before, the jit fit took the other's form: 63 fusions added, not 23)."""
    graph_functions.clear()
    alone = _graph_ops(program.variants("defaults", 2, False)[False])
    _, plain_fusions = _plain(2, True)
    _, fusions = program.counts(program.variants("defaults", 2)[False])
    assert fusions - plain_fusions <= ADDED_AT_MOST["defaults"], (fusions, plain_fusions)
    graph_functions.clear()
    program.variants("defaults", 2, True)
    assert _graph_ops(program.variants("defaults", 2, False)[False]) == alone


def test_branch_free_fusions_leave_out_what_a_conditional_calls():
    text = "\n".join([
        "%fused_a (p: f32[]) -> f32[] {", "  ROOT %x = f32[] negate(f32[] %p)", "}",
        "%branch_true (p: f32[]) -> f32[] {",
        "  ROOT %f1 = f32[] fusion(f32[] %p), kind=kLoop, calls=%fused_a", "}",
        "%branch_false (p: f32[]) -> f32[] {",
        "  %c = f32[] call(f32[] %p), to_apply=%inner",
        "  ROOT %f2 = f32[] fusion(f32[] %c), kind=kLoop, calls=%fused_a", "}",
        "%inner (p: f32[]) -> f32[] {",
        "  ROOT %f3 = f32[] fusion(f32[] %p), kind=kLoop, calls=%fused_a", "}",
        "ENTRY %main (p: f32[], q: pred[]) -> f32[] {",
        "  %f4 = f32[] fusion(f32[] %p), kind=kLoop, calls=%fused_a",
        "  ROOT %r = f32[] conditional(pred[] %q, f32[] %f4, f32[] %f4), "
        "true_computation=%branch_true, false_computation=%branch_false", "}"])
    assert program.branch_free_fusions(text) == 1


@pytest.mark.parametrize("spe", [1, 4, 7])
def test_the_host_runs_the_full_variant_exactly_where_a_schedule_names_a_step(spe, monkeypatch):
    """Two epochs of 120 steps, the default schedule (steps 1-10, then every
    50th) and histograms every 30th step: the full variant runs at the first
    execution and at those holding step 1-10, 30, 50, 60, 90, ... 240, the
    every-step variant at all others (spe 7: an epoch of 120 steps makes 17
    executions of 7 and one of 1, which the epoch's end read corrects)."""
    steps = 120
    rng = np.random.default_rng(3)
    x = rng.normal(size=(steps * 8, 32)).astype("float32")
    y = rng.integers(0, 10, size=(steps * 8,)).astype("int32")
    model = program.mlp(2)
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), jit_compile=True, steps_per_execution=spe)
    ran = []
    variant = variants_lib.VariantFunction.variant

    def spy(self, full):  # which variant each execution runs
        ran.append(full)
        return variant(self, full)

    monkeypatch.setattr(variants_lib.VariantFunction, "variant", spy)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
        GradientStatistics(histogram_every_n_steps=30), WeightStatistics()])
    named = set(range(1, 11)) | {s for s in range(1, 2 * steps + 1)
                                 if s % 50 == 0 or s % 30 == 0}
    expected = []
    for epoch in range(2):
        start = epoch * steps
        for first in range(start + 1, start + steps + 1, spe):
            last = min(first + spe - 1, start + steps)
            expected.append(first == 1 or any(first <= s <= last for s in named))
    assert ran == expected
