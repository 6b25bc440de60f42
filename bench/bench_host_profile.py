"""Where the host's time goes per step, in microseconds, with and without kerasdbg.

On the bench's MLP (a step under a millisecond on a CPU, the proxy of an
accelerator's step, where what costs is the host's work), one fit per
configuration, timed, then a second one under `cProfile`. It prints the
steady step time of each (unprofiled), then the profiled time per step of
each part of the host's work, from the functions' own time (`tottime`),
grouped by where the code lives:

- "the step (device + dispatch)": the call of the compiled train function
  (on a CPU the device's work is the host's: the statistics computed in the
  step are in here);
- "Keras's loop": Keras's own Python around the step (`keras/`);
- "capture: read + decode": kerasdbg's capture reading and decoding rows;
- "statistics callbacks", "views (Custom Scalars)", "events + store",
  "rules (StopOnRule)", "taps", "other kerasdbg";
- "other": NumPy, JAX and TensorFlow Python, the standard library.

The profiler slows Python more than compiled code, so the parts are for
comparing, and the unprofiled step times say what a part costs for real.

Usage:
    python bench/bench_host_profile.py --configs plain defaults stop stop+defaults --spe 1 16
    KERAS_BACKEND=jax python bench/bench_host_profile.py
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from bench_statistics import _callbacks, _model  # noqa: E402

PARTS = (
    # Where the compiled step runs (a jitted call has no frame of its own:
    # its time is its caller's): kerasdbg's jitted step, Keras's JAX loop
    # function that calls the plain one, TensorFlow's eager execute.
    ("the step (device + dispatch)", (), (("jax/packing.py:", "(call)"),
                                          ("keras/src/backend/jax/trainer.py", "(iterator_step)"),
                                          ("keras/src/backend/jax/trainer.py", "(one_train_step)"),
                                          # the variant of kerasdbg's step compiled ahead
                                          ("jax/_src/stages.py:", "(__call__)"),
                                          ("TFE_Py_Execute",), ("_pywrap_tfe",))),
    ("capture: read + decode", ("kerasdbg/backends/", "kerasdbg/capture/requests",
                                "kerasdbg/capture/reads", "kerasdbg/capture/keras_objects",
                                "kerasdbg/capture/interface", "kerasdbg/capture/progress"), ()),
    ("statistics callbacks", ("kerasdbg/callbacks/_statistics", "kerasdbg/callbacks/_recording",
                              "kerasdbg/callbacks/gradient_", "kerasdbg/callbacks/weight_"), ()),
    ("views (Custom Scalars)", ("kerasdbg/sinks/layout",), ()),
    ("events + store", ("kerasdbg/sinks/events", "kerasdbg/sinks/store", "kerasdbg/sinks/tfrecord",
                        "_pywrap_record_io", "SerializeToString", "CopyFrom", "protobuf"), ()),
    ("rules (StopOnRule)", ("kerasdbg/rules/", "kerasdbg/capture/step_rows",
                            "kerasdbg/callbacks/stop_on_rule", "kerasdbg/records/"), ()),
    ("taps", ("kerasdbg/layers/", "kerasdbg/callbacks/activation"), ()),
    ("other kerasdbg", ("kerasdbg/",), ()),
    ("Keras's loop", ("keras/src/",), ()),
)


def _part(location: str) -> str:
    for name, needles, alternatives in PARTS:
        if any(all(n in location for n in alternative) for alternative in alternatives):
            return name
        if any(n in location for n in needles):
            return name
    return "other"


def _fit(model, x, y, batch, config, profile=None):
    with tempfile.TemporaryDirectory() as log_dir:
        callbacks = _callbacks(config, log_dir)
        begin = time.perf_counter()
        if profile is not None:
            profile.enable()
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                  callbacks=callbacks)
        if profile is not None:
            profile.disable()
        return time.perf_counter() - begin


def measure(config: str, spe: int, steps: int):
    keras.utils.set_random_seed(0)
    model, shape, batch = _model("mlp")
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    x = np.random.default_rng(0).normal(size=(batch * steps, *shape)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, batch * steps)
    warm = batch * spe * 4
    _fit(model, x[:warm], y[:warm], batch, config)  # the trace and compile
    seconds = _fit(model, x, y, batch, config)
    profile = cProfile.Profile()
    _fit(model, x, y, batch, config, profile)
    parts: dict = {}
    for (filename, line, function), (_, _, tottime, _, _) in pstats.Stats(profile).stats.items():
        part = _part(f"{filename}:{line}({function})")
        parts[part] = parts.get(part, 0.0) + tottime
    return seconds / steps, {k: v / steps for k, v in parts.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["plain", "defaults", "stop",
                                                         "stop+defaults"])
    parser.add_argument("--spe", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--steps", type=int, default=960)
    args = parser.parse_args()
    backend = keras.backend.backend()
    names = [p[0] for p in PARTS] + ["other"]
    for spe in args.spe:
        results = {c: measure(c, spe, args.steps) for c in args.configs}
        print(f"\n{backend}: MLP, steps_per_execution={spe}, {args.steps} steps "
              "(us per step; the parts are profiled)")
        print(f"  {'':30s}" + "".join(f"{c:>15s}" for c in args.configs))
        print(f"  {'step, unprofiled':30s}" + "".join(
            f"{1e6 * results[c][0]:15.1f}" for c in args.configs))
        for name in names:
            print(f"  {name:30s}" + "".join(
                f"{1e6 * results[c][1].get(name, 0.0):15.1f}" for c in args.configs))


if __name__ == "__main__":
    main()
