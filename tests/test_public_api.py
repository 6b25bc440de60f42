"""Every public name imports, has a docstring with an example, and it runs."""

import doctest
import importlib
import types

import pytest

MODULES = ["kerasdbg", "kerasdbg.callbacks", "kerasdbg.layers", "kerasdbg.rules", "kerasdbg.report",
           "kerasdbg.run_comparison", "kerasdbg.rules.remedies",
           "kerasdbg.compat", "kerasdbg.dashboard"]
EXTRA = ["kerasdbg.stats.tensor_statistics", "kerasdbg.stats.histograms", "kerasdbg.reader.Run",
         "kerasdbg.reader.Tensor", "kerasdbg.reader.Run.scalar_table",
         "kerasdbg.reader.Run.tensor_names", "kerasdbg.rules.rule.make_verdict",
         "kerasdbg.rules.loss_rules.Plateau"]


def _public():
    names = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        assert isinstance(module.__all__, tuple)
        for name in module.__all__:
            obj = getattr(module, name)
            if not isinstance(obj, types.ModuleType):  # sub-modules: by their own __all__
                names.append(f"{module_name}.{name}")
    return sorted(set(names + EXTRA))


def _resolve(dotted):
    """A module attribute, or a class attribute (`module.Class.method`)."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("dotted", _public())
def test_docstring_has_an_example_that_runs(dotted):
    obj = _resolve(dotted)
    assert obj.__doc__ and ">>>" in obj.__doc__, f"{dotted} needs a docstring with an example"
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(obj, dotted, globs={}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0, f"doctest of {dotted} failed"
