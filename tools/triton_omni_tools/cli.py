"""``omni-triton``: serve the model repository, build demo models, call the models."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-triton", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start tritonserver with the triton-omni models")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--model-repository", action="append", type=Path,
                       help="repository path (repeatable); default: model_repository/ and ensemble/")
    serve.add_argument("--log-verbose", type=int, default=0)
    serve.add_argument("--model-control-mode", choices=["none", "explicit", "poll"], default="none")
    serve.add_argument("--load-model", action="append", default=[], help="with explicit mode (repeatable)")
    serve.add_argument("--bind", default="127.0.0.1",
                       help="address of the HTTP, gRPC and metrics endpoints (default loopback; 0.0.0.0 for all)")
    serve.add_argument("--server", choices=["auto", "embedded", "system"], default="auto",
                       help="system: /opt/tritonserver (NGC image); embedded: the nvidia-pytriton bundle")
    serve.add_argument("--place", action="append", default=[], metavar="STAGE=GPUS[xN][:shared]",
                       help="which GPUs a stage uses (repeatable): diffusion=0,1 (an instance on each), "
                            "diffusion=allx2, ar=tp:0,1 (one vLLM engine, tensor parallel), ar=0x3:shared (three "
                            "instances in front of one vLLM engine); docs/gpu.md")
    serve.add_argument("--remote", action="append", default=[], metavar="MODEL=HOST:PORT",
                       help="a stage served by another Triton server (repeatable): ar_encoder=encoder-pool:8001, or "
                            "dns:///NAME:PORT to balance over every address NAME resolves to; docs/operations.md")
    serve.add_argument("--exit-timeout-secs", type=int, default=None, metavar="S",
                       help="on SIGTERM or Ctrl-C, how long requests in flight may take to finish (new ones "
                            "are refused meanwhile); 15 by default. A pod's grace period must cover it "
                            "(docs/operations.md)")
    serve.add_argument("--no-supervise", action="store_true",
                       help="do not restart a model whose stub died (docs/operations.md)")
    # No argparse choices: the names are the families' (triton_omni.families), whose import loads torch.
    serve.add_argument("--demo", default="sd", metavar="FAMILY",
                       help="the family of the demo image models: sd (Stable Diffusion, a UNet), or an "
                            "LLM-conditioned DiT's: qwen-image, qwen-image-edit, z-image, flux2-klein, flux1-dev, ... "
                            "(docs/models.md; a name no family has is answered with the list); ar_encoder runs that "
                            "family's text recipe")
    serve.add_argument("--openai-port", type=int, default=9000,
                       help="port of the OpenAI-compatible API (/v1/images/generations, /v1/chat/completions, ...); "
                       "0 turns it off")
    serve.add_argument("--openai-workers", type=int,
                       help="the gateway's processes (default: one per four cores, at most four)")
    serve.add_argument("--api-key", help="the key OpenAI clients must send (Authorization: Bearer KEY); "
                       "default: $TRITON_OMNI_API_KEY, and no key when that is unset")
    serve.add_argument("--no-restart", action="store_true",
                       help="exit when tritonserver dies instead of starting it again (at most 5 times in "
                            "10 minutes); for a supervisor of your own (docs/operations.md)")
    serve.set_defaults(run=_serve)

    build = commands.add_parser("build-demo-models", help="build the tiny demo models into the cache")
    build.set_defaults(run=_build_demo_models)

    text = commands.add_parser("generate-text", help="generate text with the `ar` model")
    text.add_argument("prompt")
    text.add_argument("--stream", action="store_true")
    text.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    text.add_argument("--url", help="default localhost:8001 (gRPC) / localhost:8000 (HTTP)")
    text.add_argument("--model", default="ar")
    text.add_argument("--max-tokens", type=int, help="default 64 (or max_tokens from --param)")
    text.add_argument("--temperature", type=float)
    text.add_argument("--seed", type=int)
    _add_param_option(text, "any vLLM sampling key, e.g. --param top_p=0.9 --param stop='[\"\\n\"]'")
    text.set_defaults(run=_generate_text)

    omni = commands.add_parser("generate", help="text, images or speech through the `omni` scheduler")
    omni.add_argument("prompt")
    omni.add_argument("--modalities", default="text",
                      help="comma-separated: text, image, text,image, or audio, text,audio (a spoken reply)")
    omni.add_argument("--enhance-prompt", action="store_true", help="let the AR model rewrite the image prompt")
    omni.add_argument("--out", type=Path, help="PNG file for the image (image_1.png, ... for several); with audio, "
                      "the WAV file of the spoken reply")
    omni.add_argument("--voice", help="with audio: one of the speaking model's voices (default: the model's)")
    omni.add_argument("--audio", action="append", type=Path, default=[], dest="input_audio", metavar="IN.wav",
                      help="an audio file the thinker hears before the prompt (WAV, MP3, FLAC, ...; a Qwen3-Omni "
                      "thinker), repeatable")
    omni.add_argument("--image", action="append", type=Path, default=[], dest="images", metavar="IN.png",
                      help="an input image (PNG, JPEG or WebP), repeatable: with image, the diffusion model's; with "
                      "text or text,audio, the thinker sees it before the prompt (a Qwen-Omni thinker on the "
                      "transformers engine)")
    omni.add_argument("--url", help="gRPC address; default localhost:8001")
    omni.add_argument("--model", default="omni")
    omni.add_argument("--max-tokens", type=int)
    _add_image_options(omni)
    omni.add_argument("--num-images", type=int)
    _add_param_option(omni, "any option of `omni` (sampling keys, image options), e.g. --param top_k=20")
    omni.set_defaults(run=_generate)

    bench = commands.add_parser("bench", help="each stage and pipeline, direct vs through Triton, side by side")
    bench.add_argument("--preset", choices=["tiny", "realistic"], default="tiny",
                       help="tiny: demo models on CPU; realistic: real-size random weights on a GPU")
    bench.add_argument("--concurrency", help="comma-separated, for every workload; default: the preset's "
                       "(1,4,8,16; the AR stages 1,8,32,64)")
    bench.add_argument("--workloads",
                       help="comma-separated among diffusion,ar_encoder,ar,ar_transformers,text_to_image,omni")
    bench.add_argument("--diffusion-batching", choices=["step", "request"],
                       help="the Triton side's diffusion batching; default: step (the repository's)")
    bench.add_argument("--open-loop", action="store_true",
                       help="diffusion under Poisson arrivals instead: step against request batching, and "
                       "mixed traffic (writes open-loop.json)")
    bench.add_argument("--loads", default="0.5,0.8",
                       help="open loop: arrival rates as fractions of request batching's peak (\"\": none)")
    bench.add_argument("--requests", type=int, default=200, help="open loop: requests per point")
    bench.add_argument("--no-mixed", action="store_true", help="open loop: skip the mixed-traffic part")
    bench.add_argument("--mixed-modes", help="open loop: the modes mixed traffic runs, comma-separated among "
                       "request,step,step_round_robin,step_shortest_first; default: all")
    bench.add_argument("--gpus", help="comma-separated GPU counts, e.g. 1,2: diffusion one instance per GPU, ar "
                                       "tensor parallel, each against one GPU in the same run (docs/gpu.md)")
    bench.add_argument("--place", action="append", default=[], metavar="STAGE=GPUS[xN][:shared]",
                       help="the Triton side's placement, as for serve (e.g. ar=0x2: two ar engines on GPU 0; "
                       "ar=0x2:shared: two ar instances in front of one engine); "
                       "the direct side is one engine either way")
    bench.add_argument("--pairs", type=int, default=3,
                       help="closed loop: direct/triton pairs per point, back to back, where both sides fit on the "
                            "GPU at once (on CPU, always); the report takes the median ratio (default 3)")
    bench.add_argument("--ar-engine-args", metavar="JSON",
                       help="extra vLLM engine arguments of ar, the same on both sides, "
                            "e.g. '{\"stream_interval\": 4}'")
    bench.add_argument("--encoder-engine-args", metavar="JSON",
                       help="extra vLLM engine arguments of ar_encoder, the same on both sides")
    bench.add_argument("--engine-cpus", metavar="LIST",
                       help="pin every vLLM engine core of the run, both sides', to these CPUs (e.g. 7 or 6-7, as "
                            "taskset -c takes them) and keep the server and the clients off them: both sides' "
                            "engines then step on the same CPU")
    bench.add_argument("--output-range-ratio", type=float, metavar="R",
                       help="text generation: each request's max_tokens drawn uniformly from "
                            "[L*(1-R), L*(1+R)], L the preset's (128 realistic), the same lengths on both sides "
                            "(as vLLM's benchmark's --random-range-ratio; default 0: every request L tokens)")
    bench.add_argument("--client-processes", type=int, metavar="N",
                       help="the Triton side's AR clients share N processes (a thread and a connection each; "
                            "default: the preset's, 8)")
    bench.add_argument("--encoder-queue-delay-us", type=int, metavar="US",
                       help="ar_encoder's batching window on the Triton side, max_queue_delay_microseconds "
                            "(default: model_repository's)")
    bench.add_argument("--out", type=Path, help="folder for bench.json and bench.png; default .cache/bench/<preset>")
    bench.set_defaults(run=_bench)

    perf = commands.add_parser("perf", help="perf_analyzer and genai-perf against the models (make perf)")
    perf.add_argument("--url", help="gRPC address of a running server; default: start one with the demo models")
    perf.add_argument("--out", type=Path, default=Path(".cache/perf"), help="folder for the reports")
    perf.add_argument("--concurrency", type=int, default=2)
    perf.add_argument("--request-count", type=int, default=20)
    perf.add_argument("--tokenizer", help="for genai-perf; default: the demo AR model's")
    perf.add_argument("--no-genai-perf", action="store_true", help="perf_analyzer only")
    perf.set_defaults(run=_perf)

    image = commands.add_parser("generate-image", help="generate an image with the `diffusion` model")
    image.add_argument("prompt")
    image.add_argument("--out", type=Path, required=True, help="PNG file to write")
    image.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    image.add_argument("--url")
    image.add_argument("--model", help="default diffusion (diffusion_stream with --stream); or text_to_image")
    image.add_argument("--stream", action="store_true",
                       help="a progress bar fed by a decoupled diffusion model's steps (gRPC; docs/models.md)")
    image.add_argument("--image", action="append", type=Path, default=[], dest="images", metavar="IN.png",
                       help="an input image (PNG, JPEG or WebP; FLUX.2's reference images), repeatable")
    _add_image_options(image)
    image.set_defaults(run=_generate_image)

    video = commands.add_parser("generate-video", help="generate a video with a video model (Wan)")
    video.add_argument("prompt")
    video.add_argument("--out", type=Path, required=True,
                       help="OUT.mp4 (H.264, lossy) or OUT.npy (the frames [F, H, W, 3] as served, lossless)")
    video.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    video.add_argument("--url")
    video.add_argument("--model", default="diffusion", help="diffusion (default), or text_to_image")
    video.add_argument("--image", type=Path, metavar="IN.png",
                       help="a first image (PNG, JPEG or WebP) for a model that takes one (Wan 2.2 TI2V, I2V-A14B)")
    _add_image_options(video, video=True)
    video.set_defaults(run=_generate_video)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from triton_omni_tools.demos import DemoError
    from triton_omni_tools.memory_plan import MemoryPlanError
    from triton_omni_tools.placement import PlacementError
    from triton_omni_tools.remote import RemoteSpecError

    try:
        return args.run(args)
    # what the server cannot serve, said plainly
    except (PlacementError, MemoryPlanError, DemoError, RemoteSpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


# Shorter names for the diffusion options' flags, beside --name-with-dashes
SHORT_FLAGS = {"num_inference_steps": "--steps", "guidance_scale": "--guidance", "guidance_scale_2": "--guidance-2",
               "num_frames": "--frames"}


def _add_image_options(parser, video: bool = False) -> None:
    """Every diffusion option of the protocol's table as a flag whose dest is its name (a video
    model's too with ``video``); ``lora`` and ``lora_scale`` as one ``--lora NAME[:SCALE]``."""
    from triton_omni_protocol import DIFFUSION_OPTIONS, VIDEO_OPTIONS

    for spec in DIFFUSION_OPTIONS:
        if spec.name in ("lora", "lora_scale") or (spec.name in VIDEO_OPTIONS and not video):
            continue
        flags = ["--" + spec.name.replace("_", "-")]
        if spec.name in SHORT_FLAGS:
            flags.insert(0, SHORT_FLAGS[spec.name])
        parser.add_argument(*flags, type=spec.python_type, dest=spec.name, help=spec.doc or None,
                            metavar={int: "N", float: "X"}.get(spec.python_type, "TEXT"))
    parser.add_argument("--lora", type=_lora, metavar="NAME[:SCALE]",
                        help="a LoRA adapter the diffusion model serves (its lora_adapters), at SCALE (default 1)")


def _diffusion_options(args) -> dict:
    """The diffusion options the command line gave, by their names (``_add_image_options``)."""
    from triton_omni_protocol import DIFFUSION_OPTIONS

    given = {spec.name: getattr(args, spec.name) for spec in DIFFUSION_OPTIONS
             if spec.name not in ("lora", "lora_scale") and getattr(args, spec.name, None) is not None}
    return given | (args.lora or {})  # --lora NAME[:SCALE]: both


def _lora(text: str) -> dict:
    """``--lora NAME[:SCALE]`` as the request's ``lora`` and ``lora_scale``."""
    name, colon, scale = text.rpartition(":") if ":" in text else (text, "", "")
    if not name:
        raise argparse.ArgumentTypeError(f"expected NAME or NAME:SCALE, got {text!r}")
    if not colon:
        return {"lora": name}
    try:
        return {"lora": name, "lora_scale": float(scale)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"the scale in {text!r} must be a number") from None


def _add_param_option(parser, help_text: str) -> None:
    parser.add_argument("--param", action="append", default=[], type=_key_value, metavar="KEY=VALUE",
                        help=f"{help_text}; VALUE is JSON when it parses as JSON, else a string (repeatable)")


def _key_value(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _gateway_workers(demo: str, default: int) -> int:
    """The gateway's processes: one for a video demo, whose /v1/videos jobs live in one process's
    memory (a gateway of several answers them 501); else ``default``."""
    from triton_omni.families import DEMOS, FAMILIES

    makes_video = any(family.output.video for family in FAMILIES.values() if family.demo is DEMOS.get(demo))
    return 1 if makes_video else default


def _serve(args) -> int:
    from triton_omni_tools.gateway import default_workers
    from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, EXIT_TIMEOUT_S, ServerOptions, serve
    from triton_omni_tools.restarts import RestartPolicy

    options = ServerOptions(
        model_repositories=args.model_repository or list(DEFAULT_REPOSITORIES),
        http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        log_verbose=args.log_verbose, model_control_mode=args.model_control_mode,
        load_models=args.load_model, server=args.server, bind=args.bind, supervise=not args.no_supervise,
        placement=args.place, remote=args.remote, demo=args.demo, openai_port=args.openai_port,
        exit_timeout_s=EXIT_TIMEOUT_S if args.exit_timeout_secs is None else args.exit_timeout_secs,
        api_key=args.api_key, openai_workers=args.openai_workers or _gateway_workers(args.demo, default_workers()),
    )
    return serve(options, restarts=None if args.no_restart else RestartPolicy())


def _build_demo_models(args) -> int:
    from triton_omni.demo_models import build_all

    for name, path in build_all().items():
        print(f"{name}: {path}")
    return 0


def _generate_text(args) -> int:
    from triton_omni_client import InputValueError, OmniClient, OmniError

    params = dict(args.param)
    options = {name: getattr(args, name) for name in ("max_tokens", "temperature", "seed")
               if getattr(args, name) is not None}
    if "max_tokens" not in options and "max_tokens" not in params:
        options["max_tokens"] = 64
    client = OmniClient(args.url, protocol=args.protocol)
    try:
        for chunk in client.generate_text(args.prompt, stream=args.stream, model=args.model,
                                          exclude_input_in_output=True, sampling_parameters=params or None,
                                          **options):
            print(chunk.text, end="", flush=True)
    except (OmniError, InputValueError) as exc:  # a value its input cannot hold: named, not sent
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    print()
    return 0


def _generate(args) -> int:
    """Streams one omni request: text to stdout as it arrives, a progress bar
    per image fed by the diffusion steps, then the PNG files."""
    from tqdm import tqdm
    from triton_omni_client import InputValueError, OmniClient, OmniError

    modalities = [m.strip() for m in args.modalities.split(",") if m.strip()]
    if ("image" in modalities or "audio" in modalities) and args.out is None:
        print(f"error: --out is required for the {'audio' if 'audio' in modalities else 'image'} modality",
              file=sys.stderr)
        return 2
    if "audio" in modalities and ("image" in modalities or args.out.suffix.lower() != ".wav"):
        print("error: with audio, --out is the spoken reply's .wav file (ask for images in another request)",
              file=sys.stderr)
        return 2
    options = _diffusion_options(args) | {k: getattr(args, k) for k in ("max_tokens", "num_images", "voice")
                                          if getattr(args, k) is not None}
    if args.input_audio:
        options["input_audio"] = [path.read_bytes() for path in args.input_audio]
    if args.images:
        options["images"] = [path.read_bytes() for path in args.images]
    audio: list = []  # the spoken reply's chunks, and its rate
    bars: dict[int, tqdm] = {}
    written = []
    # A bar as wide as the terminal wraps to a new line at every redraw in some terminals (tmux).
    width = min(100, shutil.get_terminal_size().columns - 1)
    text_open = False  # streamed text without its newline yet: a bar must not start on that line
    try:
        for event in OmniClient(args.url).generate(args.prompt, modalities=modalities,
                                                   enhance_prompt=args.enhance_prompt, model=args.model,
                                                   parameters=dict(args.param) or None, **options):
            if event.text:
                print(event.text, end="", flush=True)
                text_open = True
            if event.enhanced_prompt is not None:
                print(f"\n[enhanced prompt] {event.enhanced_prompt}", file=sys.stderr)
            if event.stage == "diffusion":
                index = event.image_index[0]
                if index not in bars:  # one bar per image (setdefault would build one per step)
                    if text_open:
                        print(flush=True)
                        text_open = False
                    bars[index] = tqdm(total=event.total_steps, desc=f"image {index}", unit="step",
                                       file=sys.stderr, leave=True, position=len(bars), ncols=width)
                bars[index].update(event.step - bars[index].n)
            if event.image is not None:
                for index, pixels in zip(event.image_index, event.image, strict=True):
                    written.append(_save_png(pixels, _image_path(args.out, index, options.get("num_images", 1))))
            if event.audio is not None:
                audio.append((event.audio, event.sample_rate))
    except (OmniError, InputValueError) as exc:  # a value its input cannot hold: named, not sent
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        for bar in bars.values():
            bar.close()
    if text_open:
        print()
    if audio:
        written.append(_save_wav([samples for samples, _ in audio], audio[0][1], args.out))
    for path in written:
        print(f"wrote {path}")
    return 0


def _save_wav(chunks: list, rate: int, path: Path) -> Path:
    """The chunks' samples (float32 in [-1, 1]) as a 16-bit mono WAV file."""
    import wave

    import numpy as np

    pcm = (np.clip(np.concatenate(chunks), -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(str(path), "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(pcm.tobytes())
    return path


def _image_path(out: Path, index: int, count: int) -> Path:
    return out if count == 1 else out.with_name(f"{out.stem}_{index + 1}{out.suffix}")


def _save_png(pixels, path: Path) -> Path:
    from PIL import Image

    Image.fromarray(pixels).save(path, format="PNG")
    return path


def _bench(args) -> int:
    from triton_omni_tools.bench import run
    from triton_omni_tools.launcher import PROJECT_ROOT

    def parts(value: str | None, kind=str):
        return tuple(kind(v) for v in value.split(",")) if value else None

    out = args.out or PROJECT_ROOT / ".cache" / "bench" / args.preset
    if args.open_loop:
        from triton_omni_tools.bench import PRESETS, openloop

        mixed = () if args.no_mixed else parts(args.mixed_modes) or tuple(openloop.MIXED_MODES)
        openloop.run(PRESETS[args.preset], args.preset, out, parts(args.loads, float) or (), args.requests, mixed)
        return 0
    if args.gpus:
        from dataclasses import replace

        from triton_omni_tools.bench import PRESETS, scaling

        preset = PRESETS[args.preset]
        preset = replace(preset, workloads=parts(args.workloads) or preset.workloads)
        scaling.run(preset, args.preset, parts(args.gpus, int), out, parts(args.concurrency, int))
        return 0
    run(args.preset, parts(args.concurrency, int), parts(args.workloads), out,
        diffusion_batching=args.diffusion_batching, placement=args.place, pairs=args.pairs,
        ar_engine_args=args.ar_engine_args, encoder_engine_args=args.encoder_engine_args,
        client_processes=args.client_processes, output_range_ratio=args.output_range_ratio,
        encoder_queue_delay_us=args.encoder_queue_delay_us, engine_cpus=args.engine_cpus)
    return 0


def _perf(args) -> int:
    from triton_omni.demo_models import resolve_model

    from triton_omni_tools.perf import PerfError, format_table, run_all

    tokenizer = args.tokenizer or resolve_model("demo:tiny-qwen2")

    def measure(url: str) -> int:
        try:
            results = run_all(url, args.out, tokenizer, with_genai_perf=not args.no_genai_perf,
                              concurrency=args.concurrency, request_count=args.request_count)
        except PerfError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(format_table(results))
        print(f"reports in {args.out}/")
        return 0

    if args.url:
        return measure(args.url)
    from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

    args.out.mkdir(parents=True, exist_ok=True)
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            log_file=args.out / "tritonserver.log")
    with TritonServer(options) as server:
        return measure(server.grpc_url)


def _generate_image(args) -> int:
    from PIL import Image
    from triton_omni_client import InputValueError, OmniClient, OmniError

    options = _diffusion_options(args)
    client = OmniClient(args.url, protocol=args.protocol)
    try:
        if args.stream:
            pixels = _stream_image(client, args, options)
        elif args.images:
            pixels = client.edit_image(args.prompt, [str(path) for path in args.images],
                                       model=args.model or "diffusion", **options)
        else:
            pixels = client.generate_image(args.prompt, model=args.model or "diffusion", **options)
    except (OmniError, InputValueError) as exc:  # a value its input cannot hold: named, not sent
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    Image.fromarray(pixels).save(args.out, format="PNG")
    print(f"wrote {args.out} ({pixels.shape[1]}x{pixels.shape[0]})")
    return 0


def _generate_video(args) -> int:
    import numpy as np
    from triton_omni_client import InputValueError, OmniClient, OmniError
    from triton_omni_client.video import encode_mp4

    if args.out.suffix not in (".mp4", ".npy"):
        raise SystemExit(f"error: --out must end in .mp4 or .npy, got {args.out.name!r}")
    options = _diffusion_options(args)
    if args.image is not None:
        options["images"] = [args.image.read_bytes()]
    try:
        video = OmniClient(args.url, protocol=args.protocol).generate_video(
            args.prompt, model=args.model, **options)
    except (OmniError, InputValueError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    if args.out.suffix == ".npy":
        np.save(args.out, video.frames)
    else:
        args.out.write_bytes(encode_mp4(video.frames, video.fps))
    count, height, width, _ = video.frames.shape
    print(f"wrote {args.out} ({count} frames, {width}x{height}, {video.fps:g} fps)")
    return 0


def _stream_image(client, args, options: dict):
    """One image from a decoupled diffusion model, with one progress bar fed by its steps."""
    from tqdm import tqdm

    if args.protocol != "grpc":
        raise SystemExit("error: --stream needs --protocol grpc (Triton's HTTP /infer refuses decoupled models)")
    bar = None

    def on_progress(step: int, total: int) -> None:
        nonlocal bar
        if bar is None:  # one bar, drawn once (its width kept off the terminal's edge: tmux wraps it)
            bar = tqdm(total=total, desc="image", unit="step", file=sys.stderr, leave=True,
                       ncols=min(100, shutil.get_terminal_size().columns - 1))
        bar.update(step - bar.n)

    try:
        return client.stream_image(args.prompt, model=args.model or "diffusion_stream", on_progress=on_progress,
                                   **options)
    finally:
        if bar is not None:
            bar.close()


if __name__ == "__main__":
    sys.exit(main())
