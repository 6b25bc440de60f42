"""The event writer's cost per step, with TensorFlow's writer and without it.

    python bench/bench_event_writer.py [--steps 2000] [--repeats 5] [--crc32c-path DIR]

Writes `--steps` steps of 180 scalars (a small CNN's default statistics) and
of 2,000 scalars (ResNet50-sized) through `kerasdbg.sinks.events.EventWriter`,
with the TFRecord framing done by:

- "tensorflow": `tf.io.TFRecordWriter` (C++ framing and CRC; the writer used
  where TensorFlow is loaded);
- "google-crc32c": framed in Python, CRC32C by `google-crc32c` (C; the
  writer used without TensorFlow);
- "crc32c": framed in Python, CRC32C by the `crc32c` package (C; for
  comparison, when importable: install it, or pass where it lies with
  `--crc32c-path`);
- "pure-python": framed in Python, CRC32C by TensorBoard's own pure-Python
  code (the fallback when `google-crc32c` cannot be imported).

Each configuration writes to its own temporary directory; the configurations
are interleaved, `--repeats` times, and the median per step is printed (the
whole `write`: the Event proto, its serialization, the framing, the analysis
store; a flush every 100 steps), with the framing and CRC alone beside it.
Run it alone on the machine: it measures microseconds.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _tags(count: int):
    # Tags as the statistics callbacks write them: tensor path / statistic.
    statistics_ = ("l2_norm", "mean", "std", "min", "max", "nan_count", "inf_count",
                   "zero_fraction", "update_ratio")
    tags = []
    layer = 0
    while len(tags) < count:
        for variable in ("kernel", "bias"):
            for name in statistics_:
                tags.append(f"gradients/block{layer}_conv/{variable}/{name}")
        layer += 1
    return tags[:count]


def _crc_functions(crc32c_path):
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow

    functions = {}
    import google_crc32c

    functions["google-crc32c"] = google_crc32c.value
    if crc32c_path:
        sys.path.insert(0, crc32c_path)
    try:
        import crc32c

        functions["crc32c"] = crc32c.crc32c
    except ImportError:
        print("(the crc32c package is not importable: left out)")
    functions["pure-python"] = pywrap_tensorflow.crc32c
    return functions


def _write_steps(log_dir, tags, steps, use_tensorflow, crc):
    from kerasdbg.sinks import events, tfrecord

    original_writer, original_crc = tfrecord.record_writer, tfrecord._crc32c
    events._tfrecord.record_writer = functools.partial(original_writer, tensorflow=use_tensorflow)
    if crc is not None:
        tfrecord._crc32c = crc
    try:
        writer = events.EventWriter(log_dir)
        values = [0.5 + i for i in range(len(tags))]
        start = time.perf_counter()
        for step in range(1, steps + 1):
            writer.write(step, dict(zip(tags, values)))
            if step % 100 == 0:
                writer.flush()
        writer.close()
        return (time.perf_counter() - start) / steps
    finally:
        events._tfrecord.record_writer, tfrecord._crc32c = original_writer, original_crc


def _frame_only(payload, steps, use_tensorflow, crc, directory):
    """The framing and CRC alone of `payload` (one step's serialized event)."""
    from kerasdbg.sinks import tfrecord

    original = tfrecord._crc32c
    if crc is not None:
        tfrecord._crc32c = crc
    try:
        writer = tfrecord.record_writer(os.path.join(directory, "records"),
                                        tensorflow=use_tensorflow)
        start = time.perf_counter()
        for _ in range(steps):
            writer.write(payload)
        writer.close()
        return (time.perf_counter() - start) / steps
    finally:
        tfrecord._crc32c = original


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--crc32c-path", default=None)
    args = parser.parse_args(argv)

    import tensorflow as tf  # noqa: F401 - for the "tensorflow" writer
    from tensorboard.compat.proto import event_pb2, summary_pb2

    crcs = _crc_functions(args.crc32c_path)
    configurations = [("tensorflow", True, None)] + [
        (name, False, function) for name, function in crcs.items()]
    print(f"{args.steps} steps, median of {args.repeats} interleaved repeats, "
          f"microseconds per step (ratio to 'tensorflow')")
    for count in (180, 2000):
        tags = _tags(count)
        event = event_pb2.Event(step=1, wall_time=time.time(), summary=summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=tag, simple_value=1.5) for tag in tags]))
        payload = event.SerializeToString()
        whole = {name: [] for name, _, _ in configurations}
        framing = {name: [] for name, _, _ in configurations}
        for _ in range(args.repeats):
            for name, use_tensorflow, crc in configurations:
                directory = tempfile.mkdtemp()
                try:
                    whole[name].append(_write_steps(os.path.join(directory, "train"), tags,
                                                    args.steps, use_tensorflow, crc))
                    framing[name].append(_frame_only(payload, args.steps, use_tensorflow, crc,
                                                     directory))
                finally:
                    shutil.rmtree(directory, ignore_errors=True)
        base_whole = statistics.median(whole["tensorflow"])
        base_framing = statistics.median(framing["tensorflow"])
        print(f"\n{count} scalars ({len(payload)} bytes per event)")
        print(f"  {'writer':<14} {'write, us/step':>16} {'ratio':>7} {'framing+CRC, us':>17} "
              f"{'ratio':>7}")
        for name, _, _ in configurations:
            w, f = statistics.median(whole[name]), statistics.median(framing[name])
            print(f"  {name:<14} {w * 1e6:>16.1f} {w / base_whole:>7.2f} {f * 1e6:>17.1f} "
                  f"{f / base_framing:>7.2f}")


if __name__ == "__main__":
    main()
