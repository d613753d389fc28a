"""Triton's own measuring tools against the triton-omni models.

* ``perf_analyzer`` (from the ``tritonclient==2.51.0`` wheel, the release that
  matches the bundled server; ``scripts/install_perf.sh`` installs it as
  ``.venv/bin/perf_analyzer``) drives every model with the inputs below;
* ``genai-perf`` (its own virtualenv, ``.venv-genai-perf``) drives ``ar`` in
  both of its KServe input formats: ``--backend vllm`` (a
  ``sampling_parameters`` JSON with numbers as strings) and
  ``--backend tensorrtllm`` (one tensor per option: ``max_tokens``,
  ``min_length``, ...).

Each run writes its report (perf_analyzer's per-request export, genai-perf's artifacts)
under the output folder, and a ``summary.json`` of all of them. A run with
any failed request raises ``PerfError`` with the tool's output.

Standard library only: it runs the tools, it does not import them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# One request of each workload, as perf_analyzer's --input-data JSON rows.
# Small on purpose (2 denoising steps, 32x32): the demo models on a CPU.
INPUT_DATA: dict[str, dict] = {
    "ar_encoder": {"text_input": ["a watercolor lighthouse at dusk"]},
    "diffusion": {"prompt": ["a red fox"], "num_inference_steps": [2], "height": [32], "width": [32], "seed": [1]},
    "text_to_image": {"text_input": ["a red fox"], "negative_prompt": [""], "num_inference_steps": [2],
                      "height": [32], "width": [32], "seed": [1]},
    # what `genai-perf --endpoint-type kserve --backend vllm --streaming` sends
    "ar_vllm": {"text_input": ["A red fox jumps over"], "exclude_input_in_output": [True], "stream": [True],
                "sampling_parameters": [json.dumps({"max_tokens": "16", "min_tokens": "16"})]},
    # ... and with --backend tensorrtllm
    "ar_tensorrtllm": {"text_input": ["A red fox jumps over"], "max_tokens": [16], "min_length": [16],
                       "exclude_input_in_output": [True], "stream": [True]},
}


@dataclass(frozen=True)
class PerfRun:
    model: str
    data: str  # a key of INPUT_DATA
    streaming: bool = False  # decoupled models take their requests on a gRPC stream


PERF_ANALYZER_RUNS = [
    PerfRun("ar_encoder", "ar_encoder"),
    PerfRun("diffusion", "diffusion"),
    PerfRun("text_to_image", "text_to_image"),
    PerfRun("ar", "ar_vllm", streaming=True),
    PerfRun("ar", "ar_tensorrtllm", streaming=True),
]
GENAI_PERF_BACKENDS = ("vllm", "tensorrtllm")


@dataclass
class PerfResult:
    tool: str
    model: str
    form: str
    concurrency: int
    requests: int
    throughput: float  # requests/s (perf_analyzer) or output tokens/s (genai-perf)
    unit: str
    p50_latency_ms: float
    p99_latency_ms: float
    report: str  # where the tool's own report is


class PerfError(RuntimeError):
    """A tool failed or a request errored; the message carries the tool's output."""


# perf_analyzer 2.51 now and then (1 run in 40 here, with ``ar`` streaming)
# exits 0, prints every request as successful and leaves its export file empty.
# Such a run measured nothing we can read, so it is run again.
EXPORT_ATTEMPTS = 3


def venv_bin() -> Path:
    return Path(sys.executable).parent


def perf_analyzer(url: str, run: PerfRun, out_dir: Path, concurrency: int = 2, request_count: int = 20,
                  binary: Path | None = None) -> PerfResult:
    """Send ``request_count`` requests at ``concurrency`` over gRPC.

    ``--request-count`` measures a fixed number of requests instead of waiting
    for a stable window, which a shared CPU machine may never give."""
    binary = binary or venv_bin() / "perf_analyzer"
    out_dir.mkdir(parents=True, exist_ok=True)
    data_file = out_dir / f"{run.data}.input.json"
    data_file.write_text(json.dumps({"data": [INPUT_DATA[run.data]]}))
    report = out_dir / f"{run.data}.perf_analyzer.json"
    command = [str(binary), "-m", run.model, "-u", url, "-i", "grpc", "--input-data", str(data_file),
               "--concurrency-range", str(concurrency), "--request-count", str(request_count),
               "--profile-export-file", str(report)]
    if run.streaming:
        command.append("--streaming")
    log = out_dir / f"{run.data}.perf_analyzer.log"
    log.write_text("")
    for attempt in range(1, EXPORT_ATTEMPTS + 1):
        report.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite its export
        output = _run(command, timeout_s=900)
        with log.open("a") as file:
            file.write(f"--- attempt {attempt}\n{output}")
        if report.exists() and report.stat().st_size > 0:
            break
    else:
        raise PerfError(f"perf_analyzer wrote an empty {report.name} {EXPORT_ATTEMPTS} times:\n{output[-3000:]}")
    requests = json.loads(report.read_text())["experiments"][0]["requests"]
    throughput, p50, p99 = _request_stats(requests)
    return PerfResult("perf_analyzer", run.model, run.data, concurrency, len(requests), throughput, "requests/s",
                      p50, p99, str(report))


def _request_stats(requests: list[dict]) -> tuple[float, float, float]:
    """Throughput and p50/p99 latency (ms, to the last response) from
    perf_analyzer's per-request export. Its own throughput line, measured in
    whole-second windows, is too coarse for a short ``--request-count`` run."""
    starts = [r["timestamp"] for r in requests]
    ends = [r["response_timestamps"][-1] for r in requests]
    latencies = sorted((end - start) / 1e6 for start, end in zip(starts, ends, strict=True))
    span_s = (max(ends) - min(starts)) / 1e9
    return len(requests) / span_s, _percentile(latencies, 50), _percentile(latencies, 99)


def _percentile(values: list[float], q: float) -> float:
    index = min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))
    return values[index]


def genai_perf(url: str, backend: str, out_dir: Path, tokenizer: str, concurrency: int = 2, request_count: int = 20,
               output_tokens: int = 16, input_tokens: int = 32, genai_venv: Path | None = None) -> PerfResult:
    """``genai-perf profile`` against ``ar`` (streaming, KServe, ``backend`` input format)."""
    bin_dir = genai_venv / "bin" if genai_venv else Path(f"{venv_bin().parent}-genai-perf") / "bin"
    artifacts = out_dir / f"genai-perf-{backend}"
    command = [str(bin_dir / "genai-perf"), "profile", "-m", "ar", "--endpoint-type", "kserve", "--backend", backend,
               "--streaming", "-u", url, "--tokenizer", tokenizer,
               "--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(output_tokens), "--output-tokens-mean-deterministic",
               "--concurrency", str(concurrency), "--request-count", str(request_count),
               # perf_analyzer 2.51 hangs when fewer warm-up requests than the concurrency
               # are asked for (seen with 2 at concurrency 4; the server kept serving).
               "--warmup-request-count", str(concurrency), "--num-dataset-entries", str(request_count),
               "--artifact-dir", str(artifacts)]
    # genai-perf runs `perf_analyzer` from PATH; the installer links ours there.
    env = os.environ | {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    output = _run(command, timeout_s=900, env=env)
    (out_dir / f"genai-perf-{backend}.log").write_text(output)
    stats_file = next(artifacts.rglob("profile_export_genai_perf.json"))
    stats = json.loads(stats_file.read_text())
    requests = int(stats["request_count"]["avg"])
    if requests != request_count:
        raise PerfError(f"genai-perf ({backend}) completed {requests} of {request_count} requests:\n{output[-3000:]}")
    latency = stats["request_latency"]
    return PerfResult("genai-perf", "ar", backend, concurrency, requests,
                      float(stats["output_token_throughput"]["avg"]), "output tokens/s",
                      float(latency["p50"]), float(latency["p99"]), str(stats_file.parent))


def run_all(url: str, out_dir: Path, tokenizer: str, *, with_genai_perf: bool = True, concurrency: int = 2,
            request_count: int = 20) -> list[PerfResult]:
    results = [perf_analyzer(url, run, out_dir, concurrency, request_count) for run in PERF_ANALYZER_RUNS]
    if with_genai_perf:
        results += [genai_perf(url, backend, out_dir, tokenizer, concurrency, request_count)
                    for backend in GENAI_PERF_BACKENDS]
    (out_dir / "summary.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results


def format_table(results: list[PerfResult]) -> str:
    lines = ["| tool | model | input form | concurrency | requests | throughput | p50 ms | p99 ms |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.tool} | {r.model} | {r.form} | {r.concurrency} | {r.requests} | {r.throughput:.2f} {r.unit} "
              f"| {r.p50_latency_ms:.1f} | {r.p99_latency_ms:.1f} |" for r in results]
    return "\n".join(lines)


def _run(command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    if shutil.which(command[0]) is None:
        raise PerfError(f"{command[0]} not found; run `make perf` (or scripts/install_perf.sh) first")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:
        raise PerfError(f"timed out after {timeout_s:.0f} s: {' '.join(command)}") from exc
    output = done.stdout + done.stderr
    # perf_analyzer exits non-zero when a request fails and prints the error per thread.
    if done.returncode != 0 or "had error" in output:
        raise PerfError(f"{Path(command[0]).name} failed (exit {done.returncode}):\n{output[-3000:]}")
    return output
