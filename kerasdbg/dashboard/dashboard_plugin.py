"""`DashboardPlugin`: kerasdbg's own dashboard in TensorBoard."""

from __future__ import annotations

import json
import os
import time
import warnings

from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from kerasdbg import report as _report
from kerasdbg.dashboard import _data

PLUGIN_NAME = "kerasdbg"
"""The plugin's name: its tab in TensorBoard, its routes under `/data/plugin/kerasdbg/`."""

_STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
_ACTIVE_FOR_S = 10.0  # how long `is_active`'s answer is kept (TensorBoard asks at each load)


class DashboardPlugin(base_plugin.TBPlugin):
    """kerasdbg's TensorBoard dashboard: per run, which layer went wrong and when.

    TensorBoard loads it from the `tensorboard_plugins` entry point that
    kerasdbg's install declares, also where TensorBoard runs without
    TensorFlow; its tab, "kerasdbg", is listed when a run under `--logdir`
    holds kerasdbg's records. Per run it draws, without a click:

    - what went wrong and where: the first NaN/Inf step and the layer
      `NaNSource` located, the first verdict, the skipped steps;
    - the loss and the global gradient norm, with the verdicts, the skipped
      steps, the rollbacks and the first NaN/Inf step marked at their steps;
    - layer x step heatmaps of the gradient norm and the update ratio (log
      scale) and of the taps' dead and saturated fractions, a NaN/Inf cell
      marked in its own colour, a step not recorded left blank; the layers of
      a large model (ResNet50's 107) in groups by name, each expandable;
    - two runs side by side, from their first divergence (what
      `kerasdbg report A B` computes).

    Its data routes answer JSON: `runs`, `run?run=<name>` and
    `compare?a=<name>&b=<name>` (see `kerasdbg.dashboard._data`).

    Args:
        context: TensorBoard's `TBContext` (its `logdir` is read).

    Examples:
        >>> import tempfile
        >>> from tensorboard.plugins import base_plugin
        >>> from kerasdbg.dashboard import DashboardPlugin
        >>> plugin = DashboardPlugin(base_plugin.TBContext(logdir=tempfile.mkdtemp()))
        >>> plugin.plugin_name, plugin.is_active()
        ('kerasdbg', False)
    """

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        self._logdir = context.logdir or ""
        self._active = (0.0, False)

    def is_active(self) -> bool:
        """Whether a run under the log directory holds kerasdbg's records."""
        at, active = self._active
        if time.monotonic() - at < _ACTIVE_FOR_S:
            return active
        try:
            active = bool(self._logdir) and os.path.isdir(self._logdir) \
                and _data.has_runs(self._logdir)
        except Exception as error:  # noqa: BLE001 - a listing must not fail TensorBoard's
            warnings.warn(f"kerasdbg dashboard: could not read {self._logdir!r}: {error}",
                          stacklevel=2)
            active = False
        self._active = (time.monotonic(), active)
        return active

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="kerasdbg")

    def get_plugin_apps(self) -> dict:
        return {"/index.js": self._index_js, "/runs": self._runs, "/run": self._run,
                "/compare": self._compare}

    @wrappers.Request.application
    def _index_js(self, request):
        with open(os.path.join(_STATIC, "index.js"), "rb") as file:
            return http_util.Respond(request, file.read(), "text/javascript")

    def _json(self, request, make):
        """`make()` as JSON; a run that is not one as 400 with the reason, any
        other failure as 500 with it (TensorBoard goes on)."""
        try:
            body = json.dumps(make(), allow_nan=False)  # a NaN is "nan" (`_data.value`)
            return http_util.Respond(request, body, "application/json")
        except (_report.NotARunError, FileNotFoundError) as error:
            return http_util.Respond(request, json.dumps({"error": str(error)}),
                                     "application/json", code=400)
        except Exception as error:  # noqa: BLE001 - said to the page, not raised in the server
            return http_util.Respond(
                request, json.dumps({"error": f"{type(error).__name__}: {error}"}),
                "application/json", code=500)

    @wrappers.Request.application
    def _runs(self, request):
        return self._json(request, lambda: {"logdir": self._logdir,
                                            "runs": _data.runs(self._logdir)})

    @wrappers.Request.application
    def _run(self, request):
        name = request.args.get("run")
        if not name:
            return http_util.Respond(request, json.dumps(
                {"error": "the route `run` takes `?run=<a run's name>`"}), "application/json",
                code=400)
        return self._json(request, lambda: _data.run(self._logdir, name))

    @wrappers.Request.application
    def _compare(self, request):
        a, b = request.args.get("a"), request.args.get("b")
        if not a or not b:
            return http_util.Respond(request, json.dumps(
                {"error": "the route `compare` takes `?a=<run>&b=<run>`"}), "application/json",
                code=400)
        return self._json(request, lambda: _data.compare(self._logdir, a, b))
