#!/usr/bin/env bash
# What vLLM's DeepSeek-V4 path needs on an NVIDIA GPU machine beyond vLLM itself: tilelang (its mHC
# kernels) with its dependencies, and the CUDA 13 compiler pieces that tilelang's and DeepGEMM's
# JITs call (nvcc, cicc and libdevice, the crt headers, CUDA and CCCL headers). DeepGEMM (the
# o-projection, the mHC pre-norm GEMM and the indexer) ships inside vLLM.
# Downloads cp312 wheels into .device/dsv4/g0..gN (each under 60 MiB, one per command sent there)
# and writes .device/dsv4/install.sh. On the machine, after copying every group to /tmp/vb/dsv4/:
#   bash .device/dsv4/install.sh /tmp/vb/tl      # then, in every command:
#   export PYTHONPATH=/tmp/vb/tl:$PYTHONPATH CUDA_HOME=/tmp/vb/tl/nvidia/cu13 PATH=/tmp/vb/tl/nvidia/cu13/bin:$PATH
set -euo pipefail
out=.device/dsv4; rm -rf "$out"; mkdir -p "$out/all"
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
  --platform manylinux2010_x86_64 -d "$out/all" \
  tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 ml-dtypes==0.6.0 z3-solver==4.15.4.0 \
  nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85 \
  nvidia-cuda-runtime==13.0.96
# First-fit, largest first, into groups of at most 60 MiB.
python3 - "$out" <<'PY'
import os, shutil, sys
out = sys.argv[1]
files = sorted(os.listdir(f"{out}/all"), key=lambda f: -os.path.getsize(f"{out}/all/{f}"))
groups = []
for f in files:
    size = os.path.getsize(f"{out}/all/{f}")
    g = next((g for g in groups if g[0] + size <= 60 * 2**20), None)
    if g is None:
        g = [0, []]
        groups.append(g)
    g[0] += size
    g[1].append(f)
for i, (size, names) in enumerate(groups):
    os.makedirs(f"{out}/g{i}")
    for f in names:
        shutil.move(f"{out}/all/{f}", f"{out}/g{i}/{f}")
    print(f"{out}/g{i}: {size / 2**20:.1f} MiB, {', '.join(names)}")
PY
rmdir "$out/all"
cat > "$out/install.sh" <<'SH'
#!/usr/bin/env bash
# Installs /tmp/vb/dsv4/*.whl into $1 (one pip call: pip --target skips a package folder that
# already exists, and the CUDA wheels share nvidia/cu13), then gives nvidia/cu13 the toolkit
# layout the compilers expect: nvcc.profile looks for headers under targets/x86_64-linux/, and
# NVRTC (DeepGEMM's fallback) finds CCCL only directly under include/.
set -euo pipefail
target="${1:-/tmp/vb/tl}"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$target" /tmp/vb/dsv4/*.whl
cu="$target/nvidia/cu13"
mkdir -p "$cu/targets" && ln -sfn .. "$cu/targets/x86_64-linux"
for d in "$cu"/include/cccl/*; do [ -e "$cu/include/$(basename "$d")" ] || ln -s "cccl/$(basename "$d")" "$cu/include/"; done
"$cu/bin/nvcc" --version | tail -1
echo "export PYTHONPATH=$target:\$PYTHONPATH CUDA_HOME=$cu PATH=$cu/bin:\$PATH"
SH
chmod +x "$out/install.sh"
