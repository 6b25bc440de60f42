"""Step traces: the full tensors of a few training steps, in one `.npz` file.

A trace holds, for each recorded step, any of the loss, the learning rate,
the applied gradients, the weights after the update and the layer outputs.
`StepRecorder` writes one from `fit`; `TraceWriter` writes one from any
Python code (a custom loop, a `tf.compat.v1` session), so that two
implementations of one model can be recorded the same way and compared with
`compare_traces`.

The file is a NumPy `.npz` archive: `numpy.load(path)["gradients/dense/kernel@2"]`
is the gradient of `dense/kernel` applied at step 2. Keys are
`<tensor>@<step>`, where `<tensor>` is `loss`, `learning_rate`, or
`<kind>/<name>` for the named kinds; one more key, `__kerasdbg_trace__`,
holds a JSON string with the format version, the source and the order in
which each kind's tensors were recorded (used to match variables by order).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from kerasdbg import _validation as check

SCALAR_KINDS = ("loss", "learning_rate")
NAMED_KINDS = ("gradients", "weights", "layer_outputs")
KINDS = SCALAR_KINDS + NAMED_KINDS
# The order in which a step computes them: the first divergence is the
# earliest of these within the earliest failing step.
COMPUTATION_ORDER = ("layer_outputs", "loss", "gradients", "learning_rate", "weights")
META_KEY = "__kerasdbg_trace__"
FORMAT_VERSION = 1

PathOrTrace = Union[str, os.PathLike, "Trace"]


class TraceError(ValueError):
    """A file that is not a kerasdbg trace, or traces that cannot be matched."""


def tensor_name(kind: str, name: Optional[str] = None) -> str:
    """The name of a tensor in a trace: `loss`, or `<kind>/<name>`."""
    return kind if kind in SCALAR_KINDS else f"{kind}/{name}"


def _named_values(owner: str, kind: str, values: Any) -> List[Tuple[str, np.ndarray]]:
    """`(name, array)` pairs from a mapping, a list of pairs or a list of arrays."""
    if isinstance(values, Mapping):
        pairs = list(values.items())
    elif isinstance(values, (list, tuple)):
        if all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) for v in values):
            pairs = list(values)
        else:
            pairs = [(str(i), v) for i, v in enumerate(values)]
    else:
        raise TypeError(
            f"{owner}: `{kind}` must be a mapping of names to arrays, a list of "
            f"(name, array) pairs or a list of arrays. Received: {kind} of type "
            f"{type(values).__name__}"
        )
    for name, _ in pairs:
        if not isinstance(name, str) or not name or "@" in name:
            raise ValueError(
                f"{owner}: the names in `{kind}` must be non-empty strings without '@'. "
                f"Received: {name!r}"
            )
    return [(name, np.array(value, copy=True)) for name, value in pairs]


class TraceWriter:
    """Records the tensors of training steps from plain Python into one `.npz` file.

    For custom training loops and `tf.compat.v1` graph code: call `record`
    once per step with whatever that step produced, as NumPy arrays or
    tensors, and `save` at the end (or use the writer as a context manager,
    which saves on exit, also when the loop raised). Record the same things
    under the same names as the run you compare with, or let
    `compare_traces` match variables by order and shape.

    Args:
        path: the `.npz` file to write (its folder is created).
        source: a free-form description stored in the file. Defaults to
            `"python"`.

    Examples:
        >>> import os, tempfile
        >>> import numpy as np
        >>> from kerasdbg import TraceWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "tf1.npz")
        >>> with TraceWriter(path) as writer:
        ...     writer.record(1, loss=0.5, gradients={"dense/kernel:0": [[0.1], [0.2]]})
        >>> sorted(np.load(path).files)
        ['__kerasdbg_trace__', 'gradients/dense/kernel:0@1', 'loss@1']
    """

    def __init__(self, path: Union[str, os.PathLike], source: str = "python"):
        path = check.optional_path("TraceWriter", "path", path)
        if path is None:
            raise TypeError("TraceWriter: `path` must be a str or an os.PathLike. Received: path=None")
        if not isinstance(source, str):
            raise TypeError(
                f"TraceWriter: `source` must be a str. Received: source={source!r} "
                f"of type {type(source).__name__}"
            )
        self.path = path
        self.source = source
        self._arrays: Dict[str, np.ndarray] = {}
        self._order: Dict[str, List[str]] = {kind: [] for kind in NAMED_KINDS}

    def record(
        self,
        step: int,
        loss: Any = None,
        learning_rate: Any = None,
        gradients: Any = None,
        weights: Any = None,
        layer_outputs: Any = None,
    ) -> None:
        """Adds what one step produced; None leaves a kind out.

        Args:
            step: the optimizer step, from 1 (0 for the initial weights).
            loss: the step's loss (a scalar).
            learning_rate: the learning rate the step applied.
            gradients: the applied gradients: a mapping of variable names to
                arrays, a list of `(name, array)` pairs, or a list of arrays
                (named by position, `"0"`, `"1"`, ...).
            weights: the weights after the step's update, likewise.
            layer_outputs: the step's layer outputs, likewise.

        Raises:
            ValueError: a tensor already recorded for this step, or a bad name.
        """
        step = check.non_negative_int("TraceWriter.record", "step", step)
        entries: List[Tuple[str, str, np.ndarray]] = []
        for kind, value in (("loss", loss), ("learning_rate", learning_rate)):
            if value is not None:
                entries.append((kind, kind, np.array(value, copy=True)))
        for kind, values in (("gradients", gradients), ("weights", weights),
                             ("layer_outputs", layer_outputs)):
            if values is not None:
                for name, array in _named_values("TraceWriter.record", kind, values):
                    entries.append((kind, tensor_name(kind, name), array))
        for _, name, _ in entries:
            if f"{name}@{step}" in self._arrays:
                raise ValueError(
                    f"TraceWriter.record: `{name}` is already recorded for step {step}. "
                    f"Received: step={step}"
                )
        for kind, name, array in entries:
            self._arrays[f"{name}@{step}"] = array
            if kind in NAMED_KINDS and name not in self._order[kind]:
                self._order[kind].append(name)

    def save(self) -> str:
        """Writes the file (replacing it atomically) and returns its path."""
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        meta = {"version": FORMAT_VERSION, "source": self.source, "order": self._order}
        partial = f"{self.path}.partial"
        try:
            with open(partial, "wb") as handle:
                np.savez(handle, **self._arrays, **{META_KEY: np.array(json.dumps(meta))})
            os.replace(partial, self.path)
        finally:
            # No partial file left (a full disk); the error of the write is the one raised.
            try:
                os.remove(partial)
            except OSError:
                pass
        return self.path

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.save()


class Trace:
    """A trace read back from its file (see `load_trace`).

    Attributes:
        path: the file.
        source: what wrote it (`"StepRecorder"`, or `TraceWriter`'s `source`).
        tensors: `{tensor name: {step: array}}`.
    """

    def __init__(self, path: str, source: str, tensors: Dict[str, Dict[int, np.ndarray]],
                 order: Dict[str, List[str]]):
        self.path = path
        self.source = source
        self.tensors = tensors
        self._order = order

    @property
    def steps(self) -> List[int]:
        """Every step that recorded something, in order."""
        return sorted({s for by_step in self.tensors.values() for s in by_step})

    def names(self, kind: str) -> List[str]:
        """The tensor names of `kind`, in the order they were recorded."""
        check.one_of("Trace.names", "kind", kind, KINDS)
        if kind in SCALAR_KINDS:
            return [kind] if kind in self.tensors else []
        known = [n for n in self._order.get(kind, []) if n in self.tensors]
        rest = sorted(n for n in self.tensors if n.startswith(kind + "/") and n not in known)
        return known + rest

    def get(self, name: str, step: int) -> np.ndarray:
        """The array of tensor `name` at `step`."""
        if name not in self.tensors:
            raise KeyError(
                f"Trace: no tensor `{name}` in {self.path}. Tensors: {', '.join(sorted(self.tensors))}")
        by_step = self.tensors[name]
        if step not in by_step:
            raise KeyError(
                f"Trace: tensor `{name}` has no step {step} in {self.path}. "
                f"Steps: {', '.join(map(str, sorted(by_step)))}")
        return by_step[step]

    def __repr__(self) -> str:
        return (f"Trace({self.path!r}, source={self.source!r}, tensors={len(self.tensors)}, "
                f"steps={self.steps})")


def load_trace(path: PathOrTrace) -> Trace:
    """Reads a trace file written by `StepRecorder` or `TraceWriter`.

    Returns:
        A `Trace` (a `Trace` passed in is returned as it is).

    Raises:
        FileNotFoundError: no such file.
        TraceError: the file is not a kerasdbg trace.

    Examples:
        >>> import os, tempfile
        >>> from kerasdbg import TraceWriter, load_trace
        >>> path = os.path.join(tempfile.mkdtemp(), "t.npz")
        >>> with TraceWriter(path) as writer:
        ...     writer.record(1, loss=0.5, weights={"dense/kernel": [[1.0], [2.0]]})
        >>> trace = load_trace(path)
        >>> trace.steps, trace.names("weights"), float(trace.get("loss", 1))
        ([1], ['weights/dense/kernel'], 0.5)
    """
    if isinstance(path, Trace):
        return path
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"kerasdbg: no trace file at {path!r}")
    try:
        archive = np.load(path, allow_pickle=False)
        files = list(archive.files)
    except Exception as error:  # noqa: BLE001 - any unreadable file
        raise TraceError(
            f"kerasdbg: {path!r} is not a kerasdbg trace (not a NumPy .npz file: {error})"
        ) from error
    if META_KEY not in files:
        raise TraceError(
            f"kerasdbg: {path!r} is not a kerasdbg trace (no `{META_KEY}` entry); write "
            "traces with kerasdbg.callbacks.StepRecorder or kerasdbg.TraceWriter"
        )
    meta = json.loads(str(archive[META_KEY]))
    tensors: Dict[str, Dict[int, np.ndarray]] = {}
    for key in files:
        if key == META_KEY:
            continue
        name, _, step = key.rpartition("@")
        tensors.setdefault(name, {})[int(step)] = archive[key]
    return Trace(path, meta.get("source", ""), tensors, meta.get("order", {}))


def _pairs(a: Trace, b: Trace, mapping: Mapping[str, str]) -> Tuple[list, list, list]:
    """`(pairs, only_in_a, only_in_b)`: pairs `(kind, name in a, name in b)`.

    Within each kind: the names `mapping` gives, then equal names, then the
    rest by order and shape (same count, same shape at each position).
    """
    pairs, only_a, only_b = [], [], []
    for kind in KINDS:
        names_a, names_b = a.names(kind), b.names(kind)
        if not names_a or not names_b:
            only_a += names_a
            only_b += names_b
            continue
        if kind in SCALAR_KINDS:
            pairs.append((kind, kind, kind))
            continue
        bare_b = {n.split("/", 1)[1]: n for n in names_b}
        left_a, taken_b = [], set()
        for name in names_a:
            bare = name.split("/", 1)[1]
            target = mapping.get(bare, bare if bare in bare_b else None)
            if target is not None and target in bare_b and bare_b[target] not in taken_b:
                pairs.append((kind, name, bare_b[target]))
                taken_b.add(bare_b[target])
            elif bare in mapping:
                raise TraceError(
                    f"compare_traces: `mapping` maps {bare!r} to {mapping[bare]!r}, which the "
                    f"second trace does not hold among its {kind} (or maps twice). "
                    f"Its {kind}: {', '.join(n.split('/', 1)[1] for n in names_b)}"
                )
            else:
                left_a.append(name)
        left_b = [n for n in names_b if n not in taken_b]
        if not left_a or not left_b:
            only_a += left_a
            only_b += left_b
            continue
        shapes_a = [_shape(a, n) for n in left_a]
        shapes_b = [_shape(b, n) for n in left_b]
        if len(left_a) != len(left_b) or shapes_a != shapes_b:
            raise TraceError(
                f"compare_traces: cannot match the {kind} of the two traces by name, nor by "
                f"order and shape ({len(left_a)} vs {len(left_b)} left unmatched). "
                f"First trace: {_listing(left_a, shapes_a)}. Second trace: "
                f"{_listing(left_b, shapes_b)}. Pass `mapping={{name in first: name in second}}`."
            )
        pairs += [(kind, x, y) for x, y in zip(left_a, left_b)]
    return pairs, only_a, only_b


def _shape(trace: Trace, name: str) -> tuple:
    by_step = trace.tensors[name]
    return tuple(by_step[min(by_step)].shape)


def _listing(names: Sequence[str], shapes: Sequence[tuple]) -> str:
    return ", ".join(f"{n.split('/', 1)[1]} {list(s)}" for n, s in zip(names, shapes))


def differences(x: np.ndarray, y: np.ndarray) -> Tuple[float, float, bool]:
    """`(max_abs, max_rel, has_nan)` between two arrays of one shape.

    `max_rel` is `max_abs` over the larger of the two arrays' largest finite
    magnitudes (0 when both are zero everywhere). Equal infinities differ by
    0; unequal ones by infinity. A NaN in either array sets `has_nan`.
    """
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    has_nan = bool(np.isnan(x).any() or np.isnan(y).any())
    if x.size == 0:
        return 0.0, 0.0, has_nan
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(x == y, 0.0, np.abs(x - y))
    diff = np.where(np.isnan(diff), 0.0, diff)  # NaNs are reported by `has_nan`
    max_abs = float(diff.max())
    finite = np.concatenate([np.abs(x[np.isfinite(x)]), np.abs(y[np.isfinite(y)])])
    scale = float(finite.max()) if finite.size else 0.0
    if max_abs == 0.0:
        max_rel = 0.0
    elif scale == 0.0 or math.isinf(max_abs):
        max_rel = math.inf
    else:
        max_rel = max_abs / scale
    return max_abs, max_rel, has_nan


class Comparison:
    """The result of `compare_traces`.

    Attributes:
        table: a pandas DataFrame, one row per matched tensor and common step:
            `step, kind, tensor_a, tensor_b, shape_a, shape_b, max_abs, max_rel,
            tolerance ("atol" or "rtol"), passed, reason`.
        passed: whether every row passed (False when nothing was compared).
        first_divergence: the first failing row as a dict (earliest step;
            within it, in the order a step computes: layer outputs, loss,
            gradients, learning rate, weights), or None.
        only_in_a, only_in_b: tensors one trace holds and the other does not.
        steps_only_in_a, steps_only_in_b: likewise for steps.
    """

    def __init__(self, rows: List[dict], only_in_a, only_in_b, steps_a, steps_b, policy: dict):
        import pandas as pd

        columns = ["step", "kind", "tensor_a", "tensor_b", "shape_a", "shape_b", "max_abs",
                   "max_rel", "tolerance", "passed", "reason"]
        self.table = pd.DataFrame(rows, columns=columns)
        self.passed = bool(self.table["passed"].all()) if rows else False
        failing = [r for r in rows if not r["passed"]]
        self.first_divergence = failing[0] if failing else None
        self.only_in_a, self.only_in_b = only_in_a, only_in_b
        self.steps_only_in_a, self.steps_only_in_b = steps_a, steps_b
        self.policy = policy

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        p = self.policy
        lines = [f"policy: |a-b| <= atol={p['atol']:g} up to step {p['exact_steps']}, "
                 f"relative <= rtol={p['rtol']:g} after; NaN never equal"]
        t = self.table
        if t.empty:
            lines.append("no tensor and step in common: nothing compared")
        elif self.passed:
            lines.append(f"MATCH: {t['tensor_a'].nunique()} tensors over "
                         f"{t['step'].nunique()} steps ({len(t)} comparisons) within the policy")
        else:
            d = self.first_divergence
            name = d["tensor_a"] if d["tensor_a"] == d["tensor_b"] else (
                f"{d['tensor_a']} (b: {d['tensor_b']})")
            lines.append(f"DIVERGED: first at step {d['step']}, {name}: {d['reason']}")
            failing = t[~t["passed"]]
            lines.append(f"{len(failing)} of {len(t)} comparisons fail; the first ones:")
            shown = failing.head(20)[["step", "tensor_a", "max_abs", "max_rel", "reason"]]
            lines.append(shown.to_string(index=False))
        for label, names in (("only in a", self.only_in_a), ("only in b", self.only_in_b),
                             ("steps only in a", self.steps_only_in_a),
                             ("steps only in b", self.steps_only_in_b)):
            if names:
                lines.append(f"{label} (not compared): {', '.join(map(str, names))}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Comparison(passed={self.passed}, rows={len(self.table)})"


def compare_traces(
    a: PathOrTrace,
    b: PathOrTrace,
    atol: float = 1e-5,
    rtol: float = 0.05,
    exact_steps: int = 10,
    mapping: Optional[Mapping[str, str]] = None,
) -> Comparison:
    """Compares two step traces tensor by tensor and step by step.

    For every tensor and step the two traces share: the largest absolute
    difference and the relative one (over the larger magnitude of the two
    tensors). Up to step `exact_steps` a tensor passes when its largest
    absolute difference is at most `atol`; after it, when its relative
    difference is at most `rtol` (float error grows as training goes on).
    A NaN in either tensor never passes, and neither does a shape mismatch.

    Tensors are matched within each kind (gradients, weights, layer outputs)
    by `mapping`, then by equal names, then by the order they were recorded
    and their shapes: so a `tf.compat.v1` run's `dense/kernel:0` meets a
    Keras run's `dense/kernel` without a mapping when the models agree.

    Args:
        a: the first trace (a path or a `Trace`), e.g. the reference.
        b: the second trace.
        atol: the absolute tolerance of the first steps. Defaults to `1e-5`.
        rtol: the relative tolerance after them. Defaults to `0.05`.
        exact_steps: the last step compared with `atol`. Defaults to `10`.
        mapping: names in `a` to names in `b` (without the kind prefix),
            for tensors that order and shape cannot match. Defaults to None.

    Returns:
        A `Comparison`; `str()` of it is a readable report.

    Raises:
        TraceError: a file is not a trace, or some tensors of a kind cannot
            be matched (the message lists both sides with their shapes).

    Examples:
        >>> import os, tempfile
        >>> from kerasdbg import TraceWriter, compare_traces
        >>> folder = tempfile.mkdtemp()
        >>> for name, grad in (("a.npz", 0.25), ("b.npz", 0.5)):
        ...     with TraceWriter(os.path.join(folder, name)) as writer:
        ...         writer.record(1, loss=1.0, gradients={"kernel": [grad]})
        >>> result = compare_traces(os.path.join(folder, "a.npz"), os.path.join(folder, "b.npz"))
        >>> result.passed
        False
        >>> result.first_divergence["tensor_a"], result.first_divergence["step"]
        ('gradients/kernel', 1)
    """
    owner = "compare_traces"
    atol = check.number(owner, "atol", atol, minimum=0.0)
    rtol = check.number(owner, "rtol", rtol, minimum=0.0)
    exact_steps = check.non_negative_int(owner, "exact_steps", exact_steps)
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise TypeError(
            f"{owner}: `mapping` must be a mapping of str to str. Received: mapping={mapping!r}")
    a, b = load_trace(a), load_trace(b)
    pairs, only_a, only_b = _pairs(a, b, mapping)
    rank = {kind: i for i, kind in enumerate(COMPUTATION_ORDER)}
    rows = []
    for position, (kind, name_a, name_b) in enumerate(pairs):
        by_a, by_b = a.tensors[name_a], b.tensors[name_b]
        for step in sorted(set(by_a) & set(by_b)):
            x, y = by_a[step], by_b[step]
            row = {"step": step, "kind": kind, "tensor_a": name_a, "tensor_b": name_b,
                   "shape_a": tuple(x.shape), "shape_b": tuple(y.shape),
                   "tolerance": "atol" if step <= exact_steps else "rtol",
                   "max_abs": math.nan, "max_rel": math.nan, "_order": (step, rank[kind], position)}
            if x.shape != y.shape:
                row.update(passed=False, reason=f"shapes differ: {list(x.shape)} vs {list(y.shape)}")
            else:
                max_abs, max_rel, has_nan = differences(x, y)
                row.update(max_abs=max_abs, max_rel=max_rel)
                if has_nan:
                    row.update(passed=False, reason="NaN (never equal)")
                elif row["tolerance"] == "atol":
                    ok = max_abs <= atol
                    row.update(passed=ok, reason=f"max abs diff {max_abs:.3g} "
                               f"{'<=' if ok else '>'} atol {atol:g}")
                else:
                    ok = max_rel <= rtol
                    row.update(passed=ok, reason=f"max rel diff {max_rel:.3g} "
                               f"{'<=' if ok else '>'} rtol {rtol:g}")
            rows.append(row)
    rows.sort(key=lambda r: r["_order"])
    for row in rows:
        del row["_order"]
    steps_a, steps_b = set(a.steps), set(b.steps)
    return Comparison(rows, only_a, only_b, sorted(steps_a - steps_b), sorted(steps_b - steps_a),
                      {"atol": atol, "rtol": rtol, "exact_steps": exact_steps})

