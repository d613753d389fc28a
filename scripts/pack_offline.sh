#!/usr/bin/env bash
# Pack what an offline GPU host (CPython 3.12, x86-64, CUDA torch installed) needs
# to serve triton-omni, in folders small enough to copy one at a time (docs/gpu.md).
# Run it on a machine with a package registry; scripts/gpu_setup.sh installs each
# folder on the GPU host.
#
#   scripts/pack_offline.sh            all of it
#   scripts/pack_offline.sh --no-vllm  without vLLM (ar and ar_encoder then run on transformers)
#
#   .offline   the Triton 2.51 server, Python backend and 3.12 stub from the nvidia-pytriton
#              wheel (trimmed), the diffusers, peft, accelerate, tritonclient, numpy 1.26.4 wheels,
#              and uvicorn and httpx for the OpenAI gateway (~60 MB)
#   .offline2  scipy 1.14.1 (the host's scipy needs NumPy 2, Triton 2.51's stub NumPy 1), torchao
#              (the DiT's FP8), and perf_analyzer (from the tritonclient 2.51 wheel) with libb64 (~55 MB)
#   .attn1-2   FlashAttention-4 (attention_backend flash_4_hub, Hopper and Blackwell): flash-attn-4,
#              its CuTe DSL compiler for CUDA 13 (one 92 MB wheel, split in two) and what it imports
#   .gateway   the OpenAI gateway's FastAPI, Starlette, pydantic and form parser, and PyAV (a video's
#              MP4, /v1/videos) (~45 MB)
#   .vllm1-3   vLLM 0.24.0 (built for torch 2.11 / CUDA 13), its wheel tree stripped of the
#              FlashAttention-2 kernels (Hopper uses FA3), the vllm-rs binary, and extensions
#              for other Pythons, as tar.xz in three ~45 MB parts
#   .vllm4     the wheels vLLM imports that such a host lacks (~18 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
with_vllm=1
[ "${1:-}" = "--no-vllm" ] && with_vllm=0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
platforms=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64
           --platform manylinux_2_35_x86_64 --platform linux_x86_64)
wheels() {  # wheels DEST SPEC...: cp312 binary wheels, no dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$1" "${@:2}"
}

mkdir -p .offline .offline2
wheels "$tmp" nvidia-pytriton==0.7.0
( cd "$tmp" && unzip -q nvidia_pytriton-*.whl 'pytriton/tritonserver/*' 'nvidia_pytriton.libs/*' \
  && mkdir bundle && mv pytriton/tritonserver bundle/tritonserver && mv nvidia_pytriton.libs bundle/libs \
  && rm -f bundle/libs/libpython3-*.so* \
  && find bundle/tritonserver/python_backend_stubs -mindepth 1 -maxdepth 1 ! -name 3.12 -exec rm -rf {} + \
  && tar cJf tritonserver.tar.xz -C bundle tritonserver libs )
mv "$tmp/tritonserver.tar.xz" .offline/
wheels .offline diffusers tritonclient==2.73.0 python-rapidjson numpy==1.26.4 pillow importlib_metadata zipp
wheels .offline peft accelerate  # LoRA adapters: diffusers reads them through PEFT
# the OpenAI gateway's server and the benchmark's HTTP client
wheels .offline uvicorn h11 click httpx httpcore anyio idna certifi prometheus_client annotated-doc
wheels .offline2 scipy==1.14.1 uvloop httptools  # uvicorn's fast event loop and HTTP parser, for the gateway
wheels .offline2 torchao==0.18.0  # `quantization: fp8` (float8 row-wise; 0.18 wants torch 2.11 or later)
mkdir -p .gateway  # FastAPI and pydantic at vLLM's pins (.vllm4 has them too), PyAV for /v1/videos
wheels .gateway "fastapi<0.137" starlette pydantic pydantic-core typing-inspection annotated-types python-multipart \
  av
# aiohttp, the benchmark's other HTTP client (`openai_gateway.py --http-client aiohttp`, AIPerf's)
wheels .offline2 aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl
# perf_analyzer, as scripts/install_perf.sh installs it (for runs against a server on the GPU host)
scripts/fetch_perf_analyzer.sh "$tmp/perf" && tar cJf "$tmp/perf_analyzer.tar.xz" -C "$tmp/perf" bin lib
mv "$tmp/perf_analyzer.tar.xz" .offline2/
# FlashAttention-4: diffusers' flash_4_hub runs it from the package (kernels: the Hub client diffusers
# checks for; nothing is downloaded). The compiler's wheel goes in two parts, each folder under 64 MB.
mkdir -p .attn1 .attn2 "$tmp/attn"
wheels .attn1 flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 quack-kernels==0.6.5 torch-c-dlpack-ext einops kernels==0.17.2
wheels .attn2 "cuda-bindings>=13,<14" cuda-pathfinder "apache-tvm-ffi>=0.1.11,<0.2"
wheels "$tmp/attn" nvidia-cutlass-dsl-libs-cu13==4.8.1
(cd "$tmp/attn" && split -n 2 -d nvidia_cutlass_dsl_libs_cu13-*.whl part && ls nvidia_cutlass_dsl_libs_cu13-*.whl > name)
cp "$tmp/attn/part00" "$tmp/attn/name" .attn1/ && cp "$tmp/attn/part01" .attn2/

if [ "$with_vllm" = 1 ]; then
  wheels "$tmp" vllm==0.24.0
  mkdir "$tmp/tree" && (cd "$tmp/tree" && unzip -q ../vllm-0.24.0-*.whl)
  ( cd "$tmp/tree/vllm"
    rm -f vllm_flash_attn/_vllm_fa2_C.abi3.so vllm-rs
    rm -rf third_party/fmha_sm100 third_party/deep_gemm/include entrypoints/serve/instrumentator/static
    find . -name "_C.cpython-3*" ! -name "_C.cpython-312*" -delete )
  (cd "$tmp/tree" && tar cf - . | xz -T0 -6 > "$tmp/vllm.tar.xz")
  split -n 3 -d "$tmp/vllm.tar.xz" "$tmp/part"
  for i in 0 1 2; do mkdir -p ".vllm$((i + 1))" && mv "$tmp/part0$i" ".vllm$((i + 1))/"; done
  mkdir -p .vllm4
  # What AsyncLLM's import and an engine start need beyond a torch host's packages
  # (llguidance 1.7 is not on PyPI; 1.6.1 imports).
  wheels .vllm4 annotated-types "apache-tvm-ffi<0.2" blake3 cachetools cbor2 "fastapi<0.137" ijson jiter llguidance \
    msgspec openai openai-harmony opentelemetry-api partial-json-parser pybase64 pydantic pydantic-core pyzmq \
    setproctitle sniffio starlette typing-inspection xgrammar httpx2 httpcore2 truststore
fi
du -sh .offline .offline2 .gateway .attn1 .attn2 .vllm[1-4] 2>/dev/null || true
