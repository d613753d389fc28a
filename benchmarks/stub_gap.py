"""Does the diffusion batch run as fast inside Triton's stub as in a plain
process? A GPU diagnostic (docs/benchmarks.md tells what it found).

In one run, in turns: the realistic batch of 16 direct (the runner library in
this process), direct beside an idle server, and through Triton, once per
chosen variant of the served model. All along, nvidia-smi samples the GPU's
SM clock, power, temperature and utilisation every 200 ms. It prints, per
phase, throughput (and Triton's compute time) and those GPU means; then,
per variant, the GPU libraries each process mapped and the environment
variables that differ. With ``--py-spy`` it also samples the direct phase
and the stub (raw profiles in the output folder).

    python benchmarks/stub_gap.py --out DIR [--variants default,graphs off] [--py-spy PATH]
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton_omni_tools import bench
from triton_omni_tools.launcher import ServerOptions, TritonServer
from triton_omni_tools.repository import edit_config

VARIANTS = {  # name: (extra diffusion model parameters, extra tritonserver arguments)
    "default": ({}, []),
    "poll 10 s": ({"cancel_poll_s": "10"}, []),
    "graphs off": ({"cuda_graphs": "false"}, []),
    "no GPU metrics": ({}, ["--allow-gpu-metrics=false"]),
}


@dataclass
class Phases:
    out: Path
    py_spy: str | None
    done: list[tuple[str, float, float, float]] = field(default_factory=list)  # name, start, end, throughput

    def run(self, name: str, measure, pid: int | None = None) -> None:
        spy = self._spy(name, pid) if self.py_spy and pid else None
        start = time.time()
        point = measure()
        if spy:
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
            spy.wait()
        self.done.append((name, start, time.time(), point.throughput))
        compute = f"  compute_infer {point.server['compute_infer_ms']:.0f} ms" if point.server else ""
        print(f"{name:<32} {point.throughput:6.2f} img/s  p50 {point.summary()['p50_ms']:7.0f} ms{compute}",
              flush=True)

    def _spy(self, name: str, pid: int) -> subprocess.Popen:
        path = self.out / f"spy-{len(self.done)}-{re.sub(r'[^A-Za-z0-9]+', '_', name)}.txt"
        return subprocess.Popen([self.py_spy, "record", "--pid", str(pid), "--threads", "--idle", "-r", "200",
                                 "-d", "600", "-f", "raw", "-o", str(path)])


def main() -> None:
    logging.basicConfig(level=os.environ.get("TRITON_OMNI_LOG_LEVEL", "INFO"), format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--py-spy", help="path of a py-spy binary: sample the direct phase and the stub")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    preset = replace(bench.PRESETS["realistic"], workloads=("diffusion",), requests_per_worker=args.rounds)
    smi_csv = args.out / "smi.csv"
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu",
                            "--format=csv,noheader,nounits", "-lms", "200"], stdout=smi_csv.open("w"))
    phases = Phases(args.out, args.py_spy)
    direct = bench.Direct(preset, "cuda")
    embeds = direct.embeds.float().cpu().numpy()
    c = args.concurrency

    def measure_direct():
        return bench.measure_direct(direct, "diffusion", c, c * args.rounds)

    phases.run("direct", measure_direct, os.getpid())
    for index, name in enumerate(args.variants.split(",")):
        with tempfile.TemporaryDirectory() as tmp, serve(preset, name, Path(tmp), args.out / f"server-{index}.log") \
                as server:
            stub_pid = _stub_pid()
            phases.run(f"direct, server '{name}' idle", measure_direct)
            phases.run(f"triton, {name}", lambda: bench.measure_triton(
                server.grpc_url, preset, embeds, "diffusion", c, server.metrics_url), stub_pid)
            if stub_pid:
                _compare_processes(os.getpid(), stub_pid)
        phases.run("direct", measure_direct)
    smi.terminate()
    _report(phases.done, smi_csv)


def serve(preset: bench.Preset, variant: str, tmp: Path, log: Path) -> TritonServer:
    """The bench's repository with only ``diffusion`` loaded, changed as the variant says."""
    params, server_args = VARIANTS[variant]
    repositories = bench.bench_repository(preset, tmp)
    edit_config(repositories[0] / "diffusion" / "config.pbtxt", parameters=params)
    return TritonServer(ServerOptions(model_repositories=repositories, http_port=18100, grpc_port=18101,
                                      metrics_port=18102, log_file=log, model_control_mode="explicit",
                                      load_models=["diffusion"], extra_args=server_args))


def _stub_pid() -> int | None:
    found = subprocess.run(["pgrep", "-f", "triton_python_backend_stub.*diffusion"], capture_output=True,
                           text=True).stdout.split()
    return int(found[0]) if found else None


def _compare_processes(direct_pid: int, stub_pid: int) -> None:
    """The GPU libraries each process mapped, and the environment variables that differ."""
    gpu = re.compile(r"cu(dnn|blas|dart|fft|sparse|solver)|nvrtc|nccl|libnv")

    def libraries(pid: int) -> set[str]:
        return {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if gpu.search(line)}

    def environment(pid: int) -> dict[str, str]:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)

    direct, stub = libraries(direct_pid), libraries(stub_pid)
    print("GPU libraries in both:", *sorted(direct & stub), sep="\n  ")
    print("only direct:", *sorted(direct - stub), sep="\n  ")
    print("only stub:", *sorted(stub - direct), sep="\n  ")
    env_direct, env_stub = environment(direct_pid), environment(stub_pid)
    for key in sorted(set(env_direct) | set(env_stub)):
        if env_direct.get(key) != env_stub.get(key):
            print(f"env {key}: direct={env_direct.get(key)!r} stub={env_stub.get(key)!r}")


def _report(phases: list[tuple[str, float, float, float]], smi_csv: Path) -> None:
    samples = []
    for row in csv.reader(smi_csv.open()):
        try:
            at = datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((at, *(float(x) for x in row[1:])))
        except (ValueError, IndexError):
            continue  # a header or a sample cut short
    print(f"\n{'phase':<32} {'img/s':>6} {'SM MHz':>7} {'W':>6} {'°C':>4} {'util%':>6}")
    for name, start, end, throughput in phases:
        inside = [s for s in samples if start + 1 <= s[0] <= end]
        mean = [sum(s[i] for s in inside) / len(inside) if inside else float("nan") for i in range(1, 5)]
        print(f"{name:<32} {throughput:6.2f} {mean[0]:7.0f} {mean[1]:6.0f} {mean[2]:4.0f} {mean[3]:6.0f}")


if __name__ == "__main__":
    main()
