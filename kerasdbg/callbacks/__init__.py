"""Keras callbacks of kerasdbg."""

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
