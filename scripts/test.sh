#!/usr/bin/env bash
# Set up and run the checks and the test suite (what CI runs: .ci/run, the whole suite).
#   bash scripts/test.sh [--fast] [pytest args]
# --fast runs the fast subset (-m "not slow": no test marked slow, i.e. none of the multi-rank
# tests over ~20 s). Test files run on MEGASCALE_TEST_WORKERS pytest-xdist workers (default 2; 0
# runs them in this process), a file's tests on one worker in order: many tests wait on
# heartbeats, timeouts and child processes, and a second worker fills those waits. Installs the
# system services the tests use (redis-server, chromium) from Debian's packages when running as root.
set -euo pipefail
cd "$(dirname "$0")/.."
marks=""
if [ "${1:-}" = "--fast" ]; then
  shift
  marks="not slow"
fi
bash scripts/setup.sh --test
if [ "$(id -u)" = 0 ]; then
  bash scripts/install_system_deps.sh
fi
export OMP_NUM_THREADS=1
.venv/bin/python -m ruff check megascale tests bench
.venv/bin/python -m ruff format --check megascale tests bench
.venv/bin/python -m mypy  # the package, as pyproject.toml's [tool.mypy] says
# Two phases: everything but the tests marked serial on the workers, then those alone (they measure
# CPU costs, speeds or detection bounds, and a neighbour's load would move them). A phase that finds no test is
# fine when the other ran some; both finding none is pytest's exit code 5, a failure.
# --durations: the slowest tests of each phase, printed, so the suite's time can be kept under its limit
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25)
set +e
"${pytest[@]}" -n "${MEGASCALE_TEST_WORKERS:-2}" --dist loadfile -m "${marks:+$marks and }not serial" "$@"
first=$?
"${pytest[@]}" -m "${marks:+$marks and }serial" "$@"
second=$?
set -e
if [ "$first" = 5 ] && [ "$second" = 5 ]; then exit 5; fi
for rc in "$first" "$second"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
