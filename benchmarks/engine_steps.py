"""Count a vLLM engine's steps by kind, in every engine-core process of a run.

`bench` compares `ar` through Triton with the same engine driven directly.
Both sides run the same engine with the same requests, so where their
throughput differs the engine's steps differ: more of them carry a prompt
(vLLM's default runs those with the attention outside the CUDA graphs, about
three times a decode step's time on an H200), or its decode steps take
longer. This counts both, per engine-core process, without touching the
product: a `.pth` file in the venv patches vLLM's model runner in any process
started with ``TRITON_OMNI_STEP_LOG`` set, the bench's direct engine and the
stubs' engines alike (they inherit the environment).

    python benchmarks/engine_steps.py install
    TRITON_OMNI_STEP_LOG=steps python -m triton_omni_tools.cli bench --preset realistic --workloads ar
    python benchmarks/engine_steps.py report steps
    python benchmarks/engine_steps.py uninstall

Each engine core appends a cumulative snapshot to ``DIR/<pid>.jsonl`` every
two seconds. A step's time is the time to the engine's next step (the engine
runs ahead of the GPU, so the steady gap is the step's cost), capped at 50 ms
so that an idle engine's wait never counts. The report splits each side's
snapshots into two-second windows, files each window under the bench
concurrency nearest its decode steps' batch, and prints per concurrency and
side: the mean decode step, the share and mean time of the steps that held a
prompt, and the mean step; and direct's mean step over Triton's, the
throughput ratio the engine's steps alone account for.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import itertools
import json
import os
import sys
import sysconfig
import threading
import time
from collections import defaultdict
from pathlib import Path

ENV = "TRITON_OMNI_STEP_LOG"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
PTH = "zzz_triton_omni_engine_steps.pth"
IDLE_S = 0.05  # a longer gap between two steps is an idle engine, not a step
SNAPSHOT_S = 2.0


class StepCounter:
    """Steps and their times by kind (``decode`` or ``prompt``) and CUDA-graph mode."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stats: dict[str, list[float]] = {}  # kind -> [steps, seconds, tokens]
        self._last: tuple[str, float] | None = None

    def step(self, kind: str, tokens: int, now: float) -> None:
        with self.lock:
            if self._last is not None:  # the previous step lasted until this one
                previous, started = self._last
                entry = self.stats.setdefault(previous, [0, 0.0, 0])
                entry[0] += 1
                entry[1] += min(now - started, IDLE_S)
            self.stats.setdefault(kind, [0, 0.0, 0])[2] += tokens
            self._last = kind, now

    def snapshot(self) -> dict[str, list[float]]:
        with self.lock:
            return {kind: list(entry) for kind, entry in self.stats.items()}


def step_kind(mode_name: str, max_scheduled_tokens: int) -> str:
    """``decode/FULL``, ``prompt/PIECEWISE``...: a step holds a prompt when a
    request in it is scheduled more than one token."""
    return f"{'prompt' if max_scheduled_tokens > 1 else 'decode'}/{mode_name}"


def patch_runner(module, counter: StepCounter) -> None:
    """Wrap the model runner's per-step choice of CUDA graph (vLLM 0.24), which
    sees the step's token count and its longest request."""
    runner = module.GPUModelRunner
    choose = runner._determine_batch_execution_and_padding

    def counted(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, *args, **kwargs):
        result = choose(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
                        *args, **kwargs)
        if kwargs.get("force_uniform_decode") is None and not kwargs.get("force_eager"):  # not a capture
            counter.step(step_kind(result[0].name, max_num_scheduled_tokens), int(num_tokens), time.perf_counter())
        return result

    runner._determine_batch_execution_and_padding = counted


def _parent_command() -> str:
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def _write_snapshots(counter: StepCounter, out: Path) -> None:
    parent = _parent_command()
    while True:
        time.sleep(SNAPSHOT_S)
        line = {"t": time.time(), "pid": os.getpid(), "parent": parent, "stats": counter.snapshot()}
        with open(out / f"{os.getpid()}.jsonl", "a") as file:
            file.write(json.dumps(line) + "\n")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches vLLM's model runner as it is imported (only engine cores import it)."""

    def __init__(self, out: Path):
        self.out = out

    def find_spec(self, name, path, target=None):
        if name != RUNNER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            counter = StepCounter()
            try:
                patch_runner(module, counter)
            except Exception as error:  # another vLLM release: count nothing, break nothing
                print(f"engine_steps: not counting ({error!r})", file=sys.stderr)
                return
            self.out.mkdir(parents=True, exist_ok=True)
            threading.Thread(target=_write_snapshots, args=(counter, self.out), daemon=True).start()

        spec.loader.exec_module = exec_module
        return spec


def activate() -> None:
    """What the .pth runs in every process of the venv: nothing unless ENV is set."""
    installed = any(type(finder).__name__ == _PatchOnImport.__name__ for finder in sys.meta_path)
    if os.environ.get(ENV) and not installed:  # (a site folder can be read twice)
        sys.meta_path.insert(0, _PatchOnImport(Path(os.environ[ENV]).resolve()))


def _pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH


def install() -> Path:
    line = (f"import runpy, os; os.environ.get({ENV!r}) and "
            f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='engine_steps_hook')['activate']()\n")
    path = _pth_path()
    path.write_text(line)
    return path


# --- the report ----------------------------------------------------------------------------------


def windows(lines: list[dict]) -> list[dict[str, list[float]]]:
    """The steps of each snapshot interval: differences of consecutive cumulative snapshots."""
    return [{kind: [value - before["stats"].get(kind, [0, 0.0, 0])[i] for i, value in enumerate(entry)]
             for kind, entry in after["stats"].items()}
            for before, after in itertools.pairwise(lines)]


def side_of(parent: str) -> str:
    return "triton" if "triton_python_backend_stub" in parent else "direct"


def summarize(logs: dict[str, list[dict]], concurrencies: list[int], min_steps: int = 100) -> dict:
    """{(concurrency, side): {"decode_ms", "prompt_share", "prompt_ms", "steps"}} over every window
    with at least ``min_steps`` decode steps."""
    sums: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0, 0.0, 0, 0.0])
    for lines in logs.values():
        if not lines:
            continue
        side = side_of(lines[-1]["parent"])
        for window in windows(lines):
            decode = [entry for kind, entry in window.items() if kind.startswith("decode/")]
            prompt = [entry for kind, entry in window.items() if kind.startswith("prompt/")]
            steps = sum(entry[0] for entry in decode)
            if steps < min_steps:
                continue
            batch = sum(entry[2] for entry in decode) / steps
            concurrency = min(concurrencies, key=lambda c: abs(c - batch))
            total = sums[concurrency, side]
            total[0] += steps
            total[1] += sum(entry[1] for entry in decode)
            total[2] += sum(entry[0] for entry in prompt)
            total[3] += sum(entry[1] for entry in prompt)
    return {key: {"decode_ms": 1000 * s[1] / s[0], "prompt_share": s[2] / (s[0] + s[2]),
                  "prompt_ms": 1000 * s[3] / s[2] if s[2] else None, "steps": int(s[0] + s[2]),
                  "step_ms": 1000 * (s[1] + s[3]) / (s[0] + s[2])}
            for key, s in sums.items()}


def engine_ratio(summary: dict, concurrency: int) -> float | None:
    """Direct's mean step over Triton's: the throughput ratio the engine alone
    would give, both sides' steps producing a token for every running stream."""
    direct, triton = summary.get((concurrency, "direct")), summary.get((concurrency, "triton"))
    return direct["step_ms"] / triton["step_ms"] if direct and triton else None


def read_logs(folder: Path) -> dict[str, list[dict]]:
    return {path.name: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            for path in sorted(folder.glob("*.jsonl"))}


def report(folder: Path, concurrencies: list[int]) -> str:
    summary = summarize(read_logs(folder), concurrencies)
    rows = ["conc  side    steps  decode step ms  steps with a prompt  their ms  mean step ms  direct/triton"]
    for concurrency, side in sorted(summary):
        s = summary[concurrency, side]
        prompt_ms = "" if s["prompt_ms"] is None else f"{s['prompt_ms']:.2f}"
        ratio = engine_ratio(summary, concurrency) if side == "triton" else None
        rows.append(f"{concurrency:>4}  {side:<6} {s['steps']:>6}  {s['decode_ms']:>14.2f}  "
                    f"{s['prompt_share']:>19.1%}  {prompt_ms:>8}  {s['step_ms']:>12.2f}  "
                    f"{'' if ratio is None else f'{ratio:.2f}':>13}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help=f"write {PTH} into this interpreter's site-packages")
    commands.add_parser("uninstall", help=f"remove {PTH}")
    show = commands.add_parser("report", help="the table of a run's logs")
    show.add_argument("folder", type=Path)
    show.add_argument("--concurrency", default="1,8,32,64", help="the bench's concurrencies (default 1,8,32,64)")
    args = parser.parse_args()
    if args.command == "install":
        print(f"installed {install()}; set {ENV}=DIR to count")
    elif args.command == "uninstall":
        _pth_path().unlink(missing_ok=True)
    else:
        print(report(args.folder, [int(c) for c in args.concurrency.split(",")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
