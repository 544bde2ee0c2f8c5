#!/usr/bin/env bash
# Entrypoint of the images: makes the visible-device variables agree, raises the open-file
# limit, then runs the command (default: bash). `recipes/X.py ...` runs with python3.
set -euo pipefail

# One list of GPUs under every name the stack reads: torch on ROCm reads HIP_VISIBLE_DEVICES,
# torch on CUDA and vLLM read CUDA_VISIBLE_DEVICES. A scheduler may set only one of them, or only
# ROCR_VISIBLE_DEVICES (Slurm on AMD); Ray refuses to start with ROCR_ alone, and HIP indices
# count within the ROCr set, so that case becomes 0..n-1.
if [ -z "${HIP_VISIBLE_DEVICES:-}" ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ] && [ -n "${ROCR_VISIBLE_DEVICES:-}" ]; then
  IFS=, read -r -a rocr <<< "$ROCR_VISIBLE_DEVICES"
  HIP_VISIBLE_DEVICES="$(seq -s, 0 $((${#rocr[@]} - 1)))"
fi
if [ -n "${HIP_VISIBLE_DEVICES:-}" ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
  export HIP_VISIBLE_DEVICES CUDA_VISIBLE_DEVICES="$HIP_VISIBLE_DEVICES"
elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ -z "${HIP_VISIBLE_DEVICES:-}" ] && [ -e /dev/kfd ]; then
  export HIP_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"
elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ -n "${HIP_VISIBLE_DEVICES:-}" ] && [ "$CUDA_VISIBLE_DEVICES" != "$HIP_VISIBLE_DEVICES" ]; then
  echo "error: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES=$HIP_VISIBLE_DEVICES differ; set one" >&2
  exit 2
fi

# Ray opens a socket per worker and per connection; the 1024 default runs out on large clusters.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

if [ "$#" -eq 0 ]; then
  set -- bash
fi
case "$1" in
  *.py) exec python3 "$@" ;;
  *.sh) exec bash "$@" ;;
  *) exec "$@" ;;
esac
