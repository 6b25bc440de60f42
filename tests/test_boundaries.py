"""The layers of kerasdbg that must not need TensorFlow.

The rules (and what they read: the record's tags, the argument checks) judge a
recorded run; they run where neither TensorFlow, Keras nor TensorBoard is
installed. Each check runs in a fresh interpreter in which importing any of
those fails.
"""

import os
import subprocess
import sys
import textwrap

from tests.helpers import WITHOUT_TENSORFLOW

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BLOCK = textwrap.dedent("""
    import importlib.abc, sys

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("tensorflow", "keras", "tensorboard", "jax", "torch"):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Blocked())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_rules_need_no_tensorflow():
    result = _run("""
        import sys
        import kerasdbg
        from kerasdbg import _validation
        from kerasdbg.records import tags as _tags
        from kerasdbg.rules import ExplodingTensor, NonFiniteLoss, default_rules
        from kerasdbg.rules._runner import RuleRunner

        verdict = ExplodingTensor().check(
            3, {"gradients/d/kernel/nan_count": 2.0, "gradients/d/kernel/inf_count": 0.0})
        assert verdict.step == 3 and verdict.tensors == ("d/kernel",), verdict
        assert NonFiniteLoss().check(4, {"step/loss": float("nan")}).step == 4
        assert len(default_rules()) > 3
        loaded = {m.split(".")[0] for m in sys.modules}
        assert not loaded & {"tensorflow", "keras", "tensorboard"}, loaded
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_statistics_records_schedules_and_tags_need_no_tensorflow():
    """What a second backend's capture would share: the statistics (written
    against `kerasdbg.quantities.ops`), the schedule, the tags and the records
    import without TensorFlow; only computing a statistic needs a backend."""
    result = _run("""
        import sys
        from kerasdbg import schedule, stats
        from kerasdbg.records import CaptureRecord, StepRecord
        from kerasdbg.quantities import ops
        from kerasdbg.rules import FreezeOnFault, NaNSource, default_rules
        from kerasdbg.rules._runner import RuleRunner

        assert stats.STATISTICS[0] == "l2_norm" and "p50" in stats.ALL_STATISTICS
        assert schedule.DEFAULT.at(10) and not schedule.DEFAULT.at(11) and schedule.DEFAULT.at(50)
        record = StepRecord({"gradients/d/kernel/nan_count": 1.0, "step/frozen": 1.0,
                             "step/fault": 1.0, "faults/nan_source/located": 1.0,
                             "faults/nan_source/layer/x": 1.0})
        verdicts = RuleRunner(default_rules()).check(3, record)
        assert [v.rule for v in verdicts] == ["ExplodingTensor", "NaNSource"], verdicts
        captured = CaptureRecord(step=1, skipped=False, values=None, histograms=None)
        assert captured.applied
        loaded = {m.split(".")[0] for m in sys.modules}
        assert not loaded & {"tensorflow", "keras", "tensorboard"}, loaded
        try:
            stats.tensor_statistics([[1.0]], ["l2_norm"])
        except ImportError as error:
            print("needs a backend:", error)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("needs a backend: tensorflow"), result.stdout


def test_an_instrument_without_tensorflow_says_how_to_install_it():
    result = _run("""
        import kerasdbg
        try:
            kerasdbg.deterministic
        except ImportError as error:
            print(error)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("kerasdbg.deterministic needs TensorFlow >= 2.16. Install it "
                                    "with `pip install kerasdbg[cpu]`"), result.stdout


def test_the_sinks_the_reader_the_layers_and_the_model_tools_need_no_tensorflow():
    """What a JAX user without TensorFlow imports: every module of the sinks,
    the reader, the CLI, the layers' module and the model tools (the layers
    refuse to be made there: tests/test_backends_other.py)."""
    code = WITHOUT_TENSORFLOW + textwrap.dedent("""
        import pkgutil, sys
        import kerasdbg, kerasdbg.sinks

        modules = ["kerasdbg.sinks." + m.name for m in pkgutil.iter_modules(kerasdbg.sinks.__path__)]
        modules += ["kerasdbg.reader", "kerasdbg.offline", "kerasdbg.calibration",
                    "kerasdbg.report", "kerasdbg.cli", "kerasdbg.layers", "kerasdbg.tapping",
                    "kerasdbg.multi_output_model", "kerasdbg._replay", "kerasdbg._keras_graph"]
        for name in modules:
            __import__(name)
        for name in ("load_run", "check_run", "calibrate", "layers", "insert_taps",
                     "strip_debug_layers", "MultiOutputModel", "callbacks", "TraceWriter",
                     "load_trace"):
            getattr(kerasdbg, name)
        from kerasdbg.sinks import tfrecord
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"
                        or m.startswith("kerasdbg.backends"))
        assert not loaded, loaded
        assert "kerasdbg.sinks.events" in modules and "kerasdbg.sinks.layout" in modules
        print(tfrecord.CRC32C)
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300,
                            env=dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "google-crc32c", result.stdout


def test_the_capture_interface_quantities_records_rules_sinks_and_reader_need_no_framework():
    """The shared layers of every backend: the capture interface (with the
    planner and the parts of Keras every backend shares), the quantities, the
    records, the rules, the sinks and the reader import with TensorFlow absent
    (Keras on its NumPy backend, which itself imports JAX), load no backend
    of kerasdbg, and import neither TensorFlow, JAX nor a backend of kerasdbg
    in their source (imports inside functions too)."""
    import ast

    wrong = []
    paths = [os.path.join(directory, name)
             for package in ("capture", "quantities", "records", "rules", "sinks")
             for directory, _, files in os.walk(os.path.join(ROOT, "kerasdbg", package))
             for name in files if name.endswith(".py")]
    paths += [os.path.join(ROOT, "kerasdbg", m + ".py")
              for m in ("reader", "offline", "calibration", "stats", "schedule")]
    for path in paths:
        with open(path) as source:
            tree = ast.parse(source.read())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for imported in names:
                framework = imported.split(".")[0] in ("tensorflow", "jax", "torch")
                # The event writer uses TensorFlow's C++ writer where TensorFlow is
                # already loaded (`sinks/tfrecord.py`), imported there on use.
                if framework and os.sep + "sinks" + os.sep in path and \
                        node.col_offset > 0:
                    continue
                if framework or imported.startswith("kerasdbg.backends"):
                    wrong.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {imported}")
    assert not wrong, wrong
    code = textwrap.dedent("""
        import importlib.abc, pkgutil, sys

        class Blocked(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("tensorflow", "torch"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, Blocked())
        import kerasdbg
        packages = ["capture", "quantities", "records", "rules", "sinks"]
        modules = []
        for package in packages:
            module = __import__("kerasdbg." + package, fromlist=["_"])
            modules += [f"kerasdbg.{package}.{m.name}" for m in pkgutil.iter_modules(module.__path__)]
        modules += ["kerasdbg.reader", "kerasdbg.offline", "kerasdbg.calibration", "kerasdbg.stats",
                    "kerasdbg.schedule"]
        for name in modules:
            __import__(name)
        from kerasdbg import capture
        from kerasdbg.capture import planner
        from kerasdbg.rules import default_rules
        from kerasdbg.schedule import Schedule
        plan = planner.plan(default_rules(), schedule=Schedule(), default_schedule=True,
                            strict=False, owner="test", replicas=1, has_taps=False,
                            freeze=capture.Freeze(), localize=True)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"
                        or m.startswith("kerasdbg.backends"))
        assert not loaded, loaded
        assert "kerasdbg.capture.interface" in modules and "kerasdbg.capture.planner" in modules
        print(sorted({r.kind for r in plan.requests}))
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, KERAS_BACKEND="numpy"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "['gradients', 'step', 'weights']", result.stdout


def test_exported_names_win_over_sub_modules_of_the_same_name():
    result = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import kerasdbg.doctor, kerasdbg.cli  # sub-modules first, as a script may
        import kerasdbg
        assert callable(kerasdbg.doctor) and kerasdbg.doctor.__name__ == "doctor"
        assert kerasdbg.check_run.__module__ == "kerasdbg.offline"
        assert sorted(kerasdbg.__all__) == sorted(n for n in dir(kerasdbg) if n in kerasdbg.__all__)
        print("ok")
    """)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# The layers of kerasdbg, lowest first: a module imports only from its own
# layer or lower ones (checked on the source, imports inside functions too).
LAYERS = [
    # what any backend shares: argument checks, tags and records, schedules,
    # the statistics (against kerasdbg.quantities.ops) and the rules
    ("foundation", ["kerasdbg._validation", "kerasdbg._qualified", "kerasdbg.records",
                    "kerasdbg.schedule", "kerasdbg.quantities", "kerasdbg.stats",
                    "kerasdbg.errors"]),
    ("rules", ["kerasdbg.rules"]),
    # where records go: event files, the analysis store, TensorBoard's layouts
    ("sinks", ["kerasdbg.sinks"]),
    # the capture: the interface the shells use and the backends behind it
    ("capture", ["kerasdbg.capture", "kerasdbg.backends", "kerasdbg._replay",
                 "kerasdbg._keras_graph"]),
    # what users hold: callbacks, layers and model tools
    ("shells", ["kerasdbg.layers", "kerasdbg.callbacks", "kerasdbg.trace",
                "kerasdbg.tapping", "kerasdbg.multi_output_model", "kerasdbg.determinism",
                "kerasdbg.doctor", "kerasdbg.compat"]),
    # reading runs back
    ("reader", ["kerasdbg.reader", "kerasdbg.offline", "kerasdbg.calibration", "kerasdbg.report",
                "kerasdbg.demo", "kerasdbg.cli", "kerasdbg"]),
]


def _layer_of(module: str) -> int:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best[0]


def _imports(path: str, module: str):
    import ast

    with open(path) as source:
        tree = ast.parse(source.read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base == "kerasdbg":
                for alias in node.names:
                    yield f"kerasdbg.{alias.name}"
            elif base.startswith("kerasdbg."):
                yield base
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kerasdbg."):
                    yield alias.name
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("_lazy.module") \
                and node.args and isinstance(node.args[0], ast.Constant) \
                and str(node.args[0].value).startswith("kerasdbg."):
            yield node.args[0].value  # imported on first use (kerasdbg.layers._lazy)


def test_imports_run_from_higher_layers_to_lower_ones_only():
    package = os.path.join(ROOT, "kerasdbg")
    wrong = []
    for directory, _, files in os.walk(package):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            module = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
            module = module[:-len(".__init__")] if module.endswith(".__init__") else module
            own = _layer_of(module)
            for imported in _imports(path, module):
                if _layer_of(imported) > own:
                    wrong.append(f"{module} ({LAYERS[own][0]}) imports {imported} "
                                 f"({LAYERS[_layer_of(imported)][0]})")
    assert not wrong, "\n".join(wrong)


def test_the_tensorflow_engines_parts_read_it_through_its_view_only():
    """`Quantities`, `Faults` and `Collector` read the TensorFlow engine
    through the `EngineView` it hands them: no private member of the view,
    no reference to the engine itself, and its class named in annotations
    only (checked on the source)."""
    import ast

    wrong = []
    for name in ("quantities", "faults", "collect"):
        path = os.path.join(ROOT, "kerasdbg", "backends", "tensorflow", name + ".py")
        with open(path) as source:
            tree = ast.parse(source.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == \
                    "kerasdbg.backends.tensorflow.engine":
                wrong += [f"{name}:{node.lineno}: imports {a.name}" for a in node.names
                          if a.name == "Engine"]
            elif isinstance(node, ast.Attribute) and (node.attr == "engine" or (
                    ast.unparse(node.value) == "self._view" and node.attr.startswith("_"))):
                wrong.append(f"{name}:{node.lineno}: reads {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)
