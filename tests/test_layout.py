"""The Custom Scalars tab of the real TensorBoard server draws the layout the
callbacks write: a few charts, each of every tag of one statistic."""

import glob
import os
import re
import warnings

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata
from tensorboard.plugins.custom_scalar import summary as layout_summary

from kerasdbg.sinks import events as _events
from kerasdbg.sinks import layout as _layout
from kerasdbg.records import tags as _tags
from kerasdbg.rules import NonFiniteLoss
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StepTimer
from kerasdbg.callbacks import StopOnRule, WeightStatistics
from kerasdbg.layers import TapLayer
from tests.helpers import BATCH, X, Y
from tests.tensorboard_server import get as _get, serve, wait_for

# The layout the issue asks for: category -> its charts, in order; the
# per-variable charts last, in a closed category.
EVERY = "every variable and tap"
CHARTS = {
    "loss": ["loss", "log10 loss"],
    "gradients": ["global norm", "log10 global norm",
                  "log10 largest l2 norm in each group of variables",
                  "largest l2 norm in each group of variables",
                  "log10 largest and smallest l2 norm of all variables",
                  "log10 largest and smallest l2 norm, by the variable holding it"],
    "weights": ["log10 largest update ratio in each group of variables",
                "fraction of variables with update ratio above 0.01",
                "largest weight l2 norm in each group of variables"],
    "activations": ["largest dead / saturated fraction in each group of taps"],
    "timing": ["seconds per execution and per step: input, compute", "input fraction",
               "examples per second"],
    EVERY: ["gradient l2 norm of every variable", "weight update ratio of every variable",
            "weight l2 norm of every variable", "dead / saturated fraction of every tap"],
}
# StepTimer's tags, from its docstring.
SECONDS = ["time/execution_seconds", "time/step_seconds", "time/input_seconds",
           "time/compute_seconds"]
LAYOUT_WARNING = "could not write the TensorBoard custom-scalars layout"


def _tapped_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,), name="x")
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    hidden = TapLayer(stats=["mean"], activation="relu", name="hidden_tap")(hidden)
    squash = keras.layers.Dense(4, activation="tanh", name="squash")(hidden)
    squash = TapLayer(stats=["mean"], activation="tanh", name="squash_tap")(squash)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(squash), name="tapped")


def _expected_tags(model):
    """Chart title -> the tags it should draw, from the model's variables and
    taps and the callbacks' documented tags. The model's six variables are
    six groups (at most ten: one each), named by their paths."""
    paths = [v.path for v in model.trainable_variables]
    health = {"relu": "dead_fraction", "tanh": "saturated_fraction"}
    taps = {layer.name: health[layer.activation] for layer in model.layers
            if isinstance(layer, TapLayer)}
    return {
        "loss": {"step/loss"},
        "log10 loss": {"views/step/loss/log10"},
        "global norm": {"gradients/global_norm"},
        "log10 global norm": {"views/gradients/global_norm/log10"},
        "log10 largest l2 norm in each group of variables": {
            f"views/gradients/l2_norm/log10_max/{p}" for p in paths},
        "largest l2 norm in each group of variables": {
            f"views/gradients/l2_norm/max/{p}" for p in paths},
        "log10 largest and smallest l2 norm of all variables": {
            "views/gradients/l2_norm/log10_max", "views/gradients/l2_norm/log10_min"},
        # Depends on the values: filled in from the per-variable records.
        "log10 largest and smallest l2 norm, by the variable holding it": None,
        "log10 largest update ratio in each group of variables": {
            f"views/weights/update_ratio/log10_max/{p}" for p in paths},
        "fraction of variables with update ratio above 0.01": {
            "views/weights/update_ratio/fraction_above_0.01"},
        "largest weight l2 norm in each group of variables": {
            f"views/weights/l2_norm/max/{p}" for p in paths},
        "largest dead / saturated fraction in each group of taps": {
            f"views/activations/{stat}/max/{tap}" for tap, stat in taps.items()},
        "seconds per execution and per step: input, compute": set(SECONDS),
        "input fraction": {"time/input_fraction"},
        "examples per second": {"time/examples_per_second"},
        "gradient l2 norm of every variable": {f"gradients/{p}/l2_norm" for p in paths},
        "weight update ratio of every variable": {f"weights/{p}/update_ratio" for p in paths},
        "weight l2 norm of every variable": {f"weights/{p}/l2_norm" for p in paths},
        "dead / saturated fraction of every tap": {
            f"activations/{tap}/{stat}" for tap, stat in taps.items()},
    }


def _layouts(run_dir):
    """Every layout written to the run, in file order."""
    layouts = []
    for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
        for event in event_file_loader.EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.tag == metadata.CONFIG_SUMMARY_TAG:
                    assert value.metadata.plugin_data.plugin_name == metadata.PLUGIN_NAME
                    layouts.append(layout_pb2.Layout.FromString(value.tensor.string_val[0]))
    return layouts


def _titles(layout):
    """`{category: [chart titles]}` of a layout proto or of its JSON."""
    if isinstance(layout, dict):
        return {c["title"]: [chart["title"] for chart in c["chart"]] for c in layout["category"]}
    return {c.title: [chart.title for chart in c.chart] for c in layout.category}


def _served_layout(base):
    """The layout route's answer, once it lists every category."""
    wait_for(lambda: len(_get(base, "/data/plugin/custom_scalars/layout").get("category", []))
              >= len(CHARTS), "the whole layout")
    return _get(base, "/data/plugin/custom_scalars/layout")


def _served_tags(base):
    return set(_get(base, "/data/plugin/scalars/tags").get("train", {}))


def _fit(model, callbacks, epochs=1, **compile_args):
    model.compile(keras.optimizers.SGD(0.05), "mse", **compile_args)
    model.fit(X, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=callbacks)


# ---------------------------------------------------------------- a real run
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every callback that writes to `<log_dir>/train`, in one fit."""
    log_dir = str(tmp_path_factory.mktemp("layout") / "logs")
    model = _tapped_model()
    callbacks = [GradientStatistics(log_dir, every_n_steps=1),
                 WeightStatistics(log_dir, every_n_steps=1), StepTimer(log_dir),
                 StopOnRule(log_dir=log_dir, verbose=False), ActivationStatistics(log_dir)]
    _fit(model, callbacks, epochs=2)
    return log_dir, model


@pytest.fixture(scope="module", params=["false", "true"], ids=["python-loader", "rust-data-server"])
def server(trained, request):
    with serve(trained[0], load_fast=request.param) as base:
        yield base


def test_each_callback_adds_its_charts_and_the_last_layout_holds_all(trained):
    log_dir, _ = trained
    layouts = _layouts(os.path.join(log_dir, "train"))
    # One layout per callback that added charts, in the order of `callbacks`.
    assert [list(_titles(layout)) for layout in layouts] == [
        ["gradients", EVERY],
        ["gradients", "weights", EVERY],
        ["gradients", "weights", "timing", EVERY],
        ["loss", "gradients", "weights", "timing", EVERY],
        ["loss", "gradients", "weights", "activations", "timing", EVERY],
    ]
    assert _titles(layouts[-1]) == CHARTS


def test_the_plugin_serves_the_merged_layout(server):
    layout = _served_layout(server)
    assert _titles(layout) == CHARTS
    # Only the per-variable charts are closed at first.
    assert {c["title"]: c.get("closed", False) for c in layout["category"]} == {
        title: title == EVERY for title in CHARTS}


def test_each_chart_draws_the_tags_of_its_statistic(server, trained):
    _, model = trained
    expected = _expected_tags(model)
    wait_for(lambda: set().union(*filter(None, expected.values())) <= _served_tags(server),
              "every tag")
    listed = _served_tags(server)
    layout = _served_layout(server)
    # One line per variable that held the largest (smallest) gradient norm at a step.
    paths = [v.path for v in model.trainable_variables]
    norms = np.array([[v for _, _, v in _get(server, "/data/plugin/scalars/scalars", run="train",
                                             tag=f"gradients/{p}/l2_norm")] for p in paths])
    expected["log10 largest and smallest l2 norm, by the variable holding it"] = {
        f"views/gradients/l2_norm/log10_largest/{paths[i]}" for i in norms.argmax(axis=0)} | {
        f"views/gradients/l2_norm/log10_smallest/{paths[i]}" for i in norms.argmin(axis=0)}
    for category in layout["category"]:
        for chart in category["chart"]:
            drawn = set()
            for regex in chart["multiline"]["tag"]:
                served = _get(server, "/data/plugin/custom_scalars/scalars", run="train", tag=regex)
                assert served["regex_valid"], regex
                tags = served["tag_to_events"]
                assert tags, f"{chart['title']}: {regex} matches no tag"
                assert all(len(events) > 0 for events in tags.values())
                # What the plugin does with the expression, done here by hand.
                assert set(tags) == {t for t in listed if re.match(regex, t)}
                drawn |= set(tags)
            assert drawn == expected[chart["title"]], chart["title"]


# ------------------------------------------------------------ what is written
def _points(run_dir):
    """`{tag: [(step, value), ...]}` of every simple scalar in the run's event files."""
    points = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
        # The legacy loader keeps simple values as written.
        for event in event_file_loader.LegacyEventFileLoader(path).Load():
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":
                    points.setdefault(value.tag, []).append((event.step, value.simple_value))
    return points


@pytest.mark.parametrize("loss, expected", [
    (100.0, {"views/step/loss/log10": 2.0}), (-0.5, {}), (0.0, {}), (float("nan"), {}),
    (float("inf"), {"views/step/loss/log10": np.inf})],
    ids=["positive", "negative", "zero", "nan", "inf"])
def test_the_log10_loss_is_absent_at_a_loss_not_above_0_or_nan(loss, expected):
    assert _layout.loss_views({"step/loss": loss, "step/accuracy": 0.5}) == expected


GRADIENT_TAGS = ["gradients/global_norm"] + [
    f"gradients/m/{layer}/{weight}/l2_norm" for layer in ("a", "b") for weight in ("kernel", "bias")]


GRADIENT_CASES = [
    # Zero bias gradients: the smallest is the smallest nonzero norm.
    ([5.0, 3.0, 0.0, 4.0, 0.5], {
        "global_norm/log10": np.log10(5.0), "l2_norm/log10_max": np.log10(4.0),
        "l2_norm/log10_min": np.log10(0.5), "l2_norm/log10_largest/m/b/kernel": np.log10(4.0),
        "l2_norm/log10_smallest/m/b/bias": np.log10(0.5),
        "l2_norm/max/a/kernel": 3.0, "l2_norm/max/a/bias": 0.0, "l2_norm/max/b/kernel": 4.0,
        "l2_norm/max/b/bias": 0.5, "l2_norm/log10_max/a/kernel": np.log10(3.0),
        "l2_norm/log10_max/b/kernel": np.log10(4.0), "l2_norm/log10_max/b/bias": np.log10(0.5)}),
    # All zero: no log10 at all.
    ([0.0, 0.0, 0.0, 0.0, 0.0], {
        "l2_norm/max/a/kernel": 0.0, "l2_norm/max/a/bias": 0.0, "l2_norm/max/b/kernel": 0.0,
        "l2_norm/max/b/bias": 0.0}),
    # An exploded norm shows as +inf; a NaN is left out (its group's max is NaN).
    ([np.inf, np.inf, 0.0, np.nan, 0.5], {
        "global_norm/log10": np.inf, "l2_norm/log10_max": np.inf, "l2_norm/log10_min": np.log10(0.5),
        "l2_norm/log10_largest/m/a/kernel": np.inf, "l2_norm/log10_smallest/m/b/bias": np.log10(0.5),
        "l2_norm/max/a/kernel": np.inf, "l2_norm/max/a/bias": 0.0, "l2_norm/max/b/kernel": np.nan,
        "l2_norm/max/b/bias": 0.5, "l2_norm/log10_max/a/kernel": np.inf,
        "l2_norm/log10_max/b/bias": np.log10(0.5)}),
    # The only norm known is inf (the others NaN): the largest and the smallest.
    ([np.nan, np.nan, np.nan, np.nan, np.inf], {
        "l2_norm/log10_max": np.inf, "l2_norm/log10_min": np.inf,
        "l2_norm/log10_largest/m/b/bias": np.inf, "l2_norm/log10_smallest/m/b/bias": np.inf,
        "l2_norm/max/a/kernel": np.nan, "l2_norm/max/a/bias": np.nan,
        "l2_norm/max/b/kernel": np.nan, "l2_norm/max/b/bias": np.inf,
        "l2_norm/log10_max/b/bias": np.inf}),
    # NaN only: the global norm's log10 is absent too.
    ([np.nan, np.nan, np.nan, np.nan, np.nan], {
        "l2_norm/max/a/kernel": np.nan, "l2_norm/max/a/bias": np.nan,
        "l2_norm/max/b/kernel": np.nan, "l2_norm/max/b/bias": np.nan}),
]
GRADIENT_CASE_IDS = ["zero-biases", "all-zero", "inf-and-nan", "nan-and-one-inf", "all-nan"]


def _assert_views(got, expected, kind="gradients"):
    expected = {f"views/{kind}/{tag}": value for tag, value in expected.items()}
    assert set(got) == set(expected)
    for tag, value in expected.items():
        np.testing.assert_allclose(got[tag], value, rtol=1e-12, err_msg=tag)


@pytest.mark.parametrize("values, expected", GRADIENT_CASES, ids=GRADIENT_CASE_IDS)
def test_gradient_views_leave_out_the_log10_of_zero_and_nan(values, expected):
    _assert_views(_layout.views("gradients", GRADIENT_TAGS, values), expected)


def test_the_views_of_a_read_are_those_of_each_of_its_steps():
    """`views_of_steps` computes a read's steps as one array: each step's
    views are those of its own row, whatever the rows around it (every case
    above, twice, in an order that puts each beside the others)."""
    order = [0, 2, 4, 1, 3, 3, 1, 4, 2, 0]
    rows = np.array([GRADIENT_CASES[k][0] for k in order])
    got = _layout.views_of_steps("gradients", GRADIENT_TAGS, rows)
    assert len(got) == len(order)
    for views, k in zip(got, order):
        _assert_views(views, GRADIENT_CASES[k][1])
    # Update ratios: the largest finite ratio of each group, the fraction above 0.01.
    # Six groups (the layers) of two variables.
    tags = [f"weights/m/l{i}/{weight}/update_ratio" for i in range(6)
            for weight in ("kernel", "bias")]
    ratios = np.array([[1e-3, np.inf, 0.02, 1e-4, np.nan, 0.0] * 2,
                       [np.inf] * 12,
                       [0.5, 0.2, np.nan, np.nan, 3e-3, 5e-3, np.inf, 0.0, 1.0, 2.0, 0.1, 0.1]])
    for views, step in zip(_layout.views_of_steps("weights", tags, ratios), ratios):
        pairs = np.where(np.isfinite(step), step, -np.inf).reshape(6, 2).max(axis=1)
        expected = {f"update_ratio/log10_max/l{i}": np.log10(r) for i, r in enumerate(pairs)
                    if r > 0}
        finite = step[np.isfinite(step)]
        if finite.size:
            expected["update_ratio/fraction_above_0.01"] = np.mean(finite > 0.01)
        _assert_views(views, expected, "weights")
    # The taps' health: the largest dead / saturated fraction of each tap (one tap a group).
    tags = ["activations/relu_a/dead_fraction", "activations/relu_b/dead_fraction",
            "activations/tanh_c/saturated_fraction"]
    health = np.array([[0.1, 0.5, 0.0], [np.nan, 1.0, 0.25], [0.0, np.nan, np.nan]])
    for views, step in zip(_layout.views_of_steps("activations", tags, health), health):
        expected = {f"{tag.split('/')[2]}/max/{tag.split('/')[1]}": value
                    for tag, value in zip(tags, step)}
        assert set(views) == {f"views/activations/{tag}" for tag in expected}
        for tag, value in expected.items():
            np.testing.assert_array_equal(views[f"views/activations/{tag}"], value, err_msg=tag)


@pytest.mark.parametrize("ratios", [
    [[1e-3, np.inf, 0.1, np.inf], [2e-3, 0.5, 0.2, 1e-4]],
    [[np.inf, np.inf, 0.1, np.nan], [np.inf, np.inf, np.nan, np.nan]]],
    ids=["zero-initialised-biases", "none-finite-in-a-group"])
def test_update_ratio_views_leave_out_infinite_ratios(ratios):
    tags = [f"weights/m/{layer}/{weight}/update_ratio" for layer in ("a", "b")
            for weight in ("kernel", "bias")]
    groups = ["a/kernel", "a/bias", "b/kernel", "b/bias"]  # one variable each
    for step in np.array(ratios):
        got = _layout.views("weights", tags, step)
        finite = np.isfinite(step)
        expected = {f"views/weights/update_ratio/log10_max/{g}": np.log10(r)
                    for g, r, f in zip(groups, step, finite) if f}
        if finite.any():
            expected["views/weights/update_ratio/fraction_above_0.01"] = np.mean(
                step[finite] > 0.01)
        assert set(got) == set(expected)
        for tag, value in expected.items():
            np.testing.assert_allclose(got[tag], value, rtol=1e-12, err_msg=tag)
    # Six groups (the layers) of two variables: the largest finite ratio of each.
    tags = [f"weights/m/l{i}/{weight}/update_ratio" for i in range(6)
            for weight in ("kernel", "bias")]
    ratios = np.array([1e-3, np.inf, 0.02, 1e-4, np.inf, np.inf, 0.3, np.nan, 5e-3, 0.0,
                       np.inf, 2e-3])
    got = _layout.views("weights", tags, ratios)
    pairs = np.where(np.isfinite(ratios), ratios, -np.inf).reshape(6, 2).max(axis=1)
    expected = {f"views/weights/update_ratio/log10_max/l{i}": np.log10(r)
                for i, r in enumerate(pairs) if r > 0}
    finite = ratios[np.isfinite(ratios)]
    expected["views/weights/update_ratio/fraction_above_0.01"] = np.mean(finite > 0.01)
    assert set(got) == set(expected) and "views/weights/update_ratio/log10_max/l2" not in got
    for tag, value in expected.items():
        np.testing.assert_allclose(got[tag], value, rtol=1e-12, err_msg=tag)


def test_a_negative_loss_and_zero_initialised_biases_write_no_nan_view(tmp_path):
    """An ELBO-style loss below 0 at every step; the biases start at 0 (their
    first update ratio is inf)."""
    log_dir = str(tmp_path / "logs")
    model = _tapped_model()
    grads = GradientStatistics(log_dir, every_n_steps=1)
    weights = WeightStatistics(log_dir, every_n_steps=1)
    stop = StopOnRule(rules=[NonFiniteLoss()], log_dir=log_dir, verbose=False)
    model.compile(keras.optimizers.SGD(0.05),
                  lambda y, p: keras.ops.mean(keras.ops.square(y - p)) - 100.0)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[grads, weights, stop])
    points = _points(os.path.join(log_dir, "train"))
    losses = [v for _, v in points["step/loss"]]
    assert len(losses) == len(X) // BATCH and max(losses) < 0
    assert "views/step/loss/log10" not in points
    written = [(tag, v) for tag, values in points.items() if tag.startswith("views/")
               for _, v in values]
    assert written and all(not np.isnan(v) and v != -np.inf for _, v in written)
    # Against NumPy on the per-variable records (one variable per group).
    paths = [v.path for v in model.trainable_variables]
    ratios = weights.history.set_index("step")[[f"{p}/update_ratio" for p in paths]]
    assert np.isinf(ratios.loc[1]).any()  # the zero biases at step 1
    fraction = dict(points["views/weights/update_ratio/fraction_above_0.01"])
    for step, row in ratios.iterrows():
        row = row.to_numpy(np.float64)
        finite = np.isfinite(row)
        assert fraction[step] == pytest.approx(np.mean(row[finite] > 0.01))
        for path, ratio, ok in zip(paths, row, finite):
            drawn = dict(points.get(
                f"views/weights/update_ratio/log10_max/{path}", []))
            if ok:
                assert drawn[step] == pytest.approx(np.log10(ratio), rel=1e-6)
            else:
                assert step not in drawn


def test_a_views_failure_warns_once_and_the_records_are_still_written(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise ZeroDivisionError("a bug in the views")

    monkeypatch.setattr(_layout, "view_groups", fail)  # (`views_of_steps` too)
    log_dir = str(tmp_path / "logs")
    grads = GradientStatistics(log_dir, every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(_tapped_model(), [grads])
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert said == [
        "GradientStatistics could not record: it could not compute its TensorBoard views "
        "(views/gradients/..., the Custom Scalars charts); its records are written without "
        "them, and training goes on. Cause: ZeroDivisionError: a bug in the views"]
    points = _points(os.path.join(log_dir, "train"))
    steps = list(range(1, len(X) // BATCH + 1))
    history = grads.history.set_index("step")
    recorded = [t for t in points if t.startswith("gradients/")]
    assert len(recorded) == len(history.columns) - 1  # every column but `skipped`
    for tag in recorded:
        assert dict(points[tag]) == pytest.approx(
            history[_tags.column(tag, "gradients")].to_dict(), rel=1e-6)
    assert [s for s, _ in points["gradients/global_norm"]] == steps
    assert not any(tag.startswith("views/gradients/") for tag in points)


def test_strict_raises_when_the_views_fail(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise ZeroDivisionError("a bug in the views")

    monkeypatch.setattr(_layout, "view_groups", fail)  # (`views_of_steps` too)
    with pytest.raises(_events.RecordingError, match=re.escape(
            "GradientStatistics could not record: kerasdbg could not write the TensorBoard views "
            f"(views/gradients/...) to {str(tmp_path / 'logs' / 'train')!r}; the fit stops "
            "(`strict=True`). Cause: ZeroDivisionError: a bug in the views")) as raised:
        _fit(_tapped_model(), [GradientStatistics(str(tmp_path / "logs"), strict=True)])
    assert isinstance(raised.value.__cause__, ZeroDivisionError)


def test_the_summary_is_the_plugins_own():
    proto = _layout.layout(_layout.loss_lines() + _layout.timing_lines(True))
    theirs = summary_pb2.Summary.FromString(layout_summary.pb(proto).SerializeToString())
    assert _layout.summary(proto) == theirs


def test_only_charts_of_recorded_tags_and_no_rewrite_in_a_second_fit(tmp_path):
    log_dir = str(tmp_path / "logs")
    model = _tapped_model()
    callbacks = [GradientStatistics(log_dir, stats=["mean"]),
                 WeightStatistics(log_dir, stats=["update_ratio"]), StepTimer(log_dir)]
    _fit(model, callbacks, jit_compile=True)  # StepTimer: seconds only
    _fit(model, callbacks, jit_compile=True)
    layouts = _layouts(os.path.join(log_dir, "train"))
    assert len(layouts) == 3
    assert _titles(layouts[-1]) == {
        "gradients": ["global norm", "log10 global norm"],
        "weights": ["log10 largest update ratio in each group of variables",
                    "fraction of variables with update ratio above 0.01"],
        "timing": ["seconds per execution and per step: input, compute"],
        EVERY: ["weight update ratio of every variable"]}
    norm, _, seconds, _ = (c.chart[0] for c in layouts[-1].category)
    assert list(norm.multiline.tag) == ["^gradients/(.+/)?global_norm$"]
    assert [t for t in SECONDS if re.match(seconds.multiline.tag[0], t)] == SECONDS[:2]


def test_a_layout_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    def fail(self, step, summary):
        raise OSError("No space left on device")

    monkeypatch.setattr(_events.EventWriter, "write_summary", fail)
    log_dir = str(tmp_path / "logs")
    grads, weights = GradientStatistics(log_dir), WeightStatistics(log_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(_tapped_model(), [grads, weights])
    layout_warnings = [str(w.message) for w in caught if LAYOUT_WARNING in str(w.message)]
    assert len(layout_warnings) == 1
    assert "GradientStatistics" in layout_warnings[0]
    assert "No space left on device" in layout_warnings[0]
    assert grads.history.step.tolist() == list(range(1, len(X) // BATCH + 1))
    tags = {v.tag for path in glob.glob(os.path.join(log_dir, "train", "events.out.*"))
            for e in event_file_loader.EventFileLoader(path).Load() for v in e.summary.value}
    assert "gradients/global_norm" in tags and metadata.CONFIG_SUMMARY_TAG not in tags


@pytest.mark.parametrize("callback", [
    lambda d: GradientStatistics(d, strict=True),
    lambda d: StepTimer(d, strict=True),
    lambda d: StopOnRule(log_dir=d, strict=True, verbose=False),
], ids=["GradientStatistics", "StepTimer", "StopOnRule"])
def test_strict_raises_when_the_layout_cannot_be_written(tmp_path, monkeypatch, callback):
    def fail(self, step, summary):
        raise OSError("No space left on device")

    monkeypatch.setattr(_events.EventWriter, "write_summary", fail)
    with pytest.raises(_events.RecordingError, match=re.escape(
            "could not record: kerasdbg could not write the TensorBoard custom-scalars layout "
            f"to {str(tmp_path / 'logs' / 'train')!r}; the fit stops (`strict=True`). Cause: "
            "OSError: No space left on device")) as raised:
        _fit(_tapped_model(), [callback(str(tmp_path / "logs"))])
    assert isinstance(raised.value.__cause__, OSError)
