"""`ClassImbalance`: labels seen in training, and mispredictions, per class."""

from __future__ import annotations

import collections

from kerasdbg import _validation as check
from kerasdbg.rules.rule import CLASSES, Rule, listing, values_of


class ClassImbalance(Rule):
    """Fires when the classes seen in training are imbalanced, or a class is
    mostly mispredicted while the others are not.

    Reads `classes/<k>/seen` and `classes/<k>/mispredicted`, the labels of
    class `k` seen so far in the fit and how many of them the model's
    prediction (argmax; above 0.5 for one sigmoid unit) got wrong, counted
    in the train step on the first output and summed over replicas.
    `StopOnRule` records them when this rule is among its rules.

    Once `samples` labels have been seen:

    - imbalance: the largest class count divided by the smallest (a class
      of the output never seen counts as 0) above `threshold_imbalance`;
    - misprediction: over the latest `samples` labels (differences of the
      counts), a class whose fraction of mispredicted labels is above
      `threshold_misprediction` while the fraction over all classes is not:
      a class left behind, which imbalance typically causes. The first
      `samples` labels are a warm-up for this check (a fresh model
      mispredicts most of every class), so it starts after `2 * samples`.

    Args:
        threshold_imbalance: the largest accepted ratio of class counts.
            Defaults to `10.0`.
        threshold_misprediction: the largest accepted fraction of a class's
            labels predicted wrong. Defaults to `0.7`.
        samples: labels to see before judging. Defaults to `500`.

    Examples:
        >>> from kerasdbg.rules import ClassImbalance
        >>> rule = ClassImbalance(samples=100)
        >>> rule.check(3, {"classes/0/seen": 190.0, "classes/0/mispredicted": 5.0,
        ...                "classes/1/seen": 10.0, "classes/1/mispredicted": 9.0}).reason
        'ClassImbalance at step 3: class counts differ 19-fold (more than 10): 0=190, 1=10'
    """

    def __init__(self, threshold_imbalance: float = 10.0, threshold_misprediction: float = 0.7,
                 samples: int = 500):
        owner = type(self).__name__
        self.threshold_imbalance = check.number(
            owner, "threshold_imbalance", threshold_imbalance, minimum=1.0)
        self.threshold_misprediction = check.number(
            owner, "threshold_misprediction", threshold_misprediction, minimum=0.0, maximum=1.0)
        self.samples = check.positive_int(owner, "samples", samples)
        self.reset()

    requires = ((CLASSES, "seen"),)

    def reset(self):
        self._history = collections.deque()

    def check(self, step, record):
        seen = {k: v for k, v in values_of(record, CLASSES, "seen")}
        if not seen:
            return None
        wrong = dict(values_of(record, CLASSES, "mispredicted"))
        total = sum(seen.values())
        self._history.append((total, seen, wrong))
        if total < self.samples:
            return None
        largest, smallest = max(seen.values()), min(seen.values())
        if smallest == 0 or largest / smallest > self.threshold_imbalance:
            ratio = "infinitely" if smallest == 0 else f"{largest / smallest:.3g}-fold"
            return self.verdict(
                step, f"class counts differ {ratio} (more than {self.threshold_imbalance:g}): "
                f"{listing(dict(sorted(seen.items(), key=lambda kv: -kv[1])))}", seen)
        # The latest window of at least `samples` labels: now minus the last
        # snapshot that many labels ago.
        while len(self._history) > 1 and total - self._history[1][0] >= self.samples:
            self._history.popleft()
        base_total, base_seen, base_wrong = self._history[0]
        if base_total < self.samples or total - base_total < self.samples:
            return None  # the first `samples` labels are a warm-up
        window = {k: n - base_seen.get(k, 0.0) for k, n in seen.items()}
        errors = {k: wrong.get(k, 0.0) - base_wrong.get(k, 0.0) for k in seen}
        overall = sum(errors.values()) / max(sum(window.values()), 1.0)
        if overall > self.threshold_misprediction:
            return None
        behind = {k: errors[k] / n for k, n in window.items()
                  if n and errors[k] / n > self.threshold_misprediction}
        if not behind:
            return None
        return self.verdict(
            step, f"mispredicted fraction above {self.threshold_misprediction:g} for "
            f"{listing(behind)} over the latest {int(sum(window.values()))} labels "
            f"(all classes: {overall:.3g})", behind)

    def get_config(self):
        return {"threshold_imbalance": self.threshold_imbalance,
                "threshold_misprediction": self.threshold_misprediction,
                "samples": self.samples}
