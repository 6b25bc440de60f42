"""Tensors that look broken in a healthy network, by construction.

Healthy standard layers have gradients that are zero, or zero up to
rounding, by construction: the bias of a convolution or dense layer followed
by a normalization (the normalization removes any shift; measured 1e-8 to
1e-12), the key bias of `MultiHeadAttention` (the softmax is shift-invariant;
exactly 0 or 1e-10 to 1e-12), an output head the loss does not use. Their
weights then never move. A rule on magnitudes alone stops such runs at step 1.

What tells them apart from a fault is when and where:

- when: they are that way from the first step the rule sees them; a
  gradient that vanished, a layer that died or weights that stopped moving
  were fine before (a network broken from its first step is told apart by
  the next point). For magnitudes, "that way" is relative, because rounding
  noise wanders around any absolute threshold: at every step so far a
  sibling was `RATIO` times larger;
- where: the rest of their layer is healthy (a sibling variable of the same
  layer, e.g. the kernel beside the bias, learns), or, for a tensor exactly
  zero, most tensors of the step are healthy (an unused head), which is not
  the case of a dead network.

Such tensors are reported once, as information. A tensor judged by its
magnitude stays left out as long as a sibling dwarfs it at every step; one
judged at its first step is left out until it looks healthy, and a fault if
it fails again after that.
"""

from __future__ import annotations

import functools
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

RATIO = 1e3
"""How much larger than a tensor's magnitude a healthy sibling's must be."""

FIRST_STEP = 1
"""The first optimizer step of a training (step numbers count optimizer
steps from 1). Allowances for the initial weights (a tensor failing at its
first recorded step only) are given by a rule that watched the training
from it, not by one that first sees it later (a callback attached from a
later `fit` on): the same verdict as a check of the whole run offline."""


def initial(step: int) -> bool:
    """Whether `step` is the training's first optimizer step (or before it)."""
    return int(step) <= FIRST_STEP


def layer_of(tensor: str) -> str:
    """The layer path of a variable path (`model/dense/bias` -> `model/dense`)."""
    return tensor.rpartition("/")[0]


class Construction:
    """One rule's memory of the tensors it saw, and of those it exempts."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seen: Set[Tuple[str, str]] = set()
        self.exempt: Dict[Tuple[str, str], int] = {}
        self.reported: Set[Tuple[str, str]] = set()  # each is said once
        # Whether a sibling was RATIO times larger at every step so far.
        self.dwarfed: Dict[Tuple[str, str], bool] = {}
        self.from_start: Optional[bool] = None

    def started(self, step: int) -> bool:
        """Whether the rule watches the training from its first step (decided
        at the first step it sees)."""
        if self.from_start is None:
            self.from_start = initial(step)
        return self.from_start

    def quiet(self, collection: str, tensors: Sequence[str],
              magnitudes: Optional[np.ndarray] = None) -> None:
        """What `split` remembers of steps at which none of `tensors` (every
        tensor of the collection there) failed: `magnitudes` (`[steps,
        tensors]`, in the order of `tensors`) as `split`'s, for the sibling
        margin."""
        tensors = list(tensors)
        self.seen.update((collection, t) for t in tensors)
        if magnitudes is not None and len(magnitudes) and tensors:
            every = _dwarfed(tensors, np.asarray(magnitudes, np.float64)).all(axis=0)
            for tensor, dwarfed in zip(tensors, every.tolist()):
                key = (collection, tensor)
                self.dwarfed[key] = self.dwarfed.get(key, True) and dwarfed
        if self.exempt:
            present = set(tensors)
            for tensor in [t for c, t in list(self.exempt) if c == collection]:
                if tensor in present:
                    del self.exempt[(collection, tensor)]  # healthy now

    def split(
        self,
        collection: str,
        failing: Mapping[str, float],
        tensors: Iterable[str],
        first_chance: Optional[Set[str]] = None,
        magnitudes: Optional[Mapping[str, float]] = None,
        exact: Optional[Set[str]] = None,
        step: int = 0,
        defer_first: bool = False,
    ) -> Tuple[Dict[str, float], Dict[str, float]]:
        """`(faults, new)`: the failing tensors that are faults, and those
        exempted from now on as zero by construction (report them once).

        Args:
            collection: "gradients" or "weights".
            failing: tensor -> value, those that meet the rule's condition.
            tensors: every tensor of the collection in this record.
            first_chance: the tensors the rule evaluates for the first time
                (default: those not seen before).
            magnitudes: tensor -> magnitude, for the sibling margin; None
                when a healthy sibling is enough.
            exact: the failing tensors that are exactly zero (default: all).
            step: the step, kept with each exemption.
            defer_first: a tensor failing at its first chance is no fault
                yet, when the rule watches the training from its first step
                (`FIRST_STEP`): it is one if it fails at its next chance too (at their
                initial weights healthy networks have steps like no other:
                a zero-initialised output layer zeroes every other gradient
                at the first step only).
        """
        tensors = list(tensors)
        if first_chance is None:
            first_chance = {t for t in tensors if (collection, t) not in self.seen}
        self.seen.update((collection, t) for t in tensors)
        if magnitudes is not None:
            layers = {t: layer_of(t) for t in tensors}
            # Per layer, the two largest magnitudes: a tensor's largest sibling is
            # the layer's largest, or its second when the tensor is the largest.
            top: Dict[str, list] = {}
            for tensor in tensors:
                value = magnitudes.get(tensor, 0.0)
                best = top.setdefault(layers[tensor], [])
                if not value > 0.0:  # (NaN too) never a sibling that dwarfs another
                    continue
                best.append((value, tensor))
                best.sort(key=lambda e: e[0], reverse=True)
                del best[2:]
            for tensor in tensors:
                mine = abs(magnitudes.get(tensor, 0.0))
                layer = layers[tensor]
                sibling = next((v for v, t in top[layer] if t != tensor), None)
                larger = bool(layer) and sibling is not None and sibling > 0.0 and (
                    sibling >= RATIO * mine)
                key = (collection, tensor)
                self.dwarfed[key] = self.dwarfed.get(key, True) and larger
        if self.exempt:
            present = set(tensors)
            for tensor in [t for c, t in list(self.exempt) if c == collection]:
                if tensor in present and tensor not in failing:
                    del self.exempt[(collection, tensor)]  # healthy now: a fault if it fails again
        if not failing:
            return {}, {}
        if magnitudes is None:
            layers = {t: layer_of(t) for t in tensors}
        exact = set(failing) if exact is None else set(exact)
        healthy: Dict[str, int] = {}  # layer -> its healthy tensors
        for t in tensors:
            if t not in failing:
                healthy[layers[t]] = healthy.get(layers[t], 0) + 1
        minority = 2 * len(failing) < len(tensors)
        new = {}
        for tensor, value in failing.items():
            if (collection, tensor) in self.exempt:
                continue
            if magnitudes is not None and self.dwarfed[(collection, tensor)]:
                self.exempt[(collection, tensor)] = step
                if (collection, tensor) not in self.reported:
                    self.reported.add((collection, tensor))
                    new[tensor] = value
                continue
            if tensor not in first_chance:
                continue
            layer = layers.get(tensor, layer_of(tensor))
            # (A failing tensor is not among the healthy ones of its layer.)
            siblings = bool(layer) and healthy.get(layer, 0) > 0
            if magnitudes is not None:
                siblings = False  # decided by `dwarfed` above
            if siblings or (tensor in exact and minority):
                self.exempt[(collection, tensor)] = step
                if (collection, tensor) not in self.reported:
                    self.reported.add((collection, tensor))
                    new[tensor] = value
        faults = {t: v for t, v in failing.items() if (collection, t) not in self.exempt
                  and not (defer_first and t in first_chance and self.started(step))}
        return faults, new


def _dwarfed(tensors: Sequence[str], magnitudes: np.ndarray) -> np.ndarray:
    """`[steps, tensors]`: whether a sibling of each tensor (another variable
    of its layer) was `RATIO` times larger at each step, as `split` decides
    it: the sibling is the largest positive magnitude of the layer but the
    tensor's own."""
    larger = np.zeros(magnitudes.shape, bool)
    rows = np.arange(len(magnitudes))
    for positions in _siblings(tuple(tensors)):
        values = magnitudes[:, positions]
        with np.errstate(invalid="ignore"):
            positive = np.where(values > 0.0, values, -np.inf)
        first = positive.argmax(axis=1)
        top = positive[rows, first]
        rest = positive.copy()
        rest[rows, first] = -np.inf
        second = rest.max(axis=1)
        for column, position in enumerate(positions):
            sibling = np.where(first == column, second, top)
            with np.errstate(invalid="ignore"):
                larger[:, position] = (sibling > 0.0) & (
                    sibling >= RATIO * np.abs(values[:, column]))
    return larger


@functools.lru_cache(maxsize=256)
def _siblings(tensors: Tuple[str, ...]) -> Tuple[List[int], ...]:
    """The positions in `tensors` of each layer's tensors, for the layers
    with two or more (a tensor of no layer has no sibling)."""
    groups: Dict[str, list] = {}
    for position, tensor in enumerate(tensors):
        layer = layer_of(tensor)
        if layer:
            groups.setdefault(layer, []).append(position)
    return tuple(positions for positions in groups.values() if len(positions) >= 2)
