"""A tapped `.keras` file loads after a bare `import kerasdbg` (issue 32, item 10).

Keras finds a custom class only once its module has registered it; it does
not import a package outside its own. `import kerasdbg` stays lazy (it
imports neither TensorFlow nor Keras) and registers the layers when Keras
is loaded (on JAX too: tests/jax/test_taps.py). Each case runs in a fresh
interpreter, since the test process has imported everything already.
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from kerasdbg.layers import PrintLayer, TapLayer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, **environment) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **environment)
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c",
                           textwrap.dedent(code)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def tapped_file(tmp_path_factory):
    inputs = keras.Input((3,))
    h = keras.layers.Dense(2, name="dense")(inputs)
    h = TapLayer(stats=["mean", "max"], name="tap")(h)
    h = PrintLayer(stats=["mean"], summarize=0, output_stream="stdout", name="print")(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
    path = str(tmp_path_factory.mktemp("saved") / "tapped.keras")
    model.save(path)
    return path


# After loading: the layers are kerasdbg's, and they record in a fit (the
# tap's means checked against NumPy on the loaded weights).
LOAD_AND_FIT = """
    import numpy as np
    tap, printer = model.get_layer("tap"), model.get_layer("print")
    assert type(tap).__module__ == "kerasdbg.layers.tap_layer", type(tap)
    assert type(printer).__module__ == "kerasdbg.layers.print_layer", type(printer)
    x = np.arange(12, dtype="float32").reshape(4, 3) / 10
    kernel, bias = model.get_layer("dense").get_weights()
    want = (x @ kernel + bias).mean()
    model.compile("sgd", "mse")
    model.fit(x, np.zeros((4, 1), "float32"), batch_size=4, epochs=1, verbose=0)
    row = tap.history.iloc[-1]
    assert int(row["step"]) == 1 and abs(row["mean"] - want) < 1e-5, (row, want)
    print("loaded and recorded")
"""


@pytest.mark.parametrize("imports, load", [
    ("import kerasdbg\nimport keras", "keras.saving.load_model"),
    ("import keras\nimport kerasdbg", "keras.saving.load_model"),
    ("import kerasdbg\nimport tensorflow as tf", "tf.keras.models.load_model"),
], ids=["kerasdbg_then_keras", "keras_then_kerasdbg", "kerasdbg_then_tensorflow"])
def test_a_tapped_model_loads_after_a_bare_import_kerasdbg(tapped_file, imports, load):
    result = _run(f"{imports}\nmodel = {load}({tapped_file!r})\n" + textwrap.dedent(LOAD_AND_FIT))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded and recorded" in result.stdout


def test_without_kerasdbg_keras_cannot_locate_the_class(tapped_file):
    """The failure `import kerasdbg` now prevents (the test's control)."""
    result = _run(f"""
        import keras
        keras.saving.load_model({tapped_file!r})
    """)
    assert result.returncode != 0
    assert "Could not locate class 'TapLayer'" in result.stderr


def test_import_kerasdbg_imports_neither_tensorflow_nor_keras():
    result = _run("""
        import sys
        import kerasdbg
        from kerasdbg import rules
        loaded = sorted(m for m in ("tensorflow", "keras", "tensorboard") if m in sys.modules)
        print(loaded)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_a_failed_registration_warns_and_keras_still_imports(tapped_file):
    """Never break the user's `import keras`: when the layers cannot be
    imported, a warning says why and what to do."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys, warnings

        class Broken:
            def find_spec(self, name, path=None, target=None):
                if name == "kerasdbg.layers":
                    raise ImportError("kerasdbg.layers is broken in this test")

        import kerasdbg
        sys.meta_path.insert(0, Broken())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import keras
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert any("could not register TapLayer and PrintLayer" in m
                   and "kerasdbg.layers is broken in this test" in m for m in messages), messages
        assert keras.layers.Dense(1) is not None
        print("keras imported")
    """)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "keras imported" in result.stdout


def test_the_registered_names_are_the_saved_ones():
    assert keras.saving.get_registered_object("kerasdbg>TapLayer") is TapLayer
    assert keras.saving.get_registered_object("kerasdbg>PrintLayer") is PrintLayer
    assert np.all([keras.saving.get_registered_name(c) == f"kerasdbg>{c.__name__}"
                   for c in (TapLayer, PrintLayer)])
