"""Where do Triton's extra 10% of diffusion compute come from? (GPU diagnostic)

Runs the realistic diffusion batch of 16 direct and through Triton, in turns,
in one process, with the GPU's clocks, power and temperature sampled all
along (nvidia-smi, every 200 ms). Variants of the served model are started
one after another. Prints per phase: throughput, and the mean SM clock,
power and temperature while it ran.

    python benchmarks/stub_gap.py --out DIR
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton_omni.launcher import ServerOptions, TritonServer
from triton_omni_client import bench

VARIANTS = {  # name: (extra diffusion model parameters, extra tritonserver arguments)
    "default": ({}, []),
    "poll 10 s": ({"cancel_poll_s": "10"}, []),
    "graphs off": ({"cuda_graphs": "false"}, []),
    "no GPU metrics": ({}, ["--allow-gpu-metrics=false"]),
}


def main() -> None:
    logging.basicConfig(level=os.environ.get("TRITON_OMNI_LOG_LEVEL", "INFO"), format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--py-spy", help="path of a py-spy binary: sample the direct phase and the stub")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    preset = replace(bench.PRESETS["realistic"], workloads=("diffusion",), requests_per_worker=args.rounds)
    smi_csv = args.out / "smi.csv"
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu",
                            "--format=csv,noheader,nounits", "-lms", "200"], stdout=smi_csv.open("w"))
    phases: list[tuple[str, float, float, float]] = []  # name, start, end, throughput
    c = args.concurrency

    def phase(name: str, measure, pid: int | None = None) -> None:
        start = time.time()
        spy = None
        if args.py_spy and pid:
            tag = re.sub(r"\W+", "_", name)
            spy = subprocess.Popen([args.py_spy, "record", "--pid", str(pid), "--threads", "--idle", "-r", "200",
                                    "-d", "600", "-f", "raw", "-o", str(args.out / f"spy-{tag}-{len(phases)}.txt")])
        point = measure()
        if spy:
            spy.send_signal(2)  # py-spy writes its profile on SIGINT
            spy.wait()
        phases.append((name, start, time.time(), point.throughput))
        server = point.server or {}
        compute = f"  compute_infer {server['compute_infer_ms']:.0f} ms" if server else ""
        print(f"{name:<28} {point.throughput:6.2f} img/s  p50 {point.summary()['p50_ms']:7.0f} ms{compute}", flush=True)

    direct = bench.Direct(preset, "cuda")
    embeds = direct.embeds.float().cpu().numpy()
    phase("direct", lambda: bench.measure_direct(direct, "diffusion", c, c * args.rounds), os.getpid())
    for k, name in enumerate(args.variants.split(",")):
        params, server_args = VARIANTS[name]
        with tempfile.TemporaryDirectory() as tmp:
            repos = bench.bench_repository(preset, Path(tmp))
            config = repos[0] / "diffusion" / "config.pbtxt"
            config.write_text(config.read_text() + "".join(
                f'\nparameters {{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in params.items()))
            options = ServerOptions(model_repositories=repos, http_port=18100, grpc_port=18101, metrics_port=18102,
                                    log_file=args.out / f"server-{k}.log",
                                    model_control_mode="explicit", load_models=["diffusion"],
                                    extra_args=server_args)
            with TritonServer(options) as server:
                stub = subprocess.run(["pgrep", "-f", "triton_python_backend_stub.*diffusion"], capture_output=True,
                                      text=True).stdout.split()
                stub_pid = int(stub[0]) if stub else None
                phase(f"direct, {name} server idle", lambda: bench.measure_direct(direct, "diffusion", c,
                                                                                   c * args.rounds))
                phase(f"triton, {name}", lambda: bench.measure_triton(server.grpc_url, preset, embeds, "diffusion", c,
                                                                      server.metrics_url), stub_pid)
                if stub_pid:
                    _compare_processes(os.getpid(), stub_pid)
        phase("direct", lambda: bench.measure_direct(direct, "diffusion", c, c * args.rounds))
    smi.terminate()
    _report(phases, smi_csv)


def _compare_processes(direct_pid: int, stub_pid: int) -> None:
    """The GPU libraries each process mapped, and the environment variables that differ."""
    def libraries(pid: int) -> set[str]:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        gpu = re.compile(r"cu(dnn|blas|dart|fft|sparse|solver)|nvrtc|nccl|libnv")
        return {line.split()[-1] for line in maps if gpu.search(line)}

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


def _report(phases, smi_csv: Path) -> None:
    from datetime import datetime

    rows = []
    for row in csv.reader(smi_csv.open()):
        try:
            ts = datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((ts, *(float(x) for x in row[1:])))
        except (ValueError, IndexError):
            continue
    print(f"\n{'phase':<28} {'img/s':>6} {'SM MHz':>7} {'W':>6} {'°C':>4} {'util%':>6}")
    for name, start, end, throughput in phases:
        inside = [r for r in rows if start + 1 <= r[0] <= end]
        mean = [sum(r[i] for r in inside) / len(inside) if inside else float("nan") for i in range(1, 5)]
        print(f"{name:<28} {throughput:6.2f} {mean[0]:7.0f} {mean[1]:6.0f} {mean[2]:4.0f} {mean[3]:6.0f}")


if __name__ == "__main__":
    main()
