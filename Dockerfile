# Production image: triton-omni on NVIDIA's Triton + vLLM container.
# The image already has tritonserver, the Python backend, CUDA torch and vLLM;
# this adds diffusers, the client library and the project, and serves the same
# repositories the launcher serves locally (`omni-triton serve --server system`).
#
#   docker build -t triton-omni .
#   docker run --gpus all --shm-size=2g -p 8000:8000 -p 8001:8001 -p 8002:8002 -p 9000:9000 triton-omni
ARG TRITON_VERSION=25.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-vllm-python-py3

WORKDIR /opt/triton-omni
COPY pyproject.toml README.md ./
COPY protocol protocol
COPY backends backends
COPY clients clients
COPY gateway gateway
COPY tools tools
COPY model_repository model_repository
COPY ensemble ensemble

# --no-deps: keep the image's torch/vLLM/NumPy (its Triton supports NumPy 2).
RUN pip install --no-cache-dir diffusers peft accelerate torchao "tritonclient[all]" fastapi uvicorn prometheus-client \
 && pip install --no-cache-dir --no-deps -e .

# Demo models are built into the image; real models come from the hub or a
# mounted volume (set the `model` parameter in the model configs).
ENV TRITON_OMNI_CACHE=/opt/triton-omni/.cache
RUN omni-triton build-demo-models

# What torch.compile (`compile: blocks`, inductor's graphs and Triton kernels) and vLLM
# compile at load goes to one folder: mounted as a volume (deploy/kubernetes.yaml,
# or `docker run -v triton-omni-cache:/var/cache/triton-omni`), a restarted server
# reads it back instead of compiling again, on the same GPU model and torch.
ENV TORCHINDUCTOR_CACHE_DIR=/var/cache/triton-omni/torchinductor \
    VLLM_CACHE_ROOT=/var/cache/triton-omni/vllm

# 9000: the OpenAI-compatible API (its own metrics at /metrics)
EXPOSE 8000 8001 8002 9000
CMD ["omni-triton", "serve", "--server", "system", "--bind", "0.0.0.0"]
