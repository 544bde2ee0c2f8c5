#!/usr/bin/env bash
# Installs (.venv, see setup_env.sh) and runs the test suite. Extra arguments go to pytest,
# e.g. `scripts/test.sh tests/unit -x`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "${@:-tests}"
