"""A pipeline family (Qwen-Image, Z-Image, FLUX.2 [klein], FLUX.1, Wan's videos) through Triton against
diffusers' own pipeline, on one machine, with the same weights, embeddings and seeds.

* direct: the family's pipeline in this process; concurrency ``c`` is one
  ``__call__`` with a batch of ``c`` (diffusers' best), latency and images/s;
* triton: ``diffusion`` on a server of this run's own (step batching, the
  default), ``c`` clients sending one request each over gRPC.

The embeddings stand in for the text encoder's (the realistic DiTs are built
on the GPU in memory, without one), so both sides run exactly the denoiser and
the VAE; ``--end-to-end`` adds the encoder (below). A real-shape Qwen-Image DiT and a copy
of it do not both fit one 80 GB GPU, so the direct side runs first and is
freed before the server starts. Each concurrency starts with a warm-up of
two steps on both sides (kernels chosen, memory allocated). It also prints
how far request 0's served image is from the pipeline's (0: bit-exact; at
concurrency 1 it is, but for the VAE's group norms, which on a GPU are the
server's own: a few levels of 255, docs/models.md).

    .venv/bin/python benchmarks/families.py --family qwen-image                     # CPU, tiny models
    python benchmarks/families.py --family qwen-image --preset realistic          # GPU: 1024², 50 steps, CFG 4
    python benchmarks/families.py --family z-image --preset realistic             # GPU: 1024², 8 steps
    python benchmarks/families.py --family qwen-image --preset realistic --compile    # Triton's DiT blocks compiled
    python benchmarks/families.py --family z-image --preset realistic --end-to-end     # text_to_image, encoder included
    python benchmarks/families.py --family flux2-klein --preset realistic         # GPU: 1024², 50 steps, CFG 4
    python benchmarks/families.py --family flux2-klein-distilled --preset realistic  # GPU: 1024², 4 steps
    python benchmarks/families.py --family flux1-dev --preset realistic           # GPU: 1024², 28 steps, guidance 3.5
    python benchmarks/families.py --family flux1-schnell --preset realistic       # GPU: 1024², 4 steps
    python benchmarks/families.py --family qwen-image-edit --preset realistic     # GPU: edit 1024², 50 steps, CFG 4
    python benchmarks/families.py --family wan --preset realistic                 # GPU: Wan 2.1 1.3B, 832x480x81, CFG 5
    python benchmarks/families.py --family wan2.2-ti2v --preset realistic         # GPU: Wan 2.2 TI2V-5B, 1280x704x121
    python benchmarks/families.py --family wan2.2-t2v-a14b --preset realistic --steps 4  # GPU: two 14B experts

An edit family's requests (Qwen-Image-Edit) each send the same input image, 1024² (``edit_picture``):
the pipeline's ``image`` on the direct side, the request's ``images`` on Triton's.

``--compile``: the server runs with ``compile: blocks`` (torch.compile of the
DiT's blocks; ``--compile blocks,vae`` compiles the VAE's decoder too) against the
pipeline as diffusers runs it by default (eager);
``--compile-direct`` compiles the pipeline's blocks as well
(``transformer.compile_repeated_blocks()``, diffusers' own regional compilation).
The warm-up rounds take the compile time.

``--end-to-end``: prompts instead of embeddings, the text encoder included on
both sides: the pipeline called with the prompt (its own text encoder and
tokenizer) against Triton's ``text_to_image`` ensemble (``ar_encoder`` with the
family's recipe, then ``diffusion``). On the realistic preset the encoder is
at its real size with random weights (Z-Image: Qwen3-4B, built once into the
cache, about 8 GB); the tiny preset uses the tiny pipeline's own.

``--aa``: the direct side measured a second time right after the first, with the same rounds,
requests and warm-up: the host against itself (an A/A), printed beside each ratio. A Triton/direct
ratio within the A/A's distance from 1 is not resolved by this host.

``--shared-memory``: the client sends the embeddings, and receives the image, through system shared
memory (Triton's mechanism for a client on the server's host) rather than in the gRPC messages, whose
Python serialization costs tens of milliseconds for FLUX's 8 to 16 MB of float32. Each row also prints a
request's mean time inside the server, so the rest of its latency is the client's and gRPC's.

``--embeds-dtype bfloat16``: the server's ``diffusion`` declares its embeddings bf16 (its
``embeds_dtype``) and the client sends them so, half float32's bytes; both sides get the same bf16
values (the DiT runs in bf16 on a GPU either way), so only the request's trip changes.

``--quantization fp8`` (with ``--fp8-kept PATTERNS`` and ``--fp8-scales row|tensor``) and
``--attention-backend NAME``: the server's ``diffusion`` parameters of the same names (default:
bf16, ``auto``), as is ``--cuda-graphs false`` (the compiled DiT's forward replayed as CUDA graphs
is the default); the pipeline stays as diffusers
runs it (bf16, PyTorch's SDPA), so each row's image columns say how far the FP8 image is from
bf16's with the same seed: PSNR and mean absolute difference (random weights: a proxy for what
real weights lose).

Every row prints the MFU of both sides: the family's FLOPs per image (``Family.forward_flops``: the
DiT's blocks, per forward pass, times the passes of its steps) over the latency, as a fraction of the
GPU's dense bf16 peak (``gpu_peaks.PEAK_BF16``; FP8's peak is twice that, but
the fraction stays bf16's so that the rows compare). Beside it, the least time an image can take on
the GPU (the served linear layers at their type's dense peak, FP8's with ``--quantization fp8``,
attention at bf16's) and Triton's latency as a fraction of it: how far is left.

``--gather-us N``: Triton gathers the requests that arrive within N µs into one ``execute`` (no
``preferred_batch_size``), so that requests sent together start at the same step; each request then
waits the window at concurrency 1. ``--steps-ahead N``: the server's ``steps_ahead`` (GPU).

``--exact-batching pipeline``: the server runs each request's forward passes
alone (``exact_batching: pipeline``: every image the pipeline's own, bit for
bit, in any company), so the throughput ratio at concurrency above 1 prints
what that exactness costs against the default's shared passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import json
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from gpu_peaks import device_name, limit_seconds, peak_bf16
from triton_omni.demo_models import build_in_memory, resolve_model
from triton_omni.diffusion.steps import to_pixels
from triton_omni.families import family_of
from triton_omni_client import OmniClient
from triton_omni_tools.bench.presets import edit_picture
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, ServerOptions, TritonServer, free_port
from triton_omni_tools.repository import copy_repositories


@dataclass(frozen=True)
class Setup:
    model: str
    size: int  # the width (and the height, unless given)
    steps: int
    guidance: float  # Qwen-Image: true CFG scale (with a negative); the others: guidance_scale (Z 0: turbo)
    concurrency: tuple[int, ...]
    tokens: int = 64  # prompt tokens
    negative_tokens: int | None = None  # None: 3/4 as many (FLUX.2 pads every text to 512)
    height: int = 0  # 0: the size
    frames: int = 0  # a video's frame count; 0: an image

    @property
    def shape(self) -> tuple[int, int]:
        return self.height or self.size, self.size

    def sized(self) -> dict:
        """The size arguments of a call and of a request (a video's frame count too)."""
        height, width = self.shape
        return {"height": height, "width": width} | ({"num_frames": self.frames} if self.frames else {})


# --end-to-end: ar_encoder's model (a folder holding the family's text encoder and tokenizer), its recipe
ENCODERS = {
    ("qwen-image", "tiny"): "demo:tiny-qwen-image",
    ("z-image", "tiny"): "demo:tiny-z-image",
    ("z-image", "realistic"): "demo:realistic-z-image-encoder",
}
RECIPES = {"qwen-image": "qwen_image", "z-image": "z_image"}
PROMPT = "a watercolor landscape with mountains, a lake and a small wooden cabin, request"
NEGATIVE_PROMPT = "blurry, dark, low quality"


SETUPS = {
    ("qwen-image", "tiny"): Setup("demo:tiny-qwen-image", 32, 2, 4.0, (1, 4)),
    ("z-image", "tiny"): Setup("demo:tiny-z-image", 32, 2, 0.0, (1, 4)),
    ("qwen-image", "realistic"): Setup("demo:realistic-qwen-image", 1024, 50, 4.0, (1, 4)),
    ("z-image", "realistic"): Setup("demo:realistic-z-image", 1024, 8, 0.0, (1, 16)),
    ("flux2-klein", "tiny"): Setup("demo:tiny-flux2-klein", 32, 2, 4.0, (1, 4), 512, 512),
    # the pipeline's defaults: 50 steps, CFG 4; the step-distilled variant: 4 steps, no guidance
    ("flux2-klein", "realistic"): Setup("demo:realistic-flux2-klein", 1024, 50, 4.0, (1, 4), 512, 512),
    ("flux2-klein-distilled", "realistic"): Setup("demo:realistic-flux2-klein-distilled", 1024, 4, 1.0, (1, 4),
                                                  512, 512),
    ("flux1-dev", "tiny"): Setup("demo:tiny-flux1-dev", 32, 2, 3.5, (1, 4), 512),
    # FLUX.1 [dev]'s model card: 28 steps, guidance 3.5; [schnell]'s: 4 steps, guidance 0
    ("flux1-dev", "realistic"): Setup("demo:realistic-flux1-dev", 1024, 28, 3.5, (1, 4), 512),
    ("flux1-schnell", "realistic"): Setup("demo:realistic-flux1-schnell", 1024, 4, 0.0, (1, 4), 512),
    ("qwen-image-edit", "tiny"): Setup("demo:tiny-qwen-image-edit", 32, 2, 4.0, (1, 4)),
    # vLLM-Omni's published figure's setting: 1024², 50 steps, true CFG 4
    ("qwen-image-edit", "realistic"): Setup("demo:realistic-qwen-image-edit", 1024, 50, 4.0, (1, 4)),
    # every prompt 512 rows (the pipeline pads with zeros); the model card's 480p: 832x480, 81 frames, CFG 5
    ("wan", "tiny"): Setup("demo:tiny-wan", 32, 2, 5.0, (1, 4), 512, 512, frames=5),
    ("wan", "realistic"): Setup("demo:realistic-wan2.1-1.3b", 832, 50, 5.0, (1, 4), 512, 512, height=480, frames=81),
    # Wan 2.2 TI2V-5B's model card: 1280x704, 121 frames, 50 steps, CFG 5
    ("wan2.2-ti2v", "tiny"): Setup("demo:tiny-wan2.2", 32, 2, 5.0, (1, 4), 512, 512, frames=5),
    ("wan2.2-ti2v", "realistic"): Setup("demo:realistic-wan2.2-ti2v-5b", 1280, 50, 5.0, (1,), 512, 512, height=704,
                                        frames=121),
    # T2V-A14B's: 1280x720, 81 frames, 40 steps, CFG 4 (one scale for both experts: the pipeline's default)
    ("wan2.2-t2v-a14b", "realistic"): Setup("demo:realistic-wan2.2-t2v-a14b", 1280, 40, 4.0, (1,), 512, 512,
                                            height=720, frames=81),
}
GUIDES_ABOVE = {"z-image": 0.0}  # the others guide above 1
NEVER_GUIDED = {"flux1-dev", "flux1-schnell"}  # guidance-distilled or none: no negative pass at any scale
# embeddings as one tensor (Z-Image: a list)
STACKED = {"qwen-image", "qwen-image-edit", "flux2-klein", "flux2-klein-distilled", "flux1-dev", "flux1-schnell",
           "wan", "wan2.2-ti2v", "wan2.2-t2v-a14b"}
TRUE_CFG = {"qwen-image", "qwen-image-edit"}  # the scale is true_cfg_scale
EDITS = {"qwen-image-edit"}  # every request edits an input image


def embeds(hidden: int, seed: int, tokens: int) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=generator) * 0.5).numpy()


class Requests:
    """Request ``i``'s embeddings and seed, the same on both sides."""

    def __init__(self, family: str, setup: Setup, hidden: int, end_to_end: bool = False, pooled_size: int = 0,
                 embeds_dtype: str = "float32"):
        self.family, self.setup, self.hidden, self.end_to_end = family, setup, hidden, end_to_end
        self.pooled_size = pooled_size  # FLUX.1: CLIP's pooled vector beside the sequence
        self.guided = setup.guidance > GUIDES_ABOVE.get(family, 1.0) and family not in NEVER_GUIDED
        self.image = edit_picture() if family in EDITS else None  # an edit's input image, a PNG
        self.embeds_dtype = embeds_dtype  # what the client sends: float32, or bfloat16 (the server's embeds_dtype)
        self._made: dict[tuple, np.ndarray] = {}
        self._sent: dict[int, np.ndarray] = {}  # id of a made embedding -> it in bf16

    def _once(self, key: tuple, make) -> np.ndarray:
        """Each embedding made once, at its first use (the warm-up's: the timed rounds only read it),
        in float32 holding what the client sends (bf16's values with ``embeds_dtype`` bfloat16)."""
        if key not in self._made:
            array = make()
            self._made[key] = array.astype(ml_dtypes.bfloat16).astype(np.float32) \
                if self.embeds_dtype == "bfloat16" else array
        return self._made[key]

    def sent(self, array: np.ndarray | None) -> np.ndarray | None:
        """A made embedding as the client sends it: in the type the server declares, converted once
        (so that the client has nothing to cast inside the timed rounds)."""
        if array is None or self.embeds_dtype != "bfloat16":
            return array
        if id(array) not in self._sent:
            self._sent[id(array)] = array.astype(ml_dtypes.bfloat16)
        return self._sent[id(array)]

    def prompt_text(self, i: int) -> str:
        return f"{PROMPT} {i}"

    def negative_text(self, i: int) -> str | None:
        return NEGATIVE_PROMPT if self.guided else None

    def prompt(self, i: int) -> np.ndarray:
        return self._once(("prompt", i), lambda: embeds(self.hidden, 1000 + i, self.setup.tokens))

    def negative(self, i: int) -> np.ndarray | None:
        tokens = self.setup.negative_tokens or self.setup.tokens * 3 // 4
        return self._once(("negative", i), lambda: embeds(self.hidden, 2000 + i, tokens)) if self.guided else None

    def pooled(self, i: int) -> np.ndarray | None:
        return self._once(("pooled", i), lambda: embeds(self.pooled_size, 3000 + i, 1)[0]) \
            if self.pooled_size else None

    def seed(self, i: int) -> int:
        return 7 + i


def pipeline_of(setup: Setup, device: str, dtype: torch.dtype, encoder: str | None = None):
    """The setup's pipeline; an in-memory realistic one gets ``encoder``'s text encoder and tokenizer."""
    if not setup.model.startswith("demo:realistic-"):
        from diffusers import DiffusionPipeline

        return DiffusionPipeline.from_pretrained(resolve_model(setup.model), torch_dtype=dtype).to(device)
    pipeline = build_in_memory(setup.model, device, dtype)
    if encoder is None:
        return pipeline
    from transformers import AutoModel, AutoTokenizer

    root = Path(resolve_model(encoder))
    return type(pipeline)(transformer=pipeline.transformer, vae=pipeline.vae, scheduler=pipeline.scheduler,
                          text_encoder=AutoModel.from_pretrained(root / "text_encoder", dtype=dtype).to(device).eval(),
                          tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"))


def hidden_size(pipeline) -> int:
    return family_of(pipeline).hidden_size()


def pooled_size(pipeline) -> int:
    return family_of(pipeline).pooled_size()


WARM_UP_STEPS = 2
def flop_parts_per_image(pipeline, requests: Requests) -> tuple[int, int]:
    """The DiT's FLOPs for one request's image, (linear layers', attention's): every step's passes
    (the prompt's, and the negative's where it guides), each ``Family.forward_flop_parts``; an
    edit's input image's tokens are part of the sequence."""
    family, setup = family_of(pipeline), requests.setup
    image = family.image_tokens(*setup.shape, setup.frames or 1) * (2 if requests.image is not None else 1)
    passes = [family.forward_flop_parts(image, setup.tokens)]
    if requests.guided:
        passes.append(family.forward_flop_parts(image, setup.negative_tokens or setup.tokens * 3 // 4))
    return setup.steps * sum(p[0] for p in passes), setup.steps * sum(p[1] for p in passes)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def direct_call(pipeline, requests: Requests, count: int, device: str, dtype: torch.dtype,
                steps: int) -> np.ndarray:
    """One pipeline call for requests 0 .. ``count - 1``: their images, uint8."""
    setup, qwen = requests.setup, requests.family in TRUE_CFG
    indices = range(count)

    def tensors(arrays):
        as_torch = [torch.from_numpy(a).to(device, dtype) for a in arrays]
        return torch.stack(as_torch) if requests.family in STACKED else as_torch

    kwargs = {"true_cfg_scale" if qwen else "guidance_scale": setup.guidance}
    if requests.end_to_end:  # the pipeline encodes the prompts itself
        kwargs |= {"prompt": [requests.prompt_text(i) for i in indices],
                   "negative_prompt": [requests.negative_text(i) for i in indices] if requests.guided else None}
    else:
        kwargs |= {"prompt_embeds": tensors([requests.prompt(i) for i in indices]),
                   "negative_prompt_embeds": tensors([requests.negative(i) for i in indices]) if requests.guided
                   else None}
        if requests.pooled_size:
            kwargs["pooled_prompt_embeds"] = tensors([requests.pooled(i) for i in indices])
    if requests.image is not None:  # one image for the batch, as a user edits it: the pipeline repeats its latents
        from PIL import Image

        kwargs["image"] = Image.open(io.BytesIO(requests.image)).convert("RGB")
    with torch.inference_mode():
        output = pipeline(num_inference_steps=steps, output_type="pt", **setup.sized(),
                          generator=[torch.Generator(device).manual_seed(requests.seed(i)) for i in indices],
                          **kwargs)
    return to_pixels(family_of(pipeline).call_output(output)).numpy()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_direct(pipeline, requests: Requests, concurrency: int, rounds: int, device: str,
                   dtype: torch.dtype) -> tuple[dict, np.ndarray]:
    """(figures, request 0's image): a warm-up call, then ``rounds`` calls of ``concurrency``."""
    direct_call(pipeline, requests, concurrency, device, dtype, min(WARM_UP_STEPS, requests.setup.steps))
    latencies, images = [], []
    for _ in range(rounds):
        synchronize(device)
        started = time.perf_counter()
        images.append(direct_call(pipeline, requests, concurrency, device, dtype, requests.setup.steps))
        synchronize(device)
        latencies.append(time.perf_counter() - started)
    return figures(latencies, concurrency), images[0][0]


def in_server(metrics_url: str) -> dict[str, float]:
    """What ``diffusion`` has spent on the requests it finished, by its metrics: ``model_s``, from
    the model receiving each request to its response (``omni_diffusion_request_duration_seconds``);
    ``before_s``, Triton's time before the model (its queue and the inputs' copy to the model:
    ``nv_inference_queue_duration_us`` and ``nv_inference_compute_input_duration_us``; its request
    duration ends, for a decoupled model, when ``execute`` returns, long before the response);
    ``requests``; ``steps`` and ``rows``, the step engine's steps and the requests they ran
    (``omni_diffusion_batch_size``); ``compiles`` and ``compile_s``, torch.compile's compilations
    (``omni_diffusion_compiles_total``, ``omni_diffusion_compile_seconds_total``)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    series = {"model_s": ("omni_diffusion_request_duration_seconds_sum{", 1.0),
              "requests": ("omni_diffusion_request_duration_seconds_count{", 1.0),
              "steps": ("omni_diffusion_batch_size_count{", 1.0),
              "rows": ("omni_diffusion_batch_size_sum{", 1.0),
              "compiles": ("omni_diffusion_compiles_total{", 1.0),
              "compile_s": ("omni_diffusion_compile_seconds_total{", 1.0),
              "queue_s": ("nv_inference_queue_duration_us{", 1e-6),
              "input_s": ("nv_inference_compute_input_duration_us{", 1e-6)}
    totals = dict.fromkeys(series, 0.0)
    for line in text.splitlines():
        for name, (prefix, scale) in series.items():
            if line.startswith(prefix) and 'model="diffusion"' in line:
                totals[name] += float(line.rsplit(" ", 1)[1]) * scale
    return totals | {"before_s": totals.pop("queue_s") + totals.pop("input_s")}


def measure_triton(client: OmniClient, requests: Requests, concurrency: int, rounds: int,
                   metrics_url: str) -> tuple[dict, np.ndarray]:
    """The same work as ``measure_direct``: ``concurrency`` requests at once, a warm-up round first;
    also the mean time a request spent inside the server (the rest is the client's and gRPC's)."""
    setup = requests.setup
    options = setup.sized() | {"guidance_scale": setup.guidance}
    if requests.image is not None:
        options["images"] = [requests.image]

    def generate(*args, **kwargs) -> np.ndarray:  # an image, or a video's frames
        if setup.frames:
            return client.generate_video(*args, **kwargs).frames
        return client.generate_image(*args, **kwargs)

    def one(i: int, steps: int) -> np.ndarray:
        if requests.end_to_end:
            return generate(requests.prompt_text(i), negative_prompt=requests.negative_text(i),
                            model="text_to_image", seed=requests.seed(i), num_inference_steps=steps, **options)
        pooled = {"pooled_prompt_embeds": requests.sent(requests.pooled(i))} if requests.pooled_size else {}
        return generate(prompt_embeds=requests.sent(requests.prompt(i)),
                        negative_prompt_embeds=requests.sent(requests.negative(i)), seed=requests.seed(i),
                        num_inference_steps=steps, **pooled, **options)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(concurrency), [min(WARM_UP_STEPS, setup.steps)] * concurrency))
        latencies, images = [], []
        before = in_server(metrics_url)
        for _ in range(rounds):
            started = time.perf_counter()
            images.append(list(pool.map(one, range(concurrency), [setup.steps] * concurrency)))
            latencies.append(time.perf_counter() - started)
        after = in_server(metrics_url)
    finished = max(after["requests"] - before["requests"], 1)
    model_s, before_s = ((after[name] - before[name]) / finished for name in ("model_s", "before_s"))
    # requests sent together but stepped apart (each joining a step or two after the first) take more steps
    steps = after["steps"] - before["steps"]
    stepping = {"steps_per_round": steps / rounds,
                "requests_per_step": (after["rows"] - before["rows"]) / max(steps, 1),
                # torch.compile in the timed rounds (the warm-up should have met every shape)
                "compiles": after["compiles"] - before["compiles"],
                "compile_s": after["compile_s"] - before["compile_s"]}
    return (figures(latencies, concurrency) | {"in_server_s": model_s, "before_model_s": before_s} | stepping,
            images[0][0])


def figures(latencies: list[float], concurrency: int) -> dict:
    p50 = statistics.median(latencies)
    return {"latency_s": p50, "images_per_s": concurrency / p50, "rounds_s": latencies}


def server_repositories(setup: Setup, device: str, dest: Path, compile: str = "off",
                        exact_batching: str = "false", encoder: tuple[str, str] | None = None,
                        kernels: dict | None = None, gather_us: int | None = None) -> list[Path]:
    """The default repositories with ``diffusion`` serving the setup's model (step batching), and
    with ``encoder`` (model, recipe) ``ar_encoder`` encoding for it. ``gather_us``: Triton's batching
    window for ``diffusion`` in place of one request per ``execute`` (docs/models.md, "Requests sent
    together")."""
    batch = max(8, max(setup.concurrency))
    dtype = "bfloat16" if device == "cuda" else "float32"
    share = "0.90" if encoder is None else "0.75"  # the encoder's weights take the rest
    edits: dict = {"diffusion": {
        "parameters": {"model": setup.model, "dtype": dtype, "limits": {"max_size": max(1024, *setup.shape)},
                       "gpu_memory_utilization": share if device == "cuda" else "0.30",
                       "compile": compile, "exact_batching": exact_batching}
        | (kernels or {}),
        "max_batch_size": batch}}
    if gather_us is not None:
        edits["diffusion"] |= {"max_queue_delay_us": gather_us, "preferred_batch_size": []}
    if encoder is not None:
        edits["ar_encoder"] = {"parameters": {"model": encoder[0], "recipe": encoder[1], "dtype": dtype,
                                              "gpu_memory_utilization": "0.20"}}
    return copy_repositories(DEFAULT_REPOSITORIES, dest, edits)


def run(family: str, preset: str, rounds: int, concurrency: tuple[int, ...] | None, compile: str = "off",
        compile_direct: bool = False, exact_batching: str = "false", end_to_end: bool = False,
        aa: bool = False, tokens: int | None = None, shared_memory: bool = False, kernels: dict | None = None,
        gather_us: int | None = None, steps: int | None = None) -> dict:
    """``steps``: the denoising steps in place of the setup's (a model too slow for its full run
    here is measured over fewer: the ratios are per step); ``kernels``: the server's ``diffusion``
    parameters given on the command line (quantization,
    fp8_kept, attention_backend, cuda_graphs, embeds_dtype, steps_ahead); ``gather_us``: its batching
    window (``server_repositories``)."""
    setup = SETUPS[(family, preset)]
    if tokens is not None:  # the prompts' (and negatives') token count, for what the embeddings' size costs
        setup = dataclasses.replace(setup, tokens=tokens, negative_tokens=tokens)
    if steps is not None:
        setup = dataclasses.replace(setup, steps=steps)
    levels = concurrency or setup.concurrency
    device = "cuda" if preset == "realistic" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if end_to_end and (family, preset) not in ENCODERS:
        raise SystemExit(f"--end-to-end: no text encoder is built for {family} {preset}")
    encoder = (ENCODERS[(family, preset)], RECIPES[family]) if end_to_end else None
    pipeline = pipeline_of(setup, device, dtype, encoder[0] if encoder else None)
    if compile_direct:
        pipeline.transformer.compile_repeated_blocks()
    requests = Requests(family, setup, hidden_size(pipeline), end_to_end, pooled_size(pipeline),
                        (kernels or {}).get("embeds_dtype", "float32"))
    linear_flops, attention_flops = flop_parts_per_image(pipeline, requests)
    flops = linear_flops + attention_flops
    # the least time an image can take: the served linear layers at their type's peak, attention at bf16's
    limit_s = limit_seconds(linear_flops, attention_flops, device_name(), (kernels or {}).get("quantization") == "fp8")
    direct = {c: measure_direct(pipeline, requests, c, rounds, device, dtype) for c in levels}
    again = {c: measure_direct(pipeline, requests, c, rounds, device, dtype) for c in levels} if aa else {}
    del pipeline
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()  # the server's copy takes this GPU next
    with tempfile.TemporaryDirectory() as tmp, TritonServer(ServerOptions(
            model_repositories=server_repositories(setup, device, Path(tmp), compile, exact_batching, encoder,
                                                   kernels, gather_us),
            http_port=free_port(),
            grpc_port=free_port(), metrics_port=free_port(), model_control_mode="explicit",
            load_models=["ar_encoder", "diffusion", "text_to_image"] if end_to_end else ["diffusion"],
            log_file=Path(tmp) / "tritonserver.log")) as server, \
            OmniClient(server.grpc_url, shared_memory=shared_memory, admin_key=server.admin_key) as client:
        triton = {c: measure_triton(client, requests, c, rounds, server.metrics_url) for c in levels}
    points = []
    for c in levels:
        (d, d_image), (t, t_image) = direct[c], triton[c]
        points.append({"concurrency": c, "direct": d, "triton": t,
                       "latency_ratio": t["latency_s"] / d["latency_s"],
                       "throughput_ratio": t["images_per_s"] / d["images_per_s"],
                       "first_image_max_diff": int(np.abs(t_image.astype(int) - d_image.astype(int)).max()),
                       "first_image_mean_diff": float(np.abs(t_image.astype(int) - d_image.astype(int)).mean()),
                       "first_image_psnr_db": psnr(t_image, d_image)})
        peak = peak_bf16(device_name())
        for side in ("direct", "triton"):
            points[-1][side]["mfu"] = c * flops / points[-1][side]["latency_s"] / peak if peak else None
        points[-1]["triton"]["of_limit"] = c * limit_s / points[-1]["triton"]["latency_s"] if limit_s else None
        if c in again:  # the A/A: the direct side against itself
            points[-1] |= {"aa_latency_ratio": again[c][0]["latency_s"] / d["latency_s"],
                           "aa_throughput_ratio": again[c][0]["images_per_s"] / d["images_per_s"]}
    return {"family": family, "preset": preset, "setup": setup.__dict__, "rounds": rounds, "device": device_name(),
            "compile": {"triton": compile, "direct": compile_direct}, "exact_batching": exact_batching,
            "end_to_end": end_to_end, "shared_memory": shared_memory, "kernels": kernels or {},
            "gather_us": gather_us,
            "tflop_per_image": flops / 1e12, "attention_tflop_per_image": attention_flops / 1e12,
            "limit_s_per_image": limit_s,
            "date": time.strftime("%Y-%m-%d"), "points": points}


def report(result: dict) -> None:
    s = result["setup"]
    compiled = result.get("compile", {})
    triton = {True: "blocks", False: "off"}.get(compiled.get("triton"), compiled.get("triton", "off"))  # old: a bool
    gather_us = result.get("gather_us")
    window = "" if gather_us is None else f", Triton's batching window {gather_us} µs"
    size = f"{s['size']}x{s.get('height') or s['size']}" + (f"x{s['frames']} frames" if s.get("frames") else "")
    print(f"{result['family']} ({result['preset']}: {size}, {s['steps']} steps, guidance {s['guidance']}) "
          f"on {result['device']}, {result['rounds']} rounds, compiled: Triton {triton}, diffusers "
          f"{'blocks' if compiled.get('direct') else 'off'}, "
          f"server exact_batching: {result.get('exact_batching', 'false')}, "
          f"{'end to end (text_to_image, prompts)' if result.get('end_to_end') else 'diffusion (embeddings)'}"
          f"{', through shared memory' if result.get('shared_memory') else ''}"
          f"{''.join(f', server {k} {v}' for k, v in result.get('kernels', {}).items())}{window}")
    if "tflop_per_image" in result:
        print(f"the DiT's work per image: {result['tflop_per_image']:.1f} TFLOP (MFU: of the GPU's dense bf16 peak)")
    if result.get("limit_s_per_image"):
        fp8 = result.get("kernels", {}).get("quantization") == "fp8"
        print(f"its least time on this GPU: {result['limit_s_per_image']:.3f} s an image ({'FP8' if fp8 else 'bf16'} "
              f"linear layers at their dense peak, the {result['attention_tflop_per_image']:.1f} TFLOP of attention "
              "at bf16's); Triton's latency against it: " + ", ".join(
                  f"{p['triton']['of_limit']:.1%} at concurrency {p['concurrency']}" for p in result["points"]))
    print(f"{'conc':>4} {'direct s':>9} {'triton s':>9} {'latency t/d':>12} {'img/s direct':>13} "
          f"{'img/s triton':>13} {'throughput t/d':>15} {'MFU d':>6} {'MFU t':>6} {'image diff: max':>16} "
          f"{'mean':>6} {'PSNR dB':>8}")
    for p in result["points"]:
        mfu = [f"{p[side].get('mfu'):.1%}" if p[side].get("mfu") else "-" for side in ("direct", "triton")]
        print(f"{p['concurrency']:>4} {p['direct']['latency_s']:>9.3f} {p['triton']['latency_s']:>9.3f} "
              f"{p['latency_ratio']:>12.3f} {p['direct']['images_per_s']:>13.3f} {p['triton']['images_per_s']:>13.3f} "
              f"{p['throughput_ratio']:>15.3f} {mfu[0]:>6} {mfu[1]:>6} {p['first_image_max_diff']:>16} "
              f"{p.get('first_image_mean_diff', 0):>6.2f} {p.get('first_image_psnr_db', float('inf')):>8.1f}")
    for p in result["points"]:
        before = p["triton"].get("before_model_s")
        print(f"concurrency {p['concurrency']}: a request's mean time inside the model "
              f"{p['triton']['in_server_s']:.3f} s" + (f", in Triton before it {before * 1000:.1f} ms (queue, "
                                                        f"inputs copied)" if before is not None else "")
              + "; the rest of its latency: the client and gRPC"
              + (f"; {p['triton']['steps_per_round']:.1f} steps a round, {p['triton']['requests_per_step']:.2f} "
                 f"requests a step" if "steps_per_round" in p["triton"] else "")
              + (f"; torch.compile in the timed rounds: {p['triton']['compiles']:.0f} compilations, "
                 f"{p['triton']['compile_s']:.1f} s" if p["triton"].get("compiles") else ""))
        if "aa_latency_ratio" in p:
            print(f"A/A, concurrency {p['concurrency']}: direct / direct latency {p['aa_latency_ratio']:.3f}, "
                  f"throughput {p['aa_throughput_ratio']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted({family for family, _ in SETUPS}), required=True)
    parser.add_argument("--preset", choices=["tiny", "realistic"], default="tiny")
    parser.add_argument("--rounds", type=int, default=2, help="measured calls per side and concurrency")
    parser.add_argument("--concurrency", help="comma-separated (default: the setup's)")
    parser.add_argument("--compile", nargs="?", const="blocks", default="off", metavar="PARTS",
                        help="the server's compile (default off; alone: blocks, the DiT's; blocks,vae: its VAE's "
                             "decoder too)")
    parser.add_argument("--compile-direct", action="store_true", help="the pipeline's blocks compiled as well")
    parser.add_argument("--exact-batching", choices=["false", "pipeline"], default="false",
                        help="the server's exact_batching (pipeline: each request's passes alone)")
    parser.add_argument("--end-to-end", action="store_true",
                        help="prompts, the text encoder included: text_to_image against the pipeline's own call")
    parser.add_argument("--aa", action="store_true", help="the direct side twice: the host against itself")
    parser.add_argument("--tokens", type=int, help="the embeddings' token count (default: the setup's)")
    parser.add_argument("--shared-memory", action="store_true",
                        help="the embeddings and the image through system shared memory, not in the messages")
    parser.add_argument("--quantization", choices=["none", "fp8"], help="the server's DiT quantization")
    parser.add_argument("--fp8-kept", help="the server's fp8_kept (layer patterns left in bf16; default: the family's)")
    parser.add_argument("--fp8-scales", choices=["row", "tensor"], help="the server's fp8_scales (default: row)")
    parser.add_argument("--attention-backend", help="the server's attention_backend (default: auto)")
    parser.add_argument("--fuse-projections", action="store_const", const="true",
                        help="the server's fuse_projections: each attention's q, k and v one linear layer")
    parser.add_argument("--gelu-epilogue", action="store_const", const="true",
                        help="the server's gelu_epilogue: each feed-forward's tanh GELU in its projection's matmul")
    parser.add_argument("--cuda-graphs", choices=["true", "false"],
                        help="the server's cuda_graphs (default: true; a DiT's apply under --compile)")
    parser.add_argument("--embeds-dtype", choices=["float32", "bfloat16"],
                        help="the server's embeds_dtype, and the type the client sends the embeddings in "
                             "(default: float32; bfloat16: half the bytes, the same values on both sides)")
    parser.add_argument("--steps-ahead", type=int, help="the server's steps_ahead (default: 2; GPU only)")
    parser.add_argument("--gather-us", type=int, help="Triton's batching window for diffusion, in microseconds, "
                        "in place of one request per execute (requests sent together share their first step)")
    parser.add_argument("--steps", type=int, help="denoising steps in place of the setup's (the ratios are per step)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    levels = tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else None
    # model parameters are strings
    kernels = {name: str(value) for name, value in (("quantization", args.quantization), ("fp8_kept", args.fp8_kept),
                                                     ("fp8_scales", args.fp8_scales),
                                                     ("fuse_projections", args.fuse_projections),
                                                     ("gelu_epilogue", args.gelu_epilogue),
                                                     ("attention_backend", args.attention_backend),
                                                     ("cuda_graphs", args.cuda_graphs),
                                                     ("embeds_dtype", args.embeds_dtype),
                                                     ("steps_ahead", args.steps_ahead)) if value is not None}
    result = run(args.family, args.preset, args.rounds, levels, args.compile, args.compile_direct,
                 args.exact_batching, args.end_to_end, args.aa, args.tokens, args.shared_memory, kernels,
                 args.gather_us, args.steps)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
