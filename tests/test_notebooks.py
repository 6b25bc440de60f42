"""Every notebook in notebooks/ runs from top to bottom (nbclient), without errors, and is
stored with the outputs of its current code (the documentation site shows them as stored)."""

import importlib.util
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_TOTAL_BYTES = 2_000_000


def _load_execute_script():
    """docs/execute_notebooks.py, the script that stores the notebooks, as a module."""
    spec = importlib.util.spec_from_file_location(
        "execute_notebooks", ROOT / "docs" / "execute_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXECUTE = _load_execute_script()

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
        "kerasdbg: VanishingGradient at step 2: mean |gradient| below 1e-07 and update/weight "
        "ratio below 1e-08",
        "optimizer steps run: 2",
        "kerasdbg: NonFiniteLoss at step 4: the loss is nan",
        "NaNSource at step 4: the first layer whose output held NaN/Inf is 'out'",
        "optimizer steps counted: 3 | weights finite: True",
        "- **step 4 · NonFiniteLoss**: the loss is nan",
        "kerasdbg: DeadReLU at step 4: dead_fraction at or above 0.5: hidden_tap=1",
        "Verdict(rule='NonFiniteLoss', step=4",
    ],
    "03_gradient_and_weight_statistics.ipynb": [
        "sigmoid steps recorded: 32",
        "relu: first layer / last layer gradient norm = ",
        "Tensor('gradients/sigmoid8/dense0/kernel'",
        "first non-finite step: none",
        "smallest median gradient norms (same steps): sigmoid8/dense0",
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
    "06_keep_a_long_run_alive.ipynb": [
        "kerasdbg: LossSpike at step 150: the loss ",
        "; the step was skipped",
        "skipped steps: [150] | history: [1] | iterations: 199",
        "same weights as plain Keras without batch 150: True",
        "verdicts: [] | skipped steps: []",
        "No verdict: LossSpike, GradientNormSpike, ",
        "rolled back to step 120, skipping the next 10 batches",
        "rollbacks (step, to step): [(150, 120)]",
        "skipped after the rollback: steps 121-130 | iterations: 158",
        "same weights as plain Keras on batches 1-120 and 163-200: True",
        "train   121  121-150",
        "rolled back: training restarted at step 121 (1 time); steps 121-150 of the abandoned run",
        "<Figure size 1000x340 with 2 Axes>",
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
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            assert output.get("output_type") != "error", output
    shown = _shown(notebook)
    for expected in EXPECTED_OUTPUT[path.name]:
        assert expected in shown, f"{path.name} does not show {expected!r}"
    assert "kerasdbg fit step 1 replica" not in shown  # every_n_steps=4


def _shown(notebook) -> str:
    """The text of a notebook's outputs: streams and the plain-text form of results."""
    text = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            text.append(output.get("text", ""))
            text.append(str(output.get("data", {}).get("text/plain", "")))
    return "\n".join(text)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_is_stored_with_the_outputs_of_its_code(path):
    notebook = nbformat.read(path, as_version=4)
    run = f"run `{EXECUTE.COMMAND} notebooks/{path.name}` and commit the notebook"
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name} is stored with execution counts {counts}, not 1 to {len(code)} in order "
        f"(not executed, or executed out of order): {run}"
    )
    errors = [f"cell {cell.execution_count}: {output.get('ename')}: {output.get('evalue')}"
              for cell in code for output in cell.outputs if output.output_type == "error"]
    assert not errors, f"{path.name} is stored with errors: {errors}"
    executed = notebook.metadata.get(EXECUTE.METADATA_KEY, {}).get(EXECUTE.HASH_KEY)
    assert executed == EXECUTE.sources_hash(notebook), (
        f"{path.name}'s code cells are not the ones its stored outputs came from "
        f"(edited since, or never executed by the script): {run}"
    )
    shown = _shown(notebook)
    missing = [expected for expected in EXPECTED_OUTPUT[path.name] if expected not in shown]
    assert not missing, f"{path.name}'s stored outputs do not show {missing}: {run}"


def test_stored_notebooks_stay_small():
    sizes = {path.name: path.stat().st_size for path in NOTEBOOKS}
    assert sum(sizes.values()) < MAX_TOTAL_BYTES, (
        f"notebooks/ holds {sum(sizes.values())} bytes (over {MAX_TOTAL_BYTES}): {sizes}; "
        "show fewer or smaller plots"
    )
