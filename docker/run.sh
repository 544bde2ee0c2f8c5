#!/usr/bin/env bash
# Pulls the project image and runs a recipe (or any command) in it with the GPU, IPC, limits and
# mounts that the colocated loop needs. On one node this is the whole command:
#   docker/run.sh recipes/qwen3_grpo.py preset=qwen3-8b steps=100
# Everything after the options goes to the container unchanged; `*.py` runs with python3 and
# `*.sh` with bash (see docker/entrypoint.sh); no arguments opens a shell.
#
# Options (environment defaults in brackets):
#   --rocm | --cuda        platform [COLOCATE_RL_PLATFORM; else /dev/kfd -> rocm, nvidia-smi -> cuda]
#   --image REF            image [$COLOCATE_RL_IMAGE:<version>-<platform>, where COLOCATE_RL_IMAGE
#                          defaults to ghcr.io/colocate-rl/colocate-rl and <version> is pyproject's]
#   --data DIR             datasets, mounted at /data [COLOCATE_RL_DATA or ./data]
#   --checkpoints DIR      run folders (metrics, config, checkpoints), mounted over the project's
#                          runs/ [COLOCATE_RL_CHECKPOINTS or ./runs]
#   --hf-cache DIR         Hugging Face cache, mounted at /root/.cache/huggingface [HF_HOME or
#                          ~/.cache/huggingface]
#   --shm-size SIZE        /dev/shm size when the IPC namespace is private [64g]
#   --name NAME            container name (e.g. to `docker exec` into a Ray node)
#   --detach               run in the background (a Ray node: ... scripts/start_ray.sh head --block)
#   --env NAME[=VALUE]     one more variable for the container (repeatable)
#   --ray-token-file PATH  the Ray cluster's token file (scripts/start_ray.sh --help), mounted
#                          read-only at /run/secrets/colocate_rl_ray_token and named to the
#                          container by COLOCATE_RL_RAY_TOKEN_FILE; created (random, mode 0600)
#                          where missing, so the first node's command makes it: copy it to the
#                          other nodes [COLOCATE_RL_RAY_TOKEN_FILE]
#   --no-pull              use the local image as it is
#   --dry-run              print the docker commands, one per line, instead of running them
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "error: $*" >&2; exit 2; }
abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/${1#./}" ;; esac; }

platform="${COLOCATE_RL_PLATFORM:-}"
image=""
data="${COLOCATE_RL_DATA:-data}"
checkpoints="${COLOCATE_RL_CHECKPOINTS:-runs}"
hf_cache="${HF_HOME:-$HOME/.cache/huggingface}"
shm_size=64g
name=""
detach=0
pull=1
dry_run=0
extra_env=()
ray_token_file="${COLOCATE_RL_RAY_TOKEN_FILE:-}"

while [ "$#" -gt 0 ]; do
  case "$1" in
    --rocm) platform=rocm ;;
    --cuda) platform=cuda ;;
    --image) image="${2:?--image needs a value}"; shift ;;
    --data) data="${2:?--data needs a value}"; shift ;;
    --checkpoints) checkpoints="${2:?--checkpoints needs a value}"; shift ;;
    --hf-cache) hf_cache="${2:?--hf-cache needs a value}"; shift ;;
    --shm-size) shm_size="${2:?--shm-size needs a value}"; shift ;;
    --name) name="${2:?--name needs a value}"; shift ;;
    --detach) detach=1 ;;
    --env) extra_env+=(-e "${2:?--env needs a value}"); shift ;;
    --ray-token-file) ray_token_file="${2:?--ray-token-file needs a value}"; shift ;;
    --no-pull) pull=0 ;;
    --dry-run) dry_run=1 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see docker/run.sh --help)" ;;
    *) break ;;
  esac
  shift
done

if [ -z "$platform" ]; then
  if [ -e /dev/kfd ]; then platform=rocm
  elif command -v nvidia-smi >/dev/null 2>&1; then platform=cuda
  else die "no GPU platform found (no /dev/kfd, no nvidia-smi); pass --rocm or --cuda"
  fi
fi
case "$platform" in rocm|cuda) ;; *) die "COLOCATE_RL_PLATFORM=$platform is not rocm or cuda" ;; esac

if [ -z "$image" ]; then
  version="$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$root/pyproject.toml" | head -n1)"
  [ -n "$version" ] || die "no version in $root/pyproject.toml"
  image="${COLOCATE_RL_IMAGE:-ghcr.io/colocate-rl/colocate-rl}:${version}-${platform}"
fi
data="$(abspath "$data")"; checkpoints="$(abspath "$checkpoints")"; hf_cache="$(abspath "$hf_cache")"
[ -n "$ray_token_file" ] && ray_token_file="$(abspath "$ray_token_file")"

run=(docker run --rm)
if [ "$detach" = 1 ]; then run+=(--detach)
elif [ -t 0 ] && [ -t 1 ]; then run+=(--interactive --tty)
fi
[ -n "$name" ] && run+=(--name "$name")
# Host network: Ray and RCCL connect nodes by the host's addresses and RDMA NICs.
# Host IPC: vLLM and the actor hand each other GPU memory by IPC handles, and Ray's object store
# and torch's shared tensors live in /dev/shm; --shm-size applies only where host IPC is refused.
run+=(--network=host --ipc=host "--shm-size=$shm_size")
# Ray opens a socket per worker and connection; RDMA registers (locks) large buffers.
run+=(--ulimit nofile=1048576:1048576 --ulimit memlock=-1:-1 --ulimit stack=67108864:67108864)
# torch's IPC of expandable-segment memory uses pidfd_getfd, which needs ptrace rights.
run+=(--cap-add=SYS_PTRACE)
if [ "$platform" = rocm ]; then
  # /dev/kfd is the compute interface, /dev/dri the GPUs' render nodes; both owned by video or
  # render. seccomp: ROCm's NUMA-aware allocations use syscalls (mbind, ...) Docker's profile blocks.
  run+=(--device=/dev/kfd --device=/dev/dri --group-add video --security-opt seccomp=unconfined)
  # The render group has no fixed name or id across distributions: add the node's own gid.
  for node in /dev/dri/renderD*; do
    [ -e "$node" ] || continue
    gid="$(stat -c %g "$node")"
    [ "$gid" = "$(getent group video | cut -d: -f3)" ] || run+=(--group-add "$gid")
    break
  done
else
  run+=(--gpus all)
fi
# RDMA NICs for RCCL/NCCL across nodes.
[ -d /dev/infiniband ] && run+=(--device=/dev/infiniband)
run+=(-v "$data:/data" -v "$checkpoints:/workspace/colocate_rl/runs" -v "$hf_cache:/root/.cache/huggingface")
# Passed by name only: docker copies the host's value, which is never printed here.
for var in HF_TOKEN WANDB_API_KEY WANDB_MODE HIP_VISIBLE_DEVICES CUDA_VISIBLE_DEVICES ROCR_VISIBLE_DEVICES \
           NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA NCCL_IB_GID_INDEX NCCL_DEBUG; do
  [ -n "${!var:-}" ] && run+=(-e "$var")
done
# The Ray token by file only: its path is on the command line, its text never is.
if [ -n "$ray_token_file" ]; then
  secret=/run/secrets/colocate_rl_ray_token
  run+=(-v "$ray_token_file:$secret:ro" -e "COLOCATE_RL_RAY_TOKEN_FILE=$secret")
fi
run+=("${extra_env[@]}" "$image" "$@")

if [ "$dry_run" = 1 ]; then
  [ "$pull" = 1 ] && printf '%q ' docker pull "$image" | sed 's/ $//' && echo
  printf '%q ' "${run[@]}" | sed 's/ $//'
  echo
  exit 0
fi
command -v docker >/dev/null 2>&1 || die "docker is not installed (scripts/check_host.sh lists what a run needs)"
mkdir -p "$data" "$checkpoints" "$hf_cache"  # else Docker creates them, owned by root
if [ -n "$ray_token_file" ]; then
  if [ ! -e "$ray_token_file" ]; then  # else Docker would mount a new, root-owned folder there
    mkdir -p "$(dirname "$ray_token_file")"
    # 256 random bits as hex through a pipe into a file that is 0600 from its creation on.
    (umask 077 && head -c 32 /dev/urandom | od -An -v -tx1 | tr -d ' \n' > "$ray_token_file")
    echo "[run] new Ray token written to $ray_token_file (mode 0600): copy it to the other nodes" >&2
  fi
  if [ ! -f "$ray_token_file" ] || [ ! -s "$ray_token_file" ]; then
    die "the Ray token file $ray_token_file is not a file or is empty"
  fi
  [ $((8#$(stat -c %a "$ray_token_file") & 8#077)) = 0 ] || die "the Ray token file $ray_token_file is open to other users: chmod 600 $ray_token_file"
fi
[ "$pull" = 1 ] && docker pull "$image"
exec "${run[@]}"
