#!/usr/bin/env bash
# Triton's own measuring tools, for the bundled Triton 2.51 server.
#
#   scripts/install_perf.sh [VENV] [--genai-perf] [--aiperf]   (`make install` / `make perf` call this; on
#   an offline GPU host scripts/gpu_setup.sh unpacks the binary first, then calls it for the rest)
#
# perf_analyzer: from the tritonclient==2.51.0 wheel, the client release that
#   matches the server (later tritonclient wheels no longer ship it; the
#   `perf-analyzer` package on PyPI is an empty placeholder). Only the binary
#   is taken, so the project keeps its own newer tritonclient. It needs two
#   shared libraries the machine lacks, put beside it: libb64.so.0d (Debian's
#   libb64-0d, unpacked without root) and libcudart.so.12 (a link to the one
#   nvidia-pytriton bundles; perf_analyzer loads it even on a CPU machine).
#   Installed as $VENV/bin/perf_analyzer, a wrapper that sets LD_LIBRARY_PATH.
# --aiperf: AIPerf 0.13 (NVIDIA's successor to genai-perf; it speaks OpenAI's API, which the
#   gateway serves) in its own virtualenv ($VENV-aiperf): its pins are not the server's.
# --genai-perf: genai-perf 0.0.16 in its own virtualenv ($VENV-genai-perf): it
#   pins tritonclient 2.51 and, with NumPy 1, needs pandas<2.3; neither belongs
#   in the serving environment.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(realpath -m "${1:-.venv}")
python=${PYTHON:-python3}
tools="$venv/opt/perf_analyzer"
pip_q=(--disable-pip-version-check -q)

if [ ! -x "$tools/bin/perf_analyzer" ]; then
    scripts/fetch_perf_analyzer.sh "$tools" "$venv/bin/python"
fi
# perf_analyzer loads libcudart even on a CPU machine: the one nvidia-pytriton bundles
cudart=$(find "$venv"/lib/python3*/site-packages/nvidia_pytriton.libs -name 'libcudart*.so.12*' | head -1)
ln -sf "$(realpath "$cudart")" "$tools/lib/libcudart.so.12"
cat > "$venv/bin/perf_analyzer" <<WRAPPER
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$(realpath "$tools/lib")\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$(realpath "$tools/bin/perf_analyzer")" "\$@"
WRAPPER
chmod +x "$venv/bin/perf_analyzer"
"$venv/bin/perf_analyzer" --version | head -1

if [[ " ${*:2} " == *" --aiperf "* ]]; then
    aiperf="$venv-aiperf"
    [ -x "$aiperf/bin/aiperf" ] || {
        "$python" -m venv "$aiperf"
        "$aiperf/bin/python" -m pip install "${pip_q[@]}" "aiperf==0.13.0"
    }
    echo "AIPerf $("$aiperf/bin/aiperf" --version 2>/dev/null | tail -1)"
fi

if [[ " ${*:2} " == *" --genai-perf "* ]]; then
    genai="$venv-genai-perf"
    [ -x "$genai/bin/genai-perf" ] || {
        "$python" -m venv "$genai"
        "$genai/bin/python" -m pip install "${pip_q[@]}" "genai-perf==0.0.16" "tritonclient[all]==2.51.0" \
            "numpy<2" "pandas<2.3"
    }
    ln -sf "$(realpath "$venv/bin/perf_analyzer")" "$genai/bin/perf_analyzer"
    "$genai/bin/genai-perf" --version 2>/dev/null | tail -1 || true
fi
