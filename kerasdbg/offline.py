"""`check_run`: the rules on a recorded log directory."""

from __future__ import annotations

from typing import List, Sequence, Union

from kerasdbg.records.tags import scalar_parts, tag_parts, tag_pattern
from kerasdbg.reader import Run, load_run
from kerasdbg.rules._runner import RuleRunner, check_rules
from kerasdbg.rules.rule import Rule, Verdict


def check_run(
    log_dir: Union[str, Run], rules: Sequence[Rule], run: str = "train",
    first_only: bool = True, skip_missing: bool = False,
) -> List[Verdict]:
    """Evaluates `rules` on every recorded step of a run, in step order.

    The records are the scalars that kerasdbg's callbacks wrote under
    `<log_dir>/<run>`; each rule sees, step by step, the same mapping from tag
    to value as online.

    Args:
        log_dir: a log directory (or a `Run` from `load_run`).
        rules: the rules to evaluate; each is `reset()` first.
        run: which run of the directory. Defaults to `"train"`.
        first_only: report only the first step at which each rule fires.
            Defaults to `True`.
        skip_missing: leave out the rules the run holds no statistics for,
            instead of raising. Defaults to `False`.

    Returns:
        The verdicts, by step, then in the order of `rules`. A step's
        `epoch/...` tags (written once per epoch by `StopOnRule`) are checked
        as a record of their own, after the step's other tags, as online.

    Raises:
        TypeError: `rules` is not a `Rule` or a sequence of them.
        ValueError: the run holds none of the statistics a rule reads (the
            message says which, and which callback records them).
        KeyError: the directory has no scalars for `run` (lists the tags).

    Examples:
        >>> import keras, numpy as np, tempfile
        >>> import kerasdbg
        >>> from kerasdbg.callbacks import GradientStatistics
        >>> from kerasdbg.rules import ExplodingTensor
        >>> log_dir = tempfile.mkdtemp()
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, name="d")],
        ...                          name="m")
        >>> model.compile("sgd", "mse")
        >>> x = np.array([[1.0], [np.nan], [1.0], [1.0]], "float32")
        >>> _ = model.fit(x, np.ones((4, 1)), batch_size=1, epochs=1, verbose=0,
        ...               shuffle=False, callbacks=[GradientStatistics(log_dir)])
        >>> [v.reason for v in kerasdbg.check_run(log_dir, [ExplodingTensor()])]
        ['ExplodingTensor at step 2: non-finite values in gradients: m/d/bias=1, m/d/kernel=1']
    """
    rules = check_rules("check_run", rules)
    source = log_dir if isinstance(log_dir, Run) else load_run(log_dir)
    tags = source.tags(run=run)
    if not tags:
        source.scalars(".*", run=run)  # the KeyError that lists what the run holds
    present = recorded_pairs(tags)
    if skip_missing:
        rules = [rule for rule in rules if can_check(rule, present)]
    for rule in rules:
        needed = tuple(rule.requires)
        if not can_check(rule, present):
            wanted = ", ".join(tag_pattern(c, s) for c, s in needed)
            held = [tag_pattern(c, s) for c, s in needed if (c, s) in present]
            # Some of them but not enough: the rule cannot judge (never a guess).
            partly = (f" whole: it holds {', '.join(held)} only, from which {rule.name} "
                      "cannot judge" if held else "")
            raise ValueError(
                f"check_run: {rule.name} reads {wanted}, which run {run!r} of "
                f"{source.log_dir!r} does not hold{partly}. Record them with GradientStatistics, "
                "WeightStatistics or TapLayer + ActivationStatistics (their `stats`), "
                "and step/ and epoch/ values with StopOnRule(log_dir=...)."
            )
    runner = RuleRunner(rules, first_only=first_only)
    # In step order, a block of steps at a time (as `StopOnRule` judges a
    # read, at most `_runner.BLOCK_VALUES` values): a run of millions of
    # values is never held whole.
    return runner.check_records(source._records(run))


def recorded_pairs(tags) -> set:
    """The `(collection, statistic)` pairs that `tags` hold (and `(collection, name)`
    for two-part tags such as `gradients/global_norm`)."""
    present = {(p[0], p[2]) for p in map(tag_parts, tags) if p}
    return present | {p for p in map(scalar_parts, tags) if p}


def can_check(rule: Rule, present) -> bool:
    """Whether a run holding the `(collection, statistic)` pairs `present` feeds `rule`."""
    return rule.can_check(present)
