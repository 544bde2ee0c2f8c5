#!/usr/bin/env bash
# Builds verl's side of benchmarks/peers/gpu_vs_verl.py for the H200 machine (no registry there):
# the wheels pinned in benchmarks/peers/verl_requirements.txt as chunks of at most $CHUNK_MB MiB
# (default 40, so that a chunk and the working tree fit one command's 64 MiB), plus the script that
# installs them there into a target folder of their own.
# Usage, from the project root:  bash scripts/verl_bundle.sh
# Writes .device/verl-p0 .. verl-pN and .device/verl-install.sh (.device/ is ignored by git).
# On the machine, after the project's bundle (../shared/gpu/make_bundle.sh --with-ray) is installed:
#   mkdir -p /tmp/verl && cp .device/verl-p* /tmp/verl/ && bash .device/verl-install.sh
# installs into /tmp/verl/site, which gpu_vs_verl.py puts first on the path of verl's process only.
set -euo pipefail
req=benchmarks/peers/verl_requirements.txt
sdist_only=antlr4-python3-runtime  # published without a wheel: built here (pure Python)
chunk_mb="${CHUNK_MB:-40}"
out=.device; mkdir -p "$out"; rm -f "$out"/verl-p[0-9]* "$out"/verl-install.sh
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mapfile -t pins < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$req" | grep -v '^$')
wheels=(); built=()
for p in "${pins[@]}"; do [[ "${p%%==*}" == "$sdist_only" ]] && built+=("$p") || wheels+=("$p"); done
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d "$work/whl" "${wheels[@]}"
[ ${#built[@]} -eq 0 ] || python3 -m pip wheel -q --no-deps --no-binary=:all: -w "$work/whl" "${built[@]}"
n_whl=$(ls "$work"/whl/*.whl | wc -l)
[ "$n_whl" = "${#pins[@]}" ] || { echo "got $n_whl wheels for ${#pins[@]} pins in $req" >&2; exit 1; }
size=$(du -cb "$work"/whl/*.whl | tail -1 | cut -f1)
tar -C "$work/whl" -cf "$work/verl.tar" .  # wheels are zip-compressed already
split -b "${chunk_mb}M" -d -a 1 "$work/verl.tar" "$out/verl-p"
sum=$(sha256sum "$work/verl.tar" | cut -c1-16)
n=$(ls "$out"/verl-p[0-9]* | wc -l)
cat > "$out/verl-install.sh" <<EOS
#!/usr/bin/env bash
# On the device, once every chunk is in /tmp/verl: assembles, checks, installs into /tmp/verl/site.
set -euo pipefail
cd /tmp/verl
[ \$(ls verl-p[0-9]* | wc -l) = $n ] || { echo "have \$(ls verl-p[0-9]* | wc -l) of $n chunks: the machine went cold, start over"; exit 3; }
cat \$(ls verl-p[0-9]* | sort -V) > verl.tar
[ \$(sha256sum verl.tar | cut -c1-16) = $sum ] || { echo "checksum mismatch"; exit 4; }
rm -rf whl site && mkdir whl && tar -C whl -xf verl.tar
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/verl/site whl/*.whl
echo "installed verl's side in /tmp/verl/site (gpu_vs_verl.py reads VERL_SITE, default /tmp/verl/site)"
EOS
chmod +x "$out/verl-install.sh"
echo "wrote $n chunk(s) to $out/ ($n_whl wheels, $((size / 1048576)) MiB, checksum $sum)"
