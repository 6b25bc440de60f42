"""TFRecord files (TensorBoard's event files) written with or without TensorFlow.

A TFRecord file is a sequence of records, each framed as

    uint64 length, uint32 masked CRC32C of the length, the bytes, uint32 masked CRC32C of the bytes

(little-endian; the CRC is masked as `((crc >> 15) | (crc << 17)) + 0xa282ead8`).
Where TensorFlow is already loaded (the TensorFlow backend), records go
through its C++ `tf.io.TFRecordWriter`. Elsewhere (the JAX or PyTorch
backend, or TensorFlow not installed) this module frames them itself, into
a buffered file, with the CRC32C of `google-crc32c` (C, hardware CRC
instructions; a dependency of kerasdbg), falling back to TensorBoard's own
pure-Python CRC where that package cannot be imported. Both write the same
bytes.

TensorFlow is never imported here just to write a local file: on another
backend it would cost seconds of import and hundreds of MB. A remote
directory (`gs://...`) needs a file system that only `tf.io.gfile` (or
TensorBoard's stand-in for it) provides: TensorFlow is imported for it when
installed.
"""

from __future__ import annotations

import os
import struct
import sys
from typing import Callable, Optional

_LENGTH = struct.Struct("<Q")
_CHECKSUM = struct.Struct("<I")
_MASK = 0xA282EAD8


def _crc32c_function() -> "tuple[Callable[[bytes], int], str]":
    """The fastest CRC32C at hand, and its name."""
    try:
        import google_crc32c

        if google_crc32c.implementation == "c":
            return google_crc32c.value, "google-crc32c"
    except ImportError:  # an install without it: TensorBoard's pure Python
        pass
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c

    return crc32c, "tensorboard (pure Python)"


_crc32c, CRC32C = _crc32c_function()
"""`CRC32C`: which implementation computes the checksums here."""


def masked_crc32c(data: bytes) -> int:
    """The masked CRC32C of `data`, as TFRecord files hold it.

    Args:
        data: the bytes.

    Returns:
        The checksum, an unsigned 32-bit int.

    Examples:
        >>> masked_crc32c(b"")
        2726488792
    """
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One record of a TFRecord file: `data` with its length and checksums.

    Examples:
        >>> len(frame(b"abc"))
        19
    """
    length = _LENGTH.pack(len(data))
    return b"".join((length, _CHECKSUM.pack(masked_crc32c(length)), data,
                     _CHECKSUM.pack(masked_crc32c(data))))


def _remote(path: str) -> bool:
    return "://" in path


def _tensorflow_loaded() -> bool:
    module = sys.modules.get("tensorflow")
    return module is not None and hasattr(module, "io")


def _gfile():
    """A `gfile` for a remote path: TensorFlow's when it is installed, else
    TensorBoard's stand-in (S3 and fsspec file systems)."""
    try:
        import tensorflow as tf

        return tf.io.gfile
    except ImportError:
        from tensorboard.compat.tensorflow_stub.io import gfile

        return gfile


def makedirs(path: str) -> None:
    """Creates directory `path` and its parents where missing."""
    if _remote(path):
        _gfile().makedirs(path)
    else:
        os.makedirs(path, exist_ok=True)


def exists(path: str) -> bool:
    """Whether `path` exists."""
    if _remote(path):
        return bool(_gfile().exists(path))
    return os.path.exists(path)


class _FramedFile:
    """A TFRecord file framed here: a buffered local file, or a remote one
    through a `gfile`. The interface of `tf.io.TFRecordWriter`."""

    def __init__(self, path: str):
        if _remote(path):
            self._file = _gfile().GFile(path, "wb")
        else:
            self._file = open(path, "wb")  # noqa: SIM115 - closed by `close`

    def write(self, data: bytes) -> None:
        self._file.write(frame(data))

    def write_all(self, records: "list[bytes]") -> None:
        self._file.write(b"".join(map(frame, records)))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_all(writer, records: "list[bytes]") -> None:
    """Writes `records` with `writer` (a `record_writer`): in one call of the
    file where this module frames them, else one at a time."""
    many = getattr(writer, "write_all", None)
    if many is not None:
        many(records)
    else:
        for data in records:
            writer.write(data)


def record_writer(path: str, tensorflow: Optional[bool] = None):
    """A writer of TFRecord file `path` (created, or emptied): an object with
    `write(bytes)`, `flush()` and `close()`, each raising on a failure (an
    `OSError` or one of TensorFlow's errors).

    Args:
        path: the file.
        tensorflow: write through `tf.io.TFRecordWriter`; None: where
            TensorFlow is already loaded, or for a remote path where it is
            installed. Defaults to `None`.

    Examples:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "records")
        >>> writer = record_writer(path, tensorflow=False)
        >>> writer.write(b"abc")
        >>> writer.close()
        >>> open(path, "rb").read() == frame(b"abc")
        True
    """
    if tensorflow is None:
        tensorflow = _tensorflow_loaded()
        if not tensorflow and _remote(path):
            try:
                import tensorflow as tf  # noqa: F401

                tensorflow = True
            except ImportError:
                pass
    if tensorflow:
        import tensorflow as tf

        return tf.io.TFRecordWriter(path)
    return _FramedFile(path)
