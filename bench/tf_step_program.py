"""The programs a TensorFlow fit runs at each execution: counted and timed.

    python bench/tf_step_program.py [--depth 2 60] [--configs ...] [--time]
        [--calls 300] [--rounds 5]

For each model (an MLP 32-64-...-64-10 with `--depth` hidden layers: 6 variables at depth
2, 122 at depth 60) and each configuration, fits 12 steps with the instruments and
`jit_compile=True`, takes the jit-compiled step of each variant of Keras's train function
that kerasdbg traced (`variants`: the full one, run at steps 1-10, and the every-step one,
run at 11 and 12), and prints, beside plain Keras's, the `conditional`s of each one's
optimized HLO (`experimental_get_compiler_ir`) and the fusions outside the conditionals'
branches (`branch_free_fusions`: what a step runs when no branch is taken). With `--time`,
each jit-compiled step (plain's and the every-step variant's) is called `--calls` times in
a loop on one batch (no callbacks, no reads: the compiled step alone), in `--rounds`
interleaved rounds, and its median time per call is printed as a ratio to plain's.

`variants`, `counts` and `branch_free_fusions` are what tests/test_step_program.py counts
with.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

BATCH = 64
STEPS = 12  # steps 1-10 (and a fit's first execution) run the full variant, 11-12 the other
CONDITIONS = ("If", "StatelessIf", "Case", "StatelessCase")
CONFIGS = ("defaults", "stop", "stop+defaults", "taps+defaults")


def mlp(depth: int = 2, jit: bool = True, width: int = 64, taps: bool = False) -> keras.Model:
    """An MLP 32-width x depth-10 (2 * (depth + 1) variables), compiled with
    Adam; with `taps`, a `TapLayer` after each layer (`insert_taps`)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,))] + [
        keras.layers.Dense(width, activation="relu") for _ in range(depth)] + [
        keras.layers.Dense(10)])
    if taps:
        import kerasdbg

        model = kerasdbg.insert_taps(model)
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), jit_compile=jit)
    return model


def data(steps: int = STEPS):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH, 32)).astype("float32")
    y = rng.integers(0, 10, size=(steps * BATCH,)).astype("int32")
    return x, y


def callbacks_of(config: str) -> list:
    from kerasdbg.callbacks import (
        ActivationStatistics, GradientStatistics, StopOnRule, WeightStatistics,
    )

    # "warn": a deep ReLU MLP's vanishing gradients (a true verdict) must not
    # end the fit whose programs are taken.
    stop = [StopOnRule(action="warn", verbose=False)] if "stop" in config else []
    defaults = [GradientStatistics(), WeightStatistics()] if config != "stop" else []
    if config not in CONFIGS + ("plain",):
        raise ValueError(config)
    taps = [ActivationStatistics()] if "taps" in config else []
    return [] if config == "plain" else stop + defaults + taps


def functions_of(model, full: Optional[bool] = None) -> list:
    """The `tf.function`s the model's train function calls (through its
    closures). Where kerasdbg runs two variants (`VariantFunction`): the
    full one's with `full=True`, the every-step one's with `full=False`, by
    default the every-step one's where it was made, else the full one's."""
    found, stack, seen = [], [model.train_function], set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        variants = vars(item).get("functions") if hasattr(item, "__dict__") else None
        if isinstance(variants, dict) and set(variants) == {True, False}:
            key = full if full is not None else variants[False] is None
            if variants[key] is not None:
                stack.append(variants[key])
            continue
        if hasattr(item, "_list_all_concrete_functions"):
            found.append(item)
            continue
        for cell in getattr(item, "__closure__", None) or ():
            stack.append(cell.cell_contents)
    return found


class _Grab(keras.callbacks.Callback):
    """At the fit's last batch end, the functions of each variant: `{True:
    full, False: every-step}`, or `{None: ...}` where there is one."""

    def __init__(self, last: int):
        super().__init__()
        self.last = last
        self.functions: Dict[Optional[bool], list] = {}

    def on_train_batch_end(self, batch, logs=None):
        if batch != self.last:
            return
        from kerasdbg.backends.tensorflow.variants import VariantFunction

        if isinstance(self.model.train_function, VariantFunction):
            self.functions = {full: functions_of(self.model, full) for full in (True, False)}
        else:
            self.functions = {None: functions_of(self.model)}


def variants(config: str, depth: int, jit: bool = True) -> Dict[Optional[bool], list]:
    """The functions of each variant of a 12-step fit of a fresh MLP with the
    configuration's instruments (plain Keras's under `None`, its optimizer
    built before the fit as kerasdbg builds it: else the trace that creates
    its variables holds Keras's conditions for that)."""
    model = mlp(depth, jit, taps="taps" in config)
    if config == "plain":
        model.optimizer.build(model.trainable_variables)
    x, y = data()
    grab = _Grab(STEPS - 1)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=callbacks_of(config) + [grab])
    return grab.functions


def batch():
    x, y = data(1)
    return tf.constant(x), tf.constant(y)


def jitted(functions: list):
    """The jit-compiled step among a variant's functions."""
    found = [f for f in functions if getattr(f, "_jit_compile", False)]
    if len(found) != 1:
        raise ValueError(f"expected one jit-compiled step, found {len(found)}")
    return found[0]


def branch_free_fusions(text: str) -> int:
    """The fusions of an HLO module outside the branches of its conditionals
    and what those call (what a step runs where no condition takes a
    branch's work: the replay of a first fault, say)."""
    bodies: Dict[str, List[str]] = {}
    name = None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            name = header.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    branches = set()
    for lines in bodies.values():
        for line in lines:
            if re.search(r"\bconditional\(", line):
                branches.update(re.findall(
                    r"(?:true_computation|false_computation)=%([\w.\-]+)", line))
                for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                    branches.update(n.strip().lstrip("%") for n in group.split(","))
    stack = list(branches)
    while stack:
        for line in bodies.get(stack.pop(), []):
            for called in re.findall(r"(?:to_apply|true_computation|false_computation)"
                                     r"=%([\w.\-]+)", line):
                if called not in branches:
                    branches.add(called)
                    stack.append(called)
    return sum(len(re.findall(r"= \S+ fusion\(", "\n".join(lines)))
               for body, lines in bodies.items() if body not in branches)


def counts(functions: list, jit: bool = True) -> Tuple[int, Optional[int]]:
    """`(conditions, fusions)` of a variant: with jit, XLA's `conditional`s
    and `branch_free_fusions` of the optimized HLO; without, the `If`/`Case`
    ops of the traced graph (its function library included; fusions None)."""
    if jit:
        text = jitted(functions).experimental_get_compiler_ir(batch())(stage="optimized_hlo")
        return len(re.findall(r"\bconditional\(", text)), branch_free_fusions(text)
    outer = [f for f in functions if not getattr(f, "_jit_compile", False)
             and f._list_all_concrete_functions()]
    conditions = 0
    for concrete in outer[0]._list_all_concrete_functions():
        graph = concrete.graph.as_graph_def()
        nodes = list(graph.node) + [n for library in graph.library.function
                                    for n in library.node_def]
        conditions = max(conditions, sum(n.op in CONDITIONS for n in nodes))
    return conditions, None


def _time(step, data, calls: int) -> float:
    """Seconds per call of a jit-compiled step on one batch (its outputs read
    back at the end only)."""
    out = step(data)
    tf.nest.map_structure(lambda t: t.numpy(), out)
    start = time.perf_counter()
    for _ in range(calls):
        out = step(data)
    tf.nest.map_structure(lambda t: t.numpy(), out)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, nargs="+", default=[2, 60])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    data_ = batch()
    for depth in args.depth:
        plain = variants("plain", depth)[None]
        plain_counts = counts(plain)
        print(f"\nMLP depth {depth} ({2 * (depth + 1)} variables): plain Keras "
              f"{plain_counts[0]} conditionals, {plain_counts[1]} fusions")
        timed = {"plain": jitted(plain)}
        for config in args.configs:
            taken = variants(config, depth)
            for full, functions in sorted(taken.items(), key=lambda kv: kv[0] is False):
                c = counts(functions)
                name = {True: "full", False: "every-step", None: "single"}[full]
                print(f"  {config:15s} {name:10s}: {c[0]:3d} conditionals, {c[1]:5d} fusions "
                      f"outside branches (+{c[1] - plain_counts[1]})")
            timed[config] = jitted(taken.get(False) or next(iter(taken.values())))
        if args.time:
            results: Dict[str, List[float]] = {name: [] for name in timed}
            for _ in range(args.rounds):
                for name, step in timed.items():
                    results[name].append(_time(step, data_, args.calls))
            plain_time = statistics.median(results["plain"])
            print(f"  compiled step alone, median of {args.rounds} rounds of {args.calls} calls: "
                  f"plain {plain_time * 1e6:.0f} us")
            for name, times in results.items():
                if name != "plain":
                    print(f"    {name:15s} {statistics.median(times) / plain_time:.2f}x")


if __name__ == "__main__":
    main()
