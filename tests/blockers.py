"""Code for fresh interpreters that the tests start, importing no framework
(the JAX run imports no TensorFlow)."""

import textwrap

# A machine without TensorFlow, for code run in a fresh interpreter: `import
# tensorflow` fails there as it does where TensorFlow is not installed, and
# `importlib.util.find_spec` finds nothing (Keras, TensorBoard and JAX are there).
WITHOUT_TENSORFLOW = textwrap.dedent("""
    import importlib.abc, sys

    class WithoutTensorFlow(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "tensorflow":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, WithoutTensorFlow())
""")
