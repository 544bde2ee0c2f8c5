#!/usr/bin/env bash
# Installs (.venv, see setup_env.sh) and runs the test suite. Extra arguments go to pytest,
# e.g. `scripts/test.sh tests/unit -x`.
# Without arguments the whole suite runs on two pytest-xdist workers: a module's tests stay on one
# worker, the Ray modules share one, and the modules with slow tests are handed out first
# (tests/conftest.py). TEST_WORKERS=N changes the count; TEST_WORKERS=0 runs in one process.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh"
cd "$root"
if [ $# -eq 0 ]; then
  set -- -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder tests
fi
exec "$root/.venv/bin/python" -m pytest "$@"
