"""Two variants of the train function, the host picking one per execution.

What some steps only record (the statistics a schedule takes every 50th
step, the histograms) would otherwise sit behind a `tf.cond` in the
function that runs at every execution, and on a GPU each condition copies
its predicate to the host and waits for it. So the engine traces Keras's
train function twice: the full variant computes everything and picks, by
its conditions, the steps the schedules name (as a single function did);
the every-step variant computes only what every step records (the l2
norms, the NaN/Inf counts) and holds no such condition. The host runs the
full one for each fit's first execution (it copies the weights the
distances count from) and for the executions that may hold a scheduled
step; within such an execution the scheduled statistics are taken at
exactly the steps the schedule names, as with a single function.

The host counts the train steps an execution makes (`steps_per_execution`,
the last execution of an epoch may make fewer: the read at each epoch's end
corrects the count) and each optimizer's steps per train step; every read
sets both from what the steps wrote. An optimizer with a loss scaler may
not count a step: from the last read on, its window starts right after the
last step read. Every variant is traced at its first call, once per fit
shape; a later fit that keeps the instrumented function keeps both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple

from kerasdbg.capture.requests import scheduled_between, sometimes_recorded

if TYPE_CHECKING:
    from kerasdbg.backends.tensorflow.engine import Engine

UNDECIDED = object()
"""`Engine._variants` before the first execution of a fit (every request is
attached by then)."""


class Variants:
    """The host's choice, execution by execution, of the variant to run."""

    def __init__(self, engine: "Engine", requests, steps_per_execution: int, calls: int,
                 starts: Dict[int, int]):
        self.engine = engine
        self.requests = requests
        self.steps = steps_per_execution
        self.calls = calls  # the train steps made so far (as `Engine._calls` counts them)
        self.first_calls = calls  # those made before this fit
        self.starts = starts  # id(optimizer) -> its last step at the fit's start
        self.anchor: Dict[int, Tuple[int, int]] = {}  # hook index -> (train id, its last step)

    @classmethod
    def of(cls, engine: "Engine", model, calls: int, starts: Dict[int, int]
           ) -> Optional["Variants"]:
        """The choice, where a request takes some statistics or its
        histograms at some steps only; None where one variant does all."""
        if model.run_eagerly:
            return None  # the step's conditions are Python branches
        requests = sometimes_recorded(engine.requests)
        if not requests:
            return None
        return cls(engine, requests, int(model.steps_per_execution), calls, starts)

    def wanted(self) -> bool:
        """Whether the next execution runs the full variant."""
        hooks = list(self.engine.hooks.values())
        if not hooks or self.calls == self.first_calls:
            # A fit's first execution: it copies the weights the distances
            # count from (and traces: the optimizers may not be known yet).
            return True
        first_id, last_id = self.calls + 1, self.calls + self.steps
        for hook in hooks:
            if not any(channel.slots for channel in hook.channels):
                continue  # an optimizer of an earlier compile, or one nothing records
            applies = max(len(hook.channels), 1)
            start = self.starts.get(id(hook.optimizer))
            since, last = self.anchor.get(hook.index, (self.first_calls, start))
            if last is None:
                return True  # an optimizer met in the trace: its count is not known
            first = last + (first_id - since - 1) * applies + 1
            high = last + (last_id - since) * applies
            low = last + 1 if hook.scaled else first
            if scheduled_between(self.requests, max(low, 1), high):
                return True
        return False

    def executed(self) -> None:
        """An execution ran: it made at most `steps_per_execution` train steps."""
        self.calls += self.steps

    def read(self, calls: int) -> None:
        """A read: `calls` train steps were made so far."""
        self.calls = calls

    def seen(self, index: int, train_id: int, step: int) -> None:
        """A read: train step `train_id` made optimizer `index`'s steps up to
        `step` (one less than the last read's where a loss scaler skipped it:
        the next train step makes it again)."""
        anchor = self.anchor.get(index)
        if anchor is not None and anchor[0] == train_id:
            step = max(step, anchor[1])
        self.anchor[index] = (train_id, step)


class VariantFunction:
    """What the model's `train_function` is while kerasdbg records: Keras's
    function in its two variants (`functions[True]` full, `[False]` every
    step), the engine's `Variants` picking one per call. The engine's
    `variant` says which one a trace builds."""

    def __init__(self, engine: "Engine", full, make: Callable[[], object]):
        self._engine = engine
        self._make = make
        self.functions: Dict[bool, object] = {True: full, False: None}

    def variant(self, full: bool):
        """The function of a variant, made (not traced) on first use."""
        function = self.functions[full]
        if function is None:
            function = self.functions[full] = self._make()
        return function

    def __call__(self, iterator):
        engine = self._engine
        variants = engine.variants()
        full = True if variants is None else variants.wanted()
        function = self.variant(full)
        previous, engine.variant = engine.variant, full
        try:
            logs = function(iterator)
        finally:
            engine.variant = previous
        if variants is not None:
            variants.executed()
        return logs

    def __getattr__(self, name):
        # What a caller reads of a tf.function (`experimental_get_compiler_ir`,
        # `get_concrete_function`, ...): the function most executions run.
        if name.startswith("__") or name in ("functions", "_engine", "_make"):
            raise AttributeError(name)
        function = self.functions[False] or self.functions[True]
        return getattr(function, name)
