"""The spike rules and LogitGrowth on a keras-hub model at a healthy learning rate:
a two-layer GPT-2 (random weights, no download) learning to continue a counting sequence.
The rules stay quiet, every attention layer's largest logit is recorded per step, and the
run trains as without them (nothing skipped)."""

import keras
import keras_hub  # installed by ./run.sh test (with --no-deps: run.sh says why)
import numpy as np

import kerasdbg
from kerasdbg.callbacks import StopOnRule
from kerasdbg.rules import GradientNormSpike, LogitGrowth, LossSpike

VOCABULARY, LENGTH, BATCH, STEPS = 64, 16, 16, 64


def _model():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=LENGTH)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[])
    return model


def test_a_gpt2_at_a_healthy_learning_rate_is_quiet(tmp_path):
    start = np.random.default_rng(0).integers(0, VOCABULARY, size=(BATCH * STEPS, 1))
    tokens = (start + np.arange(LENGTH + 1)) % VOCABULARY
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((BATCH * STEPS, LENGTH), bool)}
    model = _model()
    rules = [LossSpike(window=16), GradientNormSpike(window=16), LogitGrowth(window=32)]
    stop = StopOnRule(rules, action="skip", log_dir=str(tmp_path), verbose=False)
    history = model.fit(x, tokens[:, 1:], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        callbacks=[stop])
    assert stop.verdicts == [] and stop.skipped_steps == []
    assert history.history["loss"][0] < np.log(VOCABULARY)  # it learns
    run = kerasdbg.load_run(str(tmp_path))
    layers = run.tags("max_attention_logit", run="train")
    assert layers == [f"step/transformer_layer_{i}/self_attention/max_attention_logit"
                      for i in range(2)]
    table = run.scalar_table("|".join(layers), run="train")
    assert list(table.index) == list(range(1, STEPS + 1))
    assert np.all(np.isfinite(table.values)) and np.all(table.values > 0)
