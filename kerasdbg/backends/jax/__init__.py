"""JAX's capture: per-step records out of Keras's JAX trainer. See `engine`."""
