"""`kerasdbg.records`: the one owner of tag names.

Every tag a recorded run holds (read with TensorBoard's own `EventAccumulator`) is one that
`kerasdbg.records.tags` takes apart and builds back to itself, with parts that name the model's
variables and taps; the tags the callbacks document are all there, spelled here by hand; and no
module outside `records/` holds a tag literal (a scan of the source).
"""

import ast
import doctest
import importlib
import os
import pathlib
import re

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing import plugin_event_accumulator

from kerasdbg import stats
from kerasdbg.callbacks import (ActivationStatistics, GradientStatistics, StepTimer, StopOnRule,
                                WeightStatistics)
from kerasdbg.layers import TapLayer
from kerasdbg.records import tags
from kerasdbg.rules import ClassImbalance, NonFiniteLoss

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kerasdbg"

# The first parts of kerasdbg's tags, spelled out here (not read from records).
COLLECTIONS = ("gradients", "applied_gradients", "weights", "activations", "step", "epoch",
               "time", "faults", "classes", "replicas", "rules")
WEIGHT_STATS = ["l2_norm", "update_ratio"]
TAP_STATS = ["mean", "std"]
CLASSES = 3
BATCH = 4


def _model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,), name="x")
    hidden = keras.layers.Dense(5, activation="relu", name="hidden")(inputs)
    hidden = TapLayer(stats=TAP_STATS, activation="relu", histogram=True, name="hidden_tap")(hidden)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", name="out")(hidden)
    model = keras.Model(inputs, outputs, name="m")
    # Clipping: the applied gradients and `gradients/clipped` are recorded too.
    model.compile(keras.optimizers.SGD(0.05, clipnorm=1.0), "sparse_categorical_crossentropy")
    return model


def _callbacks(log_dir):
    return [GradientStatistics(log_dir, every_n_steps=1, histogram_every_n_steps=1),
            WeightStatistics(log_dir, every_n_steps=1, histogram_every_n_steps=1,
                             stats=WEIGHT_STATS),
            ActivationStatistics(log_dir), StepTimer(log_dir),
            StopOnRule([ClassImbalance(), NonFiniteLoss()], log_dir=log_dir, verbose=False)]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """`(model, {plugin: {tag}})`: every tag of a healthy fit and of a second fit of the model
    stopped at a NaN batch (its faults and its verdict), as TensorBoard reads them."""
    log_dir = str(tmp_path_factory.mktemp("records") / "logs")
    model = _model()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = np.arange(16) % CLASSES
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=_callbacks(log_dir))
    x[-1, 0] = np.nan
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=_callbacks(log_dir))
    written = {}
    runs = sorted({root for root, _, files in os.walk(log_dir)
                   if any("tfevents" in f for f in files)})
    assert runs, log_dir
    for run in runs:
        accumulator = plugin_event_accumulator.EventAccumulator(
            run, size_guidance={"tensors": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["tensors"]:
            plugin = accumulator.SummaryMetadata(tag).plugin_data.plugin_name
            written.setdefault(plugin, set()).add(tag)
    return model, written


def test_every_tag_of_a_recorded_run_parses_into_its_parts_and_rebuilds_to_itself(recorded):
    model, written = recorded
    # TensorBoard's own layout tag, written by the custom-scalars plugin's format.
    assert written.pop("custom_scalars") == {"custom_scalars__config__"}
    assert set(written) == set(tags.PLUGINS), written.keys()
    paths = {v.path for v in model.trainable_variables}
    forms = set()
    for plugin, found in written.items():
        for tag in found:
            parsed = tags.parse(tag, plugin)
            assert parsed is not None, (plugin, tag)
            assert tags.build(parsed) == tag, (plugin, tag, parsed)
            forms.add(parsed.form)
            parts = parsed.parts
            if parsed.form in ("statistic", "tensor"):
                collection, tensor = parts[:2]
                expected = {"activations": {"hidden_tap"},
                            "classes": {str(k) for k in range(CLASSES)}}.get(collection, paths)
                assert tensor in expected, (tag, parts)
            if parsed.form == "statistic" and parts[0] in ("gradients", "applied_gradients"):
                assert parts[2] in stats.STATISTICS, tag
            if parsed.form == "per_optimizer":
                assert parts[2] is None, tag  # one optimizer: the short tags
    assert forms == {"statistic", "per_optimizer", "scalar", "fault", "tensor", "VERDICTS", "view"}


def test_the_documented_tags_are_written_and_are_what_the_builders_make(recorded):
    model, written = recorded
    paths = [v.path for v in model.trainable_variables]
    # The tags the guides document, spelled by hand.
    by_hand = {
        "scalars": {f"gradients/{p}/{s}" for p in paths for s in stats.STATISTICS}
        | {f"applied_gradients/{p}/{s}" for p in paths for s in stats.STATISTICS}
        | {f"weights/{p}/{s}" for p in paths for s in WEIGHT_STATS}
        | {f"activations/hidden_tap/{s}" for s in TAP_STATS + ["dead_fraction"]}
        | {f"classes/{k}/{c}" for k in range(CLASSES) for c in ("seen", "mispredicted")}
        | {"gradients/global_norm", "gradients/clipped", "applied_gradients/global_norm",
           "step/loss", "step/frozen", "step/fault", "epoch/loss", "time/step_seconds",
           "faults/nan_source/located", "faults/nan_source/layer/x"}
        # The NaN input reaches `hidden/kernel`'s gradient whatever the CPU; whether it
        # goes past the ReLU depends on the kernel (a fused oneDNN ReLU may give 0 for NaN).
        | {"faults/nan_source/gradient/hidden/kernel"},
        "histograms": {f"{kind}/{p}" for kind in ("gradients", "weights") for p in paths}
        | {"activations/hidden_tap"},
        "text": {"rules/verdicts"},
    }
    for plugin, expected in by_hand.items():
        assert expected <= written[plugin], (plugin, sorted(expected - written[plugin]))
    built = {
        "scalars": {tags.statistic(tags.GRADIENTS, p, s) for p in paths for s in stats.STATISTICS}
        | {tags.statistic(tags.APPLIED_GRADIENTS, p, s) for p in paths for s in stats.STATISTICS}
        | {tags.statistic(tags.WEIGHTS, p, s) for p in paths for s in WEIGHT_STATS}
        | {tags.statistic(tags.ACTIVATIONS, "hidden_tap", s) for s in TAP_STATS + ["dead_fraction"]}
        | {tags.statistic(tags.CLASSES, str(k), c) for k in range(CLASSES)
           for c in ("seen", "mispredicted")}
        | {tags.per_optimizer(tags.GRADIENTS, tags.GLOBAL_NORM, None),
           tags.per_optimizer(tags.GRADIENTS, tags.CLIPPED, None),
           tags.per_optimizer(tags.APPLIED_GRADIENTS, tags.GLOBAL_NORM, None),
           tags.LOSS, tags.step_scalar("frozen"), tags.step_scalar("fault"),
           tags.epoch_scalar("loss"), tags.scalar(tags.TIME, "step_seconds"),
           tags.fault("nan_source", "located"), tags.fault("nan_source", "layer", "x")}
        | {tags.fault("nan_source", "gradient", "hidden/kernel")},
        "histograms": {tags.tensor(kind, p) for kind in (tags.GRADIENTS, tags.WEIGHTS)
                       for p in paths} | {tags.tensor(tags.ACTIVATIONS, "hidden_tap")},
        "text": {tags.VERDICTS},
    }
    assert built == by_hand


@pytest.mark.parametrize("tag, plugin, parts", [
    ("gradients/d_optimizer/global_norm", "scalars",
     ("per_optimizer", ("gradients", "global_norm", "d_optimizer"))),
    ("gradients/discriminator.optimizer/clipped", "scalars",
     ("per_optimizer", ("gradients", "clipped", "discriminator.optimizer"))),
    ("step/g_optimizer/weight_decay_fraction", "scalars",
     ("per_optimizer", ("step", "weight_decay_fraction", "g_optimizer"))),
    ("replicas/m/d/kernel/spread", "scalars", ("statistic", ("replicas", "m/d/kernel", "spread"))),
    ("faults/freeze/applied_before/d_optimizer", "scalars",
     ("fault", ("freeze", "applied_before", "d_optimizer"))),
    ("faults/freeze/max_gradient_norm", "scalars", ("fault", ("freeze", "max_gradient_norm", None))),
    ("applied_gradients/m/d/kernel", "histograms", ("tensor", ("applied_gradients", "m/d/kernel"))),
    ("epoch/val_loss", "scalars", ("scalar", ("epoch", "val_loss"))),
], ids=["global-norm-per-optimizer", "clipped-per-optimizer", "decay-per-optimizer",
        "replica-spread", "freeze-per-optimizer", "freeze-limit", "applied-histogram", "epoch"])
def test_the_tags_a_small_run_does_not_write_parse_and_rebuild(tag, plugin, parts):
    parsed = tags.parse(tag, plugin)
    assert (parsed.form, parsed.parts) == parts
    assert tags.build(parsed) == tag


@pytest.mark.parametrize("tag, plugin", [
    ("epoch_loss", "scalars"), ("custom_scalars__config__", "scalars"), ("loss/x", "scalars"),
    ("step/loss", "histograms"), ("epoch_accuracy", "text"), ("gradients/kernel", "scalars"),
], ids=["keras-epoch-log", "layout", "other-collection", "scalar-as-histogram", "other-text",
        "no-statistic"])
def test_a_tag_that_is_not_kerasdbgs_does_not_parse(tag, plugin):
    assert tags.parse(tag, plugin) is None


def test_the_report_patterns_select_the_same_tags_as_the_regular_expressions_they_replace():
    """`kerasdbg report`'s tables read `Run.scalar_table` (`re.fullmatch`): the patterns
    built in records select what the hand-written expressions did, applied gradients apart."""
    candidates = ["step/loss", "epoch/loss", "epoch/val_loss", "epoch/accuracy", "step/d_loss",
                  "gradients/global_norm", "gradients/opt/global_norm",
                  "applied_gradients/global_norm", "gradients/m/d/kernel/l2_norm",
                  "applied_gradients/m/d/kernel/l2_norm", "gradients/m/d/kernel/nan_count",
                  "gradients/m/d/kernel/inf_count", "gradients/m/d/kernel/zero_count",
                  "weights/m/d/kernel/update_ratio", "weights/m/d/kernel/l2_norm",
                  "activations/t/dead_fraction", "activations/t/saturated_fraction",
                  "activations/t/std", "activations/t/mean", "time/step_seconds"]
    pairs = [
        (r"step/loss|epoch/loss|epoch/val_loss",
         tags.any_pattern([tags.scalar_pattern(tags.STEP, ["loss"]),
                           tags.scalar_pattern(tags.EPOCH, ["loss", "val_loss"])])),
        (r"gradients/(.+/)?global_norm", tags.per_optimizer_pattern(tags.GRADIENTS, "global_norm")),
        (r"gradients/.+/l2_norm", tags.statistic_pattern(tags.GRADIENTS, "l2_norm")),
        (r"gradients/.+/(nan|inf)_count",
         tags.statistic_pattern(tags.GRADIENTS, ["nan_count", "inf_count"])),
        (r"weights/.+/update_ratio", tags.statistic_pattern(tags.WEIGHTS, "update_ratio")),
        (r"activations/.+/(dead_fraction|saturated_fraction|std)",
         tags.statistic_pattern(tags.ACTIVATIONS, ["dead_fraction", "saturated_fraction", "std"])),
    ]
    for old, new in pairs:
        assert ([t for t in candidates if re.fullmatch(old, t)]
                == [t for t in candidates if re.fullmatch(new, t)]), (old, new)
        # Anchored: the Scalars tab's filter (`re.search`) selects the same tags.
        assert ([t for t in candidates if re.fullmatch(old, t)]
                == [t for t in candidates if re.search(new, t)]), (old, new)


def test_the_helpers_take_tags_apart_as_documented():
    assert tags.tensor_name("gradients/m/d/kernel/mean") == "gradients/m/d/kernel"
    assert tags.tensor_name("gradients/global_norm") == "gradients/global_norm"
    assert tags.tensor_name("classes/0/seen") == "classes/0/seen"
    assert tags.statistic_of("gradients/m/d/kernel", "gradients/m/d/kernel/mean") == "mean"
    assert tags.statistic_of("gradients/m/d", "gradients/m/d/kernel/mean") is None
    assert tags.scalar_parts("step/loss") == ("step", "loss")
    assert tags.scalar_parts("gradients/m/d/kernel/mean") is None
    assert tags.scalar_name("faults/nan_source/located") == "nan_source/located"
    assert tags.tensor_of("weights/m/d/kernel/update_ratio") == "m/d/kernel"
    assert tags.is_per_optimizer("gradients/clipped", "gradients", "clipped")
    assert tags.is_per_optimizer("gradients/d_optimizer/clipped", "gradients", "clipped")
    assert not tags.is_per_optimizer("applied_gradients/clipped", "gradients", "clipped")
    assert tags.column("activations/tap/mean", "activations") == "tap/mean"
    assert tags.tag_pattern("classes", "seen", "<k>") == "classes/<k>/seen"
    assert tags.tag_pattern("step", "loss") == "step/loss"
    assert tags.tag_pattern("gradients", "global_norm") == "gradients/global_norm"
    assert tags.KERASDBG_PREFIXES == ("gradients/", "weights/", "activations/", "step/",
                                      "epoch/", "classes/")


@pytest.mark.parametrize("module", ["kerasdbg.records", "kerasdbg.records.tags",
                                    "kerasdbg.records.step_record",
                                    "kerasdbg.records.capture_record",
                                    "kerasdbg.records.verdicts"])
def test_the_examples_of_the_records_modules_run(module):
    result = doctest.testmod(importlib.import_module(module),
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result


def _by_hand(record, collections, statistic):
    """`(tensor, value)` of the tags `<collection>/<tensor...>/<statistic>`, split by hand."""
    found = []
    for tag, value in record.items():
        head, *middle, last = tag.split("/")
        if head in collections and middle and last == statistic:
            found.append((head, "/".join(middle), value))
    return found


def test_a_step_record_reads_through_the_index_of_its_layout_what_its_tags_hold():
    from kerasdbg.records.step_record import (StepRecord, per_optimizer_values,
                                              statistics_by_tensor, values_of)
    rng = np.random.default_rng(0)
    stats_ = ("l2_norm", "mean", "zero_fraction")
    tags_ = [f"{c}/m/{layer}/{v}/{s}" for c in ("gradients", "weights")
             for layer in ("d", "block/conv") for v in ("kernel", "bias") for s in stats_]
    tags_ += ["step/loss", "step/g/skipped", "step/d/skipped", "step/skipped",
              "gradients/global_norm", "epoch/loss"]
    rows = [StepRecord(sorted(zip(tags_, rng.normal(size=len(tags_)).tolist())))
            for _ in range(3)]
    # One layout for the records of one set of tags in one order: worked out once.
    assert rows[0]._layout() is rows[1]._layout() is rows[2]._layout()
    for row in rows:
        plain = dict(row)
        for collection in ("gradients", "weights"):
            for stat in stats_:
                want = [(t, v) for c, t, v in _by_hand(plain, [collection], stat)]
                assert list(values_of(row, collection, stat)) == want
                assert list(values_of(plain, collection, stat)) == want
        want = {}
        for stat in ("l2_norm", "mean"):
            for collection, tensor, value in _by_hand(plain, ["weights"], stat):
                want.setdefault((collection, tensor), {})[stat] = value
        got = statistics_by_tensor(row, ["weights"], ["l2_norm", "mean"])
        assert got == want == statistics_by_tensor(plain, ["weights"], ["l2_norm", "mean"])
        skipped = [plain[t] for t in ("step/d/skipped", "step/g/skipped", "step/skipped")]
        assert per_optimizer_values(row, "step", "skipped") == skipped
        assert per_optimizer_values(plain, "step", "skipped") == skipped
    # Another set of tags: another layout, read alike.
    fewer = StepRecord({"weights/m/d/kernel/mean": 2.0, "step/loss": 1.0})
    assert fewer._layout() is not rows[0]._layout()
    assert list(values_of(fewer, "weights", "mean")) == [("m/d/kernel", 2.0)]
    assert per_optimizer_values(fewer, "step", "skipped") == []


# ------------------------------------------------------------------ the source
_TAG_HEAD = re.compile(r"^\^?(%s)/" % "|".join(COLLECTIONS))


def _docstrings(tree):
    """The string constants that are docstrings: of modules, classes, functions, and the
    attribute docstrings that follow an assignment."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            found.add(id(body[0].value))
        for before, after in zip(body, body[1:]):
            if isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(after, ast.Expr) \
                    and isinstance(after.value, ast.Constant):
                found.add(id(after.value))
    return found


def tag_literals(source: str):
    """`(line, text)` of each string constant or f-string head that begins with a tag
    collection and "/" (`"step/loss"`, `f"activations/{name}"`), docstrings left out."""
    tree = ast.parse(source)
    skipped = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skipped.update(id(v) for v in node.values)  # the f-string's head is checked whole
    found = []
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in skipped:
            text = node.value
        elif isinstance(node, ast.JoinedStr) and node.values \
                and isinstance(node.values[0], ast.Constant):
            text = node.values[0].value
        if text is not None and _TAG_HEAD.match(text):
            found.append((node.lineno, text))
    return found


def test_the_scan_finds_literals_and_f_string_heads_and_leaves_docstrings():
    source = '''
"""Module: `step/loss`."""
A = "gradients/global_norm"
"""Attribute docstring: weights/x."""
def f(name):
    """activations/x."""
    return f"epoch/{name}", "prose, not a tag: step", f"{name}/mean", r"^weights/.+/max$"
'''
    assert [text for _, text in tag_literals(source)] == [
        "gradients/global_norm", "epoch/", "^weights/.+/max$"]


def test_no_module_outside_records_holds_a_tag_literal():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "records") in path.parents:
            continue
        found += [f"{path.relative_to(ROOT)}:{line}: {text!r}"
                  for line, text in tag_literals(path.read_text(encoding="utf-8"))]
    assert not found, ("tags are built and parsed in kerasdbg/records/tags.py only; these "
                       "modules hold tag literals:\n" + "\n".join(found))
