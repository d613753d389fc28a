"""Spoken replies through ``omni`` (``ar``'s thinker, then ``speech``'s talker and ``code2wav``),
against the model's own ``generate(..., return_audio=True)`` at concurrency 1 (the direct side).

The workload is issue 74's: prompts of about ``--prompt-tokens`` tokens, ``--text-tokens`` tokens of
reply (the thinker's end of text held off, so every reply is as long), and the talker run to a fixed
``--audio-seconds`` of audio (its end of speech held off the same way). Printed per concurrency:

- time to first audio: from sending the request to its first audio chunk (the direct side's whole
  call: ``generate`` returns its waveform at the end);
- real-time factor: a request's time over the seconds of audio it made (below 1: faster than
  real time), its median;
- stall: how long a player that starts at the first chunk would wait for audio after it (the
  stutter a listener hears), its median and its longest;
- requests/s over the run, and the ratios Triton / direct for the first two at concurrency 1;
- with ``--with-text`` (text asked for too), the time to the first text: the thinker's share of
  the first audio;
- where the first audio's time goes inside the server, from its metrics over each round (means;
  a server this run starts, or ``--metrics-url``'s): the thinker's first token in ``ar`` and its time
  per token after it (the pace of a talker that reads each reply token's state), the speech stage's
  own first audio (from its request to its first chunk), and that split into its
  phases (``omni_speech_first_audio_phase_seconds``: the talker's prompt, joining the step batch,
  the first frame, the other frames its samples need, their decode).

On this host's CPU with the tiny demo (``--preset tiny``, the default) it only shows the benchmark
works; the figures are a GPU's, with ``--preset realistic``: Qwen3-Omni-30B-A3B at its real shapes
with random weights (``demo:realistic-qwen3-omni``), the thinker on vLLM (which draws its weights
itself, ``load_format: dummy``: they are never written to disk), the direct side's whole model built
in memory.

    python benchmarks/speech.py [--preset realistic] [--concurrency 1,64] [--requests 4] [--json OUT]
                                [--url HOST:PORT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from triton_omni_client import OmniClient
from triton_omni_tools.launcher import ServerOptions, TritonServer, free_port

SAMPLE_RATE = 24000


@dataclass(frozen=True)
class SpeakingModel:
    """What the benchmark needs to know of a model family."""

    demo: str  # serve --demo's name
    frames_per_second: float  # codec frames a second of audio
    frame_after_last: int  # Qwen3-Omni's last code drawn makes no frame: one more drawn for the same audio
    realistic: str  # its random-weight checkpoint at the real shapes
    thinker: dict  # ar's parameters at the real shapes


MODELS = {
    # 24 kHz / 1920 samples a frame; the thinker's 31 B on vLLM (61 GB in bf16) and its KV cache, the
    # talker and code2wav (7.7 GB) beside it, on one GPU
    "qwen3-omni": SpeakingModel("qwen3-omni", 12.5, 1, "demo:realistic-qwen3-omni",
                                {"engine": "vllm", "dtype": "bfloat16", "gpu_memory_utilization": "0.70",
                                 "engine_args": {"load_format": "dummy"}}),
    # 24 kHz / 480 samples a code; the thinker on the transformers engine, which hands on the states its
    # talker reads
    "qwen2.5-omni": SpeakingModel("qwen2.5-omni", 50.0, 0, "demo:realistic-qwen2.5-omni",
                                  {"engine": "transformers", "dtype": "bfloat16", "engine_args": {"max_num_seqs": 64}}),
}


def prompts(tokenizer, count: int, tokens: int) -> list[str]:
    """``count`` different prompts of about ``tokens`` tokens, words drawn from the vocabulary.

    Cut at the token count, not the word count: a vocabulary entry written after a space is
    often several tokens (100 such words are about 400 tokens in Qwen3-Omni's tokenizer)."""
    rng = np.random.default_rng(0)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3][:2000] or ["word"]
    texts = (" ".join(rng.choice(words, size=tokens)) for _ in range(count))
    return [tokenizer.decode(tokenizer(text)["input_ids"][:tokens]) for text in texts]


def codes_for(args) -> int:
    """The talker's codes for ``--audio-seconds`` of audio."""
    model = MODELS[args.model]
    return int(args.audio_seconds * model.frames_per_second) + model.frame_after_last


def omni_values(prompt: str, args) -> dict:
    frames = codes_for(args)
    modalities = ["text", "audio"] if args.with_text else ["audio"]
    return {"text_input": prompt, "modalities": modalities, "stream": True, "max_tokens": args.text_tokens,
            "parameters": {"min_tokens": args.text_tokens, "temperature": 0.0},
            "talker_max_tokens": frames, "talker_min_tokens": frames, "talker_temperature": 0.9,
            "talker_seed": 1, "chunk_frames": args.chunk_frames}


def one(url: str, prompt: str, args) -> dict:
    """One request (``OmniClient``: a gRPC stream to its final response): its time to first audio
    (and to first text, with ``--with-text``), its whole time, its seconds of audio."""
    values = omni_values(prompt, args)
    started = time.perf_counter()
    first_text, chunks = None, []  # (when, samples) of each audio chunk
    for event in OmniClient(url).generate(values.pop("text_input"), **values):
        if event.text:
            first_text = first_text or time.perf_counter() - started
        if event.audio is not None and event.audio.size:
            chunks.append((time.perf_counter() - started, event.audio.size))
    return {"ttfa": chunks[0][0] if chunks else None, "ttft": first_text, "seconds": time.perf_counter() - started,
            "audio_s": sum(n for _, n in chunks) / SAMPLE_RATE, "stall": stall(chunks)}


def stall(chunks: list[tuple[float, int]]) -> float:
    """Seconds a player that starts at the first chunk waits for audio after it: each chunk that
    comes after the audio before it has played out stalls the playback by the difference."""
    stalled, played_until = 0.0, None
    for when, samples in chunks:
        if played_until is None or when > played_until:
            stalled += 0.0 if played_until is None else when - played_until
            played_until = when
        played_until += samples / SAMPLE_RATE
    return stalled


async def at_concurrency(url: str, texts: list[str], concurrency: int, args) -> dict:
    """``len(texts)`` requests, ``concurrency`` at a time (closed loop), each on a thread of its own."""
    queue = list(texts)
    results = []

    async def worker():
        while queue:
            results.append(await asyncio.to_thread(one, url, queue.pop(), args))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summary(results, time.perf_counter() - started)


STAGE_METRICS = {"ar_ttft_ms": ("omni_ar_time_to_first_token_seconds", "ar"),
                 "speech_ttfa_ms": ("omni_speech_time_to_first_audio_seconds", "speech")}
# the speech stage's first audio split into its phases (the histograms' ``phase`` label)
PHASES = ("prompt", "join", "first_frame", "frames", "decode")


def stage_sums(metrics_url: str) -> dict[str, tuple[float, float]]:
    """Each stage histogram's (sum, count) now, over the model's instances, and the speech stage's
    first-audio phases' (``speech_<phase>_ms``)."""
    from triton_omni_tools.bench.harness import metric_by_device, metrics_text

    text = metrics_text(metrics_url)
    found = {name: (sum(metric_by_device(text, f"{family}_sum", model).values()),
                    sum(metric_by_device(text, f"{family}_count", model).values()))
             for name, (family, model) in STAGE_METRICS.items()}
    for phase in PHASES:
        series = [labelled_value(text, f"omni_speech_first_audio_phase_seconds_{part}", phase)
                  for part in ("sum", "count")]
        found[f"speech_{phase}_ms"] = (series[0], series[1])
    # the thinker's time per token after its first (its replies' time after their first token, over
    # their tokens after the first): the pace a talker that reads each reply token's state can keep
    ar = {name: sum(metric_by_device(text, name, "ar").values())
          for name in ("omni_ar_request_duration_seconds_sum", "omni_ar_request_duration_seconds_count",
                       "omni_ar_time_to_first_token_seconds_sum", "omni_ar_generated_tokens_total")}
    found["ar_tpot_ms"] = (ar["omni_ar_request_duration_seconds_sum"] - ar["omni_ar_time_to_first_token_seconds_sum"],
                           ar["omni_ar_generated_tokens_total"] - ar["omni_ar_request_duration_seconds_count"])
    return found


def labelled_value(text: str, name: str, phase: str) -> float:
    """The sum of ``name``'s series labelled ``phase``."""
    import re

    return sum(float(value) for labels, value in re.findall(rf'^{name}{{([^}}]*)}} (\S+)$', text, flags=re.M)
               if f'phase="{phase}"' in labels)


def stage_means(before: dict, after: dict) -> dict[str, float]:
    """The stages' mean first token and first audio (ms) over the requests between two readings, and
    the thinker's mean time per token after the first."""
    found = {}
    for name, (total, count) in after.items():
        if count > before[name][1]:
            found[name] = 1000 * (total - before[name][0]) / (count - before[name][1])
    return found


def summary(results: list[dict], wall: float) -> dict:
    found = {"requests": len(results), "requests_per_s": len(results) / wall,
             "ttfa_ms": 1000 * statistics.median(r["ttfa"] for r in results),
             "rtf": statistics.median(r["seconds"] / r["audio_s"] for r in results if r["audio_s"]),
             "audio_s": statistics.median(r["audio_s"] for r in results)}
    stalls = [r["stall"] for r in results if "stall" in r]
    if stalls:  # streamed playback's waits after the first audio: the stutter a listener hears
        found["stall_ms"] = 1000 * statistics.median(stalls)
        found["stall_ms_max"] = 1000 * max(stalls)
    if all(r.get("ttft") for r in results):  # the thinker's first text: what the first audio waits for first
        found["ttft_ms"] = 1000 * statistics.median(r["ttft"] for r in results)
    return found


def direct(model_path: str, texts: list[str], args) -> dict:
    """The model's own generate, one request at a time: its waveform comes at the end."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration, Qwen3OmniMoeForConditionalGeneration
    from triton_omni.speech.demos import build_qwen2_5_omni_in_memory, build_qwen3_omni_in_memory

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    qwen3 = args.model == "qwen3-omni"
    if args.preset == "realistic":  # its weights are not all on disk (Qwen3-Omni's thinker's, either tower)
        model = (build_qwen3_omni_in_memory if qwen3 else build_qwen2_5_omni_in_memory)(Path(model_path), device)
    else:
        model = (Qwen3OmniMoeForConditionalGeneration if qwen3 else Qwen2_5OmniForConditionalGeneration
                 ).from_pretrained(model_path, dtype=torch.bfloat16 if device == "cuda" else torch.float32
                                   ).to(device).eval()
    frames = codes_for(args)
    codec = model.config.talker_config
    # Qwen2.5-Omni's generate stops its talker at ids of the real checkpoint's vocabulary: the model's own here
    stops = {} if qwen3 else {"talker_eos_token_id": [codec.tts_codec_pad_token_id, codec.tts_codec_end_token_id],
                              "talker_logits_processor": unreadable_codes(model, device)}
    results = []
    started = time.perf_counter()
    for text in texts:
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=False)
        inputs = tokenizer(templated, return_tensors="pt").to(device)
        begun = time.perf_counter()
        with torch.no_grad():
            _, wav = model.generate(**inputs, thinker_max_new_tokens=args.text_tokens,
                                    thinker_min_new_tokens=args.text_tokens, thinker_do_sample=False,
                                    talker_max_new_tokens=frames, talker_min_new_tokens=frames,
                                    thinker_eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), **stops)
        seconds = time.perf_counter() - begun
        results.append({"ttfa": seconds, "seconds": seconds, "audio_s": wav.numel() / SAMPLE_RATE})
    return summary(results, time.perf_counter() - started)


def unreadable_codes(model, device: str):
    """Qwen2.5-Omni's talker kept from the codes its ``token2wav`` has no embedding for (the served
    talker's rule, ``Qwen25Talker.suppressed``): random weights draw them, and the decoder's table ends
    before them."""
    from transformers import LogitsProcessorList, SuppressTokensLogitsProcessor

    codec, readable = model.config.talker_config, model.config.token2wav_config.dit_config.num_embeds
    stops = (codec.tts_codec_pad_token_id, codec.tts_codec_end_token_id)
    unreadable = [code for code in range(readable, codec.vocab_size) if code not in stops]
    return LogitsProcessorList([SuppressTokensLogitsProcessor(unreadable, device=device)] if unreadable else [])


def realistic_configs(model: SpeakingModel, speech_parameters: dict) -> dict:
    """``--preset realistic``'s model configs: ``ar``, ``speech`` and ``omni`` serving its checkpoint."""
    return {"ar": {"parameters": {"model": model.realistic, **model.thinker}},
            "speech": {"parameters": {"model": model.realistic, **speech_parameters}},
            "omni": {"parameters": {"speech_checkpoint": model.realistic}}}


@contextlib.contextmanager
def serve(preset: str, model: SpeakingModel, speech_parameters: dict | None = None):
    """``ar``, ``speech`` and ``omni`` serving the preset's ``model``, on a server of this run's own;
    ``speech_parameters``: the realistic ``speech`` model's parameters beside the preset's."""
    from triton_omni_tools.demos import SPEECH_REPOSITORY
    from triton_omni_tools.launcher import DEFAULT_REPOSITORIES
    from triton_omni_tools.repository import copy_repositories

    log = Path(".cache/bench/speech-tritonserver.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if preset == "realistic":
            where = {"model_repositories": copy_repositories([*DEFAULT_REPOSITORIES, SPEECH_REPOSITORY],
                                                             Path(tmp) / "repos",
                                                             realistic_configs(model, speech_parameters or {}))}
        else:
            where = {"demo": model.demo}
        with TritonServer(ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                        model_control_mode="explicit", load_models=["ar", "speech", "omni"],
                                        log_file=log, **where)) as server:
            yield server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-omni")
    parser.add_argument("--preset", choices=("tiny", "realistic"), default="tiny",
                        help="tiny: the CPU demo; realistic: the real shapes (Qwen3-Omni-30B-A3B's, "
                        "Qwen2.5-Omni-7B's), on a GPU")
    parser.add_argument("--concurrency", default="1,4", help="comma-separated; none: no Triton side")
    parser.add_argument("--requests", type=int, default=8, help="per concurrency (at least the concurrency)")
    parser.add_argument("--direct-requests", type=int, default=2, help="0: no direct side")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--text-tokens", type=int, default=100)
    parser.add_argument("--audio-seconds", type=float, default=10.0)
    parser.add_argument("--chunk-frames", type=int, default=8)
    parser.add_argument("--with-text", action="store_true",
                        help="ask for the text too, and print the time to its first delta (the thinker's part)")
    parser.add_argument("--url", help="measure this server's omni (gRPC host:port) instead of starting one")
    parser.add_argument("--metrics-url", help="with --url: that server's metrics (http://HOST:PORT/metrics), "
                        "for the stages' own first token and first audio")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds at each concurrency, one after another on the same server (an A/A)")
    parser.add_argument("--speech-params", type=json.loads, default={}, metavar="JSON",
                        help='the speech model\'s parameters (realistic), e.g. \'{"compile": "off"}\'')
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if args.speech_params and (args.preset != "realistic" or args.url):
        parser.error("--speech-params sets the realistic preset's speech model on the server this run starts "
                     "(not the tiny demo's, nor a server at --url)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    from transformers import AutoTokenizer
    from triton_omni.demo_models import resolve_model

    model = MODELS[args.model]
    path = resolve_model(model.realistic if args.preset == "realistic" else f"demo:tiny-{model.demo}")
    levels = [] if args.concurrency == "none" else [int(c) for c in args.concurrency.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = prompts(tokenizer, max(args.requests, args.direct_requests, *levels), args.prompt_tokens)
    figures: dict = {"workload": vars(args), "prompt_tokens": statistics.median(len(tokenizer(t)["input_ids"])
                                                                               for t in texts), "triton": {}}
    print(f"prompts of {figures['prompt_tokens']:.0f} tokens (median)", flush=True)
    if levels:
        with contextlib.nullcontext(args.url) if args.url else serve(args.preset, model,
                                                                      args.speech_params) as server:
            url = args.url or server.grpc_url
            asyncio.run(at_concurrency(url, texts[:1], 1, args))  # warm-up
            metrics = args.metrics_url if args.url else server.metrics_url

            def measured(level: int) -> dict:
                before = stage_sums(metrics) if metrics else None
                found = asyncio.run(at_concurrency(url, texts[:max(args.requests, level)], level, args))
                return found if before is None else found | {"stages": stage_means(before, stage_sums(metrics))}

            for level in levels:
                rounds = [measured(level) for _ in range(args.rounds)]
                figures["triton"][level] = rounds[0] if len(rounds) == 1 else {**rounds[-1], "rounds": rounds}
                for found in rounds:
                    print(f"Triton, concurrency {level}: {json.dumps(found)}", flush=True)
    if args.direct_requests:
        figures["direct"] = direct(path, texts[:args.direct_requests], args)
        print(f"direct (generate, concurrency 1): {json.dumps(figures['direct'])}")
    if 1 in figures["triton"] and "direct" in figures:
        alone = figures["triton"][1]
        ratios = {name: alone[name] / figures["direct"][name] for name in ("ttfa_ms", "rtf")}
        print(f"Triton / direct at concurrency 1: time to first audio {ratios['ttfa_ms']:.3f}, "
              f"real-time factor {ratios['rtf']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
