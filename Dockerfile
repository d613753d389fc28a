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

# 9000: the OpenAI-compatible API (its own metrics at /metrics)
EXPOSE 8000 8001 8002 9000
CMD ["omni-triton", "serve", "--server", "system", "--bind", "0.0.0.0"]
