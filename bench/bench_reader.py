"""Reading large runs: the first query, its peak memory, and `kerasdbg report`.

    python bench/bench_reader.py [--steps 5000] [--mlp-steps 3000] [--keep DIR]

Writes, in a temporary directory (or `--keep DIR`):
- "resnet50": a synthetic run with ResNet50's variable paths (64x64 inputs,
  10 classes) as the default statistics callbacks at every step write it:
  one write per step of the gradients' statistics, one of the weights'
  (with the update ratio and distance), each tensor with the 9 statistics;
  `--steps` steps (5000: about 20 million values);
- "mlp60": a 60-layer MLP (120 variables) trained `--mlp-steps` steps with
  `GradientStatistics` and `WeightStatistics` at every step;
- "events-only": the first 500 steps of "resnet50" without the analysis
  store (a run written before it), for the reading that TensorBoard's event
  files alone allow.

Each query runs in a fresh Python process, which reports its wall time and
its peak resident memory (VmHWM), and the same after the imports alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

QUERY = r"gradients/.*/l2_norm"

_CHILD = r"""
import os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
import kerasdbg
from kerasdbg import load_run
base = peak()
start = time.perf_counter()
frame = load_run(sys.argv[1]).scalars(sys.argv[2])
took = time.perf_counter() - start
print(f"{took:.2f} {peak():.0f} {base:.0f} {len(frame)}")
"""


def _query(log_dir: str, pattern: str = QUERY):
    out = subprocess.run([sys.executable, "-c", _CHILD, log_dir, pattern], check=True,
                         capture_output=True, text=True, timeout=3600).stdout.split()
    seconds, peak, base, rows = float(out[0]), float(out[1]), float(out[2]), int(out[3])
    return seconds, peak, base, rows


def _resnet_tags():
    import keras

    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
    return [v.path for v in model.trainable_variables], [v.path for v in model.weights]


STATS = ("l2_norm", "mean", "std", "min", "max", "mean_abs", "zero_fraction", "nan_count",
         "inf_count")


def write_resnet(log_dir: str, steps: int) -> int:
    import numpy as np

    from kerasdbg.sinks import events as _events

    trainable, weights = _resnet_tags()
    gradient_tags = [f"gradients/{p}/{s}" for p in trainable for s in STATS]
    gradient_tags.append("gradients/global_norm")
    weight_tags = [f"weights/{p}/{s}" for p in weights
                   for s in STATS + ("update_ratio", "distance_from_start")]
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    rng = np.random.default_rng(0)
    g = rng.random(len(gradient_tags))
    w = rng.random(len(weight_tags))
    for step in range(1, steps + 1):
        writer.write(step, dict(zip(gradient_tags, g * (1 + 1e-4 * step))))
        writer.write(step, dict(zip(weight_tags, w * (1 - 1e-5 * step))))
    writer.close()
    return steps * (len(gradient_tags) + len(weight_tags))


def write_mlp(log_dir: str, steps: int) -> int:
    import keras
    import numpy as np

    from kerasdbg.callbacks import GradientStatistics, WeightStatistics

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,))] + [
        keras.layers.Dense(16, activation="relu") for _ in range(59)] + [keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    x = np.random.default_rng(0).normal(size=(steps * 8, 16)).astype("float32")
    y = np.random.default_rng(1).normal(size=(steps * 8, 1)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
        GradientStatistics(log_dir, every_n_steps=1), WeightStatistics(log_dir, every_n_steps=1)])
    from kerasdbg.sinks import events as _events

    for writer in list(_events._WRITERS.values()):
        writer.flush()
    return len(model.trainable_variables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--mlp-steps", type=int, default=3000)
    parser.add_argument("--keep", default=None)
    args = parser.parse_args()
    root = args.keep or tempfile.mkdtemp(prefix="kerasdbg-bench-reader-")
    try:
        resnet = os.path.join(root, "resnet50")
        start = time.perf_counter()
        values = write_resnet(resnet, args.steps)
        print(f"resnet50: {values / 1e6:.1f} M values written in "
              f"{time.perf_counter() - start:.0f} s")
        seconds, peak, base, rows = _query(resnet)
        print(f"resnet50 first query {QUERY!r}: {seconds:.2f} s, {rows} rows, peak RSS "
              f"{peak:.0f} MB ({peak - base:.0f} MB over the {base:.0f} MB of the imports)")
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kerasdbg.cli", "report", resnet, "--out",
                        os.path.join(root, "report")], check=True, capture_output=True,
                       timeout=3600)
        print(f"resnet50 kerasdbg report: {time.perf_counter() - start:.1f} s")

        old = os.path.join(root, "events-only")
        write_resnet(old, 500)
        for directory, names, _ in os.walk(old):
            if "kerasdbg-store" in names:
                shutil.rmtree(os.path.join(directory, "kerasdbg-store"))
        seconds, peak, base, rows = _query(old)
        print(f"events only, 500 steps ({rows} rows): {seconds:.2f} s, peak RSS {peak:.0f} MB "
              f"({peak - base:.0f} MB over the imports)")

        mlp = os.path.join(root, "mlp60")
        start = time.perf_counter()
        write_mlp(mlp, args.mlp_steps)
        print(f"mlp60: trained {args.mlp_steps} steps in {time.perf_counter() - start:.0f} s")
        seconds, peak, base, rows = _query(mlp)
        print(f"mlp60 first query {QUERY!r}: {seconds:.2f} s, {rows} rows, peak RSS "
              f"{peak:.0f} MB ({peak - base:.0f} MB over the imports)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
