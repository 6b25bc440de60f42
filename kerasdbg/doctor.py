"""`doctor`: the set-up mistakes that make training slow or break it, before it runs.

TensorFlow is imported on use: on the JAX backend the model's checks run
without it, and a `tf.data` pipeline is checked where TensorFlow is
installed (it made the pipeline); the `tf.distribute` checks are
TensorFlow's backend's alone (on JAX the devices come from
`keras.distribution`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, List, NamedTuple, Optional

import keras

from kerasdbg.sinks import workers as _workers
from kerasdbg import _validation as check

if TYPE_CHECKING:  # for the annotations only: imported on use
    import tensorflow as tf

SEVERITIES = ("error", "warning", "info")
TARGETS = ("auto", "cpu", "gpu", "xla", "tpu")
TPU_DTYPES = ("int64", "uint8", "string", "float64")
"""The input dtypes TPUs do not take (names)."""
# Ops that make a `tf.data` map function expensive per element.
HEAVY_OPS = ("Decode", "Resize", "Crop", "PyFunc", "EagerPyFunc", "ImageProjectiveTransform",
             "Conv", "MatMul", "ReadFile", "ParseExample", "ParseSingleExample")
HEAVY_OP_COUNT = 40

# The errors Keras 3 itself raises on these strategy combinations (reproduced by
# tests/test_keras_limitations.py).
MIRRORED_SPE_ERROR = (
    "INVALID_ARGUMENT: You must feed a value for placeholder tensor "
    "'.../while/cond/Placeholder_1' with dtype int32 (keras-team/keras#19246)"
)
MIRRORED_JIT_ERROR = (
    "Trying to access resource .../replica_1/... located in device CPU:1 from device CPU:0"
)
MULTI_WORKER_ERROR = (
    "`strategy.reduce` on a tuple of PerReplica values in Keras's `_maybe_symbolic_build`, "
    "then `Invalid reduction dimension 0` in `reduce_per_replica`"
)


def _tf():
    import tensorflow as tf

    return tf


def _datasets():
    from kerasdbg.backends.tensorflow import datasets

    return datasets


def _distribute():
    from kerasdbg.backends.tensorflow import distribute

    return distribute


def _multi_worker_fit():
    from kerasdbg.backends.tensorflow import multi_worker_fit

    return multi_worker_fit


def _tensorflow_installed() -> bool:
    try:
        _tf()
    except ImportError:
        return False
    return True


class Finding(NamedTuple):
    """One problem `doctor` found.

    Attributes:
        severity: "error" (training fails), "warning" (slow or wrong) or "info".
        check: the name of the check.
        what: what was found, with the values.
        why: why it matters.
        fix: how to fix it.
    """

    severity: str
    check: str
    what: str
    why: str
    fix: str


class Findings(list):
    """The list of `Finding`s of one `doctor` call; `str()` is a table."""

    def to_frame(self):
        """The findings as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame([f._asdict() for f in self], columns=list(Finding._fields))

    def __str__(self) -> str:
        if not self:
            return "kerasdbg doctor: no problem found"
        lines = [f"kerasdbg doctor: {len(self)} finding(s)"]
        for i, f in enumerate(self, 1):
            lines.append(f"{i}. [{f.severity.upper()}] {f.check}: {f.what}")
            lines.append(f"   why: {f.why}")
            lines.append(f"   fix: {f.fix}")
        return "\n".join(lines)


def _target(strategy, target: str, model) -> tuple:
    """`(tpu, xla, unknown)`: whether the run targets a TPU, XLA, or neither is known.

    The target is unknown under "auto" when neither a TPUStrategy nor
    `jit_compile=True` says it: the portability findings then come as "info".
    """
    if strategy is None:  # another backend than TensorFlow: its devices
        tpu = target == "tpu" or _platform() == "tpu"
    else:
        tpu = target == "tpu" or isinstance(strategy, _tf().distribute.TPUStrategy)
    jit = getattr(model, "jit_compile", None) if getattr(model, "compiled", False) else None
    xla = tpu or target == "xla" or jit is True
    return tpu, xla, target == "auto" and not xla


def _portability(severity: str, unknown: bool) -> str:
    """The severity of an XLA/TPU portability finding: "info" while the target is unknown."""
    return "info" if unknown else severity


def _if_moved(why: str, unknown: bool, where: str = "XLA or a TPU") -> str:
    return f"if the run moves to {where}: {why}" if unknown else why


def _platform() -> Optional[str]:
    """The platform of the JAX backend's devices ("cpu", "gpu", "tpu"), or None."""
    if keras.config.backend() != "jax":
        return None
    import jax

    return jax.default_backend()


def _data_parallel() -> tuple:
    """`(name, devices)`: the keras.distribution in place and the devices its
    batch is split over (1 without one)."""
    from keras.src.distribution import distribution_lib

    distribution = distribution_lib.distribution()
    if distribution is None:
        return None, 1
    mesh = distribution.device_mesh
    axis = getattr(distribution, "batch_dim_name", None)
    if axis in tuple(mesh.axis_names):
        return type(distribution).__name__, int(mesh.shape[tuple(mesh.axis_names).index(axis)])
    return type(distribution).__name__, 1


def _specs(dataset) -> list:
    tf = _tf()
    return [s for s in tf.nest.flatten(dataset.element_spec) if isinstance(s, tf.TensorSpec)]


def _kind(dataset) -> str:
    name = type(dataset).__name__.lstrip("_")
    for kind in ("Prefetch", "Batch", "Map", "Shuffle"):
        if kind in name:
            return kind.lower()
    return name


def _heavy(dataset) -> Optional[str]:
    """Why a map dataset's function is expensive, or None."""
    ops = _datasets().map_function_ops(dataset)
    heavy = sorted({op for op in ops if any(h in op for h in HEAVY_OPS)})
    if heavy:
        return f"its function runs {', '.join(heavy)}"
    if len(ops) > HEAVY_OP_COUNT:
        return f"its function has {len(ops)} ops"
    return None


def _data_findings(dataset, replicas: int, tpu: bool, xla: bool, unknown: bool,
                   tpu_open: bool, model) -> List[Finding]:
    found = []
    specs = _specs(dataset)
    batch = specs[0].shape[0] if specs and specs[0].shape.rank else None
    # The batch size of a pipeline without drop_remainder, for the checks after the first.
    size = batch if batch is not None else _datasets().dataset_batch_size(dataset)
    if (xla or unknown) and specs and batch is None:
        found.append(Finding(
            _portability("error" if tpu else "warning", unknown), "dynamic batch dimension",
            f"the dataset's batch dimension is unknown (element_spec {specs[0].shape})",
            _if_moved("XLA compiles one program per input shape: a partial last batch compiles "
                      "again, and a TPU needs static shapes", unknown),
            "batch with `drop_remainder=True` (`dataset.batch(n, drop_remainder=True)`)"))
    # The TPU's own findings: "info" too while a TPU is only possible (XLA known).
    where = "XLA or a TPU" if unknown else "a TPU"
    if tpu or tpu_open:
        bad = sorted({s.dtype.name for s in specs if s.dtype.name in TPU_DTYPES})
        if bad:
            found.append(Finding(
                _portability("error", tpu_open), "TPU input dtype",
                f"the dataset yields {', '.join(bad)} tensors",
                _if_moved("TPUs do not take int64, uint8, string or float64 inputs", tpu_open,
                          where),
                "cast in the pipeline: `dataset.map(lambda x, y: (tf.cast(x, tf.float32), "
                "tf.cast(y, tf.int32)))`, and decode strings before batching"))
        if size is not None and size % (8 * replicas):
            found.append(Finding(
                _portability("warning", tpu_open), "batch size",
                f"the global batch is {size}, not a multiple of 8 x "
                f"{replicas} replicas = {8 * replicas}",
                _if_moved("each TPU core pads its batch to a multiple of 8: the padding is "
                          "computed and thrown away", tpu_open, where),
                f"use a global batch that is a multiple of {8 * replicas}, e.g. "
                f"{8 * replicas * max(1, math.ceil(size / (8 * replicas)))}"))
    if size is not None and replicas and model is not None:
        per_replica = size / replicas
        bns = [layer.name for _, layer in _layers(model)
               if isinstance(layer, keras.layers.BatchNormalization)]
        if bns and per_replica < 32:
            found.append(Finding(
                "warning", "BatchNormalization batch",
                f"{len(bns)} BatchNormalization layer(s) ({', '.join(bns[:3])}) see "
                f"{per_replica:g} examples per replica (global batch {size} / {replicas})",
                "each replica normalizes over its own slice: fewer than 32 examples give noisy "
                "statistics and worse accuracy",
                "raise the global batch to at least 32 x replicas, or use "
                "`BatchNormalization(synchronized=True)`"))
    found += _pipeline_findings(dataset)
    return found


def _first_of_each(found: List[Finding]) -> List[Finding]:
    """One finding per check: the first (a pipeline may repeat a mistake)."""
    seen, kept = set(), []
    for finding in found:
        if finding.check not in seen:
            seen.add(finding.check)
            kept.append(finding)
    return kept


def _pipeline_findings(dataset) -> List[Finding]:
    found = []
    chain = _datasets().dataset_chain(dataset)  # last transformation first
    kinds = [_kind(d) for d in chain]
    if kinds and kinds[0] != "prefetch":
        found.append(Finding(
            "warning", "tf.data prefetch", "the pipeline does not end with prefetch",
            "without it the input pipeline and the train step take turns instead of overlapping",
            "end the pipeline with `.prefetch(tf.data.AUTOTUNE)`"))
    # Order from the source on: index 0 is the first transformation.
    order = list(reversed(list(zip(kinds, chain))))
    for i, (kind, d) in enumerate(order):
        if kind != "map":
            continue
        heavy = _heavy(d)
        if heavy is None:
            continue
        before = [k for k, _ in order[:i]]
        after = [k for k, _ in order[i + 1:]]
        if "batch" in before:
            found.append(Finding(
                "warning", "tf.data map after batch",
                f"an expensive map ({heavy}) runs after batch",
                "a per-batch map processes a whole batch in one call, so tf.data cannot spread "
                "the expensive work over its parallel calls, and the step waits for the batch",
                "map per element before `.batch(...)`, with `num_parallel_calls=tf.data.AUTOTUNE`"))
        if "shuffle" in after:
            found.append(Finding(
                "warning", "tf.data shuffle after map",
                f"shuffle comes after an expensive map ({heavy})",
                "the shuffle buffer must fill with mapped elements before the first batch, and "
                "holds the large mapped tensors in memory",
                "shuffle the raw elements (file names, records) before the map"))
    return _first_of_each(found)


def _layers(model):
    from kerasdbg import _replay

    if _replay.is_graph_model(model):
        return list(_replay.walk(model))
    return [((), layer) for layer in getattr(model, "_flatten_layers", lambda: [])()]


def _keras_fails(names=None) -> bool:
    """Whether Keras's trainer has the code that fails (all of
    `_MULTI_WORKER_BUGS`, or `names`) and `fix_multi_worker_fit` is not in place."""
    from kerasdbg.capture.keras_objects import KerasInternalsError

    fix = _multi_worker_fit()
    try:
        return fix.multi_worker_fit_is_broken(names) and not fix.multi_worker_fit_fixed()
    except KerasInternalsError:  # a Keras that moved the code: unknown
        return False


def _distribution_findings(name: Optional[str], model, tpu: bool,
                           devices: int) -> List[Finding]:
    """Another backend than TensorFlow's: `steps_per_execution=1` on a TPU or
    several devices (`name`: the keras.distribution, or None)."""
    compiled = model is not None and getattr(model, "compiled", False)
    spe = int(getattr(model, "steps_per_execution", 1) or 1) if compiled else None
    if not compiled or spe != 1 or not (tpu or devices > 1):
        return []
    where = f"{name} ({devices} devices)" if name else "a TPU"
    return [Finding(
        "warning", "steps_per_execution", f"steps_per_execution is 1 under {where}",
        "each step then returns to Python: on a TPU or several devices the host round trip "
        "dominates small steps",
        "compile with `steps_per_execution=32` (or more)")]


def _strategy_findings(strategy, model, tpu: bool, replicas: int) -> List[Finding]:
    tf = _tf()
    found = []
    name = type(strategy).__name__
    compiled = model is not None and getattr(model, "compiled", False)
    spe = int(getattr(model, "steps_per_execution", 1) or 1) if compiled else None
    jit = getattr(model, "jit_compile", None) if compiled else None
    # MultiWorkerMirroredStrategy on several workers (on one, Keras's fit works).
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) \
        and _workers.of(strategy) is not None
    collective = multi_worker or (replicas > 1 and _distribute().all_reduces_collectively(strategy))
    # Under a collective all-reduce, Keras fails steps_per_execution > 1 unless fixed.
    loop_fails = collective and _keras_fails(["_make_function"])
    if compiled and spe == 1 and (tpu or replicas > 1) and not (multi_worker and _keras_fails()):
        found.append(Finding(
            "warning", "steps_per_execution",
            f"steps_per_execution is 1 under {name} ({replicas} replica(s))",
            "each step then returns to Python: on a TPU or several replicas the host round trip "
            "dominates small steps",
            "compile with `steps_per_execution=32` (or more), after "
            + ("`kerasdbg.compat.fix_multi_worker_fit()` (without it Keras fails "
               "steps_per_execution > 1 under this collective all-reduce)" if loop_fails
               else "the workarounds below")))
    if compiled and spe and spe > 1 and loop_fails:
        kind = "MultiWorkerMirroredStrategy" if multi_worker else "MirroredStrategy"
        found.append(Finding(
            "error", f"Keras: {kind} + steps_per_execution",
            f"{kind} with the collective all-reduce and steps_per_execution={spe}",
            f"Keras 3 fit fails with: {MIRRORED_SPE_ERROR}",
            "call `kerasdbg.compat.fix_multi_worker_fit()` before `fit` (it runs the steps "
            "without the failing `tf.cond`)"
            + ("" if multi_worker else ", or create the strategy with "
               "`cross_device_ops=tf.distribute.ReductionToOneDevice()`")))
    if isinstance(strategy, tf.distribute.MirroredStrategy) and replicas > 1 and jit is True:
        found.append(Finding(
            "error", "Keras: MirroredStrategy + jit_compile",
            "MirroredStrategy with jit_compile=True",
            f"Keras 3 fit fails with: {MIRRORED_JIT_ERROR}",
            "compile with `jit_compile=False` under MirroredStrategy"))
    if multi_worker and _keras_fails(["_maybe_symbolic_build", "reduce_per_replica"]):
        found.append(Finding(
            "error", "Keras: MultiWorkerMirroredStrategy",
            "MultiWorkerMirroredStrategy with Keras 3 fit",
            f"Keras 3 fit fails on two or more workers with: {MULTI_WORKER_ERROR} "
            f"({_multi_worker_fit().MULTI_WORKER_ISSUE})",
            "call `kerasdbg.compat.fix_multi_worker_fit()` on every worker before `fit`"))
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        found.append(Finding(
            "error", "Keras: ParameterServerStrategy", "ParameterServerStrategy with Keras 3 fit",
            "Keras 3 fit does not support it (its trainer has no ClusterCoordinator)",
            "use a custom training loop with `tf.distribute.coordinator.ClusterCoordinator`"))
    return found


def _loss_findings(loss, replicas: int) -> List[Finding]:
    # On JAX a step is one program over the global batch (keras.distribution):
    # a mean loss is the global batch's mean, in a custom loop too.
    if loss is None or replicas <= 1 or keras.config.backend() != "tensorflow":
        return []
    reduction = getattr(loss, "reduction", None)
    reduction = getattr(reduction, "value", reduction)
    if str(reduction).lower() not in ("sum_over_batch_size", "auto"):
        return []
    return [Finding(
        "warning", "loss reduction in a custom loop",
        f"{type(loss).__name__} with reduction={reduction!r} under {replicas} replicas",
        "in a custom loop each replica divides by its own batch, so the summed gradient is "
        f"{replicas} times too large (fit scales it for you; a custom loop does not)",
        "use `reduction=\"none\"` and `tf.nn.compute_average_loss(per_example_loss, "
        "global_batch_size=GLOBAL_BATCH)`")]


def doctor(
    model: Optional[keras.Model] = None,
    data: Any = None,
    strategy: Optional["tf.distribute.Strategy"] = None,
    target: str = "auto",
    loss: Any = None,
    verbose: bool = True,
) -> Findings:
    """Finds the set-up mistakes that make training slow, or break it, before it runs.

    Checks, each when it applies:
    - portability to XLA and TPUs: a dataset with a dynamic batch dimension
      (no `drop_remainder`), input dtypes TPUs do not take (int64, uint8,
      string, float64), a global batch that is not a multiple of 8 x
      replicas, Dense/Conv widths that are not multiples of 128 (padding
      waste). Their severity follows the target: "error" or "warning" when
      it is XLA or a TPU, "info" when it is unknown ("auto" without a
      TPUStrategy or `jit_compile=True`), none when it is "cpu" or "gpu".
      With XLA known but no TPU (`jit_compile=True`, `target="xla"`), the
      dynamic batch is a warning and the TPU's own findings stay "info";
    - BatchNormalization with fewer than 32 examples per replica;
    - `steps_per_execution=1` on a TPU or several replicas;
    - `tf.data` order: no prefetch at the end, an expensive map after batch,
      a shuffle after an expensive map;
    - a loss with the SUM_OVER_BATCH_SIZE reduction used in a custom loop
      (pass it as `loss`) under several replicas;
    - the strategy combinations Keras 3 fit fails on (steps_per_execution > 1
      with the collective all-reduce of MirroredStrategy or
      MultiWorkerMirroredStrategy, and MultiWorkerMirroredStrategy itself,
      unless `kerasdbg.compat.fix_multi_worker_fit()` is in place;
      MirroredStrategy with jit_compile; ParameterServerStrategy), each with
      the error Keras raises.

    On the JAX backend (and any backend but TensorFlow's) the same checks
    run on the model and a `tf.data` pipeline, with the devices of the
    `keras.distribution` in place (`DataParallel`, `ModelParallel`'s batch
    axis) as the replicas; the `tf.distribute` strategy checks do not apply
    there, and `strategy` must be None. Without TensorFlow installed it
    checks the model alone (`data` must then be None).

    Args:
        model: the model, compiled for its `steps_per_execution` and
            `jit_compile`. Defaults to None.
        data: the `tf.data.Dataset` that feeds it. Defaults to None.
        strategy: the strategy; defaults to the model's (or the current one).
            TensorFlow's backend only.
        target: "auto" (a TPU under TPUStrategy, XLA when the model compiles
            with jit_compile=True, else unknown: the portability findings
            as "info"), or "cpu", "gpu" (no portability finding), "xla",
            "tpu". Defaults to `"auto"`.
        loss: the loss object a custom training loop uses. Defaults to None.
        verbose: print the findings as a table. Defaults to `True`.

    Returns:
        `Findings`, a list of `Finding(severity, check, what, why, fix)`,
        errors first.

    Examples:
        >>> import tensorflow as tf
        >>> from kerasdbg import doctor
        >>> labels = tf.zeros([10], tf.int64)
        >>> data = tf.data.Dataset.from_tensor_slices(([[1.0]] * 10, labels)).batch(4)
        >>> findings = doctor(data=data, target="tpu", verbose=False)
        >>> [f.check for f in findings]
        ['dynamic batch dimension', 'TPU input dtype', 'batch size', 'tf.data prefetch']
    """
    owner = "doctor"
    if model is not None and not isinstance(model, keras.Model):
        raise TypeError(f"{owner}: `model` must be a keras.Model or None. "
                        f"Received: model of type {type(model).__name__}")
    tensorflow = keras.config.backend() == "tensorflow"
    if data is not None and not (_tensorflow_installed()
                                 and isinstance(data, _tf().data.Dataset)):
        raise TypeError(f"{owner}: `data` must be a tf.data.Dataset or None (doctor inspects "
                        f"its pipeline). Received: data of type {type(data).__name__}")
    if strategy is not None and not tensorflow:
        raise ValueError(
            f"{owner}: `strategy` is a tf.distribute strategy, for the TensorFlow backend; Keras "
            f"runs on {keras.config.backend()!r}, where doctor reads the devices of the "
            "keras.distribution in place. Received: strategy of type "
            f"{type(strategy).__name__}; pass strategy=None")
    if strategy is not None and not isinstance(strategy, _tf().distribute.Strategy):
        raise TypeError(f"{owner}: `strategy` must be a tf.distribute.Strategy or None. "
                        f"Received: strategy of type {type(strategy).__name__}")
    check.one_of(owner, "target", target, TARGETS)
    check.boolean(owner, "verbose", verbose)
    found: List[Finding] = []
    if tensorflow:
        if strategy is None:
            strategy = model.distribute_strategy if model is not None \
                else _tf().distribute.get_strategy()
        try:
            replicas = int(strategy.num_replicas_in_sync)
        except Exception:  # noqa: BLE001 - a strategy without a cluster yet
            replicas = 1
        tpu, xla, unknown = _target(strategy, target, model)
        found += _strategy_findings(strategy, model, tpu, replicas)
    else:
        name, replicas = _data_parallel()
        tpu, xla, unknown = _target(None, target, model)
        found += _distribution_findings(name, model, tpu, replicas)
    tpu_open = not tpu and target in ("auto", "xla")
    if data is not None:
        found += _data_findings(data, replicas, tpu, xla, unknown, tpu_open, model)
    if (tpu or tpu_open) and model is not None:
        found += _width_findings(model, tpu_open, "XLA or a TPU" if unknown else "a TPU")
    found += _loss_findings(loss, replicas)
    result = Findings(sorted(found, key=lambda f: SEVERITIES.index(f.severity)))
    if verbose:
        print(result)
    return result


def _width_findings(model, unknown: bool, where: str = "XLA or a TPU") -> List[Finding]:
    odd = []
    for _, layer in _layers(model):
        width = getattr(layer, "units", None) or getattr(layer, "filters", None)
        if isinstance(width, int) and width % 128:
            odd.append(f"{layer.name}={width}")
    if not odd:
        return []
    return [Finding(
        "info", "feature width", f"layer widths not a multiple of 128: {', '.join(odd[:6])}"
        + (" ..." if len(odd) > 6 else ""),
        _if_moved("the TPU matrix unit works on 128 x 128 tiles: other widths are padded, and "
                  "the padding costs compute", unknown, where),
        "round widths up to multiples of 128 where the model allows (small heads are fine)")]
