"""Where one served image's time goes: the step engine's request, on the runner as ``diffusion``
serves it (step batching, in this process, no server), split on the GPU's own clock into its DiT
forwards, the gaps between them (the scheduler step, the guidance, the graphs' input copies, and
any wait for the host), the VAE decode, and the rest (admission before the first forward, the
pixels' trip back after the decode).

Why: a request's latency over its forwards' time is what serving adds on top of the DiT; this
says which part to work on (diagnostic, GPU; the same request as ``families.py``'s at concurrency 1).

    python benchmarks/request_breakdown.py --family qwen-image --compile --quantization fp8
    python benchmarks/request_breakdown.py --family z-image --compile --cuda-graphs false
    python benchmarks/request_breakdown.py --family wan --compile --attention-backend flash_4_hub --rounds 1
    .venv/bin/python benchmarks/request_breakdown.py --family qwen-image --preset tiny      # CPU: wall clock only
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from families import SETUPS, Requests, hidden_size, pooled_size
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig


class Spans:
    """(start, end) CUDA events around each call of the functions it wraps, in call order."""

    def __init__(self):
        self.spans, self._undo = {}, []

    def wrap(self, owner, attribute: str, label: str) -> None:
        inner = getattr(owner, attribute)
        spans = self.spans.setdefault(label, [])

        def timed(*args, **kwargs):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            out = inner(*args, **kwargs)
            end.record()
            spans.append((start, end))
            return out

        had_own = attribute in vars(owner)
        setattr(owner, attribute, timed)
        self._undo.append(lambda: setattr(owner, attribute, inner) if had_own else delattr(owner, attribute))

    def clear(self) -> None:
        for spans in self.spans.values():
            spans.clear()

    def undo(self) -> None:
        for undo in reversed(self._undo):
            undo()


def request_values(requests: Requests, index: int) -> dict:
    setup = requests.setup
    values = {"prompt_embeds": torch.from_numpy(requests.prompt(index)), "seed": requests.seed(index),
              "num_inference_steps": setup.steps, "guidance_scale": setup.guidance} | setup.sized()
    if requests.guided:
        values["negative_prompt_embeds"] = torch.from_numpy(requests.negative(index))
    if requests.pooled_size:
        values["pooled_prompt_embeds"] = torch.from_numpy(requests.pooled(index))
    return values


def report(spans: Spans, wall_s: float) -> None:
    forwards, decodes = spans.spans["forward"], spans.spans["decode"]
    torch.cuda.synchronize()
    forward_ms = [s.elapsed_time(e) for s, e in forwards]
    gaps_ms = [e.elapsed_time(s) for (_, e), (s, _) in itertools.pairwise(forwards)]
    decode_ms = sum(s.elapsed_time(e) for s, e in decodes)
    span_ms = forwards[0][0].elapsed_time(decodes[-1][1])
    wall_ms = wall_s * 1e3
    rows = [("DiT forwards", f"{len(forward_ms)} x {statistics.mean(forward_ms):.2f} ms "
                             f"(median {statistics.median(forward_ms):.2f})", sum(forward_ms)),
            ("between forwards", f"{len(gaps_ms)} x {statistics.mean(gaps_ms):.3f} ms "
                                 f"(max {max(gaps_ms, default=0):.2f})", sum(gaps_ms)),
            ("forwards' end to the decode", "", span_ms - sum(forward_ms) - sum(gaps_ms) - decode_ms),
            ("VAE decode", "", decode_ms),
            ("before the first forward, after the decode", "", wall_ms - span_ms)]
    print(f"request wall {wall_ms:.1f} ms")
    for name, detail, ms in rows:
        print(f"  {name:<44} {ms:9.1f} ms  {100 * ms / wall_ms:5.1f} %  {detail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted({family for family, _ in SETUPS}), required=True)
    parser.add_argument("--preset", choices=["tiny", "realistic"], default="realistic")
    parser.add_argument("--compile", action="store_true", help="compile: blocks")
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none")
    parser.add_argument("--cuda-graphs", choices=["true", "false"], default="true")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    setup = SETUPS[(args.family, args.preset)]
    cuda = torch.cuda.is_available()
    runner = DiffusionRunner(DiffusionRunnerConfig(
        setup.model, device="cuda:0" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
        batching="step", batch_size=8, exact_batching=False, compile="blocks" if args.compile else "off",
        quantization=args.quantization, cuda_graphs=args.cuda_graphs == "true",
        attention_backend=args.attention_backend, limits={"max_size": max(1024, setup.size)}))
    try:
        pipeline = runner.pipeline
        requests = Requests(args.family, setup, hidden_size(pipeline), pooled_size=pooled_size(pipeline))
        serve = lambda i: runner.submit(runner.parse(request_values(requests, i))).result()  # noqa: E731
        serve(0)  # warm-up: compiles, captures, allocates
        spans = Spans()
        if cuda:
            spans.wrap(runner.family.network, "forward", "forward")
            spans.wrap(pipeline.vae, "decode", "decode")
        print(f"{setup.model} {setup.sized()}, {setup.steps} steps, guidance {setup.guidance}, compile {args.compile}, "
              f"{args.quantization}, CUDA graphs {args.cuda_graphs}, attention {args.attention_backend}")
        for i in range(args.rounds):
            spans.clear()
            started = time.perf_counter()
            serve(1 + i)
            wall = time.perf_counter() - started
            if cuda:
                report(spans, wall)
            else:
                print(f"request wall {wall * 1e3:.1f} ms")
        spans.undo()
    finally:
        runner.close()


if __name__ == "__main__":
    main()
