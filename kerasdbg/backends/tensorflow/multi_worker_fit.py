"""The fix of Keras's `fit` under MultiWorkerMirroredStrategy with several
workers (`kerasdbg.compat.fix_multi_worker_fit`).
"""

from __future__ import annotations

import functools
import inspect

import keras
import tensorflow as tf

from kerasdbg.backends.tensorflow.distribute import (
    all_reduces_collectively,
    is_multi_worker,
)
from kerasdbg.capture.keras_objects import KerasInternalsError

# Keras 3's `fit` under MultiWorkerMirroredStrategy with two or more workers
# fails twice in its TensorFlow trainer (keras-team/keras#20585):
# `_maybe_symbolic_build` reduces the first batch's PerReplica (x, y) with
# `strategy.reduce("MEAN", ..., axis=None)`, which the collective reduce cannot
# convert, and `reduce_per_replica` reduces the scalar logs with
# `strategy.reduce("MEAN", v, axis=0)` ("Invalid reduction dimension 0").
# With steps_per_execution > 1 its loop runs each step inside a `tf.cond`
# within the `tf.while_loop`, where collective all-reduces fail ("You must
# feed a value for placeholder tensor", keras-team/keras#19246): under every
# MultiWorkerMirroredStrategy and under MirroredStrategy's default reduction.
MULTI_WORKER_ISSUE = "https://github.com/keras-team/keras/issues/20585"
_MULTI_WORKER_BUGS = {
    # what the code of each function contains while it has the bug, without blanks
    "_maybe_symbolic_build": 'distribute_strategy.reduce("MEAN",maybe_distributed_data_batch',
    "reduce_per_replica": 'strategy.reduce("MEAN",v,axis=0)',
    "_make_function": "next_optional_outputs=tf.cond(",
}
_multi_worker_originals: dict = {}


def _tensorflow_trainer_module():
    from keras.src.backend.tensorflow import trainer

    return trainer


def _multi_worker_targets():
    """`{name: (owner, current function)}` of the functions the fix may
    replace; KerasInternalsError when Keras no longer has the first two."""
    module = _tensorflow_trainer_module()
    targets = {"_maybe_symbolic_build": module.TensorFlowTrainer,
               "reduce_per_replica": module,
               "_make_function": module.TensorFlowTrainer}
    found = {}
    for name, owner in targets.items():
        function = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if name == "_make_function" and function is None:
            continue  # optional: a Keras without it has another loop (not replaced)
        if function is None or not hasattr(module, "_collective_all_reduce_multi_worker"):
            raise KerasInternalsError(
                f"Keras {keras.__version__} has no `{name}` in its TensorFlow trainer; "
                "kerasdbg's multi-worker fix does not know this version")
        found[name] = (owner, function)
    return found


def multi_worker_fit_is_broken(names=None) -> bool:
    """Whether this Keras's TensorFlow trainer has the code of
    keras-team/keras#20585 or #19246 (read from its source, fixed or not);
    `names` limits the check to some of `_MULTI_WORKER_BUGS`."""
    broken = False
    for name, (_, function) in _multi_worker_targets().items():
        if names is not None and name not in names:
            continue
        original = _multi_worker_originals.get(name, function)
        try:
            source = "".join(inspect.getsource(original).split())
        except (OSError, TypeError):  # installed without sources: assume the bug
            return True
        broken = broken or _MULTI_WORKER_BUGS[name] in source
    return broken


def multi_worker_fit_fixed() -> bool:
    """Whether `fix_multi_worker_fit` has replaced Keras's functions."""
    return bool(_multi_worker_originals)


def _first_local_values(structure, strategy):
    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value
    return tf.nest.map_structure(local, structure)


def _steps_loop(trainer, step_function):
    """Keras's train or test function for `steps_per_execution > 1`, with the
    same steps on the same batches, but each step run by the `tf.while_loop`
    itself instead of by a `tf.cond` in its body (the loop's condition
    already says a batch is there). Steps run one per iteration:
    `unrolled_steps_per_execution` is not used."""
    module = _tensorflow_trainer_module()
    strategy = trainer.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(step_function, args=(data,))
        return module.reduce_per_replica(outputs, strategy, reduction="auto")

    one_step_on_data = tf.function(one_step_on_data, reduce_retracing=True,
                                   jit_compile=trainer.jit_compile)
    # (Keras versions before `_autoconvert_optionals` pass the data as is.)
    one_step_on_data = getattr(trainer, "_autoconvert_optionals", lambda f: f)(one_step_on_data)
    steps = trainer.steps_per_execution

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_iterator(iterator):
        outputs = tf.experimental.Optional.empty(None)  # its spec is set while tracing the body

        def more(step, optional_outputs, next_inputs):
            return tf.logical_and(tf.less(step, steps), next_inputs.has_value())

        def body(step, optional_outputs, next_inputs):
            step_outputs = tf.experimental.Optional.from_value(one_step_on_data(next_inputs.get_value()))
            outputs._element_spec = step_outputs.element_spec
            # The next batch only when another step is due, as Keras does.
            next_inputs = tf.cond(tf.less(step + 1, steps),
                                  iterator.get_next_as_optional, lambda: next_inputs)
            return step + 1, step_outputs, next_inputs

        _, final_outputs, _ = tf.while_loop(
            more, body, loop_vars=[tf.constant(0), outputs, iterator.get_next_as_optional()])
        final_outputs._element_spec = outputs.element_spec
        return final_outputs

    multi_step_on_iterator = tf.function(multi_step_on_iterator, reduce_retracing=True)

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            optional_outputs = multi_step_on_iterator(iterator)
            if not optional_outputs.has_value():
                raise StopIteration
            return optional_outputs.get_value()
        outputs = None
        for _, data in zip(range(steps), iterator):
            outputs = one_step_on_data(data)
        return outputs

    return function


def fix_multi_worker_fit() -> None:
    """Replaces the two functions of keras-team/keras#20585, and Keras's
    loop of keras-team/keras#19246 where it still has it, by ones that
    behave as Keras intends under MultiWorkerMirroredStrategy with several
    workers (and the loop under any collective all-reduce), and exactly as
    before under every other strategy; idempotent.

    - the symbolic build takes the first local replica's values of the
      first batch (the build needs shapes only: every worker builds the
      same variables, and their values come from the strategy's broadcast);
    - the logs are averaged over all replicas element by element
      (`axis=None`), as `reduce_per_replica` does on one worker;
    - with `steps_per_execution > 1` and a collective all-reduce, the steps
      run in a loop without a `tf.cond` around each (`_steps_loop`).
    """
    if _multi_worker_originals:
        return
    targets = _multi_worker_targets()
    build_owner, original_build = targets["_maybe_symbolic_build"]
    reduce_owner, original_reduce = targets["reduce_per_replica"]
    # The steps loop only where Keras still has the `tf.cond` that fails.
    function_owner, original_function = targets["_make_function"] if (
        "_make_function" in targets and multi_worker_fit_is_broken(["_make_function"])) \
        else (None, None)

    @functools.wraps(original_build)
    def symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is not None and is_multi_worker(strategy):
            # The same walk as Keras's: one batch of the epoch iterator.
            for _, _, batches in iterator:
                data_batch = _first_local_values(next(batches), strategy)
                break
            iterator = None
        return original_build(self, iterator=iterator, data_batch=data_batch)

    @functools.wraps(original_reduce)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not is_multi_worker(strategy):
            return original_reduce(values, strategy, reduction)

        # Averaged over replicas element by element, as Keras does on one
        # worker (`tf.reduce_mean(local_results, axis=0)`), for any shape.
        return tf.nest.map_structure(
            lambda value: value if value is None else strategy.reduce("MEAN", value, axis=None),
            values)

    _multi_worker_originals["_maybe_symbolic_build"] = original_build
    _multi_worker_originals["reduce_per_replica"] = original_reduce
    type.__setattr__(build_owner, "_maybe_symbolic_build", symbolic_build)
    setattr(reduce_owner, "reduce_per_replica", reduce_per_replica)
    if original_function is None:
        return

    @functools.wraps(original_function)
    def make_function(self, step_function):
        if (self.steps_per_execution > 1 and not self.run_eagerly
                and all_reduces_collectively(self.distribute_strategy)):
            return _steps_loop(self, step_function)
        return original_function(self, step_function)

    _multi_worker_originals["_make_function"] = original_function
    type.__setattr__(function_owner, "_make_function", make_function)


def undo_multi_worker_fit() -> None:
    """Puts Keras's functions back; nothing when they are not replaced."""
    if not _multi_worker_originals:
        return
    module = _tensorflow_trainer_module()
    type.__setattr__(module.TensorFlowTrainer, "_maybe_symbolic_build",
                     _multi_worker_originals.pop("_maybe_symbolic_build"))
    module.reduce_per_replica = _multi_worker_originals.pop("reduce_per_replica")
    if "_make_function" in _multi_worker_originals:
        type.__setattr__(module.TensorFlowTrainer, "_make_function",
                         _multi_worker_originals.pop("_make_function"))
