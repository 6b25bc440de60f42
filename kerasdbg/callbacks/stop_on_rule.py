"""`StopOnRule`: evaluates rules at every step during `fit` and acts on them."""

from __future__ import annotations

import sys
import time
import warnings
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Union

import keras
import numpy as np

from kerasdbg import capture as _capture
from kerasdbg.capture import keras_objects, planner
from kerasdbg import _qualified
from kerasdbg.sinks import events as _events
from kerasdbg.sinks import layout as _layout
from kerasdbg import _validation as check
from kerasdbg.sinks import workers as _workers
from kerasdbg import schedule as schedule_lib
from kerasdbg.records import tags as _tags
from kerasdbg.records import verdicts as _verdicts
from kerasdbg.records.step_block import StepBlock
from kerasdbg.records.step_record import StepRecord, per_optimizer_values
from kerasdbg.records.verdicts import notes_line, verdict_markdown
from kerasdbg.callbacks._copies import CopiedAsNew
from kerasdbg.callbacks._executions import AfterEachExecution
from kerasdbg.callbacks._model import ModelWithoutSync
from kerasdbg.callbacks._recording import open_writer, release_writer
from kerasdbg.callbacks._suspension import suspend_others
from kerasdbg.callbacks.activation_statistics import find_taps
from kerasdbg.capture.step_rows import LOSS_TAG, StepRows
from kerasdbg.rules._runner import RuleRunner, check_rules, rule_config, rule_from_config
from kerasdbg.rules.defaults import default_rules, reads_any
from kerasdbg.rules.all_zero import AllZero
from kerasdbg.rules.faults import FreezeOnFault, NaNSource
from kerasdbg.rules.rule import CLASSES, SCALAR_COLLECTIONS, Rule, RuleFired, RuleWarning
from kerasdbg.rules.rule import Verdict, tag_pattern
from kerasdbg.rules.logit_growth import LogitGrowth
from kerasdbg.rules.spike_rules import SkippedStep

ACTIONS = ("stop", "raise", "warn", "skip", "rollback")
SKIP_FAULTS = frozenset({"nonfinite", "max_gradient_norm", "loss_spike", "gradient_norm_spike"})
"""The in-graph faults `action="skip"` skips (see `kerasdbg.capture.Freeze`)."""
VERDICT_TAG = _tags.VERDICTS
DEFAULT_SUSPEND = (
    keras.callbacks.BackupAndRestore,
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.EarlyStopping,
)
# The tags StopOnRule writes itself (the statistics callbacks write the rest).
_OWN_PREFIXES = _tags.prefixes(SCALAR_COLLECTIONS + (CLASSES, _tags.FAULTS, _tags.REPLICAS))


def _host_number(value) -> float:
    """A scalar Keras variable (its value as the model holds it) or a
    backend tensor (a schedule's rate) as a float on the host, without
    NumPy's conversion of a Keras variable (deprecated on NumPy 2)."""
    if isinstance(value, keras.Variable):
        return float(keras_objects.host_value(value))
    return float(np.asarray(value.numpy() if hasattr(value, "numpy") else value))


class StopOnRule(AfterEachExecution, ModelWithoutSync, CopiedAsNew, keras.callbacks.Callback):
    """Evaluates rules at every optimizer step of `fit` and acts when one fires.

    The callback records what its rules read (their `requires`): gradient and
    weight statistics in the compiled train step (of every optimizer the
    train step applies, at each one's steps, as `GradientStatistics`), the
    statistics of the model's `TapLayer`s, the loss of each train step
    (`step/loss`), every scalar the train step returns (`step/<name>`, per
    step, not per execution), Keras's epoch logs (`epoch/loss`,
    `epoch/val_loss`, ...), and for `ClassImbalance` the labels seen and
    mispredicted per class. After each execution it evaluates the rules on
    every step of it, in order; each rule fires at most once per `fit`. When
    a rule fires, the verdict (rule, step, tensors, values) is printed,
    written to TensorBoard as text (`rules/verdicts` under `<log_dir>/train`),
    and then:

    - "stop": training ends after this execution. The callbacks in `suspend`
      (by default `BackupAndRestore`, `ModelCheckpoint`, `EarlyStopping`)
      get no further `on_train_batch_end` / `on_epoch_end` / `on_train_end`
      in this `fit`, so no backup of the faulty weights is saved, the last
      good backup is not deleted and no weights are restored (the side
      effects `keras.callbacks.TerminateOnNaN` sets off). Validation of the
      current epoch still runs.
    - "raise": raises `kerasdbg.rules.RuleFired` carrying the verdicts, after
      restoring the model's train step; no other callback runs.
    - "warn": issues a `kerasdbg.rules.RuleWarning` (a `DiagnosisWarning`)
      and training goes on. The warning is the verdict's one channel (no
      `kerasdbg:` line as well), attributed to the line that called `fit`,
      so the `warnings` module filters it (`"ignore"` in a sweep) or makes
      it an error (`"error"` in a test).
    - "skip": a step whose fault is decided in the compiled train step (a
      NaN/Inf loss or gradient, a gradient norm above `max_gradient_norm`,
      a spike of `LossSpike` or `GradientNormSpike`) applies nothing: the
      weights, the optimizer's slots and step count (Keras's `iterations`
      does not count a skipped step, as `LossScaleOptimizer` does not count
      an overflow it skips) and BatchNormalization's moving statistics stay
      as if its batch had not come, on every replica and worker alike, with
      no extra host round trip; training goes on. kerasdbg numbers steps by
      `iterations` + the steps it skipped, so every batch keeps its own step.
      At most `max_skips` steps among the last `skip_window` of an optimizer
      are skipped; a fault beyond them freezes the weights and training
      stops, as does a verdict decided on the records after the step (a rule
      whose test does not run in the graph). Each skipped step is recorded
      (`step/skipped`, `skipped_steps`, and per epoch `skipped_steps` in
      Keras's logs, hence `history`), and said with its verdict.
    - "rollback": at a fault, the weights and the optimizer's variables
      (its step count included) are put back as they were at the last
      snapshot, taken on the host every `rollback_every` steps (one copy at
      a time), the next `rollback_skip` batches are skipped in the graph, and
      training goes on (`rollbacks`); the steps rolled back are written again
      in the records, which the reader shows as a rollback. The rules that
      watch NaN/Inf start afresh after a rollback (a later NaN rolls back
      again); at most `max_skips` rollbacks per fit. Without a snapshot yet,
      or beyond them, training stops.
    - a callable: called as `action(verdicts, model)`.

    A rule's own `action` ("skip" or "stop", on `LossSpike` and
    `GradientNormSpike`) overrides this one for the faults it finds in the
    graph.

    Each verdict is said once: with "warn" by its warning, else (with
    `verbose`) as a `kerasdbg: <reason>` line. Verdicts of severity "info"
    (tensors that are zero by construction in a healthy network, e.g. the
    bias of a convolution followed by `BatchNormalization`; see
    `VanishingGradient`) are never acted on: they are recorded (in
    `verdicts` and the text) and printed together, in one line at the end
    of the fit (`kerasdbg: information, not faults (...)`). The text
    (`rules/verdicts`) holds, at each write, every verdict so far of the
    StopOnRules writing to that run, in step order (TensorBoard shows the
    newest write first); a fit in which rules ran and none fired ends it
    with "No verdict: <rules> ran over steps <a>-<b> and none fired.".

    The loss of a step (`step/loss`) is, in this order: the scalar named by
    `loss` among those the train step returns; the loss `compute_loss`
    returned (Keras's `train_step`, or a custom one that calls it), summed
    over replicas; the value a custom train step gives its metric named
    "loss" (`update_state(loss)`, on JAX `stateless_update_state`: the
    keras.io guides' lower-level steps), over the replicas as that metric
    takes it; the `loss` the train step returns. A custom train step
    often returns the running mean of a `keras.metrics.Mean` tracker (the
    keras.io VAE, GAN examples): recorded per step, it is still a mean since
    the epoch began, and a NaN stays in it once it came. `loss_source` says
    which was read. When there is no single loss (a GAN returning `d_loss`
    and `g_loss`), `NonFiniteLoss` watches every scalar the train step
    returns whose name says it is a loss, and says which once (printed, as
    information). When a rule reads the loss and the model gives none, the
    rule says so once in a warning and never fires; a loss that was not
    captured is absent from the records, never NaN.

    With several optimizers, the loss and the other `step/` values of a
    train step are at the step of the first optimizer it applies, and
    freeze-on-fault and NaN localisation act on all of them: a fault in any
    apply freezes every later one.
    With `freeze_on_fault`, steps at and after an in-graph fault (a
    non-finite loss or gradient, or a global gradient norm above
    `max_gradient_norm`) do not change the weights, the optimizer slots, the
    loss scale or the state the forward pass updates (BatchNormalization's
    moving statistics, restored per replica), even within one execution of
    `steps_per_execution > 1`: the weights at the end are those before the
    faulty step. The fault is
    computed from values summed over replicas, so every replica takes the
    same decision. Frozen steps still count in `optimizer.iterations`. The
    freeze is reported by the `FreezeOnFault` rule (added to the rules when
    missing) when no other rule fired at that step, and the NaN source by
    the `NaNSource` rule (likewise, with `locate_nan`): both read what the
    capture recorded at the fault's step (`faults/...` scalars, written to
    `log_dir`), so `kerasdbg.check_run` gives the same verdicts offline; with "warn" the weights are unfrozen after the report (the
    frozen steps are lost, as skipped batches). Several `StopOnRule`s can
    watch one model, e.g. one that stops on non-finite values and one that
    only warns of dead units: only those with `freeze_on_fault` report or
    lift a freeze, and the `step/` and `epoch/` scalars they share are
    written once to a shared log directory.

    Every replica and every worker reaches the same decision from gradients,
    weights and loss, which are read after the cross-replica sum, and from
    the taps' records, which are the cluster's on every worker.

    Args:
        rules: a `kerasdbg.rules.Rule` or a sequence of them; None for
            `kerasdbg.rules.default_rules()` (the activation rules only when
            the model has taps). Defaults to `None`.
        action: "stop", "raise", "warn", "skip", "rollback", or a callable.
            Defaults to `"stop"`.
        start_step: evaluate the steps from this optimizer step on (steps are
            numbered from 1). Defaults to `0`.
        freeze_on_fault: freeze the weights at an in-graph fault; None turns
            it on when a rule watches non-finite values (`NonFiniteLoss`,
            `ExplodingTensor` on gradients) or spikes, and with "skip" or
            "rollback". Defaults to `None`.
        max_gradient_norm: with `freeze_on_fault`, also a global gradient
            norm above this is a fault. Defaults to `None`.
        locate_nan: at the first non-finite loss or gradient, replay that
            step's forward pass layer by layer (on TensorFlow inside a
            `tf.cond` taken only then; on JAX by the host, with the weights
            the freeze kept, so there it needs `freeze_on_fault`) and report,
            as a `NaNSource` verdict, the first layer whose output held NaN/Inf
            and the variables whose gradient did; None turns it on like
            `freeze_on_fault`. Defaults to `None`.
        log_dir: TensorBoard log directory for the verdicts and the
            `step/` and `epoch/` scalars, or None. Defaults to `None`.
        suspend: callback classes silenced after "stop". Defaults to
            `(BackupAndRestore, ModelCheckpoint, EarlyStopping)`.
        verbose: print each verdict. Defaults to `True`.
        strict: raise, instead of warning and going on, when kerasdbg itself
            fails during training, or when a rule has nothing to read.
            Defaults to `False`.
        loss: the name of a scalar the train step returns to read as the
            loss of each step (e.g. "g_loss" of a GAN), or None. Defaults to
            `None`.
        every_n_steps: record the gradient and weight statistics the rules
            read at steps divisible by this (and at steps `1..first_steps`);
            None for the default schedule (`kerasdbg.schedule.DEFAULT`):
            steps 1-10 and every 50th step, and at every step what the rules
            that watch NaN/Inf read (`Rule.every_step`). The loss, the fault
            test and the taps' statistics are not scheduled by it. 1 records
            everything the rules read at every step. Defaults to `None`.
        first_steps: also record at every step up to this one; None for 10
            with the default schedule, else 0. Defaults to `None`.
        max_skips: with "skip", at most this many skipped steps among the
            last `skip_window` steps of an optimizer; with "rollback", at most
            this many rollbacks per fit. Defaults to `10`.
        skip_window: see `max_skips`. Defaults to `128`.
        rollback_every: with "rollback", a snapshot every this many steps.
            Defaults to `100`.
        rollback_skip: with "rollback", the batches skipped after a rollback.
            Defaults to `0`.

    Raises:
        TypeError, ValueError: for bad arguments. A rule that reads what
            cannot be recorded for this model (activations without
            `TapLayer`s, a loss the train step does not give) is said in a
            warning at the first execution and never fires (`strict=True`
            raises a `ValueError`).

    Examples:
        >>> import keras, numpy as np
        >>> from kerasdbg.callbacks import StopOnRule
        >>> from kerasdbg.rules import NonFiniteLoss
        >>> model = keras.Sequential([keras.Input((1,), name="x"), keras.layers.Dense(1, name="d")],
        ...                          name="m")
        >>> model.compile("sgd", "mse")
        >>> x = np.array([[1.0], [1.0], [np.nan], [1.0]], "float32")
        >>> stop = StopOnRule(NonFiniteLoss(), verbose=False)
        >>> history = model.fit(x, np.ones((4, 1)), batch_size=1, epochs=2, verbose=0,
        ...                     shuffle=False, callbacks=[stop])
        >>> for verdict in stop.verdicts:
        ...     print(verdict.reason)
        NonFiniteLoss at step 3: the loss is nan
        NaNSource at step 3: the first layer whose output held NaN/Inf is 'x'; non-finite gradients: m/d/bias, m/d/kernel
        >>> bool(np.all(np.isfinite(model.get_layer("d").kernel.numpy())))
        True
    """

    # Rules added to the default ones keep the defaults' treatment in a copy
    # (those that cannot be recorded on the model are left out, not refused).
    _kept_on_copy = ("default_rules",)

    def __init__(
        self,
        rules: Union[Rule, Sequence[Rule], None] = None,
        action: Union[str, Callable] = "stop",
        start_step: int = 0,
        freeze_on_fault: Optional[bool] = None,
        max_gradient_norm: Optional[float] = None,
        locate_nan: Optional[bool] = None,
        log_dir: Optional[str] = None,
        suspend: Sequence[type] = DEFAULT_SUSPEND,
        verbose: bool = True,
        strict: bool = False,
        loss: Optional[str] = None,
        every_n_steps: Optional[int] = None,
        first_steps: Optional[int] = None,
        max_skips: int = 10,
        skip_window: int = 128,
        rollback_every: int = 100,
        rollback_skip: int = 0,
    ):
        super().__init__()
        owner = type(self).__name__
        _capture.supported(owner)  # a backend with a capture, said when made
        self.schedule, self._default_schedule = schedule_lib.resolve(
            owner, every_n_steps, first_steps)
        self.every_n_steps = None if every_n_steps is None else self.schedule.every_n_steps
        self.first_steps = None if first_steps is None else self.schedule.first_steps
        self.default_rules = rules is None
        self.rules = default_rules() if rules is None else check_rules(owner, rules)
        if not callable(action) and (isinstance(action, bool) or action not in ACTIONS):
            allowed = f"must be one of {', '.join(map(repr, ACTIONS))} or a callable"
            if not isinstance(action, str):
                raise TypeError(f"{owner}: `action` {allowed}. Received: action={action!r} "
                                f"of type {type(action).__name__}")
            raise ValueError(f"{owner}: `action` {allowed}. Received: action={action!r}")
        self.action = action
        self.start_step = check.non_negative_int(owner, "start_step", start_step)
        self.max_skips = check.positive_int(owner, "max_skips", max_skips)
        self.skip_window = check.positive_int(owner, "skip_window", skip_window)
        if self.max_skips > self.skip_window:
            raise ValueError(f"{owner}: `max_skips` must be at most `skip_window` (skips are "
                             f"counted among the last `skip_window` steps). Received: "
                             f"max_skips={max_skips!r}, skip_window={skip_window!r}")
        self.rollback_every = check.positive_int(owner, "rollback_every", rollback_every)
        self.rollback_skip = check.non_negative_int(owner, "rollback_skip", rollback_skip)
        watches = any(getattr(r, "watches_nonfinite", False) or _guards(r) for r in self.rules)
        if action == "rollback" and freeze_on_fault is False:
            raise ValueError(f"{owner}: action='rollback' skips the batches after a rollback "
                             "in the graph, at the fault test that `freeze_on_fault` arms; it "
                             "needs freeze_on_fault=True or None. Received: freeze_on_fault=False")
        if action == "skip" and freeze_on_fault is False:
            raise ValueError(f"{owner}: action='skip' skips a step in the graph, at the fault "
                             "test that `freeze_on_fault` arms; it needs freeze_on_fault=True "
                             "or None. Received: freeze_on_fault=False")
        self.freeze_on_fault = check.boolean(
            owner, "freeze_on_fault", (watches or action in ("skip", "rollback"))
            if freeze_on_fault is None else freeze_on_fault)
        self.locate_nan = check.boolean(
            owner, "locate_nan", watches if locate_nan is None else locate_nan)
        self.max_gradient_norm = None if max_gradient_norm is None else check.number(
            owner, "max_gradient_norm", max_gradient_norm, minimum=0.0, exclusive_minimum=True)
        if self.max_gradient_norm is not None and not self.freeze_on_fault:
            raise ValueError(
                f"{owner}: `max_gradient_norm` is a fault that freezes the weights; it "
                "needs freeze_on_fault=True. Received: freeze_on_fault=False, "
                f"max_gradient_norm={max_gradient_norm!r}"
            )
        self.log_dir = check.log_dir(owner, "log_dir", log_dir)
        suspend = tuple(suspend)
        for kind in suspend:
            if not (isinstance(kind, type) and issubclass(kind, keras.callbacks.Callback)):
                raise TypeError(
                    f"{owner}: `suspend` must hold keras.callbacks.Callback classes. "
                    f"Received: {kind!r} of type {type(kind).__name__}"
                )
        self.suspend = suspend
        self.verbose = check.boolean(owner, "verbose", verbose)
        self.strict = check.boolean(owner, "strict", strict)
        if loss is not None and (not isinstance(loss, str) or not loss):
            raise TypeError(
                f"{owner}: `loss` must be None or the name of a scalar the train step "
                f"returns. Received: loss={loss!r} of type {type(loss).__name__}")
        self.loss = loss
        self.loss_source: Optional[str] = None
        self.verdicts: List[Verdict] = []
        self._requests: List[_capture.Request] = []
        self._taps = []
        self._rows: Optional[StepRows] = None
        self._runner: Optional[RuleRunner] = None
        self._kept = False
        self._writer: Optional[_events.EventWriter] = None
        self._last_step = 0
        self._done = False
        self._silent: List[Rule] = []
        self._notes: List[Verdict] = []
        self._ran: Optional[tuple] = None
        self._skipped: List[int] = []
        self._epoch_skipped = 0
        self._skipping = False
        self._snapshot = None
        self.rollbacks: List[tuple] = []
        """`(step, to_step)` of each rollback of the last `fit`."""
        self.snapshot_seconds: List[float] = []
        """The time each snapshot of the last `fit` took (`action="rollback"`)."""

    def get_config(self) -> dict:
        """The constructor's arguments, JSON-able: rules as `{"class_name",
        "module", "config"}`, a callable `action` and the `suspend` classes by
        their qualified names (a lambda or a nested function cannot be saved:
        TypeError)."""
        owner = type(self).__name__
        action = self.action
        if callable(action):
            action = {"function": _qualified.name_of(owner, "action", action)}
        return {
            "rules": None if self.default_rules else
            [rule_config(owner, r) for r in self.rules],
            "action": action,
            "start_step": self.start_step,
            "freeze_on_fault": self.freeze_on_fault,
            "max_gradient_norm": self.max_gradient_norm,
            "locate_nan": self.locate_nan,
            "log_dir": self.log_dir,
            "suspend": [_qualified.name_of(owner, "suspend", kind) for kind in self.suspend],
            "verbose": self.verbose,
            "strict": self.strict,
            "loss": self.loss,
            "every_n_steps": self.every_n_steps,
            "first_steps": self.first_steps,
            "max_skips": self.max_skips,
            "skip_window": self.skip_window,
            "rollback_every": self.rollback_every,
            "rollback_skip": self.rollback_skip,
        }

    @classmethod
    def from_config(cls, config: dict) -> "StopOnRule":
        """The callback `get_config` describes."""
        config = dict(config)
        if config.get("rules") is not None:
            config["rules"] = [rule_from_config(entry) for entry in config["rules"]]
        if isinstance(config.get("action"), dict):
            config["action"] = _qualified.resolve(config["action"]["function"])
        if "suspend" in config:
            config["suspend"] = tuple(_qualified.resolve(name) for name in config["suspend"])
        return cls(**config)

    # ---------------------------------------------------------- set-up
    def _fault_rules(self, rules) -> List[Rule]:
        """`rules` with the reports of what this callback arms: `FreezeOnFault`
        (given this callback's `max_gradient_norm`) with `freeze_on_fault`,
        `NaNSource` with `locate_nan`; without them, those rules are left
        out (a freeze another `StopOnRule` made is its to report)."""
        kept = []
        for rule in rules:
            if isinstance(rule, FreezeOnFault):
                if not self.freeze_on_fault:
                    continue
                if rule.max_gradient_norm is None and self.max_gradient_norm is not None:
                    rule = FreezeOnFault(self.max_gradient_norm)
            if isinstance(rule, NaNSource) and not self.locate_nan:
                continue
            kept.append(rule)
        if self.freeze_on_fault and not any(isinstance(r, FreezeOnFault) for r in kept):
            kept.append(FreezeOnFault(self.max_gradient_norm))
        if self.locate_nan and not any(isinstance(r, NaNSource) for r in kept):
            kept.append(NaNSource())
        if self._skips() and not any(isinstance(r, SkippedStep) for r in kept):
            kept.append(SkippedStep())
        return kept

    def _skips(self) -> frozenset:
        """The in-graph faults that skip their step (`Freeze.skip`): those of
        `SKIP_FAULTS` with `action="skip"`, less the spikes of rules that ask
        to stop; the spikes of rules that ask to skip, whatever the action.
        None on a backend where the graph cannot skip (said once)."""
        kinds = set(SKIP_FAULTS) if self.action == "skip" else set()
        for rule in self.rules:
            if _guards(rule) and rule.action is not None:
                kind = f"{rule.quantity}_spike"
                (kinds.add if rule.action == "skip" else kinds.discard)(kind)
        return frozenset(kinds) if self.freeze_on_fault else frozenset()

    def _refuse(self, collection: str, statistic: str, allowed: str) -> None:
        """A rule reads what cannot be recorded for this model: it will not
        fire; say so once (raise with `strict`)."""
        for rule in self.rules:
            if (collection, statistic) not in tuple(rule.requires) or rule in self._silent:
                continue
            self._silent.append(rule)
            message = (
                f"{type(self).__name__}: {rule.name} reads "
                f"{tag_pattern(collection, statistic)}, which cannot be recorded for model "
                f"{self.model.name!r}, so it has nothing to read and will not fire. "
                f"Recordable: {allowed}.")
            if self.strict:
                raise ValueError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _no_guard(self, what: str, stops: bool) -> None:
        """Says once per fit that `what` does not run on this backend (the
        rules test the records on the host, after the step; with `stops`, a
        fault that would be skipped or rolled back stops training)."""
        message = (f"{type(self).__name__}: {what} run on the TensorFlow backend only so far; "
                   f"on {keras.config.backend()!r} the rules test the records after each "
                   "execution" + (", and a fault that would be skipped or rolled back stops "
                                  "training instead" if stops else "") + ".")
        if self.strict:
            raise ValueError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def on_train_begin(self, logs=None):
        self.verdicts = []
        self._notes = []  # this fit's "info" verdicts, printed in one line at its end
        self._ran = None  # the first and last step the rules were checked on
        # Keras's progress bar (verbose=1) leaves its line unfinished after
        # each batch it draws (it redraws it after a carriage return): a line
        # printed then would land at the bar's end.
        verbose = (getattr(self, "params", None) or {}).get("verbose", 0)
        self._bar = verbose in (1, "auto") and keras.config.is_interactive_logging_enabled()
        self._mid_line = False
        # This fit's records, merged per step for the rules.
        self._rows = StepRows(
            self.model, self.loss, lambda: _capture.engine_for(self.model).loss_captured,
            self._first_step, lambda: _capture.engine_for(self.model).loss_origin)
        self._done = False
        self._raising = None
        self._silent = []
        self._replica_every = None
        self._replica_step = None
        self._iterations = self._start_iterations = None
        self._batches = self._epoch_batches = 0
        self._replicas = None
        self.loss_source = None
        self._last_step = 0
        if getattr(self.model, "optimizer", None) is not None:
            self._last_step = keras_objects.step_number(self.model.optimizer)
        rules = self.rules
        replicas = keras_objects.replicas(self.model)
        if self.default_rules:
            # The activation rules need taps, the replica rule several
            # replicas; without them they are left out (as `default_rules(without)`).
            without = ([] if find_taps(self.model) else ["activations"]) + (
                [] if replicas > 1 else [_tags.REPLICAS])
            # AllZero on the collections there are, as `default_rules(without)`.
            rules = [AllZero(zero_fraction=r.zero_fraction, collections=[
                c for c in r.collections if c not in without])
                if isinstance(r, AllZero) and set(r.collections) - set(without) else r
                for r in rules]
            rules = [r for r in rules if not reads_any(r, without)]
        self._runner = RuleRunner(self._fault_rules(rules))
        self._kept = False
        self._continue_training()
        freeze = None
        self._skipped = []  # the steps skipped in this fit
        self._epoch_skipped = 0
        self._skipping = self._rolling = False
        if self.freeze_on_fault:
            spikes = tuple(r.spike() for r in rules if _guards(r))
            skip = self._skips()
            recordable = _capture.recordable()
            if (spikes or skip) and recordable is not None and "guard" not in recordable:
                # The rules still test the records on the host; a fault there stops.
                self._no_guard("the in-graph spike tests and skips", bool(skip))
                spikes, skip = (), frozenset()
            rollback = self.action == "rollback"
            if rollback and recordable is not None and "rollback" not in recordable:
                # The fit's state is where kerasdbg cannot put a snapshot back.
                self._no_guard("rollbacks", True)
                rollback = False
            freeze = _capture.Freeze(max_gradient_norm=self.max_gradient_norm, spikes=spikes,
                                     skip=skip, max_skips=self.max_skips,
                                     skip_window=self.skip_window, rollback=rollback)
            self._skipping = bool(skip) or rollback
            self._rolling = rollback
        self._snapshot = None
        self._rolled_to = None
        self.rollbacks = []
        self.snapshot_seconds = []
        plan = planner.plan(
            rules, schedule=self.schedule, default_schedule=self._default_schedule,
            strict=self.strict, owner=type(self).__name__, replicas=replicas,
            has_taps=bool(find_taps(self.model)), freeze=freeze, localize=self.locate_nan,
            recordable=_capture.recordable())
        for refusal in plan.refusals:
            self._refuse(*refusal)
        if plan.reads_activations:
            self._taps = find_taps(self.model)
        self._replica_every = plan.replica_every
        requests = plan.requests
        self._writer = None
        self._unwritten: list = []  # `ScalarRow`s and blocks `(steps, tags, values)`
        # Under several workers every one decides, the chief alone prints.
        self._prints = _workers.writes(getattr(self.model, "distribute_strategy", None))
        if self.log_dir is not None:
            self._writer = open_writer(self, self.log_dir, self.strict,
                                       getattr(self.model, "distribute_strategy", None))
            if self._writer is not None:
                _shown(self._writer, self.model)[1].clear()  # "No verdict" is a fit's
            guarded = self._skipping or any(
                _guards(r) or isinstance(r, LogitGrowth) for r in self.rules)
            _layout.add(type(self).__name__, self._writer, _layout.loss_lines() + (
                _layout.guard_lines() if guarded else []), self.strict)
        engine = _capture.engine_for(self.model)
        rows = self._rows
        for request in requests:
            request.consumer = lambda records, request=request: rows.take(request, records)
            request.blocks = True  # (`StepRows` merges blocks as arrays)
            # The rules judge each read's rows (`kerasdbg.capture.reads`); a
            # rollback's snapshots must be known clean: read every execution.
            request.deferred = not self._rolling
            engine.attach(request)
        self._requests = requests
        for tap in self._taps:
            tap.add_listener(rows.take_tap)
        # Whatever way this fit ends, the taps forget this callback.
        _capture.on_fit_end(self.model, self, self._finish)
        self._begin_executions()

    # --------------------------------------------------------- records
    def _first_step(self, values: Dict[str, float], returned: List[str],
                    source: Optional[str]) -> None:
        """At the first step row (`StepRows`): where the loss was read, and
        whether the rules have what they read."""
        self.loss_source = source
        self._check_loss(values, returned)
        self._check_classes()

    def _check_classes(self) -> None:
        """Says once when a rule reads class counts and the train step gives
        no labels and class predictions to count."""
        request = next((r for r in self._requests if r.kind == "classes"), None)
        if request is None or request.labelled is not False:
            return
        readers = [r for r in self._runner.rules
                   if any(c == CLASSES for c, _ in r.requires) and r not in self._silent]
        if not readers:
            return
        self._silent.extend(readers)
        message = (f"{type(self).__name__}: {', '.join(r.name for r in readers)} "
                   f"read{'s' if len(readers) == 1 else ''} classes/<k>/seen and "
                   "classes/<k>/mispredicted, which this model does not give: the train "
                   "step does not call `compute_loss` with labels and class predictions "
                   "(at most 1000 classes), so there is nothing to count. They will not fire.")
        if self.strict:
            raise ValueError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=7)

    def _check_loss(self, values: Dict[str, float], returned: List[str]) -> None:
        """Says once when a rule reads the loss and there is none to read
        (`returned`: the names of the scalars the train step gives)."""
        readers = [r for r in self._runner.rules
                   if ("step", "loss") in tuple(r.requires) and r not in self._silent]
        if LOSS_TAG in values or not readers:
            return
        losses = [] if self.loss else [n for n in returned if _tags.is_loss_name(n)]
        if losses:
            # No single loss: the rules that can (NonFiniteLoss) watch each loss
            # the train step returns; said once, as information.
            watching = [r for r in readers if r.can_check({("step", n) for n in losses})]
            readers = [r for r in readers if r not in watching]
            if watching:
                self.loss_source = f"the train step's {', '.join(map(repr, losses))}"
                self._say(f"{type(self).__name__}: the train step returns no single "
                          f"loss; {', '.join(r.name for r in watching)} watch"
                          f"{'es' if len(watching) == 1 else ''} each of its losses: "
                          f"{', '.join(losses)}")
            if not readers:
                return
        if self.loss:
            why = (f"the train step returns no scalar {self.loss!r} (`loss`); it returns: "
                   f"{', '.join(returned) or 'none'}")
        else:
            why = ("the train step neither calls `compute_loss` nor returns a `loss`; name "
                   "the scalar to read with StopOnRule(loss=...), one of: "
                   f"{', '.join(returned) or 'none (it returns no scalar)'}")
        self._silent.extend(readers)
        message = (f"{type(self).__name__}: {', '.join(r.name for r in readers)} "
                   f"read{'s' if len(readers) == 1 else ''} step/loss, which this model does "
                   f"not give: {why}. They will not fire.")
        if self.strict:
            raise ValueError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=7)

    def _gather(self, batch: Optional[int] = None) -> None:
        try:
            if batch is None:
                self._engine.collect()
            else:  # a batch end: the read clock decides
                self._engine.collect(final=False, batch=batch)
        finally:
            # A collective under several workers: reached on every worker;
            # taps the model's sink already read at this step are skipped.
            if self._taps:
                from kerasdbg.layers._debug_layer import layer_sink

                _layer_sink = layer_sink()  # the debug layers' host side on this backend
                _layer_sink.flush_layers(self._taps, _layer_sink.current_fit_step(self.model))

    # ------------------------------------------------------ evaluation
    def _before_execution(self, batch: int) -> None:
        self._engine.prepare()
        if getattr(self, "_replica_every", None) and self._start_iterations is None:
            # Where the optimizers' steps stand before this fit's first step.
            try:
                self._start_iterations = self._optimizer_step()
            except Exception:  # noqa: BLE001 - an optimizer not built yet: from 0
                self._iterations, self._start_iterations = None, 0

    def _after_execution(self, batch: int) -> None:
        self._check_replicas(batch)
        self._evaluate_pending(batch)
        if getattr(self, "_rolling", False) and not self._done:
            self._take_snapshot()
        if getattr(self, "_at_begin", False) and self._done and self.model.stop_training:
            # Read at the next batch's begin: that batch does not run.
            _capture.engine_for(self.model).hold_next_execution()
        self._batches = self._epoch_batches + batch + 1
        # The bar draws this batch (after this callback, or before it).
        self._mid_line = getattr(self, "_bar", False)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_batches = self._batches
        self._mid_line = False  # the last epoch's bar ended its line

    def _optimizer_step(self) -> int:
        """The furthest step of the model's optimizers (0 without one); their
        step variables are looked up once per fit."""
        if self._iterations is None:
            self._iterations = [o for _, o in keras_objects.find_optimizers(self.model)]
        return max([keras_objects.step_number(o) for o in self._iterations] + [0])

    def _check_replicas(self, batch: int) -> None:
        """At the first step and every `every_n_steps` of the replica rules:
        each trainable weight's spread across replicas, into that step's
        record. Every worker reaches here at the same batches (the gather
        is a collective)."""
        every = getattr(self, "_replica_every", None)
        if every is None or self._done:
            return
        try:
            # The optimizer's step once it moved in this fit; a train step
            # that applies no optimizer (it assigns the weights itself)
            # counts in batches.
            moved = self._optimizer_step()
            step = moved if moved > (self._start_iterations or 0) \
                else self._epoch_batches + batch + 1
            last = self._replica_step
            self._replica_step = step
            if step == last or (last is not None and step // every == last // every):
                return
            if self._replicas is None:  # variables exist after the first step
                self._replicas = _capture.engine_for(self.model).replica_checker()
            spreads = self._replicas.spreads() if self._replicas is not None else {}
        except Exception as error:  # noqa: BLE001 - training goes on
            if self.strict:
                raise
            self._replica_every = None
            warnings.warn(f"StopOnRule could not read its records: the replicas' weights "
                          f"could not be compared, so ReplicaConsistency will not fire. "
                          f"Cause: {type(error).__name__}: {error}", RuntimeWarning, stacklevel=3)
            return
        self._rows.add(step, {_tags.statistic(_tags.REPLICAS, path, "spread"): value
                              for path, value in spreads.items()})

    def on_epoch_end(self, epoch, logs=None):
        self._executions_read()
        self._evaluate_pending()
        if self._skipping and logs is not None:
            # Counted in `history` (and the progress bar), which read the logs after this.
            logs["skipped_steps"] = self._epoch_skipped
            self._epoch_skipped = 0
        if self._done:
            self._mid_line = False  # the bar ends its line at the epoch's end
            return
        record = {}
        for key, value in (logs or {}).items():
            try:
                record[_tags.epoch_scalar(key)] = float(value)
            except (TypeError, ValueError):
                continue
        record.update(self._learning_rates())
        self._write(self._last_step, record)
        self._write_rows()
        self._evaluate(self._last_step, self._runner.check(self._last_step, record))
        self._mid_line = False  # the bar ends its line at the epoch's end
        self._raise_decided()  # an epoch's verdict raises at the epoch's end

    def _learning_rates(self) -> Dict[str, float]:
        """The learning rate of each optimizer now, as epoch scalars:
        `epoch/learning_rate`, or with several optimizers
        `epoch/learning_rate/<name>` each (`keras_objects.find_optimizers`'
        names). What the report weighs a diverging run's rate by, recorded
        without Keras's TensorBoard callback (which needs TensorFlow). One
        read of each rate an epoch; where one cannot be read, none is
        recorded, said once."""
        if getattr(self, "_no_learning_rate", False):
            return {}
        try:
            optimizers = keras_objects.find_optimizers(self.model)
            several = len(optimizers) > 1
            return {_tags.epoch_scalar(f"learning_rate/{name}" if several else "learning_rate"):
                    _host_number(optimizer.learning_rate) for name, optimizer in optimizers}
        except Exception as error:  # noqa: BLE001 - training goes on
            if self.strict:
                raise
            self._no_learning_rate = True
            warnings.warn(f"StopOnRule records no learning rate (epoch/learning_rate): it "
                          f"could not be read. Cause: {type(error).__name__}: {error}",
                          RuntimeWarning, stacklevel=3)
            return {}

    def on_train_end(self, logs=None):
        self._evaluate_pending()
        self._keep_training(self.strict)
        if self._ran is not None and not any(v.severity == "fault" for v in self.verdicts):
            # Rules ran and none fired: said in the text, or it reads as no rules.
            rules = [r.name for r in self._runner.rules if r not in self._silent]
            self._write_verdicts(self._ran[1], ran=(rules, *self._ran))
        self._finish()

    def _optimizers(self) -> list:
        return [o for _, o in keras_objects.find_optimizers(self.model)]

    def _continue_training(self) -> None:
        """The rules go on from what they saw in the last fit of this
        training (the same model and optimizers, whose steps went on from
        there), whichever `StopOnRule` of the same rules watched it: a loop
        of short fits gets the verdicts that `kerasdbg check` gives on the
        whole run (an allowance for the first step, a tensor seen healthy
        before, are the training's, not each fit's)."""
        try:
            kept = _TRAININGS.get(self.model, {}).get(self._runner.key())
            if kept is None:
                return
            optimizers, step, state = kept
            now = self._optimizers()
            if (len(now) == len(optimizers) and all(r() is o for r, o in zip(optimizers, now))
                    and self._last_step >= step):
                self._runner.resume(state)
                if self._last_step != step:
                    # Steps trained without these rules: the spike windows are
                    # no measure of the steps to come (the graph's neither).
                    for rule in self._runner.rules:
                        if rule.repeats:
                            rule.reset()
        except Exception as error:  # noqa: BLE001 - training goes on
            self._continuity_failed(error, self.strict)

    def _keep_training(self, strict: bool = False) -> None:
        """Keeps what the rules saw in this fit for the next fit of the training
        (once per fit: at its end, or, when it raised, as it leaves)."""
        if self._runner is None or self.model is None or self._kept:
            return
        self._kept = True
        try:
            optimizers = [weakref.ref(o) for o in self._optimizers()]
            _TRAININGS.setdefault(self.model, {})[self._runner.key()] = (
                optimizers, self._last_step, self._runner.state())
        except Exception as error:  # noqa: BLE001 - training goes on
            self._continuity_failed(error, strict)

    def _continuity_failed(self, error: Exception, strict: bool) -> None:
        message = (f"StopOnRule could not carry its rules' memory from one fit to the next of "
                   f"this training; they start afresh at each fit. Cause: "
                   f"{type(error).__name__}: {error}")
        if strict:
            raise RuntimeError(message) from error
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _finish(self) -> None:
        self._keep_training()
        notes, self._notes = self._notes, []
        if notes:
            self._say(notes_line(notes))
        _capture.cancel_fit_end(self.model, self)
        engine = _capture.engine_for(self.model)
        for request in self._requests:
            engine.detach(request)
        self._requests = []
        for tap in self._taps:
            tap.remove_listener(self._rows.take_tap)
        self._taps = []
        self._write_rows()
        release_writer(self, self._writer)

    def _evaluate_pending(self, batch: Optional[int] = None) -> None:
        if self._runner is None:
            return
        try:
            self._gather(batch)
        except Exception as error:  # noqa: BLE001 - training goes on
            if self.strict:
                raise
            warnings.warn(f"StopOnRule could not read its records; training goes on. "
                          f"Cause: {type(error).__name__}: {error}", RuntimeWarning, stacklevel=2)
            return
        if batch is not None and not self._rows.waiting and not self._taps and \
                not self.__dict__.get("_unwritten"):
            return  # a batch end that read nothing: nothing new to judge or write
        self._rolled_to = None
        blocks = self._rows.pop_blocks(final=batch is None)
        # The last step of this read: a verdict that stops training stops it
        # after that step (`kerasdbg.capture.reads`), which it says.
        self._read_step = int(blocks[-1].steps[-1]) if blocks else None
        # The steps of one tag layout as a block: the rules screen it and judge
        # one by one only the steps that may make one fire. After a verdict
        # that stops training, the rest of the read's steps ran all the same:
        # judged too (as `kerasdbg check` judges them), never acted on.
        for block in blocks:
            early = int(np.searchsorted(block.steps, self.start_step))
            if early:
                self._last_step = max(self._last_step, int(block.steps[early - 1]))
                block = block.rows(early, len(block))
            if len(block) and not self._judge(block):
                break  # a rollback: the steps after its step in its execution are undone
        self._write_rows()
        if blocks and self._writer is not None:
            # Once a read: a killed run keeps every step up to its last read.
            self._writer.flush(events_only=True)
        self._raise_decided()

    def _judge(self, block: StepBlock) -> bool:
        """Judges and writes the steps of `block`; False after a rollback (the
        later steps of the read are undone: neither judged nor written)."""
        plan = block._plan
        skipped_tags = plan.per_optimizer(_tags.STEP, "skipped")
        skipped = (block.values[:, [plan.position(t) for t in skipped_tags]] != 0).any(axis=1) \
            if skipped_tags else np.zeros(len(block), bool)
        frozen = block.tag(_tags.step_scalar("frozen"))
        start = 0
        for position, verdicts in self._runner.check_block(block):
            self._quiet(block, start, position + 1, skipped)
            start = position + 1
            step = int(block.steps[position])
            self._evaluate(step, verdicts, skipped=bool(skipped[position]),
                           frozen=frozen is not None and bool(frozen[position]))
            if self._rolled_to is not None:
                return False
        self._quiet(block, start, len(block), skipped)
        return True

    def _quiet(self, block: StepBlock, start: int, end: int, skipped: np.ndarray) -> None:
        """The steps `start:end` of `block` ran: counted, their skips kept,
        their own scalars written (`_write_rows`)."""
        if end <= start:
            return
        steps = block.steps[start:end]
        self._last_step = max(self._last_step, int(steps[-1]))
        self._ran = (int(steps[0]) if self._ran is None else self._ran[0], int(steps[-1]))
        for step in steps[skipped[start:end]].tolist():
            self._skipped.append(step)
            self._epoch_skipped += 1
        if self._writer is None:
            return
        positions = block._plan.positions_starting(_OWN_PREFIXES)
        if len(positions):
            tags = tuple(block.tags[i] for i in positions.tolist())
            values = block.values[start:end][:, positions]
            # Written with the read's others (`_write_rows`), as a block.
            self.__dict__.setdefault("_unwritten", []).append((steps, tags, values))

    def _raise_decided(self) -> None:
        """Raises the verdicts `action="raise"` decided (once the read's or the
        epoch's records are judged)."""
        raising, self._raising = getattr(self, "_raising", None), None
        if raising is not None:
            # No on_train_end follows: restore the model and flush every writer now.
            _capture.engine_for(self.model).abort()
            self._finish()
            _events.flush_all()
            raise RuleFired(raising)

    def _write(self, step: int, record) -> None:
        if self._writer is None:
            return
        scalars = record.starting(_OWN_PREFIXES) if isinstance(record, StepRecord) else {
            k: v for k, v in record.items() if k.startswith(_OWN_PREFIXES)}
        if scalars:
            # Written with the read's others (`_write_rows`): one call a read.
            self._unwritten.append(_events.ScalarRow(
                step, tuple(scalars), np.fromiter(scalars.values(), np.float64, len(scalars)), {}))

    def _write_rows(self) -> None:
        """Writes the rows `_write` and the blocks `_quiet` kept, in step
        order: the rows in a row as one call, each block as one."""
        items, self._unwritten = getattr(self, "_unwritten", []), []
        if not items or self._writer is None:
            return
        rows: List[_events.ScalarRow] = []
        for item in items + [None]:
            if isinstance(item, _events.ScalarRow):
                rows.append(item)
                continue
            if rows:
                self._writer.write_rows(rows, unique=True)
                rows = []
            if item is not None:
                self._writer.write_block(*item, unique=True)

    # ----------------------------------------------------------- acting
    def _say(self, text: str) -> None:
        """Prints `kerasdbg: <text>` (with `verbose`, on the process that
        prints) on a line of its own: a newline first when Keras's progress
        bar left its line unfinished; the bar redraws below it."""
        if not (self.verbose and getattr(self, "_prints", True)):
            return
        fresh = "\n" if getattr(self, "_mid_line", False) else ""
        self._mid_line = False
        try:
            print(f"{fresh}kerasdbg: {text}", file=sys.stdout, flush=True)
        except (OSError, ValueError):  # a closed stream never breaks the fit
            pass

    def _write_verdicts(self, step: int, new: Sequence[Verdict] = (),
                        ran: Optional[tuple] = None) -> None:
        """Writes the text of the run's verdicts so far (`new` added), in step
        order, with the "No verdict" lines so far of this fit (`ran` added)."""
        if self._writer is None:
            return
        self._write_rows()  # the steps before this text first, as judged
        shown, quiet, earlier = _shown(self._writer, self.model)
        shown.extend(new)
        quiet.extend([ran] if ran is not None else [])
        # Bounded over many fits of one training: the newest verdicts, and a count.
        excess = len(shown) - _verdicts.VERDICT_TEXT_LIMIT
        if excess > 0:
            del shown[:excess]
            earlier[0] += excess
        self._writer.write(step, texts={VERDICT_TAG: verdict_markdown(shown, quiet, earlier[0])})
        self._writer.flush()

    def _fallback(self, step: int, frozen: bool) -> str:
        """Why `action="skip"` stops at `step`."""
        if not frozen:
            return ("the verdicts below are decided on the records after the step, which "
                    "cannot be skipped any more: training stops (the fallback of "
                    "action='skip')")
        recent = [s for s in self._skipped if s > step - self.skip_window]
        if len(recent) >= self.max_skips:
            return (f"{len(recent)} steps were skipped among the last {self.skip_window} "
                    f"(max_skips={self.max_skips}): the weights are frozen at step {step} "
                    "and training stops (the fallback of action='skip')")
        return (f"the weights are frozen at step {step} and training stops (a fault that "
                "action='skip' does not skip)")

    # -------------------------------------------------------- rollback
    def _take_snapshot(self) -> None:
        """Every `rollback_every` steps, at the end of an execution whose
        steps were healthy: a host copy of what a rollback puts back (one
        copy at a time: the last one is dropped first), and what the rules
        remember of the steps so far."""
        step = self._last_step
        last = self._snapshot[0] if self._snapshot is not None else 0
        if step < self.rollback_every or step // self.rollback_every <= last // self.rollback_every:
            return
        engine = _capture.engine_for(self.model)
        if engine.faults.frozen:
            return
        try:
            start = time.perf_counter()
            self._snapshot = None
            # The capture's own copy (on JAX Keras's loop holds the fit's
            # state, not the variables), which it puts back (`_roll_back`).
            self._snapshot = (step, engine.faults.snapshot(), self._runner.state(),
                              list(self._skipped))
            self.snapshot_seconds.append(time.perf_counter() - start)
        except Exception as error:  # noqa: BLE001 - training goes on
            self._snapshot = None
            if self.strict:
                raise
            warnings.warn(f"StopOnRule could not take a snapshot to roll back to; a fault "
                          f"will stop training instead. Cause: {type(error).__name__}: "
                          f"{error}", RuntimeWarning, stacklevel=3)

    def _roll_back(self, step: int) -> Optional[int]:
        """Puts back the last snapshot, unfreezes the weights and skips the
        next `rollback_skip` batches; returns the snapshot's step, or None
        when there is none."""
        if self._snapshot is None or len(self.rollbacks) >= self.max_skips:
            return None
        to_step, snapshot, rules, skipped = self._snapshot
        engine = _capture.engine_for(self.model)
        try:
            engine.faults.put_back(snapshot)
            # What a frozen or skipped step puts back is the snapshot's state.
            engine.faults.keep_state()
            engine.faults.unfreeze()
            engine.faults.skip_next(self.rollback_skip)
        except Exception as error:  # noqa: BLE001 - training stops instead
            if self.strict:
                raise
            warnings.warn(f"StopOnRule could not roll back to step {to_step}; training stops "
                          f"instead. Cause: {type(error).__name__}: {error}", RuntimeWarning,
                          stacklevel=3)
            self._snapshot = None
            return None
        self._runner.resume(rules)
        # The run goes on from the snapshot: the rules that watch NaN/Inf
        # start afresh, as at a fit's start, so a later fault is said (and
        # rolled back) too; the others fire once per fit.
        for index, rule in enumerate(self._runner.rules):
            if rule.watches_nonfinite:
                rule.reset()
                self._runner.fired.discard(index)
        self._skipped = list(skipped)
        self._last_step = to_step
        self._rolled_to = to_step
        self.rollbacks.append((step, to_step))
        return to_step

    @property
    def skipped_steps(self) -> List[int]:
        """The steps of the last `fit` that an in-graph fault skipped, in order."""
        return list(getattr(self, "_skipped", []))

    def _evaluate(self, step: int, verdicts: List[Verdict], skipped: bool = False,
                  frozen: bool = False) -> None:
        if not verdicts:
            return
        rolled = None
        if getattr(self, "_rolling", False) and not (skipped and not frozen) and \
                any(v.severity == "fault" for v in verdicts):
            rolled = self._roll_back(step)
            if rolled is not None:
                # The verdict says what was done (the records of the steps
                # rolled back are superseded, so offline they are gone).
                said = f"; rolled back to step {rolled}" + (
                    f", skipping the next {self.rollback_skip} batches"
                    if self.rollback_skip else "")
                verdicts = [v._replace(reason=v.reason + said) if v.severity == "fault" else v
                            for v in verdicts]
        self.verdicts.extend(verdicts)
        self._write_verdicts(step, verdicts)
        # Information (zero by construction) is recorded, printed in one line
        # at the end of the fit, never acted on.
        self._notes.extend(v for v in verdicts if v.severity != "fault")
        verdicts = [v for v in verdicts if v.severity == "fault"]
        if not verdicts:
            return
        if self._done:
            # A step of the read after the one that stops training: said, not acted on.
            if self.action != "warn" and not getattr(self, "_raising", None):
                for verdict in verdicts:
                    self._say(verdict.reason)
            elif getattr(self, "_raising", None):
                self._raising.extend(verdicts)
            return
        if skipped and not frozen:
            # Skipped in the graph: nothing was applied, training goes on.
            for verdict in verdicts:
                self._say(f"{verdict.reason}; the step was skipped")
            return
        action = self.action
        if action == "rollback" and getattr(self, "_rolling", False):
            if rolled is not None:
                for verdict in verdicts:
                    self._say(verdict.reason)
                return
            action = "stop"
            if len(self.rollbacks) >= self.max_skips:
                self._say(f"{len(self.rollbacks)} rollbacks in this fit (max_skips="
                          f"{self.max_skips}): training stops (the fallback of "
                          "action='rollback')")
            else:
                self._say(f"no snapshot to roll back to before step {step} (the first is "
                          f"taken at step {self.rollback_every}): training stops (the fallback "
                          "of action='rollback')")
        elif action in ("skip", "rollback"):
            # What the graph could not skip stops training (the fallback).
            action = "stop"
            self._say(self._fallback(step, frozen))
        verdicts = self._when_read(step, verdicts, action, frozen)
        if action != "warn":
            for verdict in verdicts:  # with "warn", said once, by its RuleWarning
                self._say(verdict.reason)
        engine = _capture.engine_for(self.model)
        if action == "warn":
            level = _caller_of_fit()
            for verdict in verdicts:
                warnings.warn(verdict.reason, RuleWarning, stacklevel=level)
            if self.freeze_on_fault and engine.faults.frozen:
                engine.faults.unfreeze()
            return
        if callable(action):
            action(list(verdicts), self.model)
            return
        self._done = True
        if action == "raise":
            # Raised once the read's other steps are judged (`_evaluate_pending`).
            self._raising = list(verdicts)
            return
        self.model.stop_training = True
        suspend_others(self, self.suspend)


    def _when_read(self, step: int, verdicts: List[Verdict], action, frozen: bool) -> list:
        """The verdicts of `step`, saying when the host read them where that
        was after later steps ran: the fit stops after the read's last step
        (with the weights the in-graph freeze kept, where it froze), or, with
        "warn", the freeze lasted until then."""
        read = getattr(self, "_read_step", None)
        if read is None or read <= step:
            return verdicts
        later = read - step
        if action == "warn":
            if not frozen:
                return verdicts
            said = (f"; the weights stayed frozen until the host read it after step {read} "
                    f"({later} step{'s' if later > 1 else ''} later)")
        else:
            said = (f"; the host read it after step {read}, where training stops "
                    f"({later} step{'s' if later > 1 else ''} later"
                    + ("; the weights are those the in-graph freeze kept" if frozen else "")
                    + ")")
        return [v._replace(reason=v.reason + said) for v in verdicts]


def _guards(rule) -> bool:
    """Whether `rule` has an in-graph spike test (`LossSpike`, `GradientNormSpike`)."""
    return callable(getattr(rule, "spike", None)) and hasattr(rule, "quantity")


def _skipped(record) -> bool:
    """Whether the step of `record` was skipped (by any optimizer)."""
    return any(per_optimizer_values(record, _tags.STEP, "skipped"))


_LIBRARIES = ("kerasdbg", "keras", "tensorflow", "jax", "contextlib", "functools")


def _caller_of_fit() -> int:
    """The `stacklevel` that attributes a warning issued by this function's
    caller to the first frame outside Keras and kerasdbg: the user's line
    that called `fit` (not kerasdbg's `self._evaluate_pending()`)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        if frame.f_globals.get("__name__", "").partition(".")[0] not in _LIBRARIES:
            return level
        frame, level = frame.f_back, level + 1
    return 1


_SHOWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""writer -> (the model, weakly; the verdicts written to its run so far; the
"No verdict" lines of the fit): the StopOnRules of a training that write to
one run share one verdict text."""


def _shown(writer, model) -> tuple:
    """`(verdicts, quiet, [earlier])`: the verdicts written so far to
    `writer`'s run by `model`'s training (the newest
    `VERDICT_TEXT_LIMIT`), the rules of its last fit that ran and did not
    fire, and how many verdicts were left out before them (lists to
    extend)."""
    try:
        kept = _SHOWN.get(writer)
        if kept is None or kept[0]() is not model:
            kept = _SHOWN[writer] = (weakref.ref(model), [], [], [0])
        return kept[1], kept[2], kept[3]
    except TypeError:  # a writer or model not weakly referable: this write only
        return [], [], [0]


_TRAININGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""model -> {rules' key: (weak references to its optimizers, the last step
seen, the rules' state)}: what `StopOnRule` rules saw of a training, kept
for its next fit (in the model's absence, nothing is kept)."""
