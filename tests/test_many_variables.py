"""A model with many variables (issue 32, item 15): the instrumented train
step grows with the number of variables as plain Keras's does, no condition
or call of kerasdbg's takes one input per variable, the values still match
NumPy at a size where the variables are packed together, and what a fit
traced is freed after it."""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from kerasdbg import stats as stats_lib
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from tests.helpers import traced_functions

BATCH = 4
RNG = np.random.default_rng(15)
X = RNG.normal(size=(3 * BATCH, 3)).astype("float32")
Y = RNG.normal(size=(3 * BATCH, 3)).astype("float32")

CALLS = ("If", "StatelessIf", "PartitionedCall", "StatefulPartitionedCall", "While")


def _model(layers: int):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,))] + [
        keras.layers.Dense(3, name=f"d{i}") for i in range(layers)])
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


def _instruments(log_dir):
    """The issue's configuration: both statistics callbacks with their
    defaults and StopOnRule with its default rules ("warn": a verdict on a
    deep random model does not end the fit being looked at)."""
    return [GradientStatistics(str(log_dir)), WeightStatistics(str(log_dir)),
            StopOnRule(log_dir=str(log_dir), action="warn", verbose=False)]


def _graph(model):
    """`(nodes, inputs)` of the traced train step (its function library
    included): the number of nodes, and the inputs (data, not control) of
    each condition and function call, by node name, in graph order."""
    found = traced_functions(model)
    nodes, inputs = 0, []
    for function in found:
        for concrete in function._list_all_concrete_functions():
            graph = concrete.graph.as_graph_def()
            everything = list(graph.node) + [
                n for library in graph.library.function for n in library.node_def]
            nodes += len(everything)
            inputs += [(n.name, n.op, sum(not i.startswith("^") for i in n.input))
                       for n in everything if n.op in CALLS]
    return nodes, inputs


class _Grab(keras.callbacks.Callback):
    """The train step's graph, taken during the fit (the function the
    engine installed)."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.graph = _graph(self.model)


def _fitted_graph(layers, tmp_path, instrumented):
    model = _model(layers)
    grab = _Grab()
    callbacks = _instruments(tmp_path / f"{layers}") if instrumented else []
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=callbacks + [grab])
    return grab.graph, len(model.trainable_variables)


def test_the_instrumented_step_grows_with_the_variables_as_plain_keras_does(tmp_path):
    """4 and 16 Dense layers (8 and 32 variables), plain and instrumented: per
    variable, the instrumented graph adds at most a few nodes beyond plain
    Keras's, and the inputs of conditions and calls grow by few per variable:
    beyond plain Keras's, only two conditions take every variable, both
    around Keras's own work on all of them (the update, which a frozen step
    skips; the NaN source's replay of the forward pass, with its call), and
    none of kerasdbg's statistics, copies or tests does. Before the packing,
    13 conditions and calls took every gradient or weight, and the graph
    grew by 277 nodes per variable against plain Keras's 150."""
    small, large = 4, 16
    graphs = {}
    for instrumented in (False, True):
        for layers in (small, large):
            graphs[instrumented, layers] = _fitted_graph(layers, tmp_path, instrumented)
    (_, _), variables_small = graphs[False, small]
    (_, _), variables_large = graphs[False, large]
    added = variables_large - variables_small

    def growth(instrumented):
        (nodes_small, calls_small), _ = graphs[instrumented, small]
        (nodes_large, calls_large), _ = graphs[instrumented, large]
        return ((nodes_large - nodes_small) / added,
                (sum(k for _, _, k in calls_large) - sum(k for _, _, k in calls_small)) / added)

    plain_nodes, plain_inputs = growth(False)
    nodes, inputs = growth(True)
    assert nodes - plain_nodes <= 10, (nodes, plain_nodes)
    # The update's condition takes each variable, its gradient and Adam's two
    # slots (4), the replay's condition and its call each variable (2; the
    # gradients come packed); each op is counted twice (in its graph and in
    # the function library).
    assert inputs - plain_inputs <= 2 * (4 + 2) + 2, (inputs, plain_inputs)

    # By name: the conditions and calls whose inputs grow with the variables.
    (_, calls_small), _ = graphs[True, small]
    (_, calls_large), _ = graphs[True, large]
    before = {name: k for name, _, k in calls_small}
    growing = {name for name, _, k in calls_large if k >= variables_large
               and before.get(name, k) < k}
    (_, plain_calls), _ = graphs[False, large]
    plain_growing = {name for name, _, k in plain_calls if k >= variables_large}
    assert len(growing - plain_growing) <= 3, sorted(growing - plain_growing)


def test_statistics_of_many_packed_variables_match_numpy(tmp_path):
    """50 Dense layers (100 small variables, packed per dtype): gradient and
    weight statistics of a few variables taken at random match NumPy on the
    values a GradientTape gives, at the first step (all statistics)."""
    layers = 50
    model = _model(layers)
    weights_before = [v.numpy() for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(Y[:BATCH], model(X[:BATCH], training=True))
    grads = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    gradients = GradientStatistics(every_n_steps=1)
    weights = WeightStatistics(every_n_steps=1)
    model.fit(X[:BATCH], Y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[gradients, weights])
    after = [v.numpy() for v in model.trainable_variables]
    picked = np.random.default_rng(0).choice(len(grads), size=6, replace=False)
    row_g, row_w = gradients.history.iloc[0], weights.history.iloc[0]
    for index in picked:
        variable = model.trainable_variables[int(index)]
        path = variable.path
        g = grads[index].astype(np.float64).ravel()
        np.testing.assert_allclose(row_g[f"{path}/l2_norm"], np.linalg.norm(g), rtol=1e-5)
        np.testing.assert_allclose(row_g[f"{path}/mean"], g.mean(), rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose(row_g[f"{path}/max"], g.max(), rtol=1e-6)
        w, w0 = after[index].astype(np.float64).ravel(), weights_before[index].astype(
            np.float64).ravel()
        np.testing.assert_allclose(row_w[f"{path}/std"], w.std(), rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose(row_w[f"{path}/min"], w.min(), rtol=1e-6)
        # ||w - w0|| / ||w0||: a bias starts at zero, so inf once it moved.
        moved, norm_before = np.linalg.norm(w - w0), np.linalg.norm(w0)
        expected = (moved / norm_before if norm_before else np.inf if moved else 0.0)
        np.testing.assert_allclose(row_w[f"{path}/update_ratio"], expected, rtol=1e-4)


def test_what_a_fit_traced_is_freed_after_it(tmp_path, monkeypatch):
    """The packs of tensors that the trace built (they hold the graph's
    tensors) are garbage after the fit, once the fit's callbacks are gone."""
    made = []
    original = stats_lib.Packed.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(stats_lib.Packed, "__init__", init)
    model = _model(6)
    callbacks = _instruments(tmp_path)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    assert made
    del callbacks
    gc.collect()
    alive = [r() for r in made if r() is not None]
    assert not alive, len(alive)
