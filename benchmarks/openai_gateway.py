"""The OpenAI gateway against Triton's gRPC API on the same server, same requests.

Two workloads, each run in rounds that alternate the two sides (gateway,
direct, gateway, ...), so that drift on a shared host hits both alike; the
ratio printed is the median of the rounds' ratios:

* images: `text_to_image` at concurrency 16 (closed loop), the preset's image
  work (`--preset tiny`: 32x32, 2 steps; `realistic`: 512x512, 20 steps, SD 1.5's size): images/s through
  `/v1/images/generations` (PNG, base64) against `tritonclient.grpc.aio`'s
  `infer` (raw uint8);
* chat: `ar` at concurrency 64, streamed, `ignore_eos` so every request makes
  the preset's number of tokens (16; 128): output tokens/s through `/v1/chat/completions`
  (server-sent events) against a gRPC stream of the very inputs the gateway
  sends the model (the rendered prompt, and the finish reason and token counts
  its answer's usage needs); ``--direct-outputs minimal`` asks the direct side
  for the text and output token count only.

`--edits` measures image edits instead (Qwen-Image-Edit): `text_to_image` with
one input image at concurrency 16, through `/v1/images/edits` (multipart: the
image file and the form fields, as the `openai` SDK sends them; PNG, base64)
against `tritonclient.grpc.aio`'s `infer` with the same file in `images`.
`--preset tiny` serves the tiny edit demo (32², 2 steps); `realistic` the
20 B edit DiT and a Qwen2.5-VL-7B-shaped encoder with its vision tower
(random weights; the encoder folder, about 17 GB, built into the cache on
first use), at 1024² and `--edit-steps` steps (4 by default: 16 edits of 50
steps are minutes a round). The input image is a 1024² PNG either way.

`--videos` measures videos instead (Wan): `text_to_image` at concurrency 4,
through `/v1/videos` as the `openai` SDK's `create_and_poll` and
`download_content` use it (create the job, poll it, fetch the MP4) against
`tritonclient.grpc.aio`'s `infer` of the same video (the raw frames).
`--preset tiny` serves the tiny Wan demo (32², 5 frames, 2 steps); `realistic`
Wan 2.1 T2V-1.3B's DiT and VAE and UMT5-XXL's encoder at their real shapes
(random weights; the encoder folder, about 11 GB, built into the cache on first
use) at the model card's 832x480 and 81 frames, 10 steps by default; or give
`--grpc-url` and `--openai-url` of a server that serves one (`--video-size`,
`--video-frames`, `--video-steps` set the work).

`--aa` runs the direct side against itself: the spread of those ratios is
the finest difference this host can resolve.

By default it starts its own server and gateway (the demo models); give
`--grpc-url` and `--openai-url` to measure a running `omni-triton serve`
(a GPU host, `--demo`, real models).

    .venv/bin/python benchmarks/openai_gateway.py --json .cache/openai-gateway.json
    python benchmarks/openai_gateway.py --edits --preset realistic [--aa]      # GPU: Qwen-Image-Edit's edits
    python benchmarks/openai_gateway.py --videos [--aa]                          # the tiny Wan demo
    python benchmarks/openai_gateway.py --videos --preset realistic --rounds 2 --video-requests 4 --with-aa  # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from triton_omni_client.client import batched_inputs, omni_inputs
from triton_omni_gateway.requests import ChatRequest
from triton_omni_gateway.text import ar_values
from triton_omni_tools.bench.harness import bench_repository
from triton_omni_tools.bench.presets import PRESETS, Preset, edit_picture
from triton_omni_tools.gateway import Gateway, default_workers, text_model_tokenizers
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, ServerOptions, TritonServer, free_port

PROMPT = "a lighthouse on a cliff at dusk"
MESSAGES = [{"role": "user", "content": "Describe a lighthouse on a cliff at dusk."}]


async def closed_loop(concurrency: int, requests: int, call) -> tuple[float, list[float], int]:
    """``requests`` calls by ``concurrency`` workers: (seconds, latencies, units counted by ``call``)."""
    todo = iter(range(requests))
    latencies: list[float] = []
    units = 0

    async def worker():
        nonlocal units
        for _ in todo:
            started = time.perf_counter()
            made = await call()  # not `units += await call()`: that reads `units` before the await
            units += made
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies, units


class Images:
    name, unit = "images", "images/s"

    def __init__(self, grpc: aioclient.InferenceServerClient, http: httpx.AsyncClient, options: dict):
        self.grpc, self.http, self.options = grpc, http, options

    async def direct(self) -> int:
        inputs = batched_inputs(grpcclient, text_input=PROMPT, **self.options)  # as the gateway sends it
        result = await self.grpc.infer("text_to_image", inputs)
        assert result.as_numpy("image").shape[0] == 1
        return 1

    async def gateway(self) -> int:
        size = f"{self.options['width']}x{self.options['height']}"
        body = {"prompt": PROMPT, "size": size, "seed": self.options["seed"],
                "num_inference_steps": self.options["num_inference_steps"],
                "guidance_scale": self.options["guidance_scale"]}
        response = await self.http.post("/v1/images/generations", json=body)
        response.raise_for_status()
        return len(response.json()["data"])


class Edits:
    """An edit of one input image through `text_to_image`: its encoder reads the image with the
    prompt, its DiT the image's latents."""

    name, unit = "edits", "images/s"

    def __init__(self, grpc: aioclient.InferenceServerClient, http: httpx.AsyncClient, options: dict, image: bytes):
        self.grpc, self.http, self.options, self.image = grpc, http, options, image

    async def direct(self) -> int:
        inputs = batched_inputs(grpcclient, text_input=PROMPT, images=[self.image], **self.options)
        result = await self.grpc.infer("text_to_image", inputs)
        assert result.as_numpy("image").shape[0] == 1
        return 1

    async def gateway(self) -> int:
        size = f"{self.options['width']}x{self.options['height']}"
        fields = {"model": "text_to_image", "prompt": PROMPT, "size": size,
                  **{name: str(self.options[name]) for name in ("seed", "num_inference_steps", "guidance_scale")}}
        response = await self.http.post("/v1/images/edits", data=fields,
                                        files={"image": ("in.png", self.image, "image/png")})
        response.raise_for_status()
        return len(response.json()["data"])


class Videos:
    """A video through `text_to_image`: the gateway's job (created, polled, its MP4 fetched) against
    one gRPC call that returns the frames."""

    name, unit = "videos", "videos/s"
    POLL_S = 0.02  # between a job's polls, as a client polls (the SDK's create_and_poll waits longer)

    def __init__(self, grpc: aioclient.InferenceServerClient, http: httpx.AsyncClient, options: dict):
        self.grpc, self.http, self.options = grpc, http, options

    async def direct(self) -> int:
        inputs = batched_inputs(grpcclient, text_input=PROMPT, **self.options)
        result = await self.grpc.infer("text_to_image", inputs)
        assert result.as_numpy("video").shape[1] == self.options["num_frames"]
        return 1

    async def gateway(self) -> int:
        options = self.options
        body = {"model": "text_to_image", "prompt": PROMPT, "size": f"{options['width']}x{options['height']}",
                **{name: options[name] for name in ("seed", "num_inference_steps", "guidance_scale", "num_frames")}}
        response = await self.http.post("/v1/videos", json=body)
        response.raise_for_status()
        job = response.json()
        while job["status"] in ("queued", "in_progress"):
            await asyncio.sleep(self.POLL_S)
            job = (await self.http.get(f"/v1/videos/{job['id']}")).raise_for_status().json()
        assert job["status"] == "completed", job
        content = await self.http.get(f"/v1/videos/{job['id']}/content")
        assert content.raise_for_status().headers["content-type"] == "video/mp4"
        # fetched: deleted, as a client done with it does (a gateway keeps a bounded number of jobs)
        (await self.http.delete(f"/v1/videos/{job['id']}")).raise_for_status()
        return 1


class Chat:
    name, unit = "chat", "output tokens/s"

    def __init__(self, grpc: aioclient.InferenceServerClient, http: httpx.AsyncClient, prompt: str, tokens: int,
                 outputs: str = "gateway"):
        """``outputs``: what the direct side asks the model for. ``gateway``: the very inputs the gateway
        sends (finish reason, token counts: what a chat answer's usage needs); ``minimal``: the text and the
        output token count only."""
        self.grpc, self.http, self.prompt, self.tokens, self.outputs = grpc, http, prompt, tokens, outputs
        self.first_token_s: list[float] = []  # each call's time to its first token, taken by compare()

    def body(self) -> dict:
        return {"model": "ar", "messages": MESSAGES, "max_tokens": self.tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}

    def direct_values(self) -> dict:
        if self.outputs == "gateway":  # what the gateway sends the model for body()
            return ar_values(self.prompt, ChatRequest(**self.body()).sampling())
        sampling = {"max_tokens": self.tokens, "ignore_eos": True}
        return {"text_input": self.prompt, "stream": True, "exclude_input_in_output": True,
                "sampling_parameters": json.dumps(sampling), "return_num_output_tokens": True}

    async def direct(self) -> int:
        values = self.direct_values()
        done = asyncio.Event()

        async def one_request():
            yield {"model_name": "ar", "inputs": omni_inputs(grpcclient, values)}
            await done.wait()

        tokens, started = 0, time.perf_counter()
        async for result, error in self.grpc.stream_infer(one_request()):
            assert error is None, error
            if not tokens:
                self.first_token_s.append(time.perf_counter() - started)
            tokens += int(result.as_numpy("num_output_tokens")[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        done.set()
        return tokens

    async def gateway(self) -> int:
        started = time.perf_counter()
        if isinstance(self.http, AiohttpClient):
            url = self.http.base_url + "/v1/chat/completions"
            async with self.http.session.post(url, json=self.body()) as response:
                response.raise_for_status()
                return await self._usage(started, (raw.decode() async for raw in response.content))
        async with self.http.stream("POST", "/v1/chat/completions", json=self.body()) as response:
            response.raise_for_status()
            return await self._usage(started, response.aiter_lines())

    async def _usage(self, started: float, lines) -> int:
        """The completion tokens of the stream's usage chunk; its first chunk's time noted."""
        tokens, first = 0, True
        async for line in lines:
            if first and line.startswith("data: {"):
                first = False
                self.first_token_s.append(time.perf_counter() - started)
            if line.startswith("data: {") and '"usage": {' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return tokens


class AiohttpClient:
    """The chat's gateway side on aiohttp (AIPerf's HTTP client) instead of httpx: which of the two the
    gateway's figure depends on says whether a loss is the server's or the client's."""

    def __init__(self, base_url: str):
        import aiohttp

        self.base_url = base_url
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256),
                                             timeout=aiohttp.ClientTimeout(total=600))


def cpu_seconds(pid: int | None) -> float:
    """CPU time a process and its children (the gateway's workers) have used; 0 when unknown."""
    if pid is None:
        return 0.0
    total = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(entry.name) == pid or int(fields[1]) == pid:
                total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def compare(workload, concurrency: int, requests: int, rounds: int, aa: bool = False,
                  gateway_pid: int | None = None) -> dict:
    """Warm-up, then ``rounds`` pairs (their order alternating): each side's rate and the median ratio,
    and the cores that the gateway's process and this one (the clients) kept busy meanwhile.
    ``aa``: the direct side against itself, the finest ratio this host resolves."""
    sides = {"gateway": workload.direct if aa else workload.gateway, "direct": workload.direct}
    for call in sides.values():
        await closed_loop(concurrency, concurrency, call)
    getattr(workload, "first_token_s", []).clear()
    rates: dict[str, list[float]] = {side: [] for side in sides}
    p50s: dict[str, list[float]] = {side: [] for side in sides}
    first_token: dict[str, list[float]] = {side: [] for side in sides}  # chat: p50 time to the first token
    cores: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}  # (gateway, clients)
    for index in range(rounds):
        order = ("gateway", "direct") if index % 2 == 0 else ("direct", "gateway")
        for side in order:
            gateway_cpu, client_cpu = cpu_seconds(gateway_pid), time.process_time()
            seconds, latencies, units = await closed_loop(concurrency, requests, sides[side])
            cores[side].append(((cpu_seconds(gateway_pid) - gateway_cpu) / seconds,
                                (time.process_time() - client_cpu) / seconds))
            rates[side].append(units / seconds)
            p50s[side].append(float(np.percentile(latencies, 50)))
            firsts = getattr(workload, "first_token_s", None)
            if firsts:
                first_token[side].append(float(np.percentile(firsts, 50)))
                firsts.clear()
    ratios = [g / d for g, d in zip(rates["gateway"], rates["direct"], strict=True)]
    return {"workload": workload.name + (" A/A" if aa else ""), "unit": workload.unit, "concurrency": concurrency,
            "requests": requests, "rounds": rounds, "gateway": statistics.median(rates["gateway"]),
            "direct": statistics.median(rates["direct"]), "ratio": statistics.median(ratios), "ratios": ratios,
            "p50_s": {side: statistics.median(values) for side, values in p50s.items()},
            "first_token_p50_s": {side: statistics.median(values) for side, values in first_token.items() if values},
            "cores": {side: [statistics.median(c[i] for c in values) for i in (0, 1)]
                      for side, values in cores.items()}}


async def run(grpc_url: str, openai_url: str, args) -> list[dict]:
    width, height = args.size if isinstance(args.size, tuple) else (args.size, args.size)
    options = {"num_inference_steps": args.steps, "height": height, "width": width, "seed": 1,
               "guidance_scale": args.guidance}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with aioclient.InferenceServerClient(grpc_url) as grpc, \
            httpx.AsyncClient(base_url=openai_url, timeout=600, limits=limits) as http:
        async def measured(workload, concurrency: int, requests: int) -> list[dict]:
            """The comparison, and with --with-aa the host's A/A after it (same rounds, requests, warm-up)."""
            modes = [False, True] if args.with_aa else [args.aa]
            return [await compare(workload, concurrency, requests, args.rounds, aa, args.gateway_pid) for aa in modes]

        if args.edits:
            return await measured(Edits(grpc, http, options, edit_picture()), args.image_concurrency,
                                  args.image_requests)
        if args.videos:
            return await measured(Videos(grpc, http, options | {"num_frames": args.video_frames}),
                                  args.video_concurrency, args.video_requests)
        prompt = rendered_prompt(args.tokenizer)
        chat_http = AiohttpClient(openai_url) if args.http_client == "aiohttp" else http
        images, chat = Images(grpc, http, options), Chat(grpc, chat_http, prompt, args.tokens, args.direct_outputs)
        try:
            return [await compare(images, args.image_concurrency, args.image_requests, args.rounds, args.aa,
                                  args.gateway_pid),
                    await compare(chat, args.chat_concurrency, args.chat_requests, args.rounds, args.aa,
                                  args.gateway_pid)]
        finally:
            if chat_http is not http:
                await chat_http.session.close()


def video_size(text: str) -> tuple[int, int]:
    """``--video-size``: ``WIDTHxHEIGHT``, or one side of a square."""
    width, _, height = text.partition("x")
    return int(width), int(height or width)


def rendered_prompt(tokenizer_path: str) -> str:
    """The prompt text the gateway sends for MESSAGES: the same chat template, applied here."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def report(results: list[dict]) -> None:
    print(f"{'workload':<8} {'conc':>4} {'gateway':>12} {'direct':>12} {'ratio':>6}  p50 gateway / direct (s)")
    for r in results:
        print(f"{r['workload']:<8} {r['concurrency']:>4} {r['gateway']:>12.2f} {r['direct']:>12.2f} "
              f"{r['ratio']:>6.3f}  {r['p50_s']['gateway']:.3f} / {r['p50_s']['direct']:.3f}   ({r['unit']}; "
              f"rounds' ratios {' '.join(f'{x:.3f}' for x in r['ratios'])})")
        if r.get("first_token_p50_s"):
            first = r["first_token_p50_s"]
            print(f"{'':<8} time to first token, p50 gateway / direct: "
                  f"{first['gateway']:.3f} / {first['direct']:.3f} s")
        gateway, direct = r["cores"]["gateway"], r["cores"]["direct"]
        print(f"{'':<8} cores busy, gateway process / clients: {gateway[0]:.2f} / {gateway[1]:.2f} on the gateway "
              f"side, {direct[0]:.2f} / {direct[1]:.2f} on the direct side")


# --edits --preset realistic: the edit DiT and its encoder at their real shapes, on one GPU
REALISTIC_EDITS = {
    # the 41 GB DiT and a step batch of 4 edits (8.7 k tokens each at 1024²); the encoder's 17 GB beside it
    "diffusion": {"parameters": {"model": "demo:realistic-qwen-image-edit", "dtype": "bfloat16",
                                 "gpu_memory_utilization": "0.70", "limits": {"max_size": 1024}, "max_rows": "4"}},
    "ar_encoder": {"parameters": {"model": "demo:realistic-qwen-image-edit-encoder", "recipe": "qwen_image_edit",
                                  "dtype": "bfloat16", "engine": "transformers", "gpu_memory_utilization": "0.25"}},
}

# --videos --preset realistic: Wan 2.1 T2V-1.3B and UMT5-XXL at their real shapes, on one GPU
REALISTIC_VIDEOS = {
    "diffusion": {"parameters": {"model": "demo:realistic-wan2.1-1.3b", "dtype": "bfloat16",
                                 "gpu_memory_utilization": "0.60", "limits": {"max_size": 1280}, "max_rows": "4"}},
    "ar_encoder": {"parameters": {"model": "demo:realistic-wan-encoder", "recipe": "wan", "dtype": "bfloat16",
                                  "gpu_memory_utilization": "0.20"}},
    "text_to_image": {"media": "video"},
}
REALISTIC = {"edits": REALISTIC_EDITS, "videos": REALISTIC_VIDEOS}


@contextlib.contextmanager
def edits_server(preset: str, workers: int, workload: str = "edits"):
    """The edit models, or Wan's with ``workload`` videos (or another demo's: ``preset`` names it),
    on a server of this run's own, and a gateway in front of it."""
    from triton_omni.demo_models import resolve_model
    from triton_omni_tools.repository import copy_repositories

    with tempfile.TemporaryDirectory() as tmp:
        if preset == "realistic":
            edits = REALISTIC[workload]
            resolve_model(edits["ar_encoder"]["parameters"]["model"])  # built before the server needs the GPU
            extra = {"model_repositories": copy_repositories(DEFAULT_REPOSITORIES, Path(tmp) / "repos", edits),
                     # Triton's pool for GPU tensors between the stages: an edit's embeddings are about 20 MB
                     # (its image's vision tokens), and the default 64 MB held three of 16 in flight
                     "extra_args": ["--cuda-memory-pool-byte-size=0:1073741824"]}
        else:
            extra = {"demo": preset}
        with TritonServer(ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                        model_control_mode="explicit",
                                        load_models=["ar_encoder", "diffusion", "text_to_image"], **extra)) as server:
            yield from fronted(server, {}, workers)


@contextlib.contextmanager
def own_server(preset: Preset, workers: int):
    """The preset's models (bench's presets) on a server of this run's own, and a gateway in front of it."""
    with tempfile.TemporaryDirectory() as tmp, TritonServer(ServerOptions(
            model_repositories=bench_repository(preset, Path(tmp)), http_port=free_port(), grpc_port=free_port(),
            metrics_port=free_port())) as server:
        yield from fronted(server, text_model_tokenizers(server.repositories), workers)


def fronted(server: TritonServer, tokenizers: dict, workers: int):
    """A gateway in front of ``server`` for as long as the caller holds it: (gRPC URL, gateway URL,
    the ``ar`` model's tokenizer or None, the gateway's pid)."""
    gateway = Gateway(free_port(), "127.0.0.1", server.grpc_url, tokenizers, workers=workers).start()
    try:
        yield server.grpc_url, f"http://{gateway.url}", tokenizers.get("ar"), gateway.process.pid
    finally:
        gateway.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc-url", help="a running server's gRPC address (with --openai-url)")
    parser.add_argument("--openai-url", help="its gateway, e.g. http://localhost:9000")
    parser.add_argument("--gateway-pid", type=int, help="the gateway's process (with --openai-url): its CPU use "
                        "is reported")
    parser.add_argument("--tokenizer", help="the ar model's tokenizer (with --grpc-url; for the direct side's "
                        "prompt, rendered with the same chat template)")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="the gateway's processes (as `omni-triton serve` picks them by default)")
    parser.add_argument("--image-concurrency", type=int, default=16)
    parser.add_argument("--image-requests", type=int, default=64, help="per side and round")
    parser.add_argument("--chat-concurrency", type=int, default=64)
    parser.add_argument("--chat-requests", type=int, default=128, help="per side and round")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="the models and image work of `omni-triton bench`'s preset (realistic: on a GPU)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--http-client", choices=["httpx", "aiohttp"], default="httpx",
                        help="chat's gateway side: httpx (the openai SDK's) or aiohttp (AIPerf's)")
    parser.add_argument("--direct-outputs", choices=["gateway", "minimal"], default="gateway",
                        help="chat's direct side asks the model for the gateway's very outputs (the same request), "
                        "or for the text and token count only")
    parser.add_argument("--with-aa", action="store_true", help="--edits, --videos: the comparison, then the "
                        "A/A on the same server with the same rounds, requests and warm-up")
    parser.add_argument("--aa", action="store_true", help="direct against direct: the spread this host "
                        "shows with no gateway at all (run it first on a new host)")
    workloads = parser.add_mutually_exclusive_group()
    workloads.add_argument("--edits", action="store_true", help="image edits (Qwen-Image-Edit) through "
                           "/v1/images/edits against gRPC, instead of the images and chat workloads")
    parser.add_argument("--edit-steps", type=int, default=4, help="--edits --preset realistic: steps per edit")
    workloads.add_argument("--videos", action="store_true", help="videos (Wan) through /v1/videos against gRPC, "
                           "instead of the images and chat workloads (a gateway of one process: jobs live in it)")
    parser.add_argument("--video-concurrency", type=int, default=4)
    parser.add_argument("--video-requests", type=int, default=8, help="per side and round")
    parser.add_argument("--video-size", help="--videos: WIDTHxHEIGHT or a square's side (default: 32 on the tiny "
                        "demo, 832x480 on the realistic one)")
    parser.add_argument("--video-frames", type=int, help="--videos: frames per video (default: 5 on the tiny "
                        "demo, 81 on the realistic one)")
    parser.add_argument("--video-steps", type=int, help="--videos: steps per video (default: 2 on the tiny demo)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    args.steps, args.size, args.guidance, args.tokens = preset.steps, preset.size, preset.guidance, preset.max_tokens
    if args.edits:  # true CFG needs a negative prompt: 4 is the edit pipeline's scale, here without one
        args.steps, args.size, args.guidance = (2, 32, 4.0) if args.preset == "tiny" else (args.edit_steps, 1024, 4.0)
    if args.videos:  # Wan's CFG at its model card's 5; realistic: its 480p (832x480, 81 frames)
        realistic = args.preset == "realistic"
        args.steps = args.video_steps or (10 if realistic else 2)
        args.size = video_size(args.video_size or ("832x480" if realistic else "32"))
        args.video_frames = args.video_frames or (81 if realistic else 5)
        args.guidance = 5.0
        args.workers = 1  # a gateway of several processes answers /v1/videos with a 501

    with contextlib.suppress(ImportError):  # the clients' loop: uvloop where installed, as the gateway's is
        import uvloop

        uvloop.install()
    if args.grpc_url:
        results = asyncio.run(run(args.grpc_url, args.openai_url, args))
    elif args.edits or args.videos:
        demo = args.preset if args.preset == "realistic" else "wan" if args.videos else "qwen-image-edit"
        workload = "videos" if args.videos else "edits"
        with edits_server(demo, args.workers, workload) as (grpc_url, openai_url, _, gateway_pid):
            args.gateway_pid = args.gateway_pid or gateway_pid
            results = asyncio.run(run(grpc_url, openai_url, args))
    else:
        from triton_omni.demo_models import build_all

        build_all()
        with own_server(preset, args.workers) as (grpc_url, openai_url, tokenizer, gateway_pid):
            args.tokenizer, args.gateway_pid = args.tokenizer or tokenizer, args.gateway_pid or gateway_pid
            results = asyncio.run(run(grpc_url, openai_url, args))
    report(results)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"host": platform.node(), "results": results}, out, indent=2)


if __name__ == "__main__":
    main()
