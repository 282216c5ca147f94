#!/usr/bin/env bash
# Set up and run the checks and the test suite (what CI runs: .ci/run, the whole suite).
#   bash scripts/test.sh [--fast] [pytest args]
# --fast runs the fast subset (-m "not slow": no test marked slow, i.e. none of the multi-rank
# tests over ~20 s). Test files run on MEGASCALE_TEST_WORKERS pytest-xdist workers (default 3; 0
# runs them in this process), a file's tests on one worker in order, the files in the order
# tests/conftest.py gives them. Most tests wait on heartbeats, timeouts and child processes: with
# 2 workers on 2 cores the machine was idle half of the time. Installs the system services the
# tests use (redis-server, chromium) from Debian's packages when running as root.
set -euo pipefail
cd "$(dirname "$0")/.."
marks=""
if [ "${1:-}" = "--fast" ]; then
  shift
  marks="not slow"
fi
stage() { echo "test.sh: $1 at $SECONDS s"; }  # where the suite's time goes, against its 30-minute limit
deps_pid=""
if [ "$(id -u)" = 0 ]; then  # apt beside pip: both spend their time on downloads and disk
  deps_log=$(mktemp)
  bash scripts/install_system_deps.sh >"$deps_log" 2>&1 &
  deps_pid=$!
fi
bash scripts/setup.sh --test
if [ -n "$deps_pid" ]; then
  deps_rc=0
  wait "$deps_pid" || deps_rc=$?
  cat "$deps_log" && rm -f "$deps_log"
  [ "$deps_rc" = 0 ] || exit "$deps_rc"
fi
stage "set up"
export OMP_NUM_THREADS=1
.venv/bin/python -m ruff check megascale tests bench
.venv/bin/python -m ruff format --check megascale tests bench
# mypy (the package, as pyproject.toml's [tool.mypy] says) spends a minute or more on one core
# reading torch's sources: it runs beside the first test phase, which leaves cores idle.
mypy_log=$(mktemp)
.venv/bin/python -m mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
# Two phases: everything but the tests marked serial on the workers, then those alone (they measure
# CPU costs, speeds or detection bounds, and a neighbour's load would move them). A phase that finds no test is
# fine when the other ran some; both finding none is pytest's exit code 5, a failure.
# --durations: the slowest tests of each phase, printed, so the suite's time can be kept under its limit
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25)
set +e
"${pytest[@]}" -n "${MEGASCALE_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder -m "${marks:+$marks and }not serial" "$@"
first=$?
stage "first phase"
wait "$mypy_pid"
mypy_rc=$?
echo "mypy:" && cat "$mypy_log" && rm -f "$mypy_log"
"${pytest[@]}" -m "${marks:+$marks and }serial" "$@"
second=$?
stage "serial phase"
set -e
if [ "$first" = 5 ] && [ "$second" = 5 ]; then exit 5; fi
for rc in "$mypy_rc" "$first" "$second"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
