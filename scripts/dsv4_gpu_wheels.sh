#!/usr/bin/env bash
# What vLLM's DeepSeek-V4 path needs on an NVIDIA GPU machine beyond vLLM itself: tilelang (its mHC
# kernels) with its dependencies; the CuTe DSL (nvidia-cutlass-dsl with its CUDA 13 libraries, and
# quack-kernels) for the C4/C128 compressor kernels; and the CUDA 13 compiler pieces that tilelang's
# and DeepGEMM's JITs call (nvcc, cicc and libdevice, the crt headers, CUDA and CCCL headers).
# DeepGEMM (the FP8 linears, the mHC pre-norm GEMM and the indexer) ships inside vLLM. The JIT caches
# land in .cache/compile (rollout.compile_cache). Set VLLM_DEEP_GEMM_WARMUP=skip on a cold cache: its
# default warm-up compiles ~2,500 GEMM kernels, 20-30 minutes on an H200 (docs/deepseek_v4.md).
# Downloads cp312 wheels into .device/dsv4/g0..gN (each under 60 MiB, one per command sent there;
# a larger wheel travels as .partNN pieces that install.sh joins) and writes .device/dsv4/install.sh.
# On the machine, after copying every group to /tmp/vb/dsv4/:
#   bash .device/dsv4/install.sh /tmp/vb/tl      # then, in every command:
#   export PYTHONPATH=/tmp/vb/tl:/tmp/vb/tl/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH \
#     CUDA_HOME=/tmp/vb/tl/nvidia/cu13 PATH=/tmp/vb/tl/nvidia/cu13/bin:$PATH
# (the CuTe DSL's `cutlass` package lives under dsl_packages/, which its .pth file adds to sys.path
# only in a site directory; a --target folder on PYTHONPATH needs it spelled out)
set -euo pipefail
out=.device/dsv4; rm -rf "$out"; mkdir -p "$out/all"
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
  --platform manylinux2010_x86_64 -d "$out/all" \
  tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 ml-dtypes==0.6.0 z3-solver==4.15.4.0 \
  nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85 \
  nvidia-cuda-runtime==13.0.96 \
  nvidia-cutlass-dsl==4.6.0 nvidia-cutlass-dsl-libs-base==4.6.0 nvidia-cutlass-dsl-libs-core==4.6.0 \
  nvidia-cutlass-dsl-libs-cu13==4.6.0 nvidia-cuda-nvdisasm==13.3.73 quack-kernels==0.6.0 cuda-python==13.0.3 \
  compressed-tensors==0.17.0 loguru==0.7.3
# compressed-tensors (with loguru): vLLM imports it whenever a checkpoint declares a quantization,
# as the released FP8 one does.
# vLLM 0.26 pins nvidia-cutlass-dsl[cu13]==4.6.0; quack-kernels 0.6.0 is the release made for it.
for f in "$out"/all/*.whl; do  # wheels over 50 MiB travel in pieces
  if [ "$(stat -c %s "$f")" -gt $((50 * 2**20)) ]; then split -b 50M -d "$f" "$f.part" && rm "$f"; fi
done
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
cd /tmp/vb/dsv4
for p in *.whl.part00; do
  if [ -e "$p" ]; then cat "${p%.part00}".part* > "${p%.part00}"; rm "${p%.part00}".part*; fi
done
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$target" /tmp/vb/dsv4/*.whl
cu="$target/nvidia/cu13"
mkdir -p "$cu/targets" && ln -sfn .. "$cu/targets/x86_64-linux"
for d in "$cu"/include/cccl/*; do [ -e "$cu/include/$(basename "$d")" ] || ln -s "cccl/$(basename "$d")" "$cu/include/"; done
# FlashInfer's JIT (vLLM's FP8 block-scale GEMM on SM90) links with -L$CUDA_HOME/lib64 -lcudart: the
# runtime wheel ships lib/libcudart.so.13 only (without these links that build failed at first use).
[ -e "$cu/lib64" ] || ln -s lib "$cu/lib64"
[ -e "$cu/lib/libcudart.so" ] || ln -s libcudart.so.13 "$cu/lib/libcudart.so"
# The machine's own CUDA wheels (beside torch) hold headers these do not (nvrtc.h, cublasLt.h, which
# FlashInfer's JIT includes): link each one that is missing.
for base in $(python3 -c 'import nvidia; print(*nvidia.__path__)'); do
  if [ "$base" != "$target/nvidia" ] && [ -d "$base/cu13/include" ]; then
    for h in "$base"/cu13/include/*; do [ -e "$cu/include/$(basename "$h")" ] || ln -s "$h" "$cu/include/"; done
  fi
done
"$cu/bin/nvcc" --version | tail -1
echo "export PYTHONPATH=$target:$target/nvidia_cutlass_dsl/dsl_packages:\$PYTHONPATH CUDA_HOME=$cu PATH=$cu/bin:\$PATH"
SH
chmod +x "$out/install.sh"
