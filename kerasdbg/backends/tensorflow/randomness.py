"""TensorFlow's and Keras's global random settings, read and put back (for
`kerasdbg.deterministic`)."""

from __future__ import annotations

import tensorflow as tf


def random_state() -> dict:
    """TensorFlow's and Keras's global random settings (private in both)."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils
    from tensorflow.python.eager import context
    from tensorflow.python.framework import config

    return {
        "tf_seed": context.global_seed(),
        "op_determinism": config.is_op_determinism_enabled(),
        "keras_seed": global_state.get_global_attribute(rng_utils.GLOBAL_RANDOM_SEED),
        "keras_generator": global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR),
    }


def set_random_state(state: dict) -> None:
    """Puts back what `random_state` returned."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils
    from tensorflow.python.framework import config

    tf.random.set_seed(state["tf_seed"])
    if state["op_determinism"]:
        config.enable_op_determinism()
    else:
        config.disable_op_determinism()
    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, state["keras_seed"])
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, state["keras_generator"])
