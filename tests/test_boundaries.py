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
        from kerasdbg import _tags, _validation
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


def test_an_instrument_without_tensorflow_says_how_to_install_it():
    result = _run("""
        import kerasdbg
        try:
            kerasdbg.callbacks
        except ImportError as error:
            print(error)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("kerasdbg.callbacks needs TensorFlow >= 2.16. Install it "
                                    "with `pip install kerasdbg[cpu]`"), result.stdout


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
