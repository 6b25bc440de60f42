"""Every notebook in notebooks/ runs from top to bottom (nbclient), without errors."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

# What each notebook must show, beyond running without an error.
EXPECTED_OUTPUT = {
    "01_print_and_tap.ipynb": [
        "kerasdbg fit step 4 replica 0 | hidden | shape (32, 16) | mean=",
        "kerasdbg fit step 8 replica 0 | hidden",
        "activations/hidden_tap/dead_fraction",
        "'dense_1_tap'",
        "'dense_1': (5, 32)",
    ],
    "02_rules.ipynb": [
        "kerasdbg: VanishingGradient at step 1: mean |gradient| below 1e-07",
        "optimizer steps run: 1",
        "kerasdbg: NonFiniteLoss at step 4: the loss is nan",
        "NaNSource at step 4: the first layer whose output held NaN/Inf is 'out'",
        "steps run: 8 | weights finite: True",
        "| NonFiniteLoss | 4 | step/loss |",
        "kerasdbg: DeadReLU at step 4: dead_fraction at or above 0.5: hidden_tap=1",
        "Verdict(rule='NonFiniteLoss', step=4",
    ],
    "03_gradient_and_weight_statistics.ipynb": [
        "sigmoid steps recorded: 32",
        "relu: first layer / last layer gradient norm = ",
        "Tensor('gradients/sigmoid8/dense0/kernel'",
        "first non-finite step: none",
        "smallest mean gradient norms: sigmoid8/dense0",
        "<IPython.core.display.Image object>",
    ],
    "04_strategies_and_steps_per_execution.ipynb": [
        "default, spe=1                 steps [1, 2, 3, 4, 5, 6, 7, 8]  global norm at step 8: ",
        "Mirrored (2 replicas), spe=4   steps [1, 2, 3, 4, 5, 6, 7, 8]  global norm at step 8: ",
        "the three agree at every step: True",
        "default + XLA: [6, 7, 8]",
        "Mirrored + XLA fails in Keras: InvalidArgumentError Trying to access resource",
        "plain Keras fit fails: InvalidArgumentError",
        "You must feed a value for placeholder tensor",
    ],
    "05_migration_equivalence.ipynb": [
        "['gradients/hidden/kernel:0', 'gradients/hidden/bias:0',",
        "MATCH: 12 tensors over 3 steps (36 comparisons) within the policy",
        "loss at step 1",
        "DIVERGED: first at step 1, loss: max abs diff",
        "exit status: 1",
    ],
}


def test_every_notebook_is_listed():
    assert NOTEBOOKS, "no notebooks found"
    assert {path.name for path in NOTEBOOKS} == set(EXPECTED_OUTPUT)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    text = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            assert output.get("output_type") != "error", output
            text.append(output.get("text", ""))
            text.append(str(output.get("data", {}).get("text/plain", "")))
    shown = "\n".join(text)
    for expected in EXPECTED_OUTPUT[path.name]:
        assert expected in shown, f"{path.name} does not show {expected!r}"
    assert "kerasdbg fit step 1 replica" not in shown  # every_n_steps=4
