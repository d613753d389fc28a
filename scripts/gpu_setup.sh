#!/usr/bin/env bash
# Set up .gpuvenv on the offline GPU machine (docs/gpu.md): a venv over the
# host's CUDA torch, with the carried wheels and the Triton 2.51 bundle.
# Idempotent: run it once per carried folder; each call adds what it finds.
# The folders come from scripts/pack_offline.sh (docs/gpu.md):
#   .offline   the Triton 2.51 bundle, diffusers, tritonclient, numpy 1.26.4
#   .offline2  scipy==1.14.1 (the host's scipy needs NumPy 2; the 2.51 stub needs NumPy 1), torchao
#              (quantization: fp8), and
#              perf_analyzer.tar.xz (Triton's load generator, for runs against a server on this host)
#   .gateway   the OpenAI gateway's FastAPI and pydantic, and PyAV (/v1/videos' MP4)
#   .attn1-2   FlashAttention-4 and its CuTe DSL compiler (that wheel in two parts, kept in the venv
#              until both are there)
#   .vllm1-3   vLLM 0.24.0's wheel tree, stripped, in three parts (kept in the venv until all are there)
#   .vllm4     the wheels vLLM needs that the host lacks
set -euo pipefail
cd "$(dirname "$0")/.."
host=/opt/torch/.venv/bin/python
venv=$PWD/.gpuvenv
if [ ! -x "$venv/bin/python" ]; then
  "$host" -m venv "$venv"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # .pth files load in name order: the host's packages come after this venv's own.
  "$host" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/zz_host.pth"
  printf '%s\n' "$PWD/protocol" "$PWD/backends" "$PWD/clients" "$PWD/gateway" "$PWD/tools" "$PWD" > "$site/omni.pth"
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for dir in .offline .offline2 .gateway .attn1 .attn2 .vllm4; do
  if compgen -G "$dir/*.whl" > /dev/null; then
    "$venv/bin/python" -m pip install -q --no-index --no-deps --force-reinstall "$dir"/*.whl
  fi
done
if [ -f .offline/tritonserver.tar.xz ] && [ ! -d "$site/pytriton/tritonserver" ]; then
  mkdir -p "$site/pytriton"
  tar xJf .offline/tritonserver.tar.xz -C "$site/pytriton"
  mv "$site/pytriton/libs" "$site/nvidia_pytriton.libs"
fi
perf=$venv/opt/perf_analyzer
if [ -f .offline2/perf_analyzer.tar.xz ] && [ -d "$site/nvidia_pytriton.libs" ] && [ ! -x "$perf/bin/perf_analyzer" ]; then
  mkdir -p "$perf"
  tar xJf .offline2/perf_analyzer.tar.xz -C "$perf"
  scripts/install_perf.sh "$venv"  # the libcudart link and the wrapper, .gpuvenv/bin/perf_analyzer
fi
attn=$venv/attn-parts
mkdir -p "$attn"
for i in 1 2; do
  if compgen -G ".attn$i/part0*" > /dev/null; then cp .attn$i/part0* .attn$i/name* "$attn/" 2>/dev/null || true; fi
done
if [ -f "$attn/part00" ] && [ -f "$attn/part01" ] && [ -f "$attn/name" ]; then
  cat "$attn/part00" "$attn/part01" > "$attn/$(cat "$attn/name")"
  "$venv/bin/python" -m pip install -q --no-index --no-deps --force-reinstall "$attn/$(cat "$attn/name")"
  rm -rf "$attn"
fi
parts=$venv/vllm-parts
mkdir -p "$parts"
for i in 1 2 3; do
  if compgen -G ".vllm$i/part0*" > /dev/null; then cp .vllm$i/part0* "$parts/"; fi
done
if [ ! -d "$site/vllm" ] && [ -f "$parts/part00" ] && [ -f "$parts/part01" ] && [ -f "$parts/part02" ]; then
  cat "$parts"/part00 "$parts"/part01 "$parts"/part02 | tar xJf - -C "$site"
  rm -rf "$parts"
fi
if [ -d "$site/vllm" ]; then echo "vLLM: $(ls -d "$site"/vllm-*.dist-info | xargs -n1 basename)"
else echo "vLLM: not yet ($(ls "$parts" | tr '\n' ' ')of part00 part01 part02)"; fi
echo "gpu venv ready: $venv"
