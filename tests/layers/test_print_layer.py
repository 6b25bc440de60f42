"""PrintLayer: modes of Keras, outputs, immediate mode, arguments, saving."""

import logging
import os
import re

import keras
import numpy as np
import pytest

from kerasdbg.layers import PrintLayer
from tests.conftest import make_strategy

X = np.arange(24, dtype="float32").reshape(6, 4) / 10
Y = np.ones((6, 1), "float32")


def _model(layer, strategy=None):
    with (strategy or make_strategy("default")).scope():
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(1, name="d")(layer(inputs)))
        model.compile("sgd", "mse")
    return model


def _lines(text):
    return [line for line in text.splitlines() if line.startswith("kerasdbg")]


def test_fit_evaluate_predict_and_eager_calls_report_their_mode(capsys):
    layer = PrintLayer("in", stats=["min"], summarize=0, name="p")
    model = _model(layer)
    model.fit(X, Y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    model.evaluate(X, Y, batch_size=3, verbose=0)
    model.predict(X, batch_size=6, verbose=0)
    model(X[:1])
    lines = _lines(capsys.readouterr().err)
    assert lines == [
        "kerasdbg fit step 1 replica 0 | in | shape (2, 4) | min=0",
        "kerasdbg fit step 2 replica 0 | in | shape (2, 4) | min=0.8",
        "kerasdbg fit step 3 replica 0 | in | shape (2, 4) | min=1.6",
        "kerasdbg evaluate step 1 replica 0 | in | shape (3, 4) | min=0",
        "kerasdbg evaluate step 2 replica 0 | in | shape (3, 4) | min=1.2",
        "kerasdbg predict step 1 replica 0 | in | shape (6, 4) | min=0",
        "kerasdbg call step 1 replica 0 | in | shape (1, 4) | min=0",
    ]


def test_a_second_fit_continues_the_optimizer_steps_and_a_single_execution_prints(capsys):
    model = _model(PrintLayer(stats=[], summarize=0, every_n_steps=2, name="p"))
    model.fit(X, Y, batch_size=6, epochs=1, verbose=0, shuffle=False)  # one execution only: step 1
    model.fit(X, Y, batch_size=2, epochs=1, verbose=0, shuffle=False)  # steps 2, 3, 4
    assert _lines(capsys.readouterr().err) == [
        "kerasdbg fit step 2 replica 0 | p | shape (2, 4)",
        "kerasdbg fit step 4 replica 0 | p | shape (2, 4)",
    ]


def test_all_replicas_print_their_slice_under_mirrored(capsys):
    model = _model(PrintLayer(stats=["max"], summarize=0, replicas="all", name="p"),
                   make_strategy("mirrored"))
    model.fit(X[:4], Y[:4], batch_size=4, epochs=1, verbose=0, shuffle=False)
    assert _lines(capsys.readouterr().err) == [
        "kerasdbg fit step 1 replica 0 | p | shape (2, 4) | max=0.7",
        "kerasdbg fit step 1 replica 1 | p | shape (2, 4) | max=1.5",
    ]


def test_elements_are_summarized_like_tf_print():
    stream = _Stream()
    layer = PrintLayer(stats=[], summarize=2, output_stream=stream, name="p")
    layer(np.array([1.0, 2.0, 3.0]))
    layer(np.array([1.0, 2.0, 3.0, 4.0, 5.0]))
    layer(np.zeros((0,), "float32"))
    assert stream.lines == [
        "kerasdbg call step 1 replica 0 | p | shape (3,) | [1 2 3]",
        "kerasdbg call step 2 replica 0 | p | shape (5,) | [1 2 ... 4 5]",
        "kerasdbg call step 3 replica 0 | p | shape (0,) | []",
    ]


def test_outputs_to_a_file_and_to_a_logger(tmp_path, caplog):
    path = tmp_path / "out.txt"
    PrintLayer(stats=[], summarize=0, output_stream=str(path), name="f")(X)
    assert path.read_text() == "kerasdbg call step 1 replica 0 | f | shape (6, 4)\n"
    with caplog.at_level(logging.INFO, logger="mine"):
        PrintLayer(stats=[], summarize=0, output_stream="logging:mine", name="g")(X)
    assert [r.getMessage() for r in caplog.records] == [
        "kerasdbg call step 1 replica 0 | g | shape (6, 4)"
    ]


def test_immediate_mode_prints_in_graph_and_turns_xla_off(tmp_path):
    path = tmp_path / "immediate.txt"
    layer = PrintLayer("now", stats=["max"], summarize=1, printing="immediate",
                       output_stream=str(path), name="p")
    assert layer.supports_jit is False
    model = _model(layer)
    model.compile("sgd", "mse", steps_per_execution=2)  # jit_compile="auto"
    model.fit(X, Y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    assert model.jit_compile is False
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert lines[0] == (
        "kerasdbg fit step 1 replica 0 | now | shape [2 4] | max= 0.699999988079071 | [0 ... 0.7]"
    )
    assert [line.split(" ")[3] for line in lines] == ["1", "2", "3"]


def test_saved_model_keeps_config_and_counters(tmp_path):
    model = _model(PrintLayer("m", every_n_steps=3, summarize=1, stats=["mean"],
                              output_stream="stdout", name="p"), make_strategy("mirrored"))
    model.fit(X, Y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    layer = loaded.get_layer("p")
    assert isinstance(layer, PrintLayer)
    config = layer.get_config()
    assert {k: config[k] for k in ("message", "every_n_steps", "summarize", "stats",
                                   "output_stream", "printing")} == {
        "message": "m", "every_n_steps": 3, "summarize": 1, "stats": ["mean"],
        "output_stream": "stdout", "printing": "deferred"}
    assert int(layer.calls.numpy()) == 3
    assert PrintLayer.from_config(config).get_config() == config


def test_a_saved_model_loads_where_its_print_file_directory_is_missing(tmp_path):
    """The path is checked when a user builds the layer, not when a saved model
    is loaded (another machine, a directory since removed): there the print
    warns once that it cannot write, and training goes on."""
    directory = tmp_path / "prints"
    directory.mkdir()
    model = _model(PrintLayer("m", stats=["mean"], output_stream=str(directory / "p.txt"),
                              name="p"))
    path = str(tmp_path / "m.keras")
    model.save(path)
    directory.rmdir()
    loaded = keras.models.load_model(path)
    assert loaded.get_layer("p").output_stream == str(directory / "p.txt")
    with pytest.warns(RuntimeWarning, match="stopped recording") as caught:
        loaded.fit(X, Y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "FileNotFoundError" in messages[0], messages
    assert not directory.exists()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"every_n_steps": 0}, ValueError, "PrintLayer: `every_n_steps` must be a positive int. Received: every_n_steps=0"),
        ({"printing": "later"}, ValueError, "PrintLayer: `printing` must be one of 'deferred', 'immediate'. Received: printing='later'"),
        ({"replicas": "some"}, ValueError, "PrintLayer: `replicas` must be one of 'first', 'all'. Received: replicas='some'"),
        ({"stats": ["median"]}, ValueError, "PrintLayer: `stats` must be a list of names from"),
        ({"summarize": -1}, ValueError, "PrintLayer: `summarize` must be"),
        ({"message": 3}, TypeError, "PrintLayer: `message` must be None or a str. Received: message=3"),
        ({"output_stream": 3}, TypeError, "PrintLayer: `output_stream` must be one of stderr, stdout, logging"),
        ({"printing": "immediate", "output_stream": "logging:x"}, ValueError, "printing='immediate' prints with tf.print"),
        ({"output_stream": "/no/such/directory/print.txt"}, ValueError, "PrintLayer: `output_stream` must be a stream name or a file path in an existing directory; '/no/such/directory' does not exist. Received: output_stream='/no/such/directory/print.txt'"),
        ({"output_stream": os.sep}, ValueError, f"PrintLayer: `output_stream` must be a stream name or a file path in an existing directory; {os.sep!r} is a directory. Received: output_stream={os.sep!r}"),
    ],
    ids=["every", "printing", "replicas", "stats", "summarize", "message", "stream", "immediate-logger",
         "path-in-a-missing-directory", "path-of-a-directory"],
)
def test_bad_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        PrintLayer(**kwargs)


class _Stream:
    def __init__(self):
        self.lines = []

    def write(self, text):
        self.lines += text.splitlines()


def test_mode_is_renamed_printing_with_a_warning():
    with pytest.warns(FutureWarning, match=re.escape(
            "PrintLayer: `mode` is deprecated; use `printing` (`mode` is the Keras call a record "
            "comes from everywhere else): mode='immediate' is printing='immediate'.")):
        layer = PrintLayer("x", mode="immediate", name="p")
    assert layer.printing == "immediate" and layer.supports_jit is False
    assert "mode" not in layer.get_config() and layer.get_config()["printing"] == "immediate"
