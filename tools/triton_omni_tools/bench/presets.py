"""The bench's presets and workloads: what is measured, written once."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass

PROMPT = "a lighthouse on a cliff at dusk, oil painting"


@dataclass(frozen=True)
class Preset:
    ar_model: str
    diffusion_model: str
    size: int
    steps: int
    guidance: float
    max_tokens: int
    max_batch_size: int  # of diffusion and ar_encoder
    requests_per_worker: int  # Triton side; the direct side runs the same number of requests
    # Exact batching pads every diffusion call to a fixed size (docs/models.md): free at full
    # concurrency, up to max_batch_size times the work below it. Measured without it, as the raw
    # diffusers curve is.
    exact_batching: bool = False
    # The Triton side's diffusion batching: "step" (the default repository's) or "request".
    diffusion_batching: str = "step"
    # Request batching only: how long diffusion's batcher waits for a fuller batch. 20 ms is short
    # next to a 2 s batch: 16 closed-loop clients re-sending after a batch then miss it, and the
    # batches split for good (15 + 1, ...). 100 ms is 5% of such a batch. Step batching: none.
    diffusion_queue_delay_us: int = 20_000
    workloads: tuple[str, ...] = ("diffusion", "ar_encoder", "ar", "ar_transformers", "text_to_image", "omni")
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    # The AR stages (text generation, prompt encoding) are measured where LLM serving is: up to 64 at once.
    ar_concurrency: tuple[int, ...] = (1, 8, 16, 32, 64)
    encoder_max_batch_size: int = 64  # ar_encoder's, so that direct and Triton batch alike at every concurrency
    # Closed-loop requests per client of the AR workloads, on both sides: enough work that one
    # hiccup does not make the figure (points of a second or less moved by a third between runs).
    ar_rounds: tuple[tuple[str, int], ...] = (("ar", 12), ("ar_transformers", 4), ("ar_encoder", 128))
    # Extra vLLM engine arguments of `ar` (JSON), the same on both sides: e.g. '{"stream_interval": 4}'.
    ar_engine_args: str = ""
    # The same for `ar_encoder`, e.g. '{"compilation_config": {"cudagraph_mode": "FULL"}}'.
    encoder_engine_args: str = ""
    # The Triton side's AR clients share this many processes (a thread and a connection each).
    client_processes: int = 8
    # Text generation's output lengths: max_tokens each (0), or drawn uniformly from
    # [max_tokens * (1 - R), max_tokens * (1 + R)] per request (R, as vLLM's benchmark's
    # --random-range-ratio), the same lengths on both sides. With one length, the requests that
    # start together end together, and a side whose clients resubmit at once keeps them in step.
    output_range_ratio: float = 0.0
    # CPUs for every vLLM engine core of the run, both sides' (model parameter engine_cpus), e.g. "7";
    # the bench's own processes (the server, its stubs, the clients) keep off them. "": no pinning.
    engine_cpus: str = ""
    # ar_encoder's batching window on the Triton side (microseconds); None: the repository's.
    encoder_queue_delay_us: int | None = None
    # The open loop's mixed traffic: every steps count at every size, interleaved.
    mixed_steps: tuple[int, ...] = (10, 20, 50)
    mixed_sizes: tuple[int, ...] = (512, 384)

    def __post_init__(self):
        if not 0 <= self.output_range_ratio < 1:
            raise ValueError(f"output_range_ratio must be in [0, 1), got {self.output_range_ratio}")

    def concurrency_for(self, workload: str) -> tuple[int, ...]:
        return self.ar_concurrency if workload in AR_WORKLOADS else self.concurrency

    def engine_args(self, stage: str) -> dict:
        """The extra vLLM engine arguments of ``ar`` or ``ar_encoder``, parsed ({} if none)."""
        text = {"ar": self.ar_engine_args, "ar_encoder": self.encoder_engine_args}[stage]
        return json.loads(text) if text else {}

    def rounds_for(self, workload: str) -> int:
        """Requests each client sends one after another."""
        return dict(self.ar_rounds).get(workload, self.requests_per_worker)

    def output_range(self) -> tuple[int, int]:
        """The shortest and longest max_tokens a text-generation request may draw."""
        return (max(1, round(self.max_tokens * (1 - self.output_range_ratio))),
                round(self.max_tokens * (1 + self.output_range_ratio)))

    def output_lengths(self, client: int) -> Iterator[int]:
        """The max_tokens of a text-generation client's requests, one after another
        (its warm-up request first). Seeded by the client's index, so that the
        direct side's client ``i`` and the Triton side's send the same lengths."""
        low, high = self.output_range()
        draw = random.Random(client)
        while True:
            yield draw.randint(low, high)


# Text generation, each through its engine: vLLM (`ar`) and the transformers fallback.
GENERATION_WORKLOADS = ("ar", "ar_transformers")
AR_WORKLOADS = (*GENERATION_WORKLOADS, "ar_encoder")

PRESETS = {
    "tiny": Preset("demo:tiny-qwen2", "demo:tiny-sd", size=32, steps=2, guidance=1.0, max_tokens=16,
                   max_batch_size=8, requests_per_worker=2, ar_concurrency=(1, 4, 16), encoder_max_batch_size=16,
                   ar_rounds=(("ar", 8), ("ar_transformers", 8), ("ar_encoder", 32)), mixed_sizes=(32, 64)),
    "realistic": Preset("demo:realistic-qwen2", "demo:realistic-sd", size=512, steps=20, guidance=7.5,
                        max_tokens=128, max_batch_size=16, requests_per_worker=2, diffusion_queue_delay_us=100_000),
}


@dataclass(frozen=True)
class Workload:
    models: tuple[str, ...]  # what the server loads for it
    batches_on: str  # the model whose batching and statistics the bench reports


WORKLOADS = {
    "diffusion": Workload(("diffusion",), "diffusion"),
    "ar_encoder": Workload(("ar_encoder",), "ar_encoder"),
    "ar": Workload(("ar",), "ar"),
    "ar_transformers": Workload(("ar_transformers",), "ar_transformers"),
    "text_to_image": Workload(("ar_encoder", "diffusion", "text_to_image"), "diffusion"),
    "omni": Workload(("ar", "ar_encoder", "diffusion", "omni"), "diffusion"),
}
# The executed-batch-size histogram of each batched model.
BATCH_SIZE_METRICS = {"ar_encoder": "omni_ar_batch_size", "diffusion": "omni_diffusion_batch_size"}


def models_for(workloads: tuple[str, ...]) -> list[str]:
    """Only the models the workloads use are loaded (each holds GPU memory and a process)."""
    return sorted({model for workload in workloads for model in WORKLOADS[workload].models})


def edit_picture(height: int = 1024, width: int = 1024) -> bytes:
    """The input image the edit benchmarks send (a PNG of RGB gradients): the same on both sides;
    at 1024² the edit pipelines read it at its own size."""
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([(x // 4) % 256, (y // 4) % 256, ((x + y) // 8) % 256], -1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


# FLUX.2 [dev] at full size (random weights): its 32 B DiT and its 24 B encoder, placed on two GPUs
# with `--place diffusion=0 --place ar_encoder=1` (docs/gpu.md): the repository edits
FLUX2_DEV_PLACED = {
    "diffusion": {"parameters": {"model": "demo:realistic-flux2-dev", "dtype": "bfloat16",
                                 "gpu_memory_utilization": "0.93", "limits": {"max_size": 1024}}},
    "ar_encoder": {"parameters": {"model": "demo:realistic-flux2-dev-encoder", "recipe": "flux2_dev",
                                  "dtype": "bfloat16", "engine": "transformers", "gpu_memory_utilization": "0.70"}},
}
