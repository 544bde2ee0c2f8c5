#!/usr/bin/env bash
# Installs (.venv, see setup_env.sh) and runs the embedded default: GRPO on a tiny Qwen3-shaped
# model learning 1-digit addition on CPU, through the real colocated loop (vLLM + Megatron +
# weight sync). Extra key=value arguments override the recipe, e.g. `scripts/quickstart.sh steps=10`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" recipes/qwen3_grpo.py preset=tiny "$@"
