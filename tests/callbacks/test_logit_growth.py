"""The largest attention and output logits per step, and `LogitGrowth`.

With a learning rate of 0 the weights stay those of the start, so the
largest logit of each step is computed independently from each batch: the
layer's own query and key projections, then NumPy's `q k^T / sqrt(d)`
over the positions the masks keep.
"""

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import StopOnRule
from kerasdbg.rules import LogitGrowth
from tests.conftest import make_strategy, only_upstream_failure

T, D, HEADS, KEY_DIM, BATCH, STEPS = 6, 8, 2, 4, 8, 8
RNG = np.random.default_rng(0)
X = RNG.normal(size=(BATCH * STEPS, T, D)).astype("float32")
Y = RNG.integers(0, 3, size=(BATCH * STEPS,))


class Block(keras.layers.Layer):
    """Self-attention with a padding mask or a causal mask, as a transformer block calls it."""

    def __init__(self, how, **kwargs):
        super().__init__(**kwargs)
        self.how = how
        self.attention = keras.layers.MultiHeadAttention(HEADS, KEY_DIM, name="mha")

    def call(self, x):
        if self.how == "causal":
            return self.attention(x, x, use_causal_mask=True)
        if self.how == "padding":
            keep = keras.ops.arange(T) < T - 2  # the last two positions are padding
            mask = keras.ops.broadcast_to(keep[None, None, :], (keras.ops.shape(x)[0], T, T))
            return self.attention(x, x, attention_mask=mask)
        return self.attention(x, x)


def _model(how="none", strategy_name="default", spe=1, jit=False, lr=0.0):
    with make_strategy(strategy_name).scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((T, D))
        hidden = Block(how, name="block")(inputs)
        outputs = keras.layers.Dense(3, name="out")(keras.layers.Flatten()(hidden))
        model = keras.Model(inputs, outputs, name="t")
        model.compile(keras.optimizers.SGD(lr),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=spe, jit_compile=jit)
    return model


def _expected(model, how):
    """Per step: the largest attention logit and the largest output, from the
    layer's projections and NumPy."""
    attention = model.get_layer("block").attention
    logits, outputs = [], []
    for step in range(STEPS):
        x = X[step * BATCH:(step + 1) * BATCH]
        q = np.asarray(attention._query_dense(x)) / np.sqrt(KEY_DIM)  # [B, T, N, H]
        k = np.asarray(attention._key_dense(x))
        scores = np.einsum("btnh,bsnh->bnts", q.astype(np.float64), k.astype(np.float64))
        keep = np.ones((T, T), bool)
        if how == "causal":
            keep = np.tril(keep)
        elif how == "padding":
            keep[:, T - 2:] = False
        logits.append(scores[:, :, keep].max())
        outputs.append(float(np.asarray(model(x)).max()))
    return np.array(logits), np.array(outputs)


@pytest.mark.parametrize("how, strategy_name, spe, jit", [
    ("none", "default", 1, False), ("causal", "default", 4, True), ("padding", "default", 1, True),
    ("none", "mirrored", 4, False), ("padding", "one_device", 1, False)])
def test_the_largest_logits_of_each_step_are_the_independent_ones(
        tmp_path, how, strategy_name, spe, jit):
    model = _model(how, strategy_name, spe, jit)
    stop = StopOnRule(LogitGrowth(max_output_logit=1e6), log_dir=str(tmp_path), verbose=False)
    with only_upstream_failure(strategy_name, jit):
        model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[stop])
    table = kerasdbg.load_run(str(tmp_path)).scalar_table(
        "step/max_attention_logit|step/max_output_logit", run="train")
    logits, outputs = _expected(model, how)
    assert list(table.index) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(table["step/max_attention_logit"], logits, rtol=1e-5)
    np.testing.assert_allclose(table["step/max_output_logit"], outputs, rtol=1e-5)
    assert stop.verdicts == []
    # The layer is as it was found: no method of kerasdbg's left on it.
    assert "_compute_attention" not in vars(model.get_layer("block").attention)


class _GrowQuery(keras.callbacks.Callback):
    """Multiplies the query kernel by `factor` at the start of batch `batch`."""

    def __init__(self, batch, factor):
        super().__init__()
        self.batch, self.factor = batch, factor

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            kernel = self.model.get_layer("block").attention._query_dense.kernel
            kernel.assign(kernel.numpy() * self.factor)


def test_logits_grown_past_the_limit_fire_at_their_step():
    model = _model(lr=0.0)
    stop = StopOnRule(LogitGrowth(max_logit=20.0), verbose=False)
    model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[_GrowQuery(5, 50.0), stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("LogitGrowth", 6)]
    assert "the largest attention logit is above 20: step/max_attention_logit=" in \
        stop.verdicts[0].reason
    assert model.stop_training


def test_logits_that_grow_tenfold_within_the_window_fire():
    model = _model(lr=0.0)
    stop = StopOnRule(LogitGrowth(max_logit=1e6, factor=10.0, window=4, min_logit=1.0),
                      verbose=False)
    model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[_GrowQuery(6, 30.0), stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("LogitGrowth", 7)]
    assert "grew more than 10 x in 4 steps" in stop.verdicts[0].reason


def test_several_attention_layers_are_recorded_each_and_the_rule_names_the_layer(tmp_path):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((T, D))
    first = keras.layers.MultiHeadAttention(HEADS, KEY_DIM, name="first")(inputs, inputs)
    second = keras.layers.MultiHeadAttention(HEADS, KEY_DIM, name="second")(first, first)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(second)))
    model.compile(keras.optimizers.SGD(0.0),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stop = StopOnRule(LogitGrowth(max_logit=1e6), log_dir=str(tmp_path), verbose=False)
    model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[stop])
    tags = kerasdbg.load_run(str(tmp_path)).tags("max_attention_logit", run="train")
    assert {"step/first/max_attention_logit", "step/second/max_attention_logit"} <= set(tags)
    rule = LogitGrowth(max_logit=3.0)
    verdict = rule.check(1, {"step/first/max_attention_logit": 2.0,
                             "step/second/max_attention_logit": 4.0})
    assert verdict.tensors == ("step/second/max_attention_logit",)


def test_an_attention_layers_own_compute_attention_is_kept():
    model = _model()
    attention = model.get_layer("block").attention
    calls = []

    def own(*args, **kwargs):  # a user's own override on the instance
        calls.append(1)
        return type(attention)._compute_attention(attention, *args, **kwargs)

    object.__setattr__(attention, "_compute_attention", own)
    stop = StopOnRule(LogitGrowth(max_logit=1e6), verbose=False)
    model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[stop])
    assert vars(attention)["_compute_attention"] is own and calls


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"LogitGrowth: `max_logit` must be a finite number > 0"):
        LogitGrowth(max_logit=0)
    with pytest.raises(ValueError, match=r"`factor` must be a finite number > 1"):
        LogitGrowth(factor=1.0)
    with pytest.raises(TypeError, match=r"`window` must be a positive int"):
        LogitGrowth(window=2.5)
