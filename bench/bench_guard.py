"""What each part of the in-graph guard costs, measured alone (TensorFlow).

On the bench's CNN (`bench_statistics.py`'s), each configuration's steady
step time over plain `fit`'s, in interleaved rounds (median of `--repeats`):

- "defaults": `GradientStatistics` + `WeightStatistics` (the reference);
- "nan_guard+defaults": + `StopOnRule(NonFiniteLoss())` (the fault test,
  the loss of each step, the rules on the host at each execution);
- "loss_spike+defaults": + `StopOnRule(LossSpike())` (one window in the
  graph, the weights frozen at a spike);
- "spikes+defaults": + `StopOnRule([LossSpike(), GradientNormSpike()])`
  (the global gradient norm and two windows);
- "skip+defaults": the same with `action="skip"` (the skip flags, the
  skipped count, the skip in the apply).

Usage: python bench/bench_guard.py --spe 1 16 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from bench_statistics import _Timer, _model  # noqa: E402
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics  # noqa: E402
from kerasdbg.rules import GradientNormSpike, LossSpike, NonFiniteLoss  # noqa: E402

CONFIGS = ("plain", "defaults", "nan_guard+defaults", "loss_spike+defaults", "spikes+defaults",
           "skip+defaults")


def _callbacks(config, log_dir):
    if config == "plain":
        return []
    extra = {"defaults": [],
             "nan_guard+defaults": [StopOnRule(NonFiniteLoss(), log_dir=log_dir)],
             "loss_spike+defaults": [StopOnRule(LossSpike(), log_dir=log_dir)],
             "spikes+defaults": [StopOnRule([LossSpike(), GradientNormSpike()],
                                            log_dir=log_dir)],
             "skip+defaults": [StopOnRule([LossSpike(), GradientNormSpike()], action="skip",
                                          log_dir=log_dir)]}[config]
    return extra + [GradientStatistics(log_dir), WeightStatistics(log_dir)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spe", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=320)
    args = parser.parse_args()
    for spe in args.spe:
        keras.utils.set_random_seed(0)
        model, shape, batch = _model("cnn")
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=spe)
        x = np.random.default_rng(0).normal(size=(batch * args.steps, *shape)).astype("float32")
        y = np.random.default_rng(1).integers(0, 10, batch * args.steps)
        ratios = {c: [] for c in CONFIGS[1:]}
        plain_steps = []

        def run(config):
            from kerasdbg.backends.tensorflow import graph_functions

            model.make_train_function(force=True)
            graph_functions.clear()
            with tempfile.TemporaryDirectory() as log_dir:
                timer = _Timer()
                model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                          callbacks=_callbacks(config, log_dir) + [timer])
            return float(np.mean(np.diff(timer.ends)[2:])) / spe

        for _ in range(args.repeats):
            before = run("plain")
            for config in CONFIGS[1:]:
                mine = run(config)
                after = run("plain")
                ratios[config].append(mine / ((before + after) / 2))
                plain_steps += [before, after]
                before = after
        print(f"\ncnn, steps_per_execution={spe}: plain step "
              f"{1000 * np.median(plain_steps):.1f} ms (median of {len(plain_steps)})")
        defaults = np.array(ratios["defaults"])
        for config in CONFIGS[1:]:
            mine = np.array(ratios[config])
            print(f"  {config:22s} {np.median(mine):.3f} ({mine.min():.3f}-{mine.max():.3f})"
                  f"   over defaults {np.median(mine / defaults):.3f}")


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"\n({time.time() - started:.0f} s)")
