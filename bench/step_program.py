"""The programs a JAX fit runs at each step, as XLA compiles them: counted and timed.

    KERAS_BACKEND=jax python bench/step_program.py [--depth 2 60] [--configs ...]
        [--time] [--calls 300] [--rounds 5]

For each model (an MLP 32-64-...-64-10 with `--depth` hidden layers: 6 variables at depth
2, 122 at depth 60) and each configuration, fits a few steps with the instruments, takes
every variant of the step kerasdbg jitted in that fit (`programs`), and prints, beside plain
Keras's step (`jax.jit(model.train_step)` on the same state), the `conditional` and `fusion`
instructions of each one's optimized HLO and the fusions it adds to plain's. With `--time`,
each compiled step is called `--calls` times in a loop on its own outputs (no callbacks, no
reads: the compiled step alone), in `--rounds` interleaved rounds, and its median time per
call is printed as a ratio to plain's.

`programs(model, callbacks, x, y)` is what tests/jax/test_step_program.py counts with.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from typing import Dict, List, Tuple

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

BATCH = 64


def mlp(depth: int = 2, width: int = 64, taps: bool = False) -> keras.Model:
    """An MLP 32-width x depth-10 (2 * (depth + 1) variables), compiled with Adam."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((32,))]
    layers += [keras.layers.Dense(width, activation="relu", name=f"dense_{i}")
               for i in range(depth)]
    layers.append(keras.layers.Dense(10, name="logits"))
    model = keras.Sequential(layers, name="mlp")
    if taps:
        import kerasdbg

        model = kerasdbg.insert_taps(model)
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    return model


def data(steps: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH, 32)).astype("float32")
    y = rng.integers(0, 10, size=(steps * BATCH,)).astype("int32")
    return x, y


def programs(model, callbacks, x, y, steps: int = 12) -> List[Tuple[object, tuple]]:
    """`[(jitted, abstract args), ...]`: every variant of the step that
    kerasdbg's engine jitted in a `fit` of `steps` batches with `callbacks`,
    each with the shapes, dtypes and shardings of the arguments it was first
    called or compiled for (the arrays themselves are donated): the full
    variant first, then the every-step one (or the one step there is)."""
    from kerasdbg.backends.jax import engine as engine_lib

    taken: Dict[int, Tuple[object, object, tuple]] = {}
    original_call, original_prepare = engine_lib._Jitted.__call__, engine_lib._Jitted.prepare

    def record(made, arguments):
        if id(made.jitted) not in taken:
            taken[id(made.jitted)] = (made.variant, made.jitted, _abstract(arguments))

    def call(self, state, carry, data):
        record(self, (state, carry, data))
        return original_call(self, state, carry, data)

    def prepare(self, model, arguments):
        record(self, arguments)
        return original_prepare(self, model, arguments)

    engine_lib._Jitted.__call__, engine_lib._Jitted.prepare = call, prepare
    try:
        model.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, epochs=1,
                  verbose=0, shuffle=False, callbacks=list(callbacks))
    finally:
        engine_lib._Jitted.__call__, engine_lib._Jitted.prepare = original_call, original_prepare
    order = {True: 0, False: 1, None: 2}
    return [(jitted, args) for _, jitted, args in
            sorted(taken.values(), key=lambda t: order[t[0]])]


def _abstract(tree):
    def one(leaf):
        if isinstance(leaf, jax.Array):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
        return leaf

    return jax.tree_util.tree_map(one, tree)


def plain_program(model, x, y):
    """`(jitted, abstract args)` of plain Keras's train step on the model's state."""
    model.make_train_function()
    model.optimizer.build(model.trainable_variables)
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    batch = (x[:BATCH], y[:BATCH], None)
    jitted = jax.jit(model.train_step, donate_argnums=0)
    return jitted, _abstract((state, batch))


def hlo(jitted, args) -> str:
    return jitted.lower(*args).compile().as_text()


def counts(text: str) -> Dict[str, int]:
    """The `conditional` and `fusion` instructions of an optimized HLO module's text."""
    return {"conditionals": len(re.findall(r"\bconditional\(", text)),
            "fusions": len(re.findall(r"= \S+ fusion\(", text))}


CONFIGS = ("defaults", "stop", "stop+defaults", "taps+defaults", "every_step")


def callbacks_of(config: str, log_dir=None) -> Tuple[list, bool]:
    """`(callbacks, taps)` of a configuration."""
    from kerasdbg.callbacks import (
        ActivationStatistics, GradientStatistics, StopOnRule, WeightStatistics,
    )

    defaults = [GradientStatistics(log_dir), WeightStatistics(log_dir)]

    def stop():
        # Verdicts acted on by nothing: a deep ReLU MLP's vanishing gradients
        # (a true verdict) must not end the fit whose programs are taken.
        return StopOnRule(log_dir=log_dir, verbose=False, action=lambda verdicts, model: None)

    if config == "defaults":
        return defaults, False
    if config == "stop":
        return [stop()], False
    if config == "stop+defaults":
        return [stop()] + defaults, False
    if config == "taps+defaults":
        return defaults + [ActivationStatistics(log_dir)], True
    if config == "every_step":
        return [GradientStatistics(log_dir, every_n_steps=1),
                WeightStatistics(log_dir, every_n_steps=1)], False
    raise ValueError(config)


def _time(compiled, args, calls: int) -> float:
    """Seconds per call of a compiled step called on its own outputs."""
    def fresh(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding)
        return leaf

    state, *rest = jax.tree_util.tree_map(fresh, args)

    def call(out):
        if len(rest) == 1:  # plain Keras's (state, data)
            return compiled(out[1], rest[0])
        # kerasdbg's (state, carry, data): the carry's "initial" goes in, never out.
        carry = dict(out[2], **{k: v for k, v in rest[0].items() if k not in out[2]})
        return compiled(out[1], carry, rest[1])

    out = compiled(state, *rest)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(calls):
        out = call(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, nargs="+", default=[2, 60])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    x, y = data(12)  # steps 1-10 full, 11-12 every-step
    for depth in args.depth:
        base = mlp(depth)
        plain = plain_program(base, x, y)
        plain_counts = counts(hlo(*plain))
        variables = len(base.trainable_variables)
        print(f"\nMLP depth {depth} ({variables} variables): plain Keras "
              f"{plain_counts['conditionals']} conditionals, {plain_counts['fusions']} fusions")
        timed = {"plain": (plain[0].lower(*plain[1]).compile(), plain[1])}
        for config in args.configs:
            callbacks, taps = callbacks_of(config)
            model = mlp(depth, taps=taps)
            taken = programs(model, callbacks, x, y)
            for k, (jitted, abstract) in enumerate(taken):
                text = hlo(jitted, abstract)
                c = counts(text)
                name = "full" if len(taken) > 1 and k == 0 else "every-step"
                print(f"  {config:15s} {name:10s}: {c['conditionals']:3d} conditionals, "
                      f"{c['fusions']:5d} fusions (+{c['fusions'] - plain_counts['fusions']})")
            # Timed: the variant that runs at most steps (the last one taken).
            jitted, abstract = taken[-1]
            timed[config] = (jitted.lower(*abstract).compile(), abstract)
        if args.time:
            results: Dict[str, List[float]] = {name: [] for name in timed}
            for _ in range(args.rounds):
                for name, (compiled, abstract) in timed.items():
                    results[name].append(_time(compiled, abstract, args.calls))
            plain_time = statistics.median(results["plain"])
            print(f"  compiled step alone, median of {args.rounds} rounds of {args.calls} calls: "
                  f"plain {plain_time * 1e6:.0f} us")
            for name, times in results.items():
                if name != "plain":
                    print(f"    {name:15s} {statistics.median(times) / plain_time:.2f}x")


if __name__ == "__main__":
    main()
