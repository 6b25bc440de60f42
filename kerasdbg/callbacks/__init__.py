"""Keras callbacks of kerasdbg.

A copy of a callback (`copy.deepcopy`, which KerasTuner makes for each trial,
`copy.copy` or `pickle`) is the callback built again from the arguments its
constructor received: the same configuration and nothing of a run (no model,
no event writer; `history`, `latest` and `verdicts` empty until it runs).
"""

from kerasdbg.callbacks.activation_statistics import ActivationStatistics
from kerasdbg.callbacks.gradient_statistics import GradientStatistics
from kerasdbg.callbacks.step_recorder import StepRecorder
from kerasdbg.callbacks.step_timer import StepTimer
from kerasdbg.callbacks.stop_on_rule import StopOnRule
from kerasdbg.callbacks.weight_statistics import WeightStatistics

__all__ = (
    "ActivationStatistics",
    "GradientStatistics",
    "StepRecorder",
    "StepTimer",
    "StopOnRule",
    "WeightStatistics",
)
