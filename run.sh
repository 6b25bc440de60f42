#!/usr/bin/env bash
# The two set-up commands of the README:
#   ./run.sh demo [--out DIR]   trains the demo with the instruments, writes a TensorBoard log dir
#   ./run.sh test [PYTEST ARGS] runs the whole test suite: on TensorFlow, then tests/jax/ on
#                               JAX, each backend in its own process (and installs Debian's
#                               chromium, when missing, for the TensorBoard screenshot tests);
#                               with PYTEST ARGS, one run on $KERAS_BACKEND (TensorFlow by default)
# Each creates .venv (or $KERASDBG_VENV) and installs kerasdbg with what it
# needs, again whenever setup.cfg or pyproject.toml change.
set -euo pipefail
cd "$(dirname "$0")"

usage() { echo "usage: ./run.sh demo [--out DIR] | ./run.sh test [PYTEST ARGS]" >&2; exit 2; }
[ $# -ge 1 ] || usage
command=$1; shift

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
  echo "kerasdbg needs Python >= 3.10; found $("$python" --version 2>&1). Set PYTHON=..." >&2; exit 1; }

venv=${KERASDBG_VENV:-.venv}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
stamp="$venv/.kerasdbg-install"
wanted=$(cat setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
  echo "Installing kerasdbg and its dependencies into $venv (first run: a few minutes)..." >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[cpu,test,docs]"
  # keras-hub's models for the tests, without its tensorflow-text, which pins another
  # TensorFlow than tensorflow-cpu (the models the tests build need none); the rest of
  # its requirements are in the "test" extra.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "keras-hub>=0.32"
  echo "$wanted" > "$stamp"
fi

# The tests screenshot TensorBoard's dashboards with a headless Chromium:
# Debian's `chromium` package, installed here when missing and apt-get can.
have_browser() { command -v chromium || command -v chromium-browser || command -v google-chrome; } >/dev/null
ensure_browser() {
  have_browser && return 0
  local as_root=()
  if [ "$(id -u)" != 0 ]; then
    sudo -n true 2>/dev/null || { echo "run.sh: no chromium and no root to install it" \
      "(apt-get install chromium); the screenshot tests will fail and say so" >&2; return 0; }
    as_root=(sudo -n)
  fi
  command -v apt-get >/dev/null || { echo "run.sh: no chromium and no apt-get;" \
    "install a headless Chromium for the screenshot tests" >&2; return 0; }
  echo "Installing Debian's chromium for the TensorBoard screenshot tests..." >&2
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get install -y -qq chromium >/dev/null 2>&1 || {
    "${as_root[@]}" apt-get update -qq >/dev/null 2>&1 &&
    "${as_root[@]}" apt-get install -y -qq chromium >/dev/null 2>&1; } ||
    echo "run.sh: apt-get could not install chromium; the screenshot tests will fail and say so" >&2
}

export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
case "$command" in
  demo) exec "$venv/bin/kerasdbg" demo "$@" ;;
  test)
    ensure_browser
    if [ $# -gt 0 ]; then exec "$venv/bin/python" -m pytest "$@"; fi
    KERAS_BACKEND=tensorflow "$venv/bin/python" -m pytest
    echo "run.sh: the TensorFlow run passed; now tests/jax/ on the JAX backend" >&2
    KERAS_BACKEND=jax exec "$venv/bin/python" -m pytest tests/jax ;;
  *) usage ;;
esac
