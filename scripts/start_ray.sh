#!/usr/bin/env bash
# Starts this node of a Ray cluster (head or worker) with its GPUs and visible-device variables,
# prints the address to join, and stops exactly the processes it started.
#   scripts/start_ray.sh head   [--port 6379] [options] [-- extra `ray start` arguments]
#   scripts/start_ray.sh worker --address HEAD_IP:PORT [options] [-- ...]
#   scripts/start_ray.sh stop   [--state-dir DIR]
# Options:
#   --num-gpus N          GPUs this node offers [the visible-device list, else all GPUs found]
#   --num-cpus N          CPUs this node offers [all]
#   --node-ip-address IP  the address other nodes reach this one by [Ray's choice]
#   --state-dir DIR       where the started process group and address are recorded
#                         [$COLOCATE_RL_CACHE/ray-node, else ~/.cache/colocate_rl/ray-node]
#   --token-file PATH     the cluster's authentication token [$COLOCATE_RL_RAY_TOKEN_FILE, else
#                         <state dir>/auth_token]; the head creates it (random, mode 0600) when it
#                         does not exist and uses it as it is when it does; a worker only reads it
#   --dashboard-host IP   the address the head's dashboard listens on [127.0.0.1: this machine only]
#   --block               stay in the foreground until stopped (a container's main process)
#
# Authentication: every node runs with Ray's token authentication on (RAY_AUTH_MODE=token), so
# that only a holder of the token can join the cluster, submit work or call the dashboard's APIs;
# anyone else who reaches an unauthenticated Ray port can run code on every node. Copy the head's
# token file to each node that joins (mode 0600, e.g. with scp) and pass it with --token-file; a
# driver names it with placement.ray_token_file. The token reaches Ray as a file path
# (RAY_AUTH_TOKEN_PATH), never on a command line, in the environment or in this script's output.
# Delete the file to have the next head start with a new token.
#
# Stopping: the node's daemons are started in one new session and process group, whose id is
# recorded; `stop` signals the processes of that group and their descendants (the raylet gives
# each Ray worker a group of its own), nothing else. `ray stop` would kill every Ray process of
# the machine, other clusters and test runs included.
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }
mode="${1:-}"
case "$mode" in head|worker|stop) shift ;; -h|--help|"") sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) die "first argument must be head, worker or stop, not '$mode'" ;; esac

port=6379; address=""; num_gpus=""; num_cpus=""; node_ip=""; block=0
token_file="${COLOCATE_RL_RAY_TOKEN_FILE:-}"; dashboard_host=127.0.0.1
state="${COLOCATE_RL_CACHE:-$HOME/.cache/colocate_rl}/ray-node"
while [ "$#" -gt 0 ]; do
  case "$1" in
    --port) port="${2:?--port needs a value}"; shift ;;
    --address) address="${2:?--address needs a value}"; shift ;;
    --num-gpus) num_gpus="${2:?--num-gpus needs a value}"; shift ;;
    --num-cpus) num_cpus="${2:?--num-cpus needs a value}"; shift ;;
    --node-ip-address) node_ip="${2:?--node-ip-address needs a value}"; shift ;;
    --state-dir) state="${2:?--state-dir needs a value}"; shift ;;
    --token-file) token_file="${2:?--token-file needs a value}"; shift ;;
    --dashboard-host) dashboard_host="${2:?--dashboard-host needs a value}"; shift ;;
    --block) block=1 ;;
    --) shift; break ;;
    *) die "unknown argument $1 (see scripts/start_ray.sh --help)" ;;
  esac
  shift
done
extra=("$@")
pgid_file="$state/pgid"; address_file="$state/address"; log="$state/ray-start.log"
token_file="${token_file:-$state/auth_token}"
case "$token_file" in /*) ;; *) token_file="$PWD/$token_file" ;; esac  # Ray's processes read it from elsewhere

# The live (not zombie) processes of process group $1 and all their descendants, one pid a line.
# Descendants matter: the raylet puts each Ray worker in a process group of its own.
node_pids() {
  local p stat fields want="$1" found=1
  local -A ppid_of=() pgrp_of=() keep=()
  for p in /proc/[0-9]*; do
    stat="$(cat "$p/stat" 2>/dev/null)" || continue
    read -r -a fields <<< "${stat##*) }"  # after the command name: state ppid pgrp ...
    [ "${fields[0]}" = Z ] && continue
    ppid_of[${p#/proc/}]="${fields[1]}"; pgrp_of[${p#/proc/}]="${fields[2]}"
  done
  for p in "${!pgrp_of[@]}"; do [ "${pgrp_of[$p]}" = "$want" ] && keep[$p]=1; done
  while [ "$found" = 1 ]; do
    found=0
    for p in "${!ppid_of[@]}"; do
      if [ -z "${keep[$p]:-}" ] && [ -n "${keep[${ppid_of[$p]}]:-}" ]; then keep[$p]=1; found=1; fi
    done
  done
  for p in "${!keep[@]}"; do echo "$p"; done
}

# True when one of the pids (one a line) runs Ray.
runs_ray() {
  local p
  for p in $1; do
    grep -qs ray "/proc/$p/cmdline" && return 0
  done
  return 1
}

# SIGTERM to the pids in $2 (one a line), SIGKILL to those still running after $1 seconds.
terminate() {
  local left="$2" _
  [ -n "$left" ] || return 0
  # shellcheck disable=SC2086  # one pid per word
  kill -TERM $left 2>/dev/null || true
  for _ in $(seq 1 $(($1 * 4))); do
    left="$(alive "$left")"
    [ -z "$left" ] && return 0
    sleep 0.25
  done
  echo "  SIGKILL after ${1} s: $(tr '\n' ' ' <<< "$left")"
  # shellcheck disable=SC2086
  kill -KILL $left 2>/dev/null || true
}

stop_group() {
  local pgid pids p raylets="" gcs="" rest=""
  [ -f "$pgid_file" ] || { echo "no Ray node recorded in $state: nothing to stop"; return 0; }
  pgid="$(cat "$pgid_file")"
  pids="$(node_pids "$pgid")"
  if [ -z "$pids" ]; then
    echo "the recorded Ray node (process group $pgid) is not running"
  elif ! runs_ray "$pids"; then
    # The group id was reused by something else since: leave it alone.
    echo "process group $pgid has no Ray process any more: not touching it"
  else
    echo "stopping the Ray node of process group $pgid ($(wc -l <<< "$pids") processes)"
    # In `ray stop`'s order: raylet (its workers follow it), the other daemons, the GCS last.
    # The GCS does not exit on SIGTERM; with no raylet left it holds nothing worth a wait.
    for p in $pids; do
      case "$(cat "/proc/$p/comm" 2>/dev/null)" in
        raylet) raylets+="$p"$'\n' ;;
        gcs_server) gcs+="$p"$'\n' ;;
        *) rest+="$p"$'\n' ;;
      esac
    done
    terminate 5 "$raylets"
    terminate 5 "$rest"
    terminate 1 "$gcs"
  fi
  rm -f "$pgid_file" "$address_file"
}

# The pids of $1 (one a line) that are still running (zombies are done).
alive() {
  local p stat
  for p in $1; do
    stat="$(cat "/proc/$p/stat" 2>/dev/null)" || continue
    [ "$(echo "${stat##*) }" | cut -d' ' -f1)" = Z ] || echo "$p"
  done
  return 0
}

if [ "$mode" = stop ]; then
  stop_group
  exit 0
fi

if [ -f "$pgid_file" ] && [ -n "$(node_pids "$(cat "$pgid_file")")" ]; then
  die "a Ray node started from $state is still running (process group $(cat "$pgid_file")); scripts/start_ray.sh stop --state-dir $state"
fi
[ "$mode" = worker ] && [ -z "$address" ] && die "worker needs --address HEAD_IP:PORT (printed by the head)"
command -v ray >/dev/null 2>&1 || die "ray is not on PATH (the image has it; bare metal: pip install ray)"
mkdir -p "$state"

# --- authentication token: created by the head where missing, read from a file by every process ---
if [ "$mode" = head ] && [ ! -e "$token_file" ]; then
  mkdir -p "$(dirname "$token_file")"
  # 256 random bits as hex, written through a pipe (never an argument) to a file that is 0600 from
  # its creation on (umask), then renamed into place so that no reader sees half a token.
  if ! (umask 077 && head -c 32 /dev/urandom | od -An -v -tx1 | tr -d ' \n' > "$token_file.new"); then
    die "cannot write the token file $token_file"
  fi
  mv -f "$token_file.new" "$token_file"
  echo "[start_ray] new authentication token written to $token_file (mode 0600)"
fi
[ -f "$token_file" ] || die "no token file $token_file: copy the head's token file here (mode 0600) and pass --token-file PATH"
[ -s "$token_file" ] || die "the token file $token_file is empty"
token_mode="$(stat -c %a "$token_file")"
if [ $((8#$token_mode & 8#077)) != 0 ]; then
  die "the token file $token_file is open to other users (mode $token_mode): chmod 600 $token_file"
fi
# The file is the one source of the token: a RAY_AUTH_TOKEN variable would take precedence in Ray
# (and show in every Ray process's environment).
unset RAY_AUTH_TOKEN
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$token_file"

# --- visible devices: one list under every name the stack reads (see docker/entrypoint.sh) ---
if [ -z "${HIP_VISIBLE_DEVICES:-}${CUDA_VISIBLE_DEVICES:-}" ] && [ -n "${ROCR_VISIBLE_DEVICES:-}" ]; then
  IFS=, read -r -a rocr <<< "$ROCR_VISIBLE_DEVICES"
  HIP_VISIBLE_DEVICES="$(seq -s, 0 $((${#rocr[@]} - 1)))"
fi
visible="${HIP_VISIBLE_DEVICES:-${CUDA_VISIBLE_DEVICES:-}}"
if [ -n "${HIP_VISIBLE_DEVICES:-}" ] && [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ "$HIP_VISIBLE_DEVICES" != "$CUDA_VISIBLE_DEVICES" ]; then
  die "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES=$HIP_VISIBLE_DEVICES differ; set one"
fi
if [ -z "$num_gpus" ]; then
  if [ -n "$visible" ]; then
    IFS=, read -r -a ids <<< "$visible"; num_gpus="${#ids[@]}"
  else
    num_gpus=0
    for props in /sys/class/kfd/kfd/topology/nodes/*/properties; do  # AMD: GPUs have SIMD units
      simd="$(awk '$1 == "simd_count" {print $2}' "$props" 2>/dev/null || true)"
      [ "${simd:-0}" -gt 0 ] && num_gpus=$((num_gpus + 1))
    done
    if [ "$num_gpus" = 0 ] && command -v nvidia-smi >/dev/null 2>&1; then
      num_gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
    fi
  fi
fi
if [ -z "$visible" ] && [ "$num_gpus" -gt 0 ]; then
  visible="$(seq -s, 0 $((num_gpus - 1)))"
fi
if [ -n "$visible" ]; then
  export CUDA_VISIBLE_DEVICES="$visible" HIP_VISIBLE_DEVICES="$visible"
fi
# The launcher sets the visible devices of each actor itself (colocate_rl/placement/ray_colocated.py).
export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=1 \
  RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES=1
# Ray opens a socket per worker and per connection.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

args=(start --num-gpus "$num_gpus" --disable-usage-stats)
[ -n "$num_cpus" ] && args+=(--num-cpus "$num_cpus")
[ -n "$node_ip" ] && args+=(--node-ip-address "$node_ip")
if [ "$mode" = head ]; then
  args+=(--head --port "$port" --dashboard-host "$dashboard_host")
else
  args+=(--address "$address")
fi
[ "$block" = 1 ] && args+=(--block)
args+=("${extra[@]}")

# setsid: a new session and process group whose id is this launcher's pid, inherited by every
# process `ray start` spawns (GCS, raylet, workers): that id is what `stop` signals.
echo "[start_ray] ray ${args[*]}  (log: $log)"
# shellcheck disable=SC2016  # $$ and $@ belong to the inner bash
setsid bash -c 'echo "$$" > "$0"; exec ray "$@"' "$pgid_file" "${args[@]}" > "$log" 2>&1 &
launcher=$!

started=0
for _ in $(seq 1 240); do
  if grep -qs "Ray runtime started" "$log"; then started=1; break; fi
  kill -0 "$launcher" 2>/dev/null || break
  sleep 0.5
done
if [ "$started" = 0 ]; then
  tail -n 30 "$log" >&2
  stop_group >/dev/null
  die "ray start did not come up (log above: $log)"
fi
[ "$block" = 1 ] || wait "$launcher"

ip="${node_ip:-$(sed -n 's/.*Local node IP: *\([0-9a-fA-F.:]*\).*/\1/p' "$log" | head -n1)}"
if [ "$mode" = head ]; then
  echo "${ip}:${port}" > "$address_file"
  echo "[start_ray] head up: address ${ip}:${port}, $num_gpus GPUs (visible: ${visible:-none})"
  echo "  token file:         $token_file (copy it to each node that joins; keep it mode 0600)"
  echo "  join another node:  scripts/start_ray.sh worker --address ${ip}:${port} --token-file $token_file"
  echo "  run on the cluster: python recipes/<recipe>.py preset=NAME placement.ray_address=${ip}:${port}" \
       "placement.ray_token_file=$token_file"
else
  echo "$address" > "$address_file"
  echo "[start_ray] worker up at ${ip:-?}, joined $address with $num_gpus GPUs (visible: ${visible:-none})"
fi
echo "  stop this node:     scripts/start_ray.sh stop --state-dir $state"

if [ "$block" = 1 ]; then
  trap 'stop_group; exit 0' INT TERM
  wait "$launcher" || true
  stop_group
fi
