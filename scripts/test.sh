#!/usr/bin/env bash
# Set up and run the whole test suite (what CI runs). Installs the system services the tests
# use (redis-server, chromium) from Debian's packages when running as root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
if [ "$(id -u)" = 0 ]; then
  bash scripts/install_system_deps.sh
fi
export OMP_NUM_THREADS=1
.venv/bin/python -m ruff check megascale tests bench
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
