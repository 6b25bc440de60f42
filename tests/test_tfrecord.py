"""Event files written without TensorFlow (`kerasdbg.sinks.tfrecord`): the same
bytes as TensorFlow's `TFRecordWriter`, read back by TensorFlow and by
TensorBoard, with `google-crc32c` or TensorBoard's pure-Python CRC, and a
full disk said as with TensorFlow's writer."""

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb_masked_crc

from kerasdbg.sinks import events as _events
from kerasdbg.sinks import tfrecord

from tests.test_boundaries import ROOT
from tests.test_faults import tmpfs

PAYLOADS = [b"", b"a", b"kerasdbg" * 1000, bytes(range(256)) * 17]


def test_the_crc_is_tensorboards_and_google_crc32c_computes_it():
    assert tfrecord.CRC32C == "google-crc32c"
    rng = np.random.default_rng(0)
    for payload in PAYLOADS + [rng.bytes(n) for n in (1, 7, 100, 4097)]:
        assert tfrecord.masked_crc32c(payload) == tb_masked_crc(payload)


def test_records_framed_without_tensorflow_are_tensorflows_bytes(tmp_path):
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    writer = tfrecord.record_writer(ours, tensorflow=False)
    assert not isinstance(writer, tf.io.TFRecordWriter)
    with tf.io.TFRecordWriter(theirs) as reference:
        for payload in PAYLOADS:
            writer.write(payload)
            reference.write(payload)
    writer.close()
    with open(ours, "rb") as a, open(theirs, "rb") as b:
        assert a.read() == b.read()
    # TensorFlow's reader checks every checksum.
    read = [bytes(r.numpy()) for r in tf.data.TFRecordDataset(ours)]
    assert read == PAYLOADS


def test_the_tensorflow_writer_is_used_where_tensorflow_is_loaded(tmp_path):
    writer = tfrecord.record_writer(str(tmp_path / "r"))
    assert isinstance(writer, tf.io.TFRecordWriter)
    writer.close()


_WRITE_WITHOUT_TENSORFLOW = """
import sys
import numpy as np
from kerasdbg.sinks import events, tfrecord

writer = events.EventWriter(sys.argv[1])
for step in (1, 2, 3):
    writer.write(step, {"gradients/d/kernel/l2_norm": step / 2, "step/loss": 1.0 / step},
                 histograms={"gradients/d/kernel/histogram": (np.array([1.0, 2.0, step]), -1.0, 1.0)},
                 texts={"notes": f"step {step}"} if step == 1 else {})
writer.close()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras", "jax"))
print(tfrecord.CRC32C, "|", loaded)
"""


@pytest.mark.parametrize("blocked", [("tensorflow",), ("tensorflow", "google_crc32c")],
                         ids=["google-crc32c", "tensorboard-crc"])
def test_an_event_file_written_without_tensorflow_reads_in_tensorboard(tmp_path, blocked):
    block = textwrap.dedent(f"""
        import importlib.abc, sys
        class Blocked(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {blocked!r}:
                    raise ImportError(f"{{name}} is blocked in this test")
        sys.meta_path.insert(0, Blocked())
    """)
    run = str(tmp_path / "train")
    result = subprocess.run([sys.executable, "-c", block + _WRITE_WITHOUT_TENSORFLOW, run],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    crc, loaded = result.stdout.strip().split(" | ")
    assert crc == ("google-crc32c" if len(blocked) == 1 else "tensorboard (pure Python)")
    assert loaded == "[]"
    (name,) = [n for n in os.listdir(run) if "tfevents" in n]
    path = os.path.join(run, name)
    # Every record's checksums, as TensorFlow checks them.
    assert len(list(tf.data.TFRecordDataset(path))) == 4  # the file version, then 3 steps
    accumulator = event_accumulator.EventAccumulator(path, size_guidance={"tensors": 0})
    accumulator.Reload()
    scalars = accumulator.Scalars("gradients/d/kernel/l2_norm")
    assert [(s.step, s.value) for s in scalars] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    histograms = accumulator.Tensors("gradients/d/kernel/histogram")
    np.testing.assert_array_equal(tf.make_ndarray(histograms[2].tensor_proto)[:, 2], [1, 2, 3])
    (text,) = accumulator.Tensors("notes")
    assert tf.make_ndarray(text.tensor_proto).item() == b"step 1"


def test_a_full_disk_stops_the_writer_without_tensorflow_and_keeps_what_was_flushed(
        tmp_path, monkeypatch):
    original = tfrecord.record_writer
    framed = lambda path: original(path, tensorflow=False)  # noqa: E731
    monkeypatch.setattr(_events._tfrecord, "record_writer", framed)
    disk = str(tmp_path / "disk")
    os.makedirs(disk)
    tags = [f"gradients/layer_{i}/kernel/l2_norm" for i in range(200)]
    with tmpfs(disk, size="64k"):
        writer = _events.EventWriter(os.path.join(disk, "train"))
        assert isinstance(writer._writer, tfrecord._FramedFile)
        writer.write(1, dict.fromkeys(tags, 1.0))
        writer.flush()
        with pytest.raises(OSError) as raised:
            for step in range(2, 200):
                writer.write(step, dict.fromkeys(tags, float(step)))
                writer.flush()
        assert raised.value.errno == errno.ENOSPC
        assert writer.failed and writer._writer is None  # closed: the tmpfs unmounts
        kept = str(tmp_path / os.path.basename(writer.path))
        shutil.copy(writer.path, kept)
    accumulator = event_accumulator.EventAccumulator(kept)
    accumulator.Reload()
    steps = [s.step for s in accumulator.Scalars(tags[0])]
    assert steps[0] == 1 and steps == list(range(1, len(steps) + 1))
