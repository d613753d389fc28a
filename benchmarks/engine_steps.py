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
so that an idle engine's wait never counts. Beside the steps it times the
parts of the engine core's loop (``PHASES``: taking requests in, scheduling,
preparing and launching the step, sampling, waiting for the GPU's result,
updating the scheduler) and reads each of its threads' CPU time and the time
the thread waited for a CPU (``/proc/self/task/*/schedstat``): where a slower
step's time went.

The report splits each side's snapshots into two-second windows, files each
window under the bench concurrency nearest its decode steps' batch, and
prints per concurrency and side: the mean decode step, the share and mean
time of the steps that held a prompt, and the mean step; direct's mean step
over Triton's, the throughput ratio the engine's steps alone account for;
and the parts of a step, in ms per step.
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
# The parts of a step timed in the engine core (vLLM 0.24): name -> (module, class, method).
PHASES = {
    "input": ("vllm.v1.engine.core", "EngineCoreProc", "_handle_client_request"),
    "schedule": ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    "execute": (RUNNER_MODULE, "GPUModelRunner", "execute_model"),
    "sample": (RUNNER_MODULE, "GPUModelRunner", "sample_tokens"),
    "wait": (RUNNER_MODULE, "AsyncGPUModelRunnerOutput", "get_output"),
    "update": ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
}
PTH = "zzz_triton_omni_engine_steps.pth"
IDLE_S = 0.05  # a longer gap between two steps is an idle engine, not a step
SNAPSHOT_S = 2.0


class StepCounter:
    """Steps and their times by kind (``decode`` or ``prompt``) and CUDA-graph
    mode; the time spent in each of ``PHASES``."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stats: dict[str, list[float]] = {}  # kind -> [steps, seconds, tokens]
        self.phases: dict[str, list[float]] = {}  # phase -> [calls, seconds]
        self.main_thread: int | None = None  # the native id of the thread that steps
        self._last: tuple[str, float] | None = None

    def timed(self, phase: str, seconds: float) -> None:
        with self.lock:
            entry = self.phases.setdefault(phase, [0, 0.0])
            entry[0] += 1
            entry[1] += seconds

    def step(self, kind: str, tokens: int, now: float) -> None:
        with self.lock:
            if self._last is not None:  # the previous step lasted until this one
                previous, started = self._last
                entry = self.stats.setdefault(previous, [0, 0.0, 0])
                entry[0] += 1
                entry[1] += min(now - started, IDLE_S)
            self.stats.setdefault(kind, [0, 0.0, 0])[2] += tokens
            self._last = kind, now
        if self.main_thread is None:
            self.main_thread = threading.get_native_id()

    def snapshot(self) -> dict[str, list[float]]:
        with self.lock:
            return {kind: list(entry) for kind, entry in self.stats.items()}

    def phase_snapshot(self) -> dict[str, list[float]]:
        with self.lock:
            return {phase: list(entry) for phase, entry in self.phases.items()}


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


def patch_phase(module, class_name: str, method: str, phase: str, counter: StepCounter) -> None:
    """Time every call of ``class_name.method`` as ``phase``."""
    cls = getattr(module, class_name)
    inner = getattr(cls, method)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            counter.timed(phase, time.perf_counter() - start)

    setattr(cls, method, timed)


def thread_times() -> dict[str, list]:
    """Each thread of this process by id: [CPU ns, ns waiting for a CPU, time
    slices, name] (``/proc/self/task/*/schedstat`` and ``comm``)."""
    threads: dict[str, list] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            times = [int(v) for v in (task / "schedstat").read_text().split()]
            threads[task.name] = [*times, (task / "comm").read_text().strip()]
        except (OSError, ValueError):  # a thread that just ended
            continue
    return threads


def _ancestors() -> str:
    """The commands of this process's parent and its ancestors, nearest first:
    an engine core's own worker process still tells which side started it."""
    commands, pid = [], os.getppid()
    while pid > 1:
        try:
            commands.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200].strip())
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return " < ".join(commands) or "?"


def _write_snapshots(counter: StepCounter, out: Path) -> None:
    parent = _ancestors()
    while True:
        time.sleep(SNAPSHOT_S)
        line = {"t": time.time(), "pid": os.getpid(), "parent": parent, "stats": counter.snapshot(),
                "phases": counter.phase_snapshot(), "threads": thread_times(),
                "main_thread": str(counter.main_thread)}
        with open(out / f"{os.getpid()}.jsonl", "a") as file:
            file.write(json.dumps(line) + "\n")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches vLLM's modules as they are imported: the model runner's step
    count, and ``PHASES``. Only engine cores import the model runner, so only
    they write snapshots (a frontend's patched methods are never called)."""

    def __init__(self, out: Path):
        self.out = out
        self.counter = StepCounter()
        self.pending = {module for module, _, _ in PHASES.values()} | {RUNNER_MODULE}

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        self.pending.discard(name)
        sys.meta_path.remove(self)  # the real spec, without finding this finder again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if self.pending:
                sys.meta_path.insert(0, self)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            try:
                for phase, (module_name, class_name, method) in PHASES.items():
                    if module_name == name:
                        patch_phase(module, class_name, method, phase, self.counter)
                if name == RUNNER_MODULE:
                    patch_runner(module, self.counter)
            except Exception as error:  # another vLLM release: count nothing, break nothing
                print(f"engine_steps: not counting ({error!r})", file=sys.stderr)
                return
            if name == RUNNER_MODULE:
                self.out.mkdir(parents=True, exist_ok=True)
                threading.Thread(target=_write_snapshots, args=(self.counter, self.out), daemon=True).start()

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


def windows(lines: list[dict], key: str = "stats") -> list[dict[str, list[float]]]:
    """What each snapshot interval added to ``key`` (``stats``, ``phases`` or
    ``threads``): differences of consecutive cumulative snapshots."""
    def diff(before: dict, after: dict) -> dict[str, list[float]]:  # numbers only (a thread's name stays)
        return {name: [value - (before.get(name) or [0] * len(entry))[i] if isinstance(value, int | float) else value
                       for i, value in enumerate(entry)]
                for name, entry in after.items()}

    return [diff(before.get(key, {}), after.get(key, {})) for before, after in itertools.pairwise(lines)]


def side_of(parent: str) -> str:
    return "triton" if "triton_python_backend_stub" in parent else "direct"


def by_kind(stats: dict) -> tuple[list, list]:
    """A window's [steps, seconds, tokens] entries: the decode steps', the prompt steps'."""
    return ([entry for kind, entry in stats.items() if kind.startswith("decode/")],
            [entry for kind, entry in stats.items() if kind.startswith("prompt/")])


class _Sums:
    """One (concurrency, side)'s windows added up."""

    def __init__(self):
        self.decode_steps, self.decode_s, self.prompt_steps, self.prompt_s = 0, 0.0, 0, 0.0
        self.phases: dict[str, float] = defaultdict(float)  # seconds
        self.main = [0, 0]  # CPU ns, ns waiting for a CPU
        self.others_cpu = 0  # ns

    def add(self, stats: dict, phases: dict, threads: dict, main_thread: str | None) -> None:
        decode, prompt = by_kind(stats)
        self.decode_steps += sum(entry[0] for entry in decode)
        self.decode_s += sum(entry[1] for entry in decode)
        self.prompt_steps += sum(entry[0] for entry in prompt)
        self.prompt_s += sum(entry[1] for entry in prompt)
        for phase, (_, seconds) in phases.items():
            self.phases[phase] += seconds
        for thread, times in threads.items():
            if thread == main_thread:
                self.main = [self.main[0] + times[0], self.main[1] + times[1]]
            else:
                self.others_cpu += times[0]

    def summary(self) -> dict:
        steps = self.decode_steps + self.prompt_steps
        per_step_ms = 1000 / steps
        return {"decode_ms": 1000 * self.decode_s / self.decode_steps, "prompt_share": self.prompt_steps / steps,
                "prompt_ms": 1000 * self.prompt_s / self.prompt_steps if self.prompt_steps else None,
                "steps": steps, "step_ms": (self.decode_s + self.prompt_s) * per_step_ms,
                "phases_ms": {phase: seconds * per_step_ms for phase, seconds in self.phases.items()},
                "main_cpu_ms": self.main[0] / 1e9 * per_step_ms, "main_wait_ms": self.main[1] / 1e9 * per_step_ms,
                "others_cpu_ms": self.others_cpu / 1e9 * per_step_ms}


def summarize(logs: dict[str, list[dict]], concurrencies: list[int], min_steps: int = 100) -> dict:
    """{(concurrency, side): {"decode_ms", "prompt_share", "prompt_ms", "steps", "step_ms",
    "phases_ms", "main_cpu_ms", "main_wait_ms", "others_cpu_ms"}} over every window with at
    least ``min_steps`` decode steps; the last five per step."""
    sums: dict[tuple[int, str], _Sums] = defaultdict(_Sums)
    for lines in logs.values():
        if not lines:
            continue
        side = side_of(lines[-1]["parent"])
        parts = zip(windows(lines), windows(lines, "phases"), windows(lines, "threads"), lines[1:], strict=True)
        for stats, phases, threads, line in parts:
            decode, _ = by_kind(stats)
            steps = sum(entry[0] for entry in decode)
            if steps < min_steps:
                continue
            batch = sum(entry[2] for entry in decode) / steps
            concurrency = min(concurrencies, key=lambda c: abs(c - batch))
            sums[concurrency, side].add(stats, phases, threads, line.get("main_thread"))
    return {key: total.summary() for key, total in sums.items()}


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
    if any(s["phases_ms"] for s in summary.values()):
        rows += ["", "where a step's time goes, ms per step (main: the thread that steps; "
                 "waiting: ready to run, no CPU given)",
                 "conc  side    " + "".join(f"{phase:>9}" for phase in PHASES)
                 + "     rest  main CPU  main waiting  other threads' CPU"]
        for concurrency, side in sorted(summary):
            s = summary[concurrency, side]
            parts = [s["phases_ms"].get(phase, 0.0) for phase in PHASES]
            rows.append(f"{concurrency:>4}  {side:<6}" + "".join(f"{ms:>9.3f}" for ms in parts)
                        + f"{s['step_ms'] - sum(parts):>9.3f}{s['main_cpu_ms']:>10.3f}"
                        f"{s['main_wait_ms']:>14.3f}{s['others_cpu_ms']:>20.3f}")
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
