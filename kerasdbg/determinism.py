"""`deterministic`: one seed for everything, and op determinism, for a block."""

from __future__ import annotations

import random
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from kerasdbg.backends.tensorflow import randomness
from kerasdbg import _validation as check


class deterministic:  # noqa: N801 - used as a function: `with kerasdbg.deterministic(0):`
    """Makes the code in a `with` block repeatable, then puts everything back.

    On entry: seeds Python's `random`, NumPy's global generator, TensorFlow's
    global seed and Keras's global seed generator with `seed` (as
    `keras.utils.set_random_seed` does), and enables TensorFlow's op
    determinism (`tf.config.experimental.enable_op_determinism`), under which
    ops without a deterministic implementation raise instead of varying.
    On exit, also after an exception: restores Python's and NumPy's generator
    states, TensorFlow's previous global seed (its sequence of op seeds
    starts over), Keras's previous seed and generator, and the previous op
    determinism setting.

    Two runs of the same code in such a block give bitwise-equal weights and
    traces on CPU (tested). On a GPU, cuDNN and XLA may still pick kernels
    that differ between runs unless op determinism rules them out; a
    `tf.distribute` strategy with several workers adds network order.

    Args:
        seed: an int in [0, 2**32 - 1].

    Examples:
        >>> import keras, numpy as np
        >>> from kerasdbg import deterministic
        >>> with deterministic(7):
        ...     a = keras.initializers.GlorotUniform()((3, 2))
        >>> import keras, numpy as np
        >>> from kerasdbg import deterministic
        >>> with deterministic(7):
        ...     b = keras.initializers.GlorotUniform()((3, 2))
        >>> bool((np.asarray(a) == np.asarray(b)).all())
        True
    """

    def __init__(self, seed: int):
        seed = check.non_negative_int("deterministic", "seed", seed)
        if seed > 2**32 - 1:
            raise ValueError(
                f"deterministic: `seed` must be an int in [0, 2**32 - 1] (NumPy's limit). "
                f"Received: seed={seed}"
            )
        self.seed = seed
        self._saved: Optional[dict] = None

    def __enter__(self) -> "deterministic":
        if self._saved is not None:
            raise RuntimeError("deterministic: this block is already entered; nest a new one instead.")
        self._saved = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            **randomness.random_state(),
        }
        keras.utils.set_random_seed(self.seed)
        tf.config.experimental.enable_op_determinism()
        return self

    def __exit__(self, *exc_info) -> None:
        saved, self._saved = self._saved, None
        random.setstate(saved["python"])
        np.random.set_state(saved["numpy"])
        randomness.set_random_state(saved)
