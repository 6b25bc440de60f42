"""Identity layers that show what flows through a model during training."""

from kerasdbg.layers.print_layer import PrintLayer
from kerasdbg.layers.tap_layer import TapLayer

__all__ = (
    "PrintLayer",
    "TapLayer",
)
