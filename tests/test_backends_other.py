"""kerasdbg on the Keras backends without a capture yet (JAX, PyTorch): what
works there works without TensorFlow, and what does not says so in one
clear error, never a crash deep inside or a silent no-op.

`KERAS_BACKEND` is fixed when Keras is imported, so each JAX check runs in a
fresh interpreter with `KERAS_BACKEND=jax` and TensorFlow blocked (importing
it fails as where it is not installed); the run it reads is recorded here,
on TensorFlow. PyTorch cannot be installed for the suite (PyPI's Linux
wheel is 555 MB and pulls 5.4 GB of CUDA packages; the CPU wheels live on
an index of their own): its check reads the source against torch's own
attribute names.
"""

import ast
import json
import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import GradientStatistics
from kerasdbg.layers import PrintLayer, TapLayer
from tests.helpers import WITHOUT_TENSORFLOW

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a machine without TensorFlow does: `import tensorflow` fails with
# ModuleNotFoundError, and `importlib.util.find_spec` finds nothing.


def run_on(backend: str, code: str, *args: str, block_tensorflow: bool = True):
    """Runs `code` in a fresh interpreter on Keras backend `backend`; returns
    what it printed last as JSON."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               JAX_PLATFORMS="cpu")
    source = (WITHOUT_TENSORFLOW if block_tensorflow else "") + textwrap.dedent(code)
    result = subprocess.run([sys.executable, "-c", source, *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


MESSAGE = (r"{owner}: kerasdbg's debug layers \(TapLayer, PrintLayer\) record on the Keras "
           r"backends tensorflow, jax only, and Keras runs on 'numpy' here \(KERAS_BACKEND\)\. "
           r"Works on: tensorflow, jax\. On numpy, MultiOutputModel exposes")


def test_the_debug_layers_on_a_backend_without_them_say_once_where_they_record():
    """Keras's NumPy backend stands for PyTorch's (which cannot be installed
    for the suite): the debug layers record on TensorFlow and JAX only."""
    out = run_on("numpy", """
        import json, sys
        import keras
        from kerasdbg.errors import UnsupportedBackendError
        from kerasdbg.layers import PrintLayer, TapLayer
        import kerasdbg

        errors = {}
        for make in (TapLayer, lambda: PrintLayer("x")):
            try:
                make()
            except UnsupportedBackendError as error:
                errors.setdefault(type(error).__name__, []).append(str(error))
        try:  # a saved model's tap: Keras wraps the error, and keeps its words
            TapLayer.from_config({"name": "t"})
        except TypeError as error:
            errors["loading"] = str(error)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="d")])
        for tap in (None, TapLayer, PrintLayer):
            try:
                kerasdbg.insert_taps(model, tap=tap)
            except UnsupportedBackendError as error:
                errors[type(error).__name__].append(str(error))
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow")
        print(json.dumps({"backend": keras.config.backend(), "errors": errors,
                          "tensorflow": loaded}))
    """)
    assert out["backend"] == "numpy" and out["tensorflow"] == []
    messages = out["errors"]["UnsupportedBackendError"]
    assert len(messages) == 5, messages
    for owner, message in zip(["TapLayer", "PrintLayer"] + ["insert_taps"] * 3, messages):
        assert re.match(MESSAGE.format(owner=owner), message), message
    assert re.search(MESSAGE.format(owner="TapLayer"), out["errors"]["loading"])


def test_insert_taps_strip_debug_layers_and_multi_output_model_work_on_jax():
    """Fit and predict on JAX without TensorFlow; the intermediate output is
    checked against NumPy on the model's weights, and a custom tap layer sees
    what flows."""
    out = run_on("jax", """
        import json, sys
        import keras, numpy as np
        import kerasdbg

        seen = []

        class Seen(keras.layers.Layer):
            def call(self, x):
                return x

            def compute_output_shape(self, shape):
                return shape

        keras.utils.set_random_seed(0)
        x = keras.Input((3,), name="x")
        h = keras.layers.Dense(4, activation="relu", name="h")(x)
        model = keras.Model(x, keras.layers.Dense(1, name="y")(h), name="net")
        model.compile(keras.optimizers.SGD(0.1), "mse")
        data = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
        target = np.ones((8, 1), "float32")

        tapped = kerasdbg.insert_taps(model, layers=["h"], tap=lambda layer, name: Seen(name=name))
        history = tapped.fit(data, target, batch_size=4, epochs=2, verbose=0)
        stripped = kerasdbg.strip_debug_layers(tapped)

        wrapped = kerasdbg.MultiOutputModel(model, outputs=["h"])
        wrapped.fit(data, target, batch_size=4, epochs=1, verbose=0)
        outputs, intermediates = wrapped.predict(data, verbose=0)
        kernel, bias = [np.asarray(w) for w in model.get_layer("h").weights]
        print(json.dumps({
            "tapped": [layer.name for layer in tapped.layers],
            "stripped": [layer.name for layer in stripped.layers],
            "losses": history.history["loss"],
            "optimizer_shared": tapped.optimizer is model.optimizer,
            "steps": int(model.optimizer.iterations.numpy()),
            "hidden": np.asarray(intermediates["h"]).tolist(),
            "expected_hidden": np.maximum(data @ kernel + bias, 0).tolist(),
            "outputs": np.asarray(outputs).tolist(),
            "expected_outputs": np.asarray(model.predict(data, verbose=0)).tolist(),
            "tensorflow": sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"),
        }))
    """)
    assert out["tapped"] == ["x", "h", "h_tap", "y"]
    assert out["stripped"] == ["x", "h", "h_tap", "y"]  # not a kerasdbg debug layer: kept
    assert len(out["losses"]) == 2 and all(np.isfinite(out["losses"]))
    assert out["optimizer_shared"] and out["steps"] == 2 * 2 + 2
    np.testing.assert_allclose(out["hidden"], out["expected_hidden"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["outputs"], out["expected_outputs"], rtol=1e-5, atol=1e-6)
    assert out["tensorflow"] == []


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """A run recorded here, on TensorFlow, for the reader on JAX."""
    log_dir = str(tmp_path_factory.mktemp("run"))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="m")
    model.compile("sgd", "mse")
    model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, epochs=1, verbose=0,
              callbacks=[GradientStatistics(log_dir)])
    return log_dir


def test_the_reader_report_and_check_work_on_jax_without_tensorflow(recorded_run):
    out = run_on("jax", """
        import contextlib, io, json, sys
        import kerasdbg
        from kerasdbg import cli, load_run
        from kerasdbg.rules import ExplodingTensor

        frame = load_run(sys.argv[1]).scalars("gradients/global_norm")
        report, check = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(report):
            report_code = cli.main(["report", sys.argv[1]])
        with contextlib.redirect_stdout(check):
            check_code = cli.main(["check", sys.argv[1]])
        print(json.dumps({
            "steps": frame["step"].tolist(), "values": frame["value"].tolist(),
            "report": report.getvalue(), "report_code": report_code,
            "check": check.getvalue(), "check_code": check_code,
            "check_run": len(kerasdbg.check_run(sys.argv[1], [ExplodingTensor()])),
            "tensorflow": sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"),
        }))
    """, recorded_run)
    expected = kerasdbg.load_run(recorded_run).scalars("gradients/global_norm")
    assert out["steps"] == expected["step"].tolist() == [1, 2]
    np.testing.assert_array_equal(out["values"], expected["value"].to_numpy())
    assert out["report_code"] == 0 and "steps recorded: 2 (1-2)" in out["report"], out["report"]
    assert os.path.getsize(os.path.join(recorded_run, "report", "report.html")) > 0
    assert out["check_code"] == 0 and out["check_run"] == 0, out["check"]
    assert out["tensorflow"] == []


def test_what_needs_tensorflow_says_how_to_install_it_on_jax():
    out = run_on("jax", """
        import json
        import kerasdbg

        import keras

        # doctor checks a model on JAX without TensorFlow (no tf.data to check there).
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
        report = kerasdbg.doctor(model)
        try:
            kerasdbg.deterministic
        except ImportError as error:
            print(json.dumps([str(error), type(report).__name__]))
    """)
    message, report = out
    assert report != "NoneType", out
    assert message.startswith("kerasdbg.deterministic needs TensorFlow >= 2.16. Install it with "
                              "`pip install kerasdbg[cpu]`"), message
    assert "`pip install kerasdbg[jax]`), the callbacks, the layers, doctor, load_run" in message


def test_the_callbacks_record_on_jax_without_tensorflow(tmp_path):
    """A JAX user's install: the statistics and StopOnRule record a fit, write
    TensorBoard files, and `load_run` and `check_run` read them back, with
    TensorFlow absent."""
    out = run_on("jax", """
        import json, sys
        import keras, numpy as np
        import kerasdbg
        from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics

        log_dir = sys.argv[1]
        keras.utils.set_random_seed(0)
        x = np.random.default_rng(0).normal(size=(128, 4)).astype("float32")
        y = x.sum(1, keepdims=True)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("adam", "mse", steps_per_execution=2)
        stop = StopOnRule(log_dir=log_dir)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
            GradientStatistics(log_dir=log_dir), WeightStatistics(log_dir=log_dir), stop])
        run = kerasdbg.load_run(log_dir)
        norms = run.scalars(".*global_norm", run="train")
        print(json.dumps({
            "tensorflow": "tensorflow" in sys.modules,
            "steps": sorted(set(int(s) for s in norms["step"])),
            "tags": sorted(norms["tag"].unique()),
            "verdicts": [str(v) for v in stop.verdicts],
            "offline": [str(v) for v in kerasdbg.check_run(log_dir, stop.rules, skip_missing=True)],
        }))
    """, str(tmp_path / "logs"))
    assert out["tensorflow"] is False
    assert out["steps"] == list(range(1, 17)), out["steps"]
    assert out["tags"] == ["gradients/global_norm"], out["tags"]
    assert out["verdicts"] == [] and out["offline"] == [], out


# ------------------------------------------------------------ PyTorch
# torch.nn.Module's own attributes and methods: `sorted(set(dir(torch.nn.Module()))
# - set(dir(object())))` of torch 2.14.1 (the wheel from PyPI, run once by hand),
# less the dunders Keras's Layer itself defines over torch's. On the PyTorch
# backend a Keras layer is a torch.nn.Module: a layer that assigns one of these
# (`self._buffers = ...`) breaks torch (`TypeError: argument of type '_Buffers' is
# not iterable` when the layer is built).
TORCH_MODULE_NAMES = frozenset("""
    T_destination _apply _backward_hooks _backward_pre_hooks _buffers _call_impl
    _compiled_call_impl _forward_hooks _forward_hooks_always_called _forward_hooks_with_kwargs
    _forward_pre_hooks _forward_pre_hooks_with_kwargs _get_backward_hooks
    _get_backward_pre_hooks _get_name _is_full_backward_hook _load_from_state_dict
    _load_state_dict_post_hooks _load_state_dict_pre_hooks _maybe_warn_non_full_backward_hook
    _modules _named_members _non_persistent_buffers_set _parameters
    _register_load_state_dict_pre_hook _register_state_dict_hook _replicate_for_data_parallel
    _save_to_state_dict _slow_forward _state_dict_hooks _state_dict_pre_hooks _version
    _wrapped_call_impl add_module apply bfloat16 buffers call_super_init children compile cpu
    cuda double dump_patches eval extra_repr float forward get_buffer get_extra_state
    get_parameter get_submodule half ipu load_state_dict modules mtia named_buffers
    named_children named_modules named_parameters parameters register_backward_hook
    register_buffer register_forward_hook register_forward_pre_hook register_full_backward_hook
    register_full_backward_pre_hook register_load_state_dict_post_hook
    register_load_state_dict_pre_hook register_module register_parameter
    register_state_dict_post_hook register_state_dict_pre_hook requires_grad_ set_extra_state
    set_submodule share_memory state_dict to to_empty train training type xpu zero_grad
""".split())

# What Keras's own Model defines over torch.nn.Module on purpose (its API).
KERAS_OWN = frozenset({"compile"})


def _keras_subclasses():
    """Every class in kerasdbg's source that derives from a Keras layer or
    model (directly, or from one of kerasdbg's), by (path, class node)."""
    found, bases_of = [], {}
    package = os.path.join(ROOT, "kerasdbg")
    for directory, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                with open(path) as source:
                    tree = ast.parse(source.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef):
                        bases_of[node.name] = [ast.unparse(b) for b in node.bases]
                        found.append((path, node))

    def keras_derived(name, seen=()):
        for base in bases_of.get(name, []):
            if base.startswith("keras.") and base.split(".")[-1] in (
                    "Layer", "Model", "Sequential", "Functional"):
                return True
            if base not in seen and keras_derived(base.split(".")[-1], seen + (base,)):
                return True
        return False

    return [(path, node) for path, node in found if keras_derived(node.name)]


def test_no_kerasdbg_layer_or_model_takes_a_name_of_torch_modules():
    classes = _keras_subclasses()
    assert {node.name for _, node in classes} >= {"DebugLayer", "TapLayer", "PrintLayer",
                                                  "MultiOutputModel"}
    clashes = []
    for path, node in classes:
        names = {item.name for item in node.body
                 if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
        names |= {target.id for item in node.body if isinstance(item, (ast.Assign,))
                  for target in item.targets if isinstance(target, ast.Name)}
        for inner in ast.walk(node):
            if isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store) \
                    and isinstance(inner.value, ast.Name) and inner.value.id == "self":
                names.add(inner.attr)
            if isinstance(inner, ast.Call) and ast.unparse(inner.func) in (
                    "setattr", "object.__setattr__") and len(inner.args) > 1 \
                    and isinstance(inner.args[1], ast.Constant):
                names.add(inner.args[1].value)
        for name in sorted(names & (TORCH_MODULE_NAMES - KERAS_OWN)):
            clashes.append(f"{os.path.relpath(path, ROOT)}: {node.name}.{name}")
    assert not clashes, "\n".join(clashes)


def test_built_debug_layers_hold_no_attribute_of_torch_modules():
    """The same at run time, on TensorFlow: what a built layer holds beyond
    what a plain Keras layer holds."""
    plain = keras.layers.Dense(2)
    plain.build((None, 3))
    for layer in (TapLayer(histogram=True, name="t"), PrintLayer("p", name="p")):
        layer(np.ones((2, 3), "float32"))
        added = set(vars(layer)) - set(vars(plain))
        assert not added & TORCH_MODULE_NAMES, (layer.name, added & TORCH_MODULE_NAMES)


def test_every_callback_on_a_backend_without_a_capture_says_so_when_made():
    """Keras's NumPy backend has no kerasdbg capture, as PyTorch's has none
    yet (PyTorch cannot be installed for the suite): each callback raises
    one UnsupportedBackendError when made, naming the backend and what
    works there."""
    out = run_on("numpy", """
        import json
        from kerasdbg.callbacks import (ActivationStatistics, GradientStatistics, StepRecorder,
                                        StepTimer, StopOnRule, WeightStatistics)
        from kerasdbg.errors import UnsupportedBackendError

        said = {}
        for make in (GradientStatistics, WeightStatistics, StopOnRule, StepTimer,
                     ActivationStatistics, lambda: StepRecorder("trace.npz")):
            try:
                made = make()
                said[type(made).__name__] = "made"
            except UnsupportedBackendError as error:
                said[str(error).split(" ")[0]] = str(error)
        print(json.dumps(said))
    """)
    assert sorted(out) == ["ActivationStatistics", "GradientStatistics", "StepRecorder",
                           "StepTimer", "StopOnRule", "WeightStatistics"], out
    for owner, message in out.items():
        assert message.startswith(f"{owner} records per optimizer step, which kerasdbg does on "
                                  "the Keras backends jax, tensorflow; Keras runs on 'numpy'"), \
            message
        assert "load_run, kerasdbg check and kerasdbg report" in message
