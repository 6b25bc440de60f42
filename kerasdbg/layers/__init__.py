"""Keras layers of kerasdbg (PrintLayer and TapLayer arrive with the taps issue)."""

__all__ = ()
