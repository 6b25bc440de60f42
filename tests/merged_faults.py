"""A case both backends run: two `StopOnRule`s arm both their faults, whichever
comes first (tests/callbacks/test_skip_and_spikes.py, tests/jax/test_skip_and_spikes.py)."""

from kerasdbg.callbacks import StopOnRule
from kerasdbg.rules import LossSpike, NonFiniteLoss


def check_two_stop_on_rules(model, fit, spiked_y, spike: int, window: int, reference,
                            assert_same, skipping_first: bool) -> None:
    """One StopOnRule stops on a NaN loss, another skips loss spikes: `fit(model,
    spiked_y, callbacks)` skips the spike at step `spike` in the step, as if its
    batch had not come (`assert_same(model, reference())`: a plain fit without
    it), and stops nothing."""
    stopping = StopOnRule(NonFiniteLoss(), verbose=False)
    skipping = StopOnRule(LossSpike(window=window), action="skip", verbose=False)
    fit(model, spiked_y, [skipping, stopping] if skipping_first else [stopping, skipping])
    assert skipping.skipped_steps == [spike] and stopping.verdicts == []
    assert not model.stop_training
    assert_same(model, reference())
