#!/usr/bin/env bash
# Installs (.venv, see setup_env.sh) and runs the test suite. Extra arguments go to pytest,
# e.g. `scripts/test.sh tests/unit -x`.
# Without arguments the whole suite runs on two pytest-xdist workers (a module's tests stay on one
# worker, the modules with slow tests are handed out first: tests/conftest.py), then the modules
# that start Ray run alone. TEST_WORKERS=N changes the count; TEST_WORKERS=0 runs in one process.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh"
cd "$root"
py="$root/.venv/bin/python"
if [ $# -eq 0 ]; then
  # Two phases: everything but the Ray modules on the xdist workers, then the Ray modules alone in
  # one process (a Ray node gives its raylet a fixed 30 s to start; tests/conftest.py).
  rc=0
  TEST_RAY_MODULES=skip "$py" -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder tests || rc=$?
  TEST_RAY_MODULES=only "$py" -m pytest tests || rc=$((rc ? rc : $?))
  exit "$rc"
fi
exec "$py" -m pytest "$@"
