"""Which worker of a multi-worker cluster this process is, and where its
records go.

Under `MultiWorkerMirroredStrategy` every worker runs the same `fit` with the
same callbacks. kerasdbg's records that describe the whole step (gradients
after the all-reduce, the weights, the loss Keras averages over replicas)
are equal on every worker, so one writer is enough: the chief writes events,
files and printed lines, the others nothing, unless
`kerasdbg.compat.set_worker_output("per_worker")` asks each worker to write
under its own `worker_<i>` directory.

The chief is the task of type "chief", or worker 0 when the cluster has no
"chief" task (TensorFlow's convention).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import NamedTuple, Optional

OUTPUTS = ("chief", "per_worker")
_output = {"mode": "chief"}
_told = set()


class Worker(NamedTuple):
    """One task of a multi-worker cluster."""

    task_type: str
    index: int
    count: int
    chief: bool
    position: int
    """The task's place in the cluster (TensorFlow's order: the chief first,
    then the workers), which orders the replicas."""

    @property
    def label(self) -> str:
        return f"worker_{self.index}" if self.task_type == "worker" else f"{self.task_type}_{self.index}"


def of(strategy) -> Optional[Worker]:
    """This process's task when `strategy` trains on several workers, or,
    without a strategy, when this is one of several JAX processes
    (`jax.distributed`), else None."""
    if strategy is None:
        return _jax_process()
    extended = getattr(strategy, "extended", None)
    in_multi_worker = getattr(extended, "_in_multi_worker_mode", None)
    try:
        if in_multi_worker is None or not in_multi_worker():
            return None
    except NotImplementedError:  # a strategy of the user's own
        return None
    resolver = getattr(strategy, "cluster_resolver", None)
    task_type = getattr(resolver, "task_type", None) or "worker"
    index = int(getattr(resolver, "task_id", 0) or 0)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    count = sum(len(spec.get(kind, ())) for kind in ("chief", "worker")) or 1
    chief = task_type == "chief" or (task_type == "worker" and index == 0 and "chief" not in spec)
    position = 0 if task_type == "chief" else index + (1 if "chief" in spec else 0)
    return Worker(task_type, index, count, chief, position)


def _jax_process() -> Optional[Worker]:
    """This process under multi-process JAX (`jax.distributed.initialize`,
    which `keras.distribution.initialize` calls): process 0 is the chief, as
    worker 0 is under TensorFlow. Read from JAX only where it is loaded
    already (the JAX backend imports it): this module imports no framework."""
    keras = sys.modules.get("keras")
    jax = sys.modules.get("jax")
    if jax is None or keras is None or keras.config.backend() != "jax":
        return None  # JAX loaded beside TensorFlow's Keras: not asked (it would start JAX)
    try:
        count = int(jax.process_count())
        index = int(jax.process_index())
    except Exception:  # noqa: BLE001 - no JAX runtime: one process
        return None
    if count <= 1:
        return None
    return Worker("worker", index, count, index == 0, index)


def set_output(mode: str) -> None:
    _output["mode"] = mode


def output() -> str:
    return _output["mode"]


def writes(strategy, owner: Optional[str] = None) -> bool:
    """Whether this process writes kerasdbg's events, files and printed lines;
    with `owner`, a worker that does not says so once."""
    worker = of(strategy)
    if worker is None or worker.chief or _output["mode"] == "per_worker":
        return True
    if owner is not None:
        _say_silent(worker, owner)
    return False


def directory(path: str, strategy, owner: str) -> Optional[str]:
    """Where this process writes what goes to `path`: `path` itself on one
    worker and on the chief, `<path>/worker_<i>` on another worker with
    per-worker output, else None (said once per process)."""
    worker = of(strategy)
    if worker is None or worker.chief:
        return path
    if _output["mode"] == "per_worker":
        return os.path.join(path, worker.label)
    _say_silent(worker, owner)
    return None


def _say_silent(worker: Worker, owner: str) -> None:
    """Once per process and owner: this worker writes nothing, and why."""
    if (worker.label, owner) in _told:
        return
    _told.add((worker.label, owner))
    warnings.warn(
        f"kerasdbg: {owner} on {worker.label} of {worker.count} writes nothing; the chief "
        "writes the records of the whole cluster. Use "
        "kerasdbg.compat.set_worker_output('per_worker') to have every worker write its own.",
        UserWarning, stacklevel=4)


def file_path(path: str, strategy, owner: str) -> Optional[str]:
    """Where this process writes the file `path`: `path` on one worker and on
    the chief, `<dir>/worker_<i>/<name>` on another worker with per-worker
    output, else None (said once per process)."""
    folder, name = os.path.split(path)
    folder = directory(folder, strategy, owner)
    return None if folder is None else os.path.join(folder, name)
