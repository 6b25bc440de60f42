"""The README's main job: two small trainings instrumented for TensorBoard.

A healthy run and one with a learning rate far too high, side by side, each
with `GradientStatistics`, `WeightStatistics`, taps after the ReLU layers
(`insert_taps` + `ActivationStatistics`), two `StopOnRule`s (one stops
training at a non-finite loss or gradient, keeping the weights of the last
good step and naming the layer where the NaN arose; one only warns of dead
ReLU units), in one log directory. Each run also gets a `kerasdbg report`
page. Synthetic data, so nothing is downloaded; no TensorFlow needed (the
epoch logs and the learning rate are `StopOnRule`'s records).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Dict

import numpy as np


def make_data(samples: int = 1920, seed: int = 0):
    """28x28 noise images with a bright 6x6 square whose place is the class."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, samples)
    images = rng.normal(0.0, 0.3, (samples, 28, 28, 1)).astype("float32")
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 5)
        top, left = 3 + row * 12, 1 + col * 5
        images[i, top:top + 6, left:left + 6, 0] += 1.5
    return images, labels.astype("int32")


def make_model():
    """The CNN of TensorFlow's distributed-training tutorial."""
    import keras

    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu", name="conv1"),
            keras.layers.MaxPooling2D(name="pool1"),
            keras.layers.Conv2D(64, 3, activation="relu", name="conv2"),
            keras.layers.MaxPooling2D(name="pool2"),
            keras.layers.Flatten(name="flatten"),
            keras.layers.Dense(64, activation="relu", name="dense"),
            keras.layers.Dense(10, name="logits"),
        ],
        name="cnn",
    )


def train(log_dir: str, learning_rate: float, epochs: int, optimizer: str = "adam"):
    """Trains the CNN with the instruments; returns the gradient statistics, the
    verdicts of the rules (in step order), whether a rule stopped the
    training, and the model."""
    import keras

    from kerasdbg import insert_taps
    from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StepTimer
    from kerasdbg.callbacks import StopOnRule
    from kerasdbg.callbacks import WeightStatistics
    from kerasdbg.layers import TapLayer
    from kerasdbg.rules import RuleWarning, default_rules

    keras.utils.set_random_seed(0)
    images, labels = make_data()
    # A tap after each ReLU layer: activation statistics, dead units, histograms.
    model = insert_taps(make_model(), layers=r"^conv\d$|^dense$",
                        tap=TapLayer(histogram=True))
    model.compile(
        optimizer=keras.optimizers.get({"class_name": optimizer,
                                        "config": {"learning_rate": float(learning_rate)}}),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    gradients = GradientStatistics(log_dir, histogram_every_n_steps=2)
    weights = WeightStatistics(log_dir, histogram_every_n_steps=2)
    # The default rules (those of `StopOnRule()` and `kerasdbg check`; one replica).
    rules = default_rules(without=["replicas"])
    # Stop at a non-finite loss or gradient: the faulty step does not reach the
    # weights, and the first layer whose output held NaN/Inf is named.
    stop = StopOnRule([r for r in rules if r.watches_nonfinite], log_dir=log_dir, verbose=False)
    # The others (dead ReLU units, update ratios) are worth knowing about, not
    # worth stopping for: warn.
    watch = StopOnRule([r for r in rules if not r.watches_nonfinite], action="warn",
                       log_dir=log_dir, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleWarning)  # the demo prints the verdicts itself
        model.fit(
            images,
            labels,
            batch_size=64,
            epochs=epochs,
            validation_split=0.1,
            verbose=0,
            callbacks=[gradients, weights, ActivationStatistics(log_dir), StepTimer(log_dir),
                       stop, watch],
        )
    verdicts = sorted(watch.verdicts + stop.verdicts, key=lambda verdict: verdict.step)
    return gradients, verdicts, bool(stop.verdicts), model


def dead_units(model) -> str:
    """The taps' dead-ReLU fractions at their last recorded step."""
    from kerasdbg.callbacks.activation_statistics import find_taps

    parts = []
    for tap in find_taps(model):
        latest = tap.latest_by_mode.get("fit")
        if latest and "dead_fraction" in latest:
            parts.append(f"{tap.name.removesuffix('_tap')} {100 * latest['dead_fraction']:.0f}%")
    return "    dead ReLU units at the last recorded step: " + ", ".join(parts)


def summarize(name: str, gradients) -> str:
    """A few lines on what the gradient statistics show."""
    import pandas as pd

    from kerasdbg.report import first_positive_step, median_norms, median_window

    history = gradients.history.set_index("step")
    lines = [f"  {name}: {len(history)} steps recorded"]
    # The norms leave NaN/Inf out (they are counted): a step with any is not "finite".
    counts = history.filter(regex=r"/(nan|inf)_count$").fillna(0).to_numpy()
    finite = np.isfinite(history["global_norm"].to_numpy()) & (counts.sum(axis=1) == 0)
    if finite.any():
        step = history.index[finite][-1]
        lines.append(f"    global gradient norm at the last step without NaN/Inf: "
                     f"{history['global_norm'][step]:.4g} (step {step})")
    bad = first_positive_step(history.filter(like="/nan_count"))
    if bad is not None:
        lines.append(f"    first step with a NaN gradient: {bad}")
    # The report's medians: over the steps before the run began to explode, said so.
    end, why = median_window({"loss": pd.DataFrame(), "global_norm": history[["global_norm"]],
                              "nan_counts": history.filter(regex=r"/(nan|inf)_count$")})
    median = median_norms(history.filter(like="/l2_norm"), before=end)
    median.index = [name.removesuffix("/l2_norm") for name in median.index]
    kept = [int(s) for s in history.index if end is None or s < end]
    over = ("" if end is None or not kept else
            f" ({'step' if len(kept) == 1 else 'steps'} {kept[0]}"
            f"{'' if len(kept) == 1 else f'-{kept[-1]}'}, {why})")
    if len(median):
        lines.append(f"    largest median gradient norm{over}:  {median.index[-1]} "
                     f"({median.iloc[-1]:.3g})")
        lines.append(f"    smallest median gradient norm{' (same steps)' if over else ''}: "
                     f"{median.index[0]} ({median.iloc[0]:.3g})")
    elif end is not None:
        lines.append(f"    median gradient norms: none finite before step {end}")
    return "\n".join(lines)


def _writable(out: str) -> None:
    """Makes `out` and writes a file in it, or says in one line why it cannot."""
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise OSError(f"run_demo: `out` must be a directory it can write in "
                      f"({error.strerror or error}). Received: out={out!r}") from error


def _runs(log_dir: str) -> list:
    from kerasdbg.reader import load_run

    return load_run(log_dir).runs if os.path.isdir(log_dir) else []


def new_run(log_dir: str, before: list) -> str:
    """The run a training wrote in `log_dir`, whose runs were `before` it: a
    demo run again in the same `--out` is another training, a run of its own
    (`train-2`, ...), and its report is of that run.

    Examples:
        >>> import os, tempfile
        >>> from kerasdbg.demo import new_run
        >>> new_run(tempfile.mkdtemp(), [])
        'train'
    """
    kept = set(before)
    new = [name for name in _runs(log_dir) if name not in kept and name.startswith("train-")]
    return new[-1] if new else "train"


def run_demo(out: str = "runs/demo", epochs: int = 3) -> Dict[str, str]:
    """Writes the demo's log directories under `out` and prints how to open them.

    Returns:
        The run name -> log directory.

    Raises:
        OSError: `out` cannot be made or written in (said before any
            training), or a report could not be written in it.
    """
    from kerasdbg.report import write_report

    _writable(out)

    runs = {
        "healthy": dict(learning_rate=1e-3, optimizer="adam"),
        "lr_too_high": dict(learning_rate=30.0, optimizer="sgd"),
    }
    dirs = {}
    print(f"kerasdbg demo: training a small CNN twice ({epochs} epochs each) ...", flush=True)
    for name, settings in runs.items():
        log_dir = os.path.join(out, name)
        before = _runs(log_dir)
        # Said before the run: its first step traces the instrumented train step
        # (seconds; a longer one says so itself, `kerasdbg.capture.progress`).
        print(f"  {name}: training with {settings['optimizer']}, learning rate "
              f"{settings['learning_rate']:g} ...", flush=True)
        gradients, verdicts, stopped, model = train(log_dir, epochs=epochs, **settings)
        print(summarize(name, gradients))
        print(dead_units(model))
        for verdict in verdicts:
            print(f"    rule: {verdict.reason}")
        if not verdicts:
            print("    rules: none fired")
        if stopped:
            # The optimizer counts none of the frozen steps: the step as kerasdbg numbers it.
            from kerasdbg.capture import keras_objects

            step = keras_objects.step_number(model.optimizer)
            print(f"    stopped by StopOnRule after step {step}; the weights are those before "
                  "the fault (frozen there)")
        try:
            print(f"    report: {write_report(log_dir, run_name=new_run(log_dir, before))}")
        except OSError as error:
            raise OSError(f"run_demo: could not write the report of {log_dir!r} "
                          f"({error.strerror or error})") from error
        dirs[name] = log_dir
    absolute = os.path.abspath(out)
    print(f"\nTensorBoard logs written to {absolute}")
    print(f"Open them with:\n  tensorboard --logdir {absolute}\nthen browse http://localhost:6006 "
          "(the KERASDBG tab: which layer went wrong and when, per run, and the two runs "
          "side by side; Custom Scalars: the loss, the gradient norms and update ratios per "
          "group of layers beside their log10, the variable holding the largest norm, dead units, the "
          "step time; Scalars: every tag; Histograms; Text: the verdicts in step order). "
          "Or open each run's report.html.")
    if len(dirs) == 2:
        print("Compare the two runs (where they part, loss and norms overlaid):\n  kerasdbg report "
              + " ".join(os.path.abspath(d) for d in dirs.values()))
    return dirs


if __name__ == "__main__":  # pragma: no cover
    run_demo()
