#!/usr/bin/env bash
# Set up .gpuvenv on the offline GPU machine (docs/gpu.md): a venv over the
# host's CUDA torch, with the carried wheels and the Triton 2.51 bundle.
# Idempotent: a second call (e.g. carrying .offline2) only adds wheels.
#   .offline   shared/gpu/pack-offline.sh .offline   (bundle, diffusers, tritonclient, numpy 1.26.4)
#   .offline2  scipy==1.14.1 (the host's scipy needs NumPy 2; the 2.51 stub needs NumPy 1)
set -euo pipefail
cd "$(dirname "$0")/.."
host=/opt/torch/.venv/bin/python
venv=$PWD/.gpuvenv
if [ ! -x "$venv/bin/python" ]; then
  "$host" -m venv "$venv"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # .pth files load in name order: the host's packages come after this venv's own.
  "$host" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/zz_host.pth"
  printf '%s\n' "$PWD/protocol" "$PWD/backends" "$PWD/clients" "$PWD/tools" "$PWD" > "$site/omni.pth"
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for dir in .offline .offline2; do
  if compgen -G "$dir/*.whl" > /dev/null; then
    "$venv/bin/python" -m pip install -q --no-index --no-deps --force-reinstall "$dir"/*.whl
  fi
done
if [ -f .offline/tritonserver.tar.xz ] && [ ! -d "$site/pytriton/tritonserver" ]; then
  mkdir -p "$site/pytriton"
  tar xJf .offline/tritonserver.tar.xz -C "$site/pytriton"
  mv "$site/pytriton/libs" "$site/nvidia_pytriton.libs"
fi
echo "gpu venv ready: $venv"
