"""The Python snippets of README.md and of the guides in docs/, run as written.

Each ```python block of README.md and of every docs/*.md file runs in a fresh
namespace, in a directory that holds the demo's runs (`runs/demo/...`, as
after `./run.sh demo`). A block that continues the reader's own code (their
`model`, `x`, `y`, or a TF1 session) says so with a marker on the line before
it, `<!-- readme-test: context=NAME -->`, and gets the names of that context
from `CONTEXTS` below. Comment lines right after a `print(...)` are the output
the document promises; they must appear in that order ("..." stands for
anything). Other blocks (```bash) are not run.
"""

import contextlib
import glob
import io
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCUMENTS = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"(?:<!-- readme-test: context=(\w+) -->\n)?```python\n(.*?)```", re.S)


def _blocks(paths=DOCUMENTS):
    """`(context, code, path)` of every ```python block, with ids like
    `README-line41` or `rules-line12`."""
    params = []
    for path in paths:
        text = open(path, encoding="utf-8").read()
        name = os.path.splitext(os.path.basename(path))[0]
        params += [pytest.param(match.group(1) or "none", match.group(2), path,
                                id=f"{name}-line{text[:match.start(2)].count(chr(10)) + 1}")
                   for match in FENCE.finditer(text)]
    return params


def _promised_output(code):
    """The comment lines that directly follow a line calling print()."""
    promised, after_print = [], False
    for line in code.splitlines():
        if after_print and line.startswith("# "):
            promised.append(line[2:])
            continue
        after_print = "print(" in line
    return promised


# ------------------------------------------------------------ contexts
def _cnn():
    """A user's image classifier and its data."""
    from kerasdbg.demo import make_data

    images, labels = make_data(samples=256)
    inputs = keras.Input((28, 28, 1), name="image")
    h = keras.layers.Conv2D(8, 3, activation="relu", name="block1_conv")(inputs)
    h = keras.layers.Conv2D(8, 3, activation="relu", name="block2_conv")(h)
    h = keras.layers.Dense(16, activation="relu", name="dense")(keras.layers.Flatten()(h))
    outputs = keras.layers.Dense(10, activation="softmax", name="probabilities")(h)
    model = keras.Model(inputs, outputs, name="classifier")
    model.compile("adam", "sparse_categorical_crossentropy")
    return {"keras": keras, "np": np, "model": model, "x": images, "y": labels}


def _migration():
    """A TF1 graph (session, loss, gradients, train op) and its Keras counterpart,
    with the same initial weights, as in the migration guide."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 10)).astype("float32")
    y = rng.normal(size=(48, 2)).astype("float32")
    kernel = rng.normal(scale=0.3, size=(10, 2)).astype("float32")
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(2, name="dense")],
                             name="model")
    model.set_weights([kernel, np.zeros(2, "float32")])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    graph = tf.Graph()
    with graph.as_default():
        inputs = tf.compat.v1.placeholder(tf.float32, (None, 10))
        labels = tf.compat.v1.placeholder(tf.float32, (None, 2))
        with tf.compat.v1.variable_scope("dense"):
            w = tf.compat.v1.get_variable("kernel", initializer=kernel)
            b = tf.compat.v1.get_variable("bias", initializer=np.zeros(2, "float32"))
        loss = tf.reduce_mean(tf.square(tf.matmul(inputs, w) + b - labels))
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        grads_and_vars = optimizer.compute_gradients(loss)
        train_op = optimizer.apply_gradients(grads_and_vars)
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())

    def feed(step):
        rows = slice((step - 1) * 16, step * 16)
        return {inputs: x[rows], labels: y[rows]}

    return {"keras": keras, "np": np, "model": model, "x": x, "y": y, "sess": sess,
            "loss": loss, "grads_tensors": [g for g, _ in grads_and_vars], "train_op": train_op,
            "tvars": [v for _, v in grads_and_vars], "feed": feed}


def _gan():
    """A generator and a discriminator, their images, and the callbacks' names."""
    from kerasdbg.callbacks import GradientStatistics, StopOnRule

    keras.utils.set_random_seed(0)
    generator = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(4)], name="generator")
    discriminator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(1)], name="discriminator")
    images = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    return {"keras": keras, "tf": tf, "np": np, "generator": generator,
            "discriminator": discriminator, "images": images,
            "GradientStatistics": GradientStatistics, "StopOnRule": StopOnRule}


CONTEXTS = {"none": dict, "cnn": _cnn, "migration": _migration, "gan": _gan}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from kerasdbg.demo import run_demo

    folder = tmp_path_factory.mktemp("readme")
    with contextlib.redirect_stdout(io.StringIO()):
        run_demo(str(folder / "runs" / "demo"), epochs=1)
    return folder


def test_every_block_is_found_and_every_context_is_known():
    assert len(_blocks([README])) >= 7
    assert len(DOCUMENTS) > 1, "no guides found in docs/"
    blocks = _blocks()
    assert {param.values[0] for param in blocks} <= set(CONTEXTS)


@pytest.mark.parametrize("context, code, path", _blocks())
def test_readme_block_runs_as_written(context, code, path, demo_dir, monkeypatch):
    monkeypatch.chdir(demo_dir)
    namespace = CONTEXTS[context]()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, path, "exec"), namespace)  # noqa: S102 - the document's own code
    lines = iter(printed.getvalue().splitlines())
    for promised in _promised_output(code):
        pattern = re.compile(".*".join(re.escape(part) for part in promised.split("...")))
        assert any(pattern.fullmatch(line) for line in lines), (
            f"{os.path.basename(path)} promises the output {promised!r}; printed:\n"
            f"{printed.getvalue()}")
