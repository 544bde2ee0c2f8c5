#!/usr/bin/env bash
# Pre-flight of a node, before pulling the image or starting Ray: GPUs and driver, GPU memory,
# RDMA devices, open-file and memlock limits, /dev/shm, Docker, Ray, free disk for checkpoints.
# Prints one table with a verdict per line (ok / warn / FAIL) and exits 1 when something would
# block a run (2 on a usage error).
#   scripts/check_host.sh [--cpu-ok] [--checkpoints DIR] [--min-disk-gib N] [--min-shm-gib N]
#                         [--min-gpu-mem-gib N]
#   --cpu-ok             no GPU is not a failure (the tiny CPU recipes, scripts/smoke.sh)
#   --checkpoints DIR    where checkpoints will be written [COLOCATE_RL_CHECKPOINTS or ./runs]
#   --min-disk-gib N     free space needed there [100]
#   --min-shm-gib N      /dev/shm size needed [1]; below 16 GiB is a warning
#   --min-gpu-mem-gib N  memory each GPU needs [0: report only]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

cpu_ok=0
checkpoints="${COLOCATE_RL_CHECKPOINTS:-runs}"
min_disk_gib=100
min_shm_gib=1
min_gpu_mem_gib=0
while [ "$#" -gt 0 ]; do
  case "$1" in
    --cpu-ok) cpu_ok=1 ;;
    --checkpoints) checkpoints="${2:?--checkpoints needs a value}"; shift ;;
    --min-disk-gib) min_disk_gib="${2:?--min-disk-gib needs a value}"; shift ;;
    --min-shm-gib) min_shm_gib="${2:?--min-shm-gib needs a value}"; shift ;;
    --min-gpu-mem-gib) min_gpu_mem_gib="${2:?--min-gpu-mem-gib needs a value}"; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1 (see scripts/check_host.sh --help)" >&2; exit 2 ;;
  esac
  shift
done
for n in "$min_disk_gib" "$min_shm_gib" "$min_gpu_mem_gib"; do
  [[ "$n" =~ ^[0-9]+$ ]] || { echo "error: '$n' is not a whole number of GiB" >&2; exit 2; }
done

rows=()
failed=0
# row CHECK VERDICT VALUE [NOTE]
row() {
  rows+=("$1"$'\x1f'"$2"$'\x1f'"$3"$'\x1f'"${4:-}")
  [ "$2" = FAIL ] && failed=$((failed + 1))
  return 0
}
have() { command -v "$1" >/dev/null 2>&1; }
gib() { echo $(($1 / 1073741824)); }  # bytes -> whole GiB

# --- GPUs: AMD through the amdgpu/KFD sysfs (no tool needed), NVIDIA through nvidia-smi ---
gpu_kind=none; gpu_count=0
if [ -d /sys/class/kfd/kfd/topology/nodes ]; then
  # KFD lists CPUs and GPUs as topology nodes; GPUs are those with SIMD units.
  for props in /sys/class/kfd/kfd/topology/nodes/*/properties; do
    simd="$(awk '$1 == "simd_count" {print $2}' "$props" 2>/dev/null)"
    [ "${simd:-0}" -gt 0 ] && gpu_count=$((gpu_count + 1))
  done
  [ "$gpu_count" -gt 0 ] && gpu_kind=amd
fi
if [ "$gpu_kind" = none ] && have nvidia-smi; then
  gpu_count="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')"
  [ "$gpu_count" -gt 0 ] && gpu_kind=nvidia
fi

case "$gpu_kind" in
  amd)
    tool="$(for t in amd-smi rocm-smi; do have "$t" && echo "$t" && break; done)"
    driver="$(cat /sys/module/amdgpu/version 2>/dev/null || modinfo -F version amdgpu 2>/dev/null || echo "in-kernel")"
    row gpus ok "$gpu_count AMD" "amdgpu driver ${driver:-?}; ${tool:-no amd-smi/rocm-smi (only needed for monitoring)}"
    if [ -r /dev/kfd ] && [ -w /dev/kfd ]; then
      row /dev/kfd ok "read/write"
    else
      row /dev/kfd FAIL "no access" "add the user to the video and render groups"
    fi
    mem=""
    for f in /sys/class/drm/card*/device/mem_info_vram_total; do
      [ -r "$f" ] && mem="$(gib "$(cat "$f")")" && break
    done
    ;;
  nvidia)
    driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1)"
    row gpus ok "$gpu_count NVIDIA" "driver ${driver:-?}"
    mem="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n1)"
    [ -n "$mem" ] && mem=$((mem / 1024))
    ;;
  *)
    mem=""
    if [ "$cpu_ok" = 1 ]; then
      row gpus ok "none" "CPU mode (--cpu-ok): tiny recipes only"
    else
      row gpus FAIL "none" "no AMD GPU in /sys/class/kfd and no nvidia-smi; install the driver, or pass --cpu-ok"
    fi
    ;;
esac
if [ "$gpu_kind" != none ]; then
  if [ -z "$mem" ]; then
    row gpu-memory warn "unknown" "could not read it"
  elif [ "$mem" -lt "$min_gpu_mem_gib" ]; then
    row gpu-memory FAIL "${mem} GiB/GPU" "needs ${min_gpu_mem_gib} GiB"
  else
    row gpu-memory ok "${mem} GiB/GPU"
  fi
fi
# AMD's tuning guides for MI300-class nodes: automatic NUMA balancing stalls GPU memory traffic.
if [ "$gpu_kind" = amd ] && [ "$(cat /proc/sys/kernel/numa_balancing 2>/dev/null || echo 0)" != 0 ]; then
  row numa-balancing warn "on" "sudo sysctl kernel.numa_balancing=0"
fi

# --- RDMA (multi-node RCCL/NCCL) ---
rdma=0; active=0
for dev in /sys/class/infiniband/*; do
  [ -e "$dev" ] || continue
  rdma=$((rdma + 1))
  grep -qs ACTIVE "$dev"/ports/*/state && active=$((active + 1))
done
if [ "$rdma" -eq 0 ]; then
  row rdma warn "none" "single node only: multi-node runs fall back to TCP sockets"
elif [ "$active" -eq 0 ]; then
  row rdma warn "$rdma devices, 0 active" "check the links (ibstat / rdma link)"
else
  row rdma ok "$active of $rdma active"
fi

# --- limits (the container gets its own from docker/run.sh; bare-metal runs use these) ---
nofile="$(ulimit -n)"; nofile_hard="$(ulimit -Hn)"
if [ "$nofile" = unlimited ] || [ "$nofile" -ge 65536 ]; then
  row open-files ok "$nofile"
elif [ "$nofile_hard" = unlimited ] || [ "$nofile_hard" -ge 65536 ]; then
  row open-files warn "$nofile (hard $nofile_hard)" "ulimit -n $nofile_hard before a bare-metal Ray start"
else
  row open-files warn "$nofile (hard $nofile_hard)" "Ray on many nodes needs >= 65536: raise nofile in limits.conf"
fi
memlock="$(ulimit -l)"
if [ "$memlock" = unlimited ]; then
  row memlock ok "unlimited"
elif [ "$rdma" -gt 0 ]; then
  row memlock warn "$memlock KiB" "RDMA registers pinned buffers: set memlock unlimited"
else
  row memlock ok "$memlock KiB" "no RDMA here"
fi

# --- /dev/shm (the container shares the host's: run.sh uses --ipc=host) ---
shm_kib="$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $2}')"
if [ -z "$shm_kib" ]; then
  row /dev/shm FAIL "missing" "Ray's object store and torch IPC need it"
else
  shm_gib=$((shm_kib / 1048576))
  if [ "$shm_gib" -lt "$min_shm_gib" ]; then
    row /dev/shm FAIL "${shm_gib} GiB" "needs ${min_shm_gib} GiB"
  elif [ "$shm_gib" -lt 16 ]; then
    row /dev/shm warn "${shm_gib} GiB" "large models' Ray object store wants more (16+ GiB)"
  else
    row /dev/shm ok "${shm_gib} GiB"
  fi
fi

# --- Docker and Ray ---
if have docker; then
  client="$(docker version --format '{{.Client.Version}}' 2>/dev/null | head -n1)"
  if timeout 10 docker info >/dev/null 2>&1; then
    row docker ok "${client:-?}" "daemon reachable"
  else
    row docker warn "${client:-?}" "daemon not reachable (not running, or no permission: docker group)"
  fi
else
  row docker warn "absent" "needed for docker/run.sh; bare-metal runs do without"
fi
want_ray="$(sed -n 's/^ *"ray==\([^"]*\)".*/\1/p' "$root/pyproject.toml" | head -n1)"
py="${PYTHON:-}"
[ -z "$py" ] && [ -x "$root/.venv/bin/python" ] && py="$root/.venv/bin/python"
py="${py:-python3}"
ray_version="$("$py" -c 'from importlib.metadata import version; print(version("ray"))' 2>/dev/null)"
if [ -z "$ray_version" ]; then
  row ray warn "absent" "not in $py: the image has it (bare metal: pip install ray==$want_ray)"
elif [ -n "$want_ray" ] && [ "$ray_version" != "$want_ray" ]; then
  row ray warn "$ray_version" "project pins $want_ray: every node must run the same version"
else
  row ray ok "$ray_version"
fi

# --- free disk where checkpoints go (its nearest existing parent) ---
case "$checkpoints" in /*) dir="$checkpoints" ;; *) dir="$PWD/${checkpoints#./}" ;; esac
while [ ! -d "$dir" ]; do dir="$(dirname "$dir")"; done
free_kib="$(df -Pk "$dir" | awk 'NR == 2 {print $4}')"
free_gib=$((free_kib / 1048576))
if [ "$free_gib" -lt "$min_disk_gib" ]; then
  row disk FAIL "${free_gib} GiB free" "at $dir; needs ${min_disk_gib} GiB (--min-disk-gib)"
else
  row disk ok "${free_gib} GiB free" "at $dir"
fi

# --- the table ---
printf '%-15s %-7s %-22s %s\n' CHECK VERDICT VALUE NOTE
for r in "${rows[@]}"; do
  IFS=$'\x1f' read -r check verdict value note <<< "$r"
  printf '%-15s %-7s %-22s %s\n' "$check" "$verdict" "$value" "$note"
done
if [ "$failed" -gt 0 ]; then
  echo "verdict: BLOCKED ($failed failing check(s))"
  exit 1
fi
echo "verdict: ready"
