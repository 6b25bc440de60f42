#!/usr/bin/env bash
# The two set-up commands of the README:
#   ./run.sh demo [--out DIR]   trains the demo with the instruments, writes a TensorBoard log dir
#   ./run.sh test [PYTEST ARGS] runs the whole test suite
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
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[cpu,test]"
  echo "$wanted" > "$stamp"
fi

export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
case "$command" in
  demo) exec "$venv/bin/kerasdbg" demo "$@" ;;
  test) exec "$venv/bin/python" -m pytest "$@" ;;
  *) usage ;;
esac
