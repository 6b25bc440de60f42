"""Step traces: TraceWriter, load_trace, compare_traces and `kerasdbg compare`."""

import numpy as np
import pytest

from kerasdbg import cli
from kerasdbg.trace import (
    META_KEY, TraceError, TraceWriter, compare_traces, differences, load_trace,
)


def _write(path, steps, **by_step):
    with TraceWriter(str(path)) as writer:
        for step in steps:
            writer.record(step, **{k: v(step) if callable(v) else v for k, v in by_step.items()})
    return str(path)


def test_writer_round_trip_in_every_form(tmp_path):
    path = tmp_path / "sub" / "t.npz"
    with TraceWriter(path, source="tf1") as writer:
        writer.record(0, weights={"b/kernel:0": np.ones((2, 2)), "a/bias:0": np.zeros(2)})
        writer.record(1, loss=np.float32(0.5), learning_rate=0.1,
                      gradients=[("b/kernel:0", np.full((2, 2), 0.5)), ("a/bias:0", [1.0, 2.0])],
                      layer_outputs=[np.arange(6.0).reshape(3, 2)])
    raw = np.load(path)
    np.testing.assert_array_equal(raw["gradients/a/bias:0@1"], [1.0, 2.0])
    assert META_KEY in raw.files
    trace = load_trace(path)
    assert trace.source == "tf1" and trace.steps == [0, 1]
    # Recording order, not alphabetical: order-and-shape matching relies on it.
    assert trace.names("weights") == ["weights/b/kernel:0", "weights/a/bias:0"]
    assert trace.names("layer_outputs") == ["layer_outputs/0"]
    assert trace.names("loss") == ["loss"]
    assert float(trace.get("loss", 1)) == 0.5
    with pytest.raises(KeyError, match="has no step 0"):
        trace.get("loss", 0)
    with pytest.raises(KeyError, match="no tensor `gradients/x`"):
        trace.get("gradients/x", 1)


def test_writer_refuses_bad_input_and_keeps_what_it_has(tmp_path):
    writer = TraceWriter(tmp_path / "t.npz")
    writer.record(1, loss=1.0)
    with pytest.raises(ValueError, match="`loss` is already recorded for step 1"):
        writer.record(1, loss=2.0, gradients={"k": [1.0]})
    with pytest.raises(ValueError, match="non-empty strings without '@'"):
        writer.record(2, gradients={"a@b": [1.0]})
    with pytest.raises(TypeError, match="`weights` must be a mapping"):
        writer.record(2, weights=np.ones(3))
    with pytest.raises(ValueError, match="`step` must be a non-negative int"):
        writer.record(-1, loss=1.0)
    with pytest.raises(TypeError, match="`path` must be"):
        TraceWriter(None)
    writer.save()
    trace = load_trace(tmp_path / "t.npz")
    assert list(trace.tensors) == ["loss"] and float(trace.get("loss", 1)) == 1.0


def test_writer_saves_on_an_exception(tmp_path):
    with pytest.raises(RuntimeError):
        with TraceWriter(tmp_path / "t.npz") as writer:
            writer.record(1, loss=1.0)
            raise RuntimeError("the loop failed")
    assert load_trace(tmp_path / "t.npz").steps == [1]


def test_load_trace_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trace file"):
        load_trace(tmp_path / "missing.npz")
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(TraceError, match="not a NumPy .npz file"):
        load_trace(tmp_path / "text.npz")
    np.savez(tmp_path / "plain.npz", a=np.ones(2))
    with pytest.raises(TraceError, match="no `__kerasdbg_trace__` entry"):
        load_trace(tmp_path / "plain.npz")


def test_differences_against_numpy():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
    max_abs, max_rel, has_nan = differences(a, b)
    assert max_abs == pytest.approx(np.max(np.abs(a - b)))
    assert max_rel == pytest.approx(np.max(np.abs(a - b)) / max(np.abs(a).max(), np.abs(b).max()))
    assert not has_nan
    assert differences(np.zeros(3), np.zeros(3)) == (0.0, 0.0, False)
    assert differences([np.inf, 1.0], [np.inf, 1.0]) == (0.0, 0.0, False)
    assert differences([np.inf, 1.0], [-np.inf, 1.0])[:2] == (np.inf, np.inf)
    assert differences([np.nan], [np.nan])[2] is True
    assert differences(np.zeros(0), np.zeros(0)) == (0.0, 0.0, False)


def test_identical_traces_match(tmp_path):
    grads = {"dense/kernel": np.ones((3, 2)), "dense/bias": np.zeros(2)}
    a = _write(tmp_path / "a.npz", [1, 2], loss=0.5, gradients=grads)
    result = compare_traces(a, a)
    assert result.passed and bool(result)
    assert len(result.table) == 6 and (result.table.max_abs == 0).all()
    assert result.first_divergence is None
    assert "MATCH: 3 tensors over 2 steps" in str(result)


def test_policy_absolute_first_then_relative(tmp_path):
    steps = [1, 2, 3, 4]
    a = _write(tmp_path / "a.npz", steps, gradients=lambda s: {"k": np.array([1.0, 100.0])})
    # A difference of 0.5 on a tensor of magnitude 100: 0.005 relative.
    b = _write(tmp_path / "b.npz", steps, gradients=lambda s: {"k": np.array([1.5, 100.0])})
    result = compare_traces(a, b, atol=1e-3, rtol=0.01, exact_steps=2)
    table = result.table.set_index("step")
    assert table.loc[[1, 2], "passed"].tolist() == [False, False]
    assert table.loc[[3, 4], "passed"].tolist() == [True, True]
    assert table.loc[1, "tolerance"] == "atol" and table.loc[3, "tolerance"] == "rtol"
    np.testing.assert_allclose(table["max_abs"], 0.5)
    np.testing.assert_allclose(table["max_rel"], 0.005)
    assert result.first_divergence["step"] == 1
    assert "max abs diff 0.5 > atol 0.001" in result.first_divergence["reason"]
    assert compare_traces(a, b, atol=0.5, rtol=0.01, exact_steps=2).passed
    assert not compare_traces(a, b, atol=0.5, rtol=0.001, exact_steps=2).passed


def test_nan_is_never_equal_and_shapes_must_agree(tmp_path):
    a = _write(tmp_path / "a.npz", [1], loss=np.nan, weights={"w": np.ones(3)})
    b = _write(tmp_path / "b.npz", [1], loss=np.nan, weights={"w": np.ones(4)})
    result = compare_traces(a, b, atol=1.0)
    rows = result.table.set_index("tensor_a")
    assert rows.loc["loss", "reason"] == "NaN (never equal)"
    assert rows.loc["weights/w", "reason"] == "shapes differ: [3] vs [4]"
    assert not rows["passed"].any()


def test_first_divergence_is_the_earliest_step_then_computation_order(tmp_path):
    def a_values(step):
        return {"gradients": {"k": np.zeros(2)}, "weights": {"k": np.zeros(2)},
                "layer_outputs": {"h": np.zeros(2)}}

    def b_values(step):
        bad = np.ones(2) if step >= 2 else np.zeros(2)
        return {"gradients": {"k": bad}, "weights": {"k": np.ones(2)},
                "layer_outputs": {"h": bad}}

    for name, values in (("a.npz", a_values), ("b.npz", b_values)):
        with TraceWriter(tmp_path / name) as writer:
            for step in (1, 2, 3):
                writer.record(step, **values(step))
    result = compare_traces(tmp_path / "a.npz", tmp_path / "b.npz")
    first = result.first_divergence
    # Weights differ from step 1; at step 2 the layer output comes before the gradient.
    assert (first["step"], first["tensor_a"]) == (1, "weights/k")
    failing = result.table[~result.table.passed]
    step2 = failing[failing.step == 2].tensor_a.tolist()
    assert step2 == ["layer_outputs/h", "gradients/k", "weights/k"]
    assert "DIVERGED: first at step 1, weights/k" in str(result)


def test_variables_match_by_order_and_shape_across_frameworks(tmp_path):
    tf1 = {"dense/kernel:0": np.ones((3, 2)), "dense/bias:0": np.zeros(2)}
    keras_ = {"sequential/dense/kernel": np.ones((3, 2)), "sequential/dense/bias": np.zeros(2)}
    a = _write(tmp_path / "a.npz", [1], gradients=tf1)
    b = _write(tmp_path / "b.npz", [1], gradients=keras_)
    result = compare_traces(a, b)
    assert result.passed
    assert result.table[["tensor_a", "tensor_b"]].values.tolist() == [
        ["gradients/dense/kernel:0", "gradients/sequential/dense/kernel"],
        ["gradients/dense/bias:0", "gradients/sequential/dense/bias"],
    ]


def test_unmatchable_variables_are_a_clear_error_and_a_mapping_fixes_them(tmp_path):
    a = _write(tmp_path / "a.npz", [1], weights={"w1:0": np.ones(3), "w2:0": np.ones(2)})
    b = _write(tmp_path / "b.npz", [1], weights={"second": np.ones(2), "first": np.ones(3)})
    with pytest.raises(TraceError, match=r"cannot match the weights .* First trace: w1:0 \[3\], "
                       r"w2:0 \[2\]\. Second trace: second \[2\], first \[3\]"):
        compare_traces(a, b)
    result = compare_traces(a, b, mapping={"w1:0": "first", "w2:0": "second"})
    assert result.passed and len(result.table) == 2
    with pytest.raises(TraceError, match="maps 'w1:0' to 'nope'"):
        compare_traces(a, b, mapping={"w1:0": "nope"})


def test_tensors_and_steps_in_one_trace_only_are_listed(tmp_path):
    a = _write(tmp_path / "a.npz", [1, 2], loss=1.0, learning_rate=0.1)
    b = _write(tmp_path / "b.npz", [1, 3], loss=1.0)
    result = compare_traces(a, b)
    assert result.passed and result.table.step.tolist() == [1]
    assert result.only_in_a == ["learning_rate"] and result.only_in_b == []
    assert result.steps_only_in_a == [2] and result.steps_only_in_b == [3]
    assert "only in a (not compared): learning_rate" in str(result)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"atol": -1}, ValueError, "`atol` must be a finite number >= 0"),
    ({"rtol": "x"}, TypeError, "`rtol` must be a number"),
    ({"exact_steps": 1.5}, TypeError, "`exact_steps` must be a non-negative int"),
    ({"mapping": {"a": 1}}, TypeError, "`mapping` must be a mapping of str to str"),
], ids=["atol", "rtol", "exact_steps", "mapping"])
def test_bad_arguments_are_refused(kwargs, error, match, tmp_path):
    a = _write(tmp_path / "a.npz", [1], loss=1.0)
    with pytest.raises(error, match=match):
        compare_traces(a, a, **kwargs)


def test_cli_compare_exit_status_and_report(tmp_path, capsys):
    a = _write(tmp_path / "a.npz", [1, 2], gradients=lambda s: {"dense/kernel:0": np.ones(2)})
    same = _write(tmp_path / "same.npz", [1, 2], gradients=lambda s: {"dense/kernel": np.ones(2)})
    other = _write(tmp_path / "other.npz", [1, 2],
                   gradients=lambda s: {"dense/kernel": np.ones(2) * (1 + s)})
    assert cli.main(["compare", a, same]) == 0
    assert "MATCH" in capsys.readouterr().out
    assert cli.main(["compare", a, other, "--all"]) == 1
    out = capsys.readouterr().out
    assert "DIVERGED: first at step 1, gradients/dense/kernel:0 (b: gradients/dense/kernel)" in out
    assert "max abs diff 1 > atol 1e-05" in out
    assert cli.main(["compare", a, other, "--atol", "3"]) == 0
    capsys.readouterr()
    assert cli.main(["compare", a, str(tmp_path / "missing.npz")]) == 2
    assert "no trace file" in capsys.readouterr().err
    assert cli.main(["compare", a, same, "--map", "oops"]) == 2
    assert "NAME_IN_A=NAME_IN_B" in capsys.readouterr().err
    assert cli.main(["compare", a, same, "--atol", "-1"]) == 2
    assert "`atol` must be a finite number >= 0" in capsys.readouterr().err
