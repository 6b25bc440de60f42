"""The boundary between the instruments and the backends' captures.

The callbacks (`kerasdbg/callbacks/`) and the debug layers
(`kerasdbg/layers/`) talk to a backend through `kerasdbg.capture`'s
interface (`Capture`, `FaultState`): they import no framework and no
`kerasdbg.backends` module, and do not probe a capture for what it offers
(`getattr`/`hasattr` on an engine or its fault state). What still crosses
the boundary is listed here, to move behind the interface; the test fails
for anything new, and for anything listed that no longer crosses it (the
list only shrinks).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "kerasdbg"
FRAMEWORKS = ("tensorflow", "jax", "torch", "kerasdbg.backends")
PROBED = ("engine", "faults", "capture", "collector")

# module -> what it imports across the boundary (or loads with `_lazy.module`).
STILL_CROSSING = {
    "callbacks/step_timer.py": {"tensorflow", "kerasdbg.backends.tensorflow.buffers",
                                "kerasdbg.backends.tensorflow.variable_reads"},
    "layers/_debug_layer.py": {"tensorflow", "kerasdbg.backends.tensorflow.buffers",
                               "kerasdbg.backends.tensorflow.graph_functions",
                               "kerasdbg.backends.tensorflow.variable_reads",
                               "kerasdbg.backends.tensorflow.layer_sink",
                               "kerasdbg.backends.jax.layer_record",
                               "kerasdbg.backends.jax.layer_sink"},
    "layers/print_layer.py": {"tensorflow", "kerasdbg.backends.tensorflow.buffers",
                              "kerasdbg.backends.tensorflow.graph_functions"},
    "layers/tap_layer.py": {"tensorflow", "kerasdbg.backends.tensorflow.buffers",
                            "kerasdbg.backends.jax.layer_record"},
}


def _crossing(tree: ast.AST) -> set:
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] if node.module != "kerasdbg.backends" else \
                [f"{node.module}.{alias.name}" for alias in node.names]
            if node.module.startswith("kerasdbg.backends.") and node.module.count(".") == 2:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            called = ast.unparse(node.func)
            if called.endswith(("_lazy.module", "import_module")):
                names = [node.args[0].value]
        found.update(n for n in names if n.split(".")[0] in ("tensorflow", "jax", "torch")
                     or n.startswith("kerasdbg.backends"))
    return found


def _probes(tree: ast.AST) -> list:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr") and node.args:
            target = ast.unparse(node.args[0])
            if any(word in target.lower() for word in PROBED):
                out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def _modules():
    for folder in ("callbacks", "layers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def test_the_instruments_import_no_framework_and_no_backend_but_what_is_listed():
    crossing = {name: found for name, tree in _modules() if (found := _crossing(tree))}
    assert crossing == STILL_CROSSING


def test_the_instruments_do_not_probe_a_capture_for_what_it_offers():
    probes = {name: found for name, tree in _modules() if (found := _probes(tree))}
    assert probes == {}


def test_the_check_sees_each_kind_of_crossing():
    # What the two tests above look for, found in a module written for it.
    source = (
        "import tensorflow as tf\n"
        "from jax import numpy\n"
        "from kerasdbg.backends import jax\n"
        "from kerasdbg.backends.tensorflow import buffers\n"
        "x = _lazy.module('kerasdbg.backends.jax.layer_sink')\n"
        "y = importlib.import_module('torch')\n"
        "if hasattr(engine, 'tensor_request'): pass\n"
        "z = getattr(self._engine.faults, 'snapshot', None)\n"
        "w = getattr(layer, 'kerasdbg_debug_layer', False)\n")
    tree = ast.parse(source)
    assert _crossing(tree) == {"tensorflow", "jax", "kerasdbg.backends.jax",
                               "kerasdbg.backends.tensorflow.buffers",
                               "kerasdbg.backends.jax.layer_sink", "torch"}
    assert len(_probes(tree)) == 2
