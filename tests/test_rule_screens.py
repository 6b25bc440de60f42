"""Rules screen a block of steps, then judge one by one the steps that need it.

Expected verdicts come from the per-step path (`RuleRunner.check_step`, each
rule's `check` at every step, tested on its own elsewhere): judging the same
records as blocks (`RuleRunner.check_records`, `check_block`) must give the
same verdicts, notes included, in the same order, and leave every rule with
the same memory, on healthy runs and with a fault planted at every position;
and on a healthy run the screened rules judge no step one by one.
"""

import collections
import math

import numpy as np
import pytest

from kerasdbg.records.step_block import StepBlock, blocks_of
from kerasdbg.rules import (
    AllZero, ExplodingTensor, FreezeOnFault, NaNSource, NonFiniteLoss, UnchangedTensor,
    VanishingGradient, WeightUpdateRatio, default_rules,
)
from kerasdbg.rules._runner import RuleRunner

TENSORS = ("m/d1/kernel", "m/d1/bias", "m/d2/kernel", "m/d2/bias", "m/emb/embeddings", "lone")
FREQUENT = {"gradients": ("l2_norm", "nan_count", "inf_count"),
            "weights": ("l2_norm", "nan_count", "inf_count")}
FULL = {"gradients": ("l2_norm", "nan_count", "inf_count", "mean_abs", "zero_fraction",
                      "min", "max", "mean", "std"),
        "weights": ("l2_norm", "nan_count", "inf_count", "update_ratio", "zero_fraction",
                    "mean", "std", "min", "max", "mean_abs")}
STEPS = 60
SCREENED = (NonFiniteLoss, ExplodingTensor, VanishingGradient, AllZero, UnchangedTensor,
            WeightUpdateRatio, FreezeOnFault, NaNSource)


def scheduled(step, every_step=False):
    return every_step or step <= 10 or step % 50 == 0


def healthy(steps=STEPS, seed=0, every_step=False, first=1, bias="zero"):
    """`[(step, record)]` of a healthy run: the full statistics at steps 1-10
    and every 50th (or every step), the frequent ones elsewhere. The bias of
    `m/d1` has a zero gradient by construction (a bias before a
    normalization: `bias="zero"`), or one a thousand times below its
    kernel's, rounding noise (`"tiny"`), or a gradient like the others
    (`"healthy"`)."""
    rng = np.random.default_rng(seed)
    rows = []
    norms = {t: 1.0 + rng.uniform() for t in TENSORS}
    for step in range(first, first + steps):
        full = scheduled(step, every_step)
        record = {"step/loss": 2.3 - step * 0.01 + rng.normal() * 0.01, "step/frozen": 0.0,
                  "step/fault": 0.0, "step/skipped": 0.0}
        for collection, stats in (FULL if full else FREQUENT).items():
            for tensor in TENSORS:
                odd = collection == "gradients" and tensor == "m/d1/bias"
                zero_gradient = odd and bias == "zero"
                if collection == "weights":
                    norms[tensor] *= 1.0 + rng.uniform(1e-4, 1e-2)
                for stat in stats:
                    value = {
                        "l2_norm": norms[tensor] if collection == "weights"
                        else rng.uniform(0.1, 1.0),
                        "nan_count": 0.0, "inf_count": 0.0,
                        "mean_abs": rng.uniform(1e-3, 1e-2),
                        "zero_fraction": rng.uniform(0.0, 0.2),
                        "update_ratio": rng.uniform(1e-4, 1e-2),
                        "min": -rng.uniform(0.1, 1), "max": rng.uniform(0.1, 1),
                        "mean": rng.normal() * 0.1, "std": rng.uniform(0.1, 1),
                    }[stat]
                    if zero_gradient and stat in ("l2_norm", "mean_abs", "min", "max", "mean",
                                                  "std"):
                        value = 0.0
                    if zero_gradient and stat == "zero_fraction":
                        value = 1.0
                    if odd and bias == "tiny" and stat in ("mean_abs", "l2_norm"):
                        value *= 1e-8
                    if bias == "tiny" and tensor == "m/d1/bias" and stat == "update_ratio":
                        value = math.inf  # weights at their initial zeros: no ratio says
                    record[f"{collection}/{tensor}/{stat}"] = value
        if bias == "decay":  # AdamW's lr x wd at each step, ratios near it
            record["step/weight_decay_fraction"] = 4e-6
        rows.append((step, dict(sorted(record.items()))))
    return rows


def plant(rows, fault, position):
    """`rows` with `fault` planted at the step at `position` (and after it
    where the fault lasts)."""
    rows = [(step, dict(record)) for step, record in rows]

    def put(at, tag, value):
        if tag in rows[at][1]:
            rows[at][1][tag] = value

    for at in range(position, len(rows)):
        if fault == "nan_loss" and at == position:
            put(at, "step/loss", math.nan)
        if fault == "inf_gradient" and at == position:
            put(at, "gradients/m/d2/kernel/inf_count", 3.0)
            put(at, "step/frozen", 1.0)
            put(at, "step/fault", 1.0)
            rows[at][1]["faults/nan_source/located"] = 1.0
            rows[at][1]["faults/nan_source/layer/m/d2"] = 1.0
        if fault == "nan_count_nan" and at == position:  # a count not captured
            put(at, "gradients/m/d1/kernel/nan_count", math.nan)
        if fault == "all_zero":
            put(at, "weights/m/d2/kernel/zero_fraction", 1.0)
        if fault == "large_update" and at in (position, position + 1):
            put(at, "weights/m/d1/kernel/update_ratio", 50.0)
        if fault == "vanished":
            put(at, "gradients/m/d2/kernel/mean_abs", 1e-12)
            put(at, "weights/m/d2/kernel/update_ratio", 1e-12)
        if fault == "unchanged":
            for stat in FULL["weights"]:
                put(at, f"weights/m/d2/kernel/{stat}", rows[position][1].get(
                    f"weights/m/d2/kernel/{stat}", 0.0))
            put(at, "weights/m/d2/kernel/update_ratio", 1e-9)  # moved by none
        if fault == "not_recorded":  # a gradient statistic not captured at one step
            if at == position:
                put(at, "gradients/m/d1/bias/mean_abs", math.nan)
                put(at, "gradients/m/d2/bias/mean_abs", math.nan)
    return rows


def memory(value):
    """A rule's memory as plain values (objects as their attributes)."""
    if isinstance(value, dict):
        return {k: memory(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, collections.deque)):
        return [memory(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(map(repr, value))
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if hasattr(value, "__dict__") and not callable(value):
        return {k: memory(v) for k, v in vars(value).items()}
    return value


def same(found, expected) -> bool:
    """Verdict lists equal, a NaN value equal to a NaN."""
    return memory([v._asdict() for v in found]) == memory([v._asdict() for v in expected])


def both_ways(make_rules, rows):
    """`(verdicts step by step, verdicts as blocks, runners)`."""
    one, blocks = RuleRunner(make_rules()), RuleRunner(make_rules())
    expected = [v for step, record in rows for v in one.check_step(step, record)]
    found = blocks.check_records(rows)
    return expected, found, (one, blocks)


def in_reads(make_rules, rows, size=7):
    """`(verdicts, runner)` of the rows judged as `StopOnRule` judges reads of
    `size` steps: each read's steps of one layout a block."""
    runner, verdicts = RuleRunner(make_rules()), []
    for start in range(0, len(rows), size):
        for block in blocks_of(rows[start:start + size]):
            for _, found in runner.check_block(block):
                verdicts.extend(found)
    return verdicts, runner


def assert_same(make_rules, rows):
    expected, found, (one, blocks) = both_ways(make_rules, rows)
    assert same(found, expected)
    read, reads = in_reads(make_rules, rows)
    assert same(read, expected)
    for other in (blocks, reads):
        assert one.fired == other.fired
        for a, b in zip(one.rules, other.rules):
            # (`others` is what the runner hands a rule during a check, not memory.)
            kept = [{k: v for k, v in vars(r).items() if k != "others"} for r in (a, b)]
            assert memory(kept[0]) == memory(kept[1]), a.name
    return expected, blocks


def defaults():
    return default_rules(without=["activations", "replicas"])


@pytest.mark.parametrize("every_step", [False, True])
def test_a_healthy_run_is_judged_alike_and_no_screened_rule_judges_a_step_one_by_one(
        every_step):
    rows = healthy(every_step=every_step)
    verdicts, _ = assert_same(defaults, rows)
    # The zero gradient of m/d1/bias is reported once as information, nothing else.
    assert {v.severity for v in verdicts} <= {"info"}
    for rule in SCREENED:
        runner = RuleRunner([rule()])
        runner.check_records(rows)
        if rule is AllZero:
            # The bias zero by construction: judged where its zero_fraction is recorded.
            assert runner.judged == sum(scheduled(s, every_step) for s, _ in rows)
        elif rule is VanishingGradient:
            # Its zero gradient is below the threshold wherever its mean_abs is recorded.
            assert runner.judged == sum(scheduled(s, every_step) for s, _ in rows)
        else:
            assert runner.judged == 0, rule.__name__


@pytest.mark.parametrize("every_step", [False, True])
def test_a_healthy_run_without_a_zero_tensor_is_judged_at_no_step(every_step):
    rows = healthy(every_step=every_step, bias="healthy")
    assert same(assert_same(lambda: [rule() for rule in SCREENED], rows)[0], [])
    runner = RuleRunner([rule() for rule in SCREENED])
    assert runner.check_records(rows) == []
    assert runner.judged == 0


def test_a_gradient_dwarfed_by_its_sibling_is_judged_where_it_is_small_only():
    rows = healthy(bias="tiny")
    verdicts, runner = assert_same(defaults, rows)
    assert [(v.rule, v.severity) for v in verdicts] == [("VanishingGradient", "info")]
    assert 0 < runner.judged


FAULTS = ("nan_loss", "inf_gradient", "nan_count_nan", "all_zero", "large_update", "vanished",
          "unchanged", "not_recorded")


@pytest.mark.parametrize("bias", ["zero", "tiny", "healthy", "decay"])
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_planted_at_every_position_gets_the_verdicts_of_the_step_by_step_judgement(
        fault, bias):
    base = healthy(bias=bias, every_step=bias == "decay")
    fired_somewhere = False
    for position in range(len(base)):
        rows = plant(base, fault, position)
        expected, _ = assert_same(defaults, rows)
        fired_somewhere |= any(v.severity == "fault" for v in expected)
        # Each rule alone too (no other rule's judgement at the step to lean
        # on), at every third position (the tag layouts change at 11 and 50).
        if position % 3 == 1 or position in (9, 10, 48, 49, 50):
            for rule in SCREENED:
                assert_same(lambda: [rule()], rows)
    assert fired_somewhere == (fault not in ("nan_count_nan", "not_recorded")), fault


def test_a_rule_watched_from_a_later_step_and_a_run_resumed_are_judged_alike():
    rows = healthy(first=101)
    assert_same(defaults, plant(rows, "large_update", 5))
    assert_same(defaults, plant(rows, "vanished", 20))


def test_rules_with_settings_screen_as_they_judge():
    rows = plant(healthy(), "large_update", 30)
    for make in (lambda: [ExplodingTensor(threshold=0.5)],
                 lambda: [ExplodingTensor(collections=["gradients", "weights"], only_nan=True)],
                 lambda: [AllZero(zero_fraction=0.15)],
                 lambda: [WeightUpdateRatio(large_threshold=5e-3, small_threshold=1e-3)],
                 lambda: [VanishingGradient(threshold=2e-3, require="all")],
                 lambda: [UnchangedTensor(num_steps=2)]):
        assert_same(make, rows)


def test_epoch_records_are_judged_after_their_step_as_one_by_one():
    rows = healthy(20)
    rows[9][1]["epoch/loss"] = 2.0
    rows[19][1]["epoch/loss"] = math.nan
    expected, found, _ = both_ways(defaults, rows)
    assert same(found, expected) and len(expected) > 0


def test_a_custom_rule_without_a_screen_is_judged_at_every_step():
    from kerasdbg.rules import Rule

    class Seen(Rule):
        requires = (("step", "loss"),)

        def reset(self):
            self.steps = []

        def check(self, step, record):
            self.steps.append(step)

    rule = Seen()
    runner = RuleRunner([rule, NonFiniteLoss()])
    runner.check_records(healthy(30))
    assert rule.steps == list(range(1, 31)) and runner.judged == 30


def test_a_block_holds_its_steps_as_arrays():
    rows = healthy(12)
    blocks = list(blocks_of(rows))
    # Steps 1-10 (the full statistics), then 11-12 (the frequent ones).
    assert [b.steps.tolist() for b in blocks] == [list(range(1, 11)), [11, 12]]
    block = blocks[0]
    assert block.values.shape == (10, len(rows[0][1]))
    names = tuple(sorted(TENSORS))  # in the records' tag order
    assert block.names("weights", "update_ratio") == names
    np.testing.assert_array_equal(
        block.column("weights", "update_ratio")[3],
        [rows[3][1][f"weights/{t}/update_ratio"] for t in names])
    assert block.tag("step/missing") is None
    assert block.record(4) == rows[4][1]
    part = block.rows(2, 5)
    assert part.steps.tolist() == [3, 4, 5] and part.values.base is not None
    assert isinstance(part, StepBlock) and len(part) == 3


def test_a_rule_that_overrides_a_built_in_check_only_is_judged_at_every_step():
    class Stricter(ExplodingTensor):
        def check(self, step, record):  # fires on any step with a gradient norm above 0.5
            if any(v > 0.5 for k, v in record.items()
                   if k.startswith("gradients/") and k.endswith("/l2_norm")):
                return self.verdict(step, "a norm above 0.5", {"any": 1.0})

    rows = healthy(20)
    expected, found, (_, runner) = both_ways(lambda: [Stricter()], rows)
    assert same(found, expected) and len(expected) == 1
    assert runner.judged == 1  # it fired at step 1 and, firing once, is checked no more


def test_a_long_run_is_judged_a_bounded_block_at_a_time(monkeypatch):
    from kerasdbg.rules import _runner

    sizes = []
    original = _runner.RuleRunner.check_block

    def check_block(self, block):
        sizes.append(block.values.size)
        return original(self, block)

    monkeypatch.setattr(_runner.RuleRunner, "check_block", check_block)
    monkeypatch.setattr(_runner, "BLOCK_VALUES", 1000)
    rows = healthy(120, bias="healthy")
    RuleRunner(defaults()).check_records(rows)
    tags = max(len(record) for _, record in rows)
    assert max(sizes) <= 1000 + tags and sum(sizes) == sum(len(r) for _, r in rows)
