"""What a verdict of each built-in rule likely means and what to try: the
table the report (`kerasdbg report`) shows beside each verdict. Plain Python,
no TensorFlow.

A test checks that every rule of `kerasdbg.rules` has an entry; a new rule
adds one here.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

# The tables REMEDIES, USUAL_LEARNING_RATES and LEARNING_RATE_RULES are read by name.
__all__ = ("Remedy", "first_tries", "learning_rate_note")


@dataclasses.dataclass(frozen=True)
class Remedy:
    """The likely causes of a rule's verdict and what to try, most likely first;
    `first`, what a one-line summary says to try (`tries[0]` when empty: rules
    with the same one share a line), and `when`, the case it answers when it
    does not answer every verdict of the rule.

    Examples:
        >>> from kerasdbg.rules.remedies import REMEDIES
        >>> REMEDIES["DeadReLU"].tries[0]
        'lower the learning rate (dead units often follow a few large updates)'
    """

    causes: Tuple[str, ...]
    tries: Tuple[str, ...]
    first: str = ""
    when: str = ""


_LOWER_RATE = "lower the learning rate (by 10x to start with)"
_CLIP = "clip the gradients (`clipnorm=1.0` or `global_clipnorm=1.0` on the optimizer)"

REMEDIES: Dict[str, Remedy] = {
    "NonFiniteLoss": Remedy(
        causes=("a learning rate too high for the optimizer: the weights grew step after "
                "step until the loss overflowed",
                "NaN or Inf in a batch of inputs or labels",
                "a log or a division of zero in the loss (e.g. a probability of 0 given "
                "to a cross-entropy that expects logits, or the reverse)",
                "float16 overflow under mixed precision"),
        tries=(_LOWER_RATE, _CLIP,
               "check the data: `np.isfinite(x).all()` on the batches before the step",
               "pass `from_logits=True` to the loss when the model outputs logits")),
    "NaNSource": Remedy(
        causes=("the layer's inputs at that step were already huge (the weights before it "
                "had grown) and its output overflowed",
                "the layer's own weights had grown (see their update ratios)",
                "an operation of the layer undefined on its inputs (a log, sqrt or "
                "division of 0 or a negative number)"),
        tries=(_LOWER_RATE, _CLIP,
               "look at the layer's weights and the taps before it at the step "
               "(beside the causes, when recorded); insert a TapLayer before the layer to "
               "see its input",
               "add a small epsilon to a log, sqrt or division in a custom layer")),
    "FreezeOnFault": Remedy(
        causes=("a non-finite loss or gradient (or a gradient norm above the limit) at "
                "this step: the weights were kept as they were before it",),
        tries=("read the verdicts of NonFiniteLoss, ExplodingTensor or NaNSource at this "
               "step: they say where it came from",
               _LOWER_RATE, _CLIP)),
    "ExplodingTensor": Remedy(
        causes=("a learning rate too high: each update makes the next gradient larger",
                "no normalisation between deep layers (BatchNormalization, "
                "LayerNormalization)",
                "a recurrent layer without gradient clipping"),
        tries=(_LOWER_RATE, _CLIP,
               "add normalisation layers, or a learning-rate warm-up")),
    "WeightUpdateRatio": Remedy(
        causes=("ratios above the range: a learning rate too high for the optimizer "
                "(a healthy ratio is near 1e-3)",
                "ratios below the range: a learning rate too low, or a vanished gradient"),
        tries=(_LOWER_RATE + " when the ratios are above the range",
               "raise the learning rate when they are below it, or look at VanishingGradient",
               "compare with a run with another learning rate: `kerasdbg report RUN_A RUN_B`"),
        first=_LOWER_RATE, when="when its ratios are above the range"),
    "DeadReLU": Remedy(
        causes=("a learning rate too high: a few large updates pushed the units' "
                "pre-activations below zero for every input",
                "initialisation: biases started negative, or a kernel initialiser too wide "
                "for ReLU",
                "the activation: ReLU units that stop firing never recover"),
        tries=("lower the learning rate (dead units often follow a few large updates)",
               "initialise with `he_normal` / `he_uniform` and zero (or small positive) biases",
               "use `leaky_relu`, `elu` or `gelu`, or BatchNormalization before the ReLU"),
        first=_LOWER_RATE),
    "SaturatedActivation": Remedy(
        causes=("pre-activations too large for tanh or sigmoid (their gradient is ~0 there)",
                "initialisation too wide for the activation",
                "a learning rate too high"),
        tries=("initialise with `glorot_uniform` / `glorot_normal`",
               "add BatchNormalization or LayerNormalization before the activation",
               "lower the learning rate")),
    "VanishingGradient": Remedy(
        causes=("a deep stack of saturating activations (sigmoid, tanh)",
                "dead ReLU units: no gradient flows back through them",
                "initialisation too narrow; a learning rate too low"),
        tries=("use ReLU-family activations with `he_normal`, or residual connections",
               "add BatchNormalization",
               "raise the learning rate, or check DeadReLU's verdicts")),
    "PoorWeightInitialization": Remedy(
        causes=("an initialiser whose variance does not suit the activation (the activations' "
                "spread grows or shrinks from layer to layer)",),
        tries=("`he_normal` for ReLU, `glorot_uniform` for tanh / sigmoid",
               "add normalisation layers")),
    "TensorVariance": Remedy(
        causes=("variance above the range: weights or activations growing (a learning rate "
                "too high, no normalisation)",
                "variance below the range: a collapsed layer (dead units, a vanished gradient)"),
        tries=("above: lower the learning rate, add normalisation",
               "below: look at DeadReLU and VanishingGradient, check the initialiser")),
    "AllZero": Remedy(
        causes=("weights initialised to zero (every unit the same: they never differ)",
                "a layer whose units all died (ReLU), or a masked input",
                "gradients of a variable the loss does not depend on"),
        tries=("use a random kernel initialiser (`glorot_uniform`, `he_normal`)",
               "check that the variable takes part in the loss (a frozen or unused layer)")),
    "UnchangedTensor": Remedy(
        causes=("a frozen layer (`trainable=False`) or a variable not used by the loss",
                "a learning rate of zero or a vanished gradient"),
        tries=("check `layer.trainable` and the model's trainable_variables",
               "raise the learning rate; look at VanishingGradient")),
    "LossNotDecreasing": Remedy(
        causes=("a learning rate too low (the loss barely moves) or too high (it jumps)",
                "labels that do not match the inputs (a shuffle of one without the other)",
                "a loss that does not suit the output (e.g. from_logits)"),
        tries=("try learning rates 10x above and below",
               "check a few (input, label) pairs by hand",
               "overfit one small batch first: a model that cannot is wired wrong")),
    "Overfit": Remedy(
        causes=("the model memorises the training data: too many parameters or too few "
                "samples",),
        tries=("add Dropout or weight decay, or augment the data",
               "stop earlier (`keras.callbacks.EarlyStopping(restore_best_weights=True)`)")),
    "Overtraining": Remedy(
        causes=("neither loss improves any more: training goes on past its useful end",),
        tries=("stop earlier (`keras.callbacks.EarlyStopping`)",
               "lower the learning rate on a plateau (`ReduceLROnPlateau`)")),
    "ClassImbalance": Remedy(
        causes=("some classes are far rarer than others in the training data",
                "a class the model never predicts"),
        tries=("pass `class_weight` to fit, or resample the data",
               "use metrics that see each class (precision / recall per class)")),
    "ReplicaConsistency": Remedy(
        causes=("the replicas applied different updates: a variable created outside the "
                "strategy's scope, or a custom train step that skips the all-reduce",),
        tries=("create the model and the optimizer inside `strategy.scope()`",
               "in a custom train step, apply the gradients with the optimizer Keras gives")),
    "LossSpike": Remedy(
        causes=("a batch unlike the others: mislabelled or corrupted samples, targets on "
                "another scale, a shard of duplicates",
                "the learning rate (or its warm-up's end) too high for this point of "
                "training: the update of the step before overshot",
                "large-model instability: attention logits or the output layer's logits "
                "growing until a step diverges"),
        tries=("keep the run alive: `StopOnRule([LossSpike()], action=\"skip\")` skips such "
               "steps in the graph; `action=\"rollback\"` goes back to a snapshot and skips "
               "the batches after the spike",
               "look at the batch of that step (its inputs and labels)",
               _LOWER_RATE, _CLIP),
        first="skip the spiky steps (`action=\"skip\"`) or roll back past them"),
    "GradientNormSpike": Remedy(
        causes=("a batch unlike the others (see LossSpike)",
                "the learning rate too high for this point of training",
                "a layer whose weights or activations are growing (see its update ratios "
                "and the taps' statistics)"),
        tries=("keep the run alive: `StopOnRule([GradientNormSpike()], action=\"skip\")`",
               _CLIP, _LOWER_RATE),
        first="skip the spiky steps (`action=\"skip\"`) or roll back past them"),
    "LogitGrowth": Remedy(
        causes=("attention logits growing without bound (the query and key weights growing "
                "together), which makes the softmax one-hot and precedes divergence in large "
                "transformers",
                "a learning rate too high for the attention layers",
                "no normalisation of the queries and keys"),
        tries=("normalise the queries and keys (QK-norm: a LayerNormalization on each before "
               "the dot product)",
               _LOWER_RATE,
               "add weight decay on the query and key projections",
               "keep the run alive meanwhile: `StopOnRule([LogitGrowth(), LossSpike()], "
               "action=\"rollback\")`")),
    "SkippedStep": Remedy(
        causes=("an in-graph fault (a NaN/Inf, a spike, a gradient norm above the limit) "
                "that the rules on the records did not report: a rule left out of the run, "
                "or a value at a threshold's last bit"),
        tries=("read the step's records (`step/loss`, `step/gradient_norm`) around it",
               "add the rule whose fault it was (NonFiniteLoss, LossSpike, "
               "GradientNormSpike) to the rules checked")),
    "LearnedRange": Remedy(
        causes=("something changed since the healthy run it was calibrated on: the learning "
                "rate or its schedule (update ratios above the range), the inputs' scaling "
                "or the data (gradient norms above it), weights reset or overwritten (a "
                "kernel's norm below it)",
                "the run differs from the calibrated one by design (another optimizer, batch "
                "size or length): the ranges do not apply"),
        tries=("diff the run's set-up against the calibrated run's: learning rate, data "
               "pipeline, initial weights, callbacks that change the optimizer",
               "compare the two runs: `kerasdbg report CALIBRATED_RUN THIS_RUN`",
               "calibrate again on a healthy run of the new set-up (`kerasdbg.calibrate`)")),
}

USUAL_LEARNING_RATES: Tuple[Tuple[str, float, float], ...] = (
    ("SGD", 1e-3, 1e-1),
    ("Adam, AdamW, RMSprop", 1e-5, 1e-2),
)
"""(optimizers, low, high): the learning rates those optimizers are usually
trained with, as the report says them."""

LEARNING_RATE_RULES = ("NonFiniteLoss", "NaNSource", "FreezeOnFault", "ExplodingTensor",
                       "WeightUpdateRatio", "DeadReLU", "SaturatedActivation",
                       "TensorVariance", "LossNotDecreasing")
"""Rules whose verdict a learning rate above the usual ranges can explain."""


def first_tries(rules: Sequence[str]) -> List[Tuple[str, List[str]]]:
    """What to try first for the rules that fired, each remedy once: `(what
    to try, the rules it answers)`, in the order of `rules`; a rule is named
    with the case it answers (`Remedy.when`) when it does not answer all.
    Rules without an entry are left out.

    Examples:
        >>> from kerasdbg.rules.remedies import first_tries
        >>> for text, rules in first_tries(["WeightUpdateRatio", "DeadReLU", "NonFiniteLoss"]):
        ...     print(text, "|", "; ".join(rules))
        lower the learning rate (by 10x to start with) | WeightUpdateRatio when its ratios are above the range; DeadReLU; NonFiniteLoss
    """
    found: Dict[str, List[str]] = {}
    for rule in dict.fromkeys(rules):
        remedy = REMEDIES.get(rule)
        if remedy is not None:
            found.setdefault(remedy.first or remedy.tries[0], []).append(
                f"{rule} {remedy.when}" if remedy.when else rule)
    return list(found.items())


def _times(ratio: float) -> str:
    """`300` for 300.0, `2.5` for 2.5: a factor as a person writes it."""
    return f"{ratio:.0f}" if ratio >= 10 else f"{ratio:.2g}"


def learning_rate_note(rate: Optional[float], epoch: Optional[int] = None,
                       last: Optional[Tuple[int, float]] = None) -> Optional[str]:
    """What the report says of a run's learning rate: how far it is above the
    usual ranges (`USUAL_LEARNING_RATES`), or None when it is within the widest
    of them or unknown; which epoch's rate it is, and the last epoch's when it
    differs (a schedule), when given.

    Args:
        rate: the learning rate (e.g. Keras's `epoch_learning_rate`), or None.
        epoch: the epoch (from 1) `rate` is of, or None. Defaults to `None`.
        last: `(epoch, rate)` of the last epoch when its rate differs, or
            None. Defaults to `None`.

    Examples:
        >>> from kerasdbg.rules.remedies import learning_rate_note
        >>> print(learning_rate_note(30.0, epoch=1, last=(3, 0.3))[:50])
        the learning rate of epoch 1 is 30 (0.3 by epoch 3
        >>> print(learning_rate_note(30.0))
        the learning rate is 30, 300x above the usual range for SGD (0.001-0.1) and 3000x above that for Adam, AdamW, RMSprop (1e-05-0.01): lower it (try 0.01 for SGD, 0.001 for Adam)
        >>> learning_rate_note(1e-3) is None
        True
    """
    if rate is None or not rate == rate or rate <= USUAL_LEARNING_RATES[-1][2]:
        return None
    above = [(names, low, high) for names, low, high in USUAL_LEARNING_RATES if rate > high]
    parts = [f"{_times(rate / high)}x above {'the usual range for' if i == 0 else 'that for'} "
             f"{names} ({low:g}-{high:g})" for i, (names, low, high) in enumerate(above)]
    within = [names for names, low, high in USUAL_LEARNING_RATES if low <= rate <= high]
    tail = (f" (within the range for {within[0]})"
            if within else ": lower it (try 0.01 for SGD, 0.001 for Adam)")
    of = f" of epoch {epoch}" if epoch is not None else ""
    later = f" ({last[1]:g} by epoch {last[0]})" if last is not None else ""
    return f"the learning rate{of} is {rate:g}{later}, " + " and ".join(parts) + tail
