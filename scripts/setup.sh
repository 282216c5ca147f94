#!/usr/bin/env bash
# Create .venv with PyTorch 2.13.0 (CPU build) and megascale installed in editable mode.
# Usage: bash scripts/setup.sh [--test]   (--test adds the test tools)
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0"
  "${PIP[@]}" "torch==2.13.0"
fi
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
echo "setup: installing megascale${extra} and its dependencies"
"${PIP[@]}" -e ".${extra}"
# An editable install compiles nothing: without this, where PYTHONDONTWRITEBYTECODE is set (as in
# many containers) every process -- each rank, standby and self-check -- recompiles megascale's
# sources, ~0.4 s of CPU each.
.venv/bin/python -m compileall -q -j 0 megascale
echo "setup: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
