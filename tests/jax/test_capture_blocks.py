"""A read hands the statistics callbacks and the rules blocks, on JAX: the
same tests as on TensorFlow (tests/test_capture_blocks.py, the shared checks
in tests/capture_blocks.py), run here on the JAX backend."""

from tests.test_capture_blocks import *  # noqa: F401,F403 - the tests, collected here
