"""Every private part of Keras that kerasdbg relies on, in one place.

Keras 3 has no public hook for the gradients that `fit` applies. While a
kerasdbg train step is being traced (only then: tracing is the only time
Python runs inside `fit`'s compiled step), kerasdbg routes these optimizer
methods through itself (`optimizer_routes`):

- `apply` (public) of every optimizer class that defines one (Keras's
  `BaseOptimizer` and `LossScaleOptimizer`, and a wrapper another tool put
  on a class), for every optimizer the train step applies, wherever the
  model keeps it: the step being applied, whether the loss scaler skipped
  it, the gradients the model produced and the weights before and after the
  update;
- `_all_reduce_sum_gradients` (private, TensorFlow backend), whose result is
  the gradient the optimizer applies: after clipping and, under a
  `tf.distribute` strategy, after the cross-replica sum;
- `_distributed_tf_update_step` and `_apply_weight_decay` (private,
  TensorFlow backend), which a frozen step skips inside Keras's own `apply`
  (`update_gateable`).

A class method is replaced only during traces and put back after each, so
nothing is left on any optimizer instance. `fit` itself is wrapped once
(`wrap_fit`) so that whatever way a `fit` ends, an exception included, kerasdbg
restores the model it instrumented.

`check_supported` is called before anything is patched, and
`tests/test_keras_internals.py` fails loudly if an upgrade moves any of this.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import types
from typing import Callable, List, Optional, Tuple

import keras
import tensorflow as tf

from kerasdbg.capture.keras_objects import (  # noqa: F401 - what this module's callers still read here
    FUNCTION_ATTRIBUTES, ITERATIONS_ATTRIBUTE, KerasInternalsError, LOOP_METHODS, STEP_METHODS,
    StepContext, VAR_KEY_METHOD, _FIT_WRAPPED, _loop_callbacks, _loop_frame,
    accumulation_steps, accumulators, clip_gradients, clipping, drop_name_scopes, ensure_built,
    find_optimizers, fit_batch_size, inner_optimizer, is_float, name_scope_depth,
    optimizer_variables, patch, raw_iterations, running_callbacks, step_context, step_counters,
    unpatch, uses_standard_train_step, variable_key, wrap_fit,
)

REDUCE_METHOD = "_all_reduce_sum_gradients"
UPDATE_METHOD = "_distributed_tf_update_step"
WEIGHT_DECAY_METHOD = "_apply_weight_decay"


def check_supported(optimizer) -> None:
    """Raises `KerasInternalsError` if `optimizer` cannot be instrumented."""
    if keras.backend.backend() != "tensorflow":
        raise KerasInternalsError(
            "kerasdbg needs the TensorFlow backend of Keras. "
            f"Received: keras.backend.backend()={keras.backend.backend()!r}"
        )
    inner = inner_optimizer(optimizer)
    owners = ((optimizer, "apply"), (inner, REDUCE_METHOD), (inner, VAR_KEY_METHOD),
              (inner, "_iterations"))
    owners += tuple((cls, name) for cls, name in _routed_methods())
    for owner, name in owners:
        if getattr(owner, name, None) is None:
            kind = owner.__name__ if isinstance(owner, type) else type(owner).__name__
            raise KerasInternalsError(
                f"kerasdbg: {kind} has no `{name}` "
                f"(Keras {keras.__version__}). kerasdbg supports Keras >= 3.0 "
                "with the TensorFlow backend; please report this Keras version."
            )


def build_optimizer_before_trace(model) -> bool:
    """Builds the model's optimizer now, outside `fit`'s first trace; returns
    whether it did.

    Without an explicit strategy Keras builds the optimizer inside the first
    trace of the train function; that trace then creates variables, and
    `tf.function` throws it away and traces again, so everything in the
    graph (taps, statistics) is traced twice. Keras itself builds first under
    an explicit strategy (`Trainer._symbolic_build`); this is that build. A
    model whose layers are not all built yet (a subclassed model before its
    first call) is left to Keras: its variables do not exist yet.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        return False
    if not all(layer.built for layer in model._flatten_layers()):
        return False
    with model.distribute_strategy.scope():
        ensure_built(optimizer, model.trainable_variables)
    return True


def replica_id() -> Optional[int]:
    """The replica this code is traced for (0 without a strategy), or None
    in a cross-replica context."""
    context = tf.distribute.get_replica_context()
    if context is None:
        return None
    value = getattr(context, "_replica_id_in_sync_group", None)
    if not isinstance(value, int):
        value = tf.get_static_value(context.replica_id_in_sync_group)
    return int(value) if value is not None else 0


def merge_call(function: Callable[[], object]):
    """Runs `function` once, in a cross-replica context, from a replica
    context of a `tf.distribute` strategy (each replica must call this), or
    directly without one. Variables can only be created there."""
    context = tf.distribute.get_replica_context()
    if tf.distribute.has_strategy() and context is not None and not tf.distribute.in_cross_replica_context():
        return context.merge_call(lambda _: function())
    return function()


def _routed_methods() -> List[Tuple[type, str]]:
    """The class methods `optimizer_routes` replaces: `BaseOptimizer.apply`,
    `LossScaleOptimizer.apply`, the `apply` that another tool or a test put on
    any optimizer class (such as a wrapper of the function it saved from
    `AdamW.apply` first, which no route further up would see), and the
    TensorFlow optimizer's reduction, update and weight decay."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    classes, pending = [], [BaseOptimizer]
    while pending:
        cls = pending.pop(0)
        if cls in classes:
            continue
        classes.append(cls)
        pending.extend(type.__subclasses__(cls))
    # Keras's own `apply`s route through these two (a MultiOptimizer's
    # dispatches to its optimizers' own); one from elsewhere is routed too.
    keras_applies = (BaseOptimizer, keras.optimizers.LossScaleOptimizer)
    applies = [(cls, "apply") for cls in classes
               if cls in keras_applies or (_takes_apply_arguments(cls.__dict__.get("apply"))
                                           and not _from_keras(cls.__dict__["apply"]))]
    return applies + [(TFOptimizer, REDUCE_METHOD), (TFOptimizer, UPDATE_METHOD),
                      (TFOptimizer, WEIGHT_DECAY_METHOD)]


def _takes_apply_arguments(function) -> bool:
    """Whether `function` is a function callable as `apply(self, grads,
    trainable_variables)`, as Keras calls it (a class's own `apply` of
    another signature is left alone)."""
    if not isinstance(function, types.FunctionType):
        return False
    try:
        inspect.signature(function).bind(None, [], None)
    except (TypeError, ValueError):
        return False
    return True


_KERAS_SOURCES = os.path.dirname(os.path.abspath(keras.__file__)) + os.sep


def _from_keras(function) -> bool:
    """Whether `function`'s code is Keras's own (by its file: a wrapper made
    with `functools.wraps(AdamW.apply)` carries Keras's `__module__`)."""
    code = getattr(function, "__code__", None)
    return code is not None and os.path.abspath(code.co_filename).startswith(_KERAS_SOURCES)


_ROUTES_LOCK = threading.Lock()
_ROUTES_DEPTH = 0
_ROUTES_ORIGINALS: dict = {}


@contextlib.contextmanager
def optimizer_routes(apply_route, reduce_route, update_route, weight_decay_route):
    """While active, every optimizer's `apply` runs as
    `apply_route(optimizer, original_apply, grads, trainable_variables)`,
    its `_all_reduce_sum_gradients` as `reduce_route(optimizer,
    original_reduce, grads_and_vars)`, its `_distributed_tf_update_step`
    as `update_route(optimizer, original_update, distribution,
    grads_and_vars, learning_rate)` and its `_apply_weight_decay` as
    `weight_decay_route(optimizer, original, variables)`, where the
    originals are bound methods.

    Class-level and reference-counted: the replicas of a `MirroredStrategy`
    trace their steps at the same time in several threads, and routes that
    do not recognise the optimizer call the original. Only kerasdbg's own
    four routes are ever passed. Where several classes of an optimizer's
    hierarchy define `apply`, each is routed, and the route passes the
    calls that the first one made on to the original.
    """
    global _ROUTES_DEPTH
    routes = {REDUCE_METHOD: reduce_route, UPDATE_METHOD: update_route,
              WEIGHT_DECAY_METHOD: weight_decay_route}
    with _ROUTES_LOCK:
        if _ROUTES_DEPTH == 0:
            for cls, name in _routed_methods():
                original = cls.__dict__[name]
                _ROUTES_ORIGINALS[(cls, name)] = original
                type.__setattr__(cls, name, _routed(original, routes.get(name, apply_route), name))
        _ROUTES_DEPTH += 1
    try:
        yield
    finally:
        with _ROUTES_LOCK:
            _ROUTES_DEPTH -= 1
            if _ROUTES_DEPTH == 0:
                _restore_optimizer_methods()


def _restore_optimizer_methods() -> None:
    """Puts back every class method `optimizer_routes` replaced (under the lock)."""
    for (cls, name), original in list(_ROUTES_ORIGINALS.items()):
        type.__setattr__(cls, name, original)
    _ROUTES_ORIGINALS.clear()


def routes_active() -> bool:
    """Whether an optimizer class method is routed now (for tests)."""
    return any(getattr(cls.__dict__[name], "_kerasdbg_route", False)
               for cls, name in _routed_methods())


def _routed(original, route, name):
    if name == REDUCE_METHOD:
        @functools.wraps(original)
        def routed(self, grads_and_vars):
            return route(self, functools.partial(original, self), grads_and_vars)
    elif name == WEIGHT_DECAY_METHOD:
        @functools.wraps(original)
        def routed(self, variables):
            return route(self, functools.partial(original, self), variables)
    elif name == UPDATE_METHOD:
        @functools.wraps(original)
        def routed(self, distribution, grads_and_vars, learning_rate):
            return route(self, functools.partial(original, self), distribution, grads_and_vars,
                         learning_rate)
    else:
        @functools.wraps(original)
        def routed(self, grads, trainable_variables=None, *args, **kwargs):
            if args or kwargs:  # an `apply` of another signature: not one kerasdbg knows
                return original(self, grads, trainable_variables, *args, **kwargs)
            return route(self, functools.partial(original, self), grads, trainable_variables)
    routed._kerasdbg_route = True
    return routed


def _unrouted(cls, name: str):
    """`cls.<name>` as it is outside a trace (the function a route wraps)."""
    function = getattr(cls, name, None)
    return function.__wrapped__ if getattr(function, "_kerasdbg_route", False) else function


def update_gateable(optimizer, variables) -> bool:
    """Whether every write that `optimizer.apply` derives from the gradients
    happens in `_distributed_tf_update_step`, so that a condition there can
    skip the update and leave the rest of `apply` as Keras traces it.

    True for Keras's own `apply` (not a mixed-precision `LossScaleOptimizer`,
    not one another tool replaced) and `update_step` of an optimizer without
    clipping, loss scaling, EMA, gradient accumulation, variable constraints or
    variables overwritten with their gradient, whose `_backend_apply_gradients`, `_backend_update_step` and
    `_distributed_tf_update_step` are the TensorFlow backend's.
    """
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    if optimizer is not inner_optimizer(optimizer) or not isinstance(optimizer, TFOptimizer):
        return False
    cls = type(optimizer)
    for owner, name in ((BaseOptimizer, "apply"), (BaseOptimizer, "_backend_apply_gradients"),
                        (BaseOptimizer, "_overwrite_variables_directly_with_gradients"),
                        (TFOptimizer, "_backend_update_step"), (TFOptimizer, UPDATE_METHOD),
                        (TFOptimizer, WEIGHT_DECAY_METHOD)):
        if _unrouted(cls, name) is not _unrouted(owner, name):
            return False
    # Keras's own update steps read the step count and write only the
    # variables and the optimizer's slots (`_route_update` relies on both).
    if not getattr(_unrouted(cls, "update_step"), "__module__", "").startswith("keras."):
        return False
    # Clipping and loss scaling compute on the gradients before the update:
    # with the update in a condition of its own, TensorFlow's graph optimizer
    # may fuse them otherwise than in plain Keras (a last-bit difference).
    if any(getattr(optimizer, name, None) is not None
           for name in ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor")):
        return False
    if getattr(optimizer, "use_ema", False) or getattr(optimizer, "gradient_accumulation_steps",
                                                        None):
        return False
    return not any(getattr(v, "overwrite_with_gradient", False)
                   or getattr(v, "constraint", None) is not None for v in variables)


def read_handle(variable):
    """The tf.Variable behind a Keras variable (what the optimizer's reduction sees)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def on_read(variable) -> bool:
    """Whether a variable is synchronized on read (a per-replica buffer, e.g.
    those of kerasdbg's own layers), rather than state the model updates."""
    return read_handle(variable).synchronization == tf.VariableSynchronization.ON_READ


def read(variable) -> tf.Tensor:
    """The current value of a Keras or tf variable as a tensor (in-graph)."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    return tf.convert_to_tensor(variable)


# ------------------------------------------------------------ model graphs
# The functional-graph helpers of `insert_taps`, `strip_debug_layers` and
# `MultiOutputModel` are backend-neutral: `kerasdbg._keras_graph`.


# ------------------------------------------------ random state (deterministic)
def random_state() -> dict:
    """TensorFlow's and Keras's global random settings (private in both)."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils
    from tensorflow.python.eager import context
    from tensorflow.python.framework import config

    return {
        "tf_seed": context.global_seed(),
        "op_determinism": config.is_op_determinism_enabled(),
        "keras_seed": global_state.get_global_attribute(rng_utils.GLOBAL_RANDOM_SEED),
        "keras_generator": global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR),
    }


def set_random_state(state: dict) -> None:
    """Puts back what `random_state` returned."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils
    from tensorflow.python.framework import config

    tf.random.set_seed(state["tf_seed"])
    if state["op_determinism"]:
        config.enable_op_determinism()
    else:
        config.disable_op_determinism()
    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, state["keras_seed"])
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, state["keras_generator"])


# ------------------------------------------------------- doctor (tf.data, strategies)
def dataset_chain(dataset) -> list:
    """The datasets of a `tf.data` pipeline, last transformation first
    (following the private `_input_dataset` of each unary dataset)."""
    chain = []
    while dataset is not None and len(chain) < 1000:
        chain.append(dataset)
        dataset = getattr(dataset, "_input_dataset", None)
    return chain


def map_function_ops(dataset) -> list:
    """The op types of a map dataset's function, or [] for another dataset."""
    function = getattr(dataset, "_map_func", None)
    graph = getattr(getattr(function, "function", None), "graph", None)
    return [op.type for op in graph.get_operations()] if graph is not None else []


def cross_device_ops(strategy):
    """The `cross_device_ops` a MirroredStrategy was made with (None: the default)."""
    return getattr(strategy.extended, "_cross_device_ops", None)


def dataset_batch_size(dataset):
    """The batch size of the last `batch` in a `tf.data` pipeline, or None."""
    for d in dataset_chain(dataset):
        size = getattr(d, "_batch_size", None)
        if size is not None:
            try:
                return int(tf.get_static_value(size))
            except (TypeError, ValueError):
                return None
    return None


# ------------------------------------------------------------ multi-worker fit
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
    import inspect

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
    return bool(_multi_worker_originals)


def _is_multi_worker(strategy) -> bool:
    return bool(strategy is not None
                and _tensorflow_trainer_module()._collective_all_reduce_multi_worker(strategy))


def _first_local_values(structure, strategy):
    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value
    return tf.nest.map_structure(local, structure)


def all_reduces_collectively(strategy) -> bool:
    """Whether the strategy's gradient all-reduce is a collective op: every
    MultiWorkerMirroredStrategy with several replicas, and a MirroredStrategy
    over several devices made without `cross_device_ops` or with
    `CollectiveAllReduce`."""
    if _is_multi_worker(strategy):
        return True
    if strategy is None or strategy.num_replicas_in_sync < 2:
        return False
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return True  # one worker with several local devices: collective too
    if not isinstance(strategy, tf.distribute.MirroredStrategy):
        return False
    chosen = cross_device_ops(strategy)
    return chosen is None or "Collective" in type(chosen).__name__


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
        if iterator is not None and _is_multi_worker(strategy):
            # The same walk as Keras's: one batch of the epoch iterator.
            for _, _, batches in iterator:
                data_batch = _first_local_values(next(batches), strategy)
                break
            iterator = None
        return original_build(self, iterator=iterator, data_batch=data_batch)

    @functools.wraps(original_reduce)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not _is_multi_worker(strategy):
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
