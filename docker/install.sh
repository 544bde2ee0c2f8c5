#!/usr/bin/env bash
# Runs inside `docker build` (docker/Dockerfile.rocm, docker/Dockerfile.cuda), from the project
# copy: installs megatron-core, Ray and this project into the base image's Python without
# replacing the image's own torch, vLLM, triton or AITER builds.
# Reads MEGATRON_CORE_VERSION, RAY_VERSION, OMEGACONF_VERSION (the Dockerfiles' ARGs) and PYTHON.
set -euo pipefail
: "${MEGATRON_CORE_VERSION:?}" "${RAY_VERSION:?}" "${OMEGACONF_VERSION:?}"
py="${PYTHON:-python3}"  # the base image's interpreter (the one its torch and vLLM are in)
pip=("$py" -m pip install --no-cache-dir --disable-pip-version-check)
keep=/tmp/colocate-rl-constraints.txt

# The base image's torch/vLLM/triton/AITER are built for its ROCm or CUDA; PyPI has other
# builds under the same names. Constrain each to the installed version so that no dependency
# of ours can swap one out, and add our own pins (a disagreement fails here, at build time).
"$py" - > "$keep" <<'EOF'
import re
from importlib import metadata

image_builds = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch-triton.*|vllm|.*aiter.*|flash[-_]attn.*|amdsmi|nvidia-.*)$")
seen = set()
for dist in metadata.distributions():
    name = (dist.metadata["Name"] or "").lower()
    if name and name not in seen and image_builds.match(name):
        seen.add(name)
        print(f"{name}=={dist.version}")
EOF
printf '%s\n' "megatron-core==${MEGATRON_CORE_VERSION}" "ray==${RAY_VERSION}" "omegaconf==${OMEGACONF_VERSION}" >> "$keep"
echo "[install] keeping the image's builds:"; sed 's/^/  /' "$keep"

# megatron-core: its dependencies are torch, numpy and packaging, all in the image already.
if ! "${pip[@]}" --no-deps "megatron-core==${MEGATRON_CORE_VERSION}"; then
  # PyPI has megatron-core wheels for CPython 3.12 and 3.13 only. Their one compiled file is
  # Megatron's dataset-index helper (megatron/core/datasets/helpers_cpp), which this project
  # does not use, so on a newer CPython the 3.13 wheel's Python files are unpacked as they are.
  "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.13 \
    "megatron-core==${MEGATRON_CORE_VERSION}" -d /tmp/megatron-wheel
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$py" -m zipfile -e /tmp/megatron-wheel/megatron_core-*.whl "$site"
  rm -rf /tmp/megatron-wheel
fi

# The project (editable, so a mounted checkout over /workspace/colocate_rl is what runs) with its
# pinned dependencies (ray, omegaconf, ...) and the test extra (pytest and the offline tokenizers
# used by tests/gpu and scripts/gpu_checks.sh).
"${pip[@]}" -c "$keep" -e ".[test]"

# Fail the build, not the first run, when a pin did not take.
"$py" - <<EOF
from importlib import metadata
want = {"megatron-core": "${MEGATRON_CORE_VERSION}", "ray": "${RAY_VERSION}", "omegaconf": "${OMEGACONF_VERSION}"}
got = {name: metadata.version(name) for name in want}
bad = {name: (got[name], want[name]) for name in want if got[name] != want[name]}
assert not bad, f"installed != pinned: {bad}"
import megatron.core, ray, colocate_rl  # noqa: F401,E401
image = {}
for name in ("torch", "vllm"):
    try:
        image[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        image[name] = "?"
print("[install] ok:", ", ".join(f"{n}=={v}" for n, v in {**got, **image}.items()))
EOF
