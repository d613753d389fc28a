"""Where a spoken reply's time goes in the speech stage: the talker's step batch and the decoder.

``benchmarks/speech.py`` measures the whole chain through ``omni``; this runs the speech stage's
own parts in one process, with no server, so each part's cost per step is seen apart:

- a step of ``TalkerBatcher`` at each batch size (``--rows``): the whole step as the stage runs
  it (nothing synchronised: the rate it reaches), then the same steps with the device
  synchronised around each part, split into the talker's forward, the code predictor (15 small
  passes and draws a frame), the first code's draw (penalties and sampling) and the rest;
- ``code2wav``'s streamed decode of a chunk of ``--chunk-frames`` frames for as many streams as
  rows, one stream after another and batched as the runner decodes them (``Code2WavBatcher``);
- from those, the real-time factor the stage alone allows at each batch size: a frame is
  1/12.5 s of audio, each row of a step makes one, and each row's chunk is decoded once;
- what one utterance's first audio waits for here: its talker prompt, its prefill, the time to
  its first frame, and the decode of a first chunk of 1 and of 2 frames;
- with ``--cold-codec``, first of all: the streams' first chunks decoded together (as
  ``Code2WavBatcher`` decodes urgent chunks) at each of ``--rows``' stream counts and at 1, 2 and 4
  frames, the first decode of each shape in this process against the second (what a server's first
  burst of new streams pays that later ones do not); then the stage's warm-up (``warm``: each shape
  its chunks make at a ladder of batch sizes, run at load) timed, and first decodes at stream counts
  off that ladder on the warmed decoder, which pads them onto it;
- on a GPU, all of it with CUDA graphs (the talker's step and the code predictor's frame: the
  stage's default) and without, and the ratio of their steps; with ``--compile PARTS``, also with
  those parts' captured passes under torch.compile (the model parameter ``compile``), and its ratio
  to the graphs alone; with ``--baseline PARTS``, also with those parts compiled, and the compiled
  mode's ratio to it (``--compile predictor,talker --baseline predictor``: the talker's regions);
  with ``--fuse-projections [PARTS]``, the compiled mode's model with those parts' projections fused
  (the model parameter ``fuse_projections``; the parts predictor, talker, both when none are named;
  ``--compile predictor,talker --baseline predictor,talker --fuse-projections predictor``: the
  served default's fusion alone). Every other mode's projections are unfused.

Random weights at Qwen3-Omni-30B-A3B's talker and decoder shapes (``--preset realistic``, a GPU),
or the tiny demo's on this host's CPU (it only shows the benchmark works). ``--model qwen2.5-omni``:
Qwen2.5-Omni-7B's talker instead (a code a frame, 50 a second, no code predictor; random thinker
states in its prompts), its steps and first frame only: its decoder, ``token2wav``, is
``benchmarks/token2wav_batch.py``'s, and its real-time floor here is the talker's steps alone.

    python benchmarks/speech_step.py [--preset realistic] [--rows 1,8,64] [--steps 40] [--json OUT] [--profile 8]
        [--compile predictor[,talker]] [--baseline PARTS] [--grouped-baseline] [--fuse-projections [PARTS]]
        [--modes compiled,graphs,baseline]
        [--cold-codec]
        [--model qwen2.5-omni]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

FRAMES_PER_SECOND = {"qwen3-omni": 12.5, "qwen2.5-omni": 50.0}  # a frame each step makes, per second of audio


class Timers:
    """Seconds per named part, the device synchronised around each call (``wrap``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.enabled = False

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.enabled:
                return inner(*args, **kwargs)
            self.sync()
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            self.sync()
            self.seconds[part].append(time.perf_counter() - started)
            return result

        setattr(owner, name, timed)


def utterances(talker, tokenizer, rows: int, frames: int, reply_tokens: int):
    """``rows`` utterances of a reply of ``reply_tokens`` tokens, each held to ``frames`` frames,
    sampled as the model's talker samples (its defaults), each with a seed of its own."""
    from triton_omni.speech.talker import Utterance

    prompt_ids, reply = conversation(tokenizer, reply_tokens)
    return [Utterance(spoken_prompt(talker, prompt_ids, reply), sampling(talker, frames, row), lambda item: None)
            for row in range(rows)]


def spoken_prompt(talker, prompt_ids: list[int], reply: list[int]):
    """The talker's prompt for a reply; a Qwen2.5-Omni talker's reads the thinker's states at every
    token (random here: the talker's cost is the same)."""
    if talker.groups > 1:
        return talker.prompt(prompt_ids, reply, talker.default_voice)
    states = torch.randn(len(prompt_ids) + len(reply) - 1, talker.width, generator=torch.Generator().manual_seed(0))
    return talker.prompt(prompt_ids, reply, talker.default_voice, states=states)


def conversation(tokenizer, reply_tokens: int) -> tuple[list[int], list[int]]:
    """A prompt's token ids in the chat template, and a reply of ``reply_tokens`` tokens."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}],
                                           add_generation_prompt=True, tokenize=False)
    reply = tokenizer("a reply the thinker wrote, " * (reply_tokens // 4 + 1))["input_ids"][:reply_tokens]
    return tokenizer(prompt)["input_ids"], reply


def sampling(talker, frames: int, seed: int):
    """The talker's defaults (the model's own), held to ``frames`` frames."""
    from triton_omni.ar.sampling import SamplingOptions

    options = {k: v for k, v in talker.defaults.items() if k != "max_tokens"}
    return SamplingOptions(**options, max_tokens=frames, min_tokens=frames, seed=seed)


def step_batch(batcher, talker, tokenizer, timers: Timers, rows: int, steps: int, reply_tokens: int) -> dict:
    """``rows`` utterances spoken together for ``steps`` steps: ms a step free-running, then with
    each part timed."""
    figures = {}
    # a few steps first, untimed: the first steps at a batch size pay once (the allocator's new
    # blocks, a graph's first replay), and over a few dozen steps that showed as a slower step
    for timed in (None, False, True):
        made = utterances(talker, tokenizer, rows, (4 if timed is None else steps) + 2, reply_tokens)
        # woken by the batcher's thread, not polling it: a thread that polls takes the GIL from the
        # batcher's every time it wakes, and the steps would measure that
        stepping, ended, left = threading.Event(), threading.Event(), [rows]
        stamps: dict[int, float] = {}  # step -> when its first frame came out
        before = batcher.steps

        def emit(item, left=left, stepping=stepping, ended=ended, stamps=stamps, before=before):
            stamps.setdefault(batcher.steps, time.perf_counter())
            if batcher.steps > before:  # (a Qwen2.5-Omni talker's prefill speaks a frame before any step)
                stepping.set()
            if item is None or isinstance(item, BaseException):
                left[0] -= 1
                if not left[0]:
                    ended.set()

        for utterance in made:
            utterance.emit = emit
        for utterance in made:
            batcher.submit(utterance)
        stepping.wait()  # a first frame after a step: every row has joined (the prefills are not steps)
        timers.enabled, timers.seconds = bool(timed), defaultdict(list)
        first, started = batcher.steps, time.perf_counter()
        ended.wait()
        ran = batcher.steps - first
        timers.enabled = False
        elapsed = time.perf_counter() - started
        if timed is None:
            continue
        if not timed:
            # the mean, and the median of the steps' own intervals: a few long steps show as a gap
            figures["step_ms"] = 1000 * elapsed / max(ran, 1)
            times = [stamps[k] for k in sorted(stamps) if stamps[k] >= started]
            intervals = [b - a for a, b in itertools.pairwise(times)]
            if intervals:
                figures["step_ms_median"] = 1000 * statistics.median(intervals)
                figures["step_ms_longest"] = 1000 * max(intervals)
        else:
            parts = {part: 1000 * statistics.median(values) for part, values in timers.seconds.items()}
            parts["the rest"] = (parts["step"] - parts.get("code predictor", 0.0) - parts["first code draw"]
                                 - parts["talker forward"])
            figures["parts_ms (synchronised)"] = parts
    return figures


def first_frame(batcher, talker, tokenizer, timers: Timers, reply_tokens: int, repeats: int = 8) -> dict:
    """What one utterance's first audio waits for in this stage, ms (medians of ``repeats``): its
    talker prompt (the reply's embeddings projected), then from its submission to its first frame
    (the prefill draws the frame's first code, the next step's code predictor the others; a
    Qwen2.5-Omni talker's first code is its first frame, spoken at the prefill: no step in it),
    free-running; and the prefill alone, synchronised."""
    from triton_omni.speech.talker import Utterance

    times: dict[str, list[float]] = defaultdict(list)
    prompt_ids, reply = conversation(tokenizer, reply_tokens)
    for attempt in range(repeats + 1):
        first, ended = [], threading.Event()

        def emit(item, first=first, ended=ended):
            if not first:
                first.append(time.perf_counter())
            if item is None or isinstance(item, BaseException):
                ended.set()

        timers.sync()
        started = time.perf_counter()
        made = Utterance(spoken_prompt(talker, prompt_ids, reply), sampling(talker, 2, attempt), emit)
        timers.sync()
        prompted = time.perf_counter()
        timed = attempt % 2 == 1  # every other run with the prefill synchronised and timed
        timers.enabled, timers.seconds = timed, defaultdict(list)
        batcher.submit(made)
        ended.wait()
        timers.enabled = False
        if attempt == 0:
            continue  # a warm-up
        if timed:
            times["prefill (synchronised)"].extend(timers.seconds["prefill"])
        else:
            times["talker prompt"].append(prompted - started)
            times["to the first frame"].append(first[0] - prompted)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def first_chunk_decode_ms(decoder, groups: int, frames: int, timers: Timers, repeats: int = 6) -> float:
    """ms to decode a stream's first chunk of ``frames`` frames (no lookback yet)."""
    size = decoder.model.config.codebook_size
    codes = torch.randint(0, size, (groups, frames), generator=torch.Generator().manual_seed(2))
    times = []
    for _ in range(repeats + 1):
        stream = decoder.stream()
        timers.sync()
        started = time.perf_counter()
        stream.add(codes)
        timers.sync()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[1:])


def profile_steps(batcher, talker, tokenizer, rows: int, steps: int, reply_tokens: int) -> str:
    """torch.profiler's table of ``steps`` steps of ``rows`` utterances (after as many unprofiled):
    the operators by their own device time, and how many times each ran (what launches cost); and
    the device events (kernels and copies) a step, from a second profile of twice the steps (the
    difference leaves the prefill and the first draw out)."""
    from torch.profiler import ProfilerActivity, profile

    def speak(frames: int) -> None:
        ended, left = threading.Event(), [rows]

        def emit(item):
            if item is None or isinstance(item, BaseException):
                left[0] -= 1
                if not left[0]:
                    ended.set()

        for utterance in utterances(talker, tokenizer, rows, frames, reply_tokens):
            utterance.emit = emit
            batcher.submit(utterance)
        ended.wait()

    def profiled(frames: int):
        stepped = batcher.steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            speak(frames)
        events = sum(1 for e in profiler.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation)
        return profiler, events, batcher.steps - stepped

    speak(steps)
    profiler, events, stepped = profiled(steps)
    _, more_events, more_steps = profiled(2 * steps)
    # a step at one row is bound by how many kernels it launches, not by the weights it reads
    per_step = (more_events - events) / max(more_steps - stepped, 1)
    table = profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)
    return f"{rows} rows: {per_step:.0f} device events (kernels and copies) a step\n{table}"


def cold_first_chunks_ms(decoder, groups: int, timers: Timers, streams: int, frames: int) -> dict:
    """ms to decode ``streams`` new streams' first chunks of ``frames`` frames together, the first
    time this process decodes that shape and the second."""
    size = decoder.model.config.codebook_size
    generator = torch.Generator().manual_seed(3)
    found = {}
    for call in ("first", "second"):
        together = [decoder.stream() for _ in range(streams)]
        codes = [torch.randint(0, size, (groups, frames), generator=generator) for _ in range(streams)]
        timers.sync()
        started = time.perf_counter()
        for stream, chunk in zip(together, decoder.convolve_windows(decoder.windows(together, codes)), strict=True):
            stream.settle(chunk)
        timers.sync()
        found[call] = 1000 * (time.perf_counter() - started)
    return found


def chunk_decode_ms(decoder, groups: int, chunk_frames: int, timers: Timers, streams: int = 1,
                    repeats: int = 6) -> dict:
    """ms to decode one streamed chunk of ``chunk_frames`` frames (after the first, which has no
    lookback) for each of ``streams`` streams: one stream after another, as the stage decoded them
    before, and together (``Code2WavBatcher``'s way: the transformer in one pass, the convolutions in
    one batch), with the transformer's share of that; the samples of both ways compared."""
    size = decoder.model.config.codebook_size
    generator = torch.Generator().manual_seed(1)
    shape = (groups, chunk_frames * (repeats + 1))
    codes = [torch.randint(0, size, shape, generator=generator) for _ in range(streams)]
    alone, together = [decoder.stream() for _ in range(streams)], [decoder.stream() for _ in range(streams)]
    times: dict[str, list[float]] = defaultdict(list)
    apart = 0.0
    for i in range(repeats + 1):
        frames = slice(i * chunk_frames, (i + 1) * chunk_frames)
        timers.sync()
        started = time.perf_counter()
        one_by_one = [stream.add(c[:, frames]) for stream, c in zip(alone, codes, strict=True)]
        timers.sync()
        times["one after another"].append(time.perf_counter() - started)
        started = time.perf_counter()
        windows = decoder.windows(together, [c[:, frames] for c in codes])
        timers.sync()
        times["transformer"].append(time.perf_counter() - started)
        batched = [stream.settle(chunk) for stream, chunk in zip(together, decoder.convolve_windows(windows),
                                                                  strict=True)]
        timers.sync()
        times["together"].append(time.perf_counter() - started)
        apart = max([apart] + [float((a - b).abs().max()) for a, b in zip(one_by_one, batched, strict=True)])
    found = {name: 1000 * statistics.median(values[1:]) for name, values in times.items()}
    return found | {"together / one after another": found["together"] / found["one after another"],
                    "max sample difference": apart}


def compile_parts(value: str) -> tuple[str, ...]:
    """``--compile``'s parts, checked as the model parameter is."""
    from triton_omni.speech.runner import SpeechConfig

    return SpeechConfig(compile=value).compile_parts()


def fused_parts(value: str) -> tuple[str, ...]:
    """``--fuse-projections``' parts, checked as the model parameter is."""
    from triton_omni.speech.runner import SpeechConfig

    return SpeechConfig(fuse_projections=value).fused_parts()


def modes(args, device: torch.device) -> dict[str, dict]:
    """The batcher's options of each mode measured: on a GPU CUDA graphs, eager and (with
    ``--compile``) compiled; on a CPU eager alone."""
    found = {"eager": {"cuda_graphs": False}}
    if args.compile and args.model != "qwen3-omni":
        raise SystemExit("--compile: the code predictor's, which a Qwen2.5-Omni talker has not")
    if args.fuse_projections and not args.compile:
        raise SystemExit("--fuse-projections: the compiled mode's, which needs --compile")
    if device.type == "cuda":
        found["cuda graphs"] = {"cuda_graphs": True}
        if args.compile:
            found["compiled"] = {"cuda_graphs": True, "compile": compile_parts(args.compile)}
        if args.baseline:
            found["baseline"] = {"cuda_graphs": True, "compile": compile_parts(args.baseline)}
    wanted = {"graphs": "cuda graphs"}
    names = [wanted.get(m, m) for m in args.modes.split(",")] if args.modes else list(found)
    if missing := [name for name in names if name not in found]:
        raise SystemExit(f"--modes {', '.join(missing)}: not measured here (compiled needs --compile, baseline "
                         "--baseline, and they and the graphs a GPU)")
    if args.grouped_baseline and "baseline" not in names:
        raise SystemExit("--grouped-baseline: the baseline mode's, which is not measured here (it needs a GPU)")
    return {name: found[name] for name in names}


def print_ratios(faster: dict, slower: dict, label: str, levels: list[int]) -> None:
    for rows in levels:
        free = faster[rows]["step_ms"] / slower[rows]["step_ms"]
        ours, theirs = faster[rows]["parts_ms (synchronised)"], slower[rows]["parts_ms (synchronised)"]
        synced = {part: ours[part] / theirs[part] for part in ("step", "talker forward", "code predictor")
                  if part in ours and part in theirs}  # (a Qwen2.5-Omni talker has no code predictor)
        predictor = f", the code predictor {synced['code predictor']:.3f}" if "code predictor" in synced else ""
        print(f"{rows} rows, {label}: a step {free:.3f} free-running, {synced['step']:.3f} synchronised; "
              f"the talker's forward {synced['talker forward']:.3f}{predictor}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("tiny", "realistic"), default="tiny")
    parser.add_argument("--model", choices=tuple(FRAMES_PER_SECOND), default="qwen3-omni",
                        help="qwen2.5-omni: its talker's steps and first frame only (no code2wav)")
    parser.add_argument("--rows", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=24, help="timed steps per batch size")
    parser.add_argument("--reply-tokens", type=int, default=100)
    parser.add_argument("--chunk-frames", type=int, default=8)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--no-tf32", action="store_true",
                        help="cuDNN's convolutions and matmuls in full float32 (PyTorch runs them in TF32 by default)")
    parser.add_argument("--compile", default="", metavar="PARTS",
                        help="also measure the stage with these parts compiled (predictor, talker)")
    parser.add_argument("--baseline", default="", metavar="PARTS",
                        help="also measure the stage with these parts compiled, the compiled mode's baseline "
                             "(its ratio to it printed: --compile predictor,talker --baseline predictor)")
    parser.add_argument("--fuse-projections", nargs="?", const="predictor,talker", default="", metavar="PARTS",
                        help="the compiled mode's q/k/v and gate/up projections fused in these parts (predictor, "
                             "talker; both if none are named; needs --compile)")
    parser.add_argument("--grouped-baseline", action="store_true",
                        help="the baseline mode's one-row talker steps run their experts as grouped GEMMs, as "
                             "the wider steps do (--compile predictor,talker --baseline predictor,talker: the "
                             "compiled regions' one-row experts as reductions, alone)")
    parser.add_argument("--modes", default="",
                        help="the modes measured, of graphs, eager, compiled and baseline (default: all that apply)")
    parser.add_argument("--cold-codec", action="store_true",
                        help="first, each stream count's first chunks decoded the first time and the second")
    parser.add_argument("--profile", type=int, metavar="ROWS",
                        help="then profile a few steps of this many utterances (CUDA graphs on) and print the table")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoTokenizer
    from triton_omni.demo_models import resolve_model
    from triton_omni.speech import talker_regions
    from triton_omni.speech.codec import StreamingCode2Wav
    from triton_omni.speech.fused_projections import fuse_projections
    from triton_omni.speech.qwen25_talker import Qwen25Talker
    from triton_omni.speech.runner import SpeechConfig, load_qwen3_speech, load_qwen25_speech
    from triton_omni.speech.talker import Qwen3Talker, TalkerBatcher

    if args.grouped_baseline and "talker" not in compile_parts(args.baseline):
        raise SystemExit("--grouped-baseline: the baseline's compiled talker regions', which need --baseline talker")
    few_rows = talker_regions.FEW_ROWS
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    folder = Path(resolve_model(f"demo:{args.preset}-{args.model}"))
    device = torch.device("cuda" if args.preset == "realistic" else "cpu")
    config = AutoConfig.from_pretrained(folder)
    dtype = SpeechConfig(device=str(device)).torch_dtype()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    qwen3 = args.model == "qwen3-omni"
    if qwen3:
        model, code2wav, embedding = load_qwen3_speech(folder, config, device, dtype)
        talker = Qwen3Talker(model, embedding, config)
        talker.default_voice = "ethan" if "ethan" in talker.voices else next(iter(talker.voices))
        decoder = StreamingCode2Wav(code2wav)
    else:
        model, _, embedding, speakers = load_qwen25_speech(folder, config, device, dtype)
        talker, decoder = Qwen25Talker(model, embedding, speakers, config), None
        if args.cold_codec:
            raise SystemExit("--cold-codec: code2wav's, which a Qwen2.5-Omni checkpoint has not")
    per_second = FRAMES_PER_SECOND[args.model]
    levels = [int(r) for r in args.rows.split(",")]
    timers = Timers(device)
    figures: dict = {"workload": vars(args), "chunk_decode_ms": {}, "first_frame_ms": {}, "modes": {}}
    if args.cold_codec:  # before anything else decodes: each shape's first decode in this process
        figures["cold_first_chunks_ms"] = {}
        for streams, frames in itertools.product(levels, (1, 2, 4)):
            found = cold_first_chunks_ms(decoder, talker.groups, timers, streams, frames)
            figures["cold_first_chunks_ms"][f"{streams}x{frames}"] = found
            print(f"code2wav, {streams} streams' first chunks of {frames} frames together, the first and the "
                  f"second time: {json.dumps(found)}", flush=True)
        # then a decoder warmed as the stage warms it: stream counts off its ladder, first decodes
        started = time.perf_counter()
        warmed = StreamingCode2Wav(code2wav)
        shapes = warmed.warm(max(levels), 1, args.chunk_frames)
        figures["warm_s"], figures["warmed_shapes"] = time.perf_counter() - started, len(shapes)
        print(f"code2wav warmed for {max(levels)} streams: {len(shapes)} shapes in {figures['warm_s']:.1f} s",
              flush=True)
        figures["warmed_first_chunks_ms"] = {}
        for streams, frames in itertools.product(sorted({3, max(levels) - 1, max(levels) // 2 + 5}), (1, 3, 7)):
            if 0 < streams <= max(levels):
                found = cold_first_chunks_ms(warmed, talker.groups, timers, streams, frames)
                figures["warmed_first_chunks_ms"][f"{streams}x{frames}"] = found
                print(f"code2wav warmed, {streams} streams' first chunks of {frames} frames, the first and the "
                      f"second time: {json.dumps(found)}; shapes not planned: {warmed.unplanned}", flush=True)
    if decoder is not None:
        figures["first_chunk_decode_ms"] = {frames: first_chunk_decode_ms(decoder, talker.groups, frames, timers)
                                            for frames in (1, 2)}
        print(f"code2wav, a stream's first chunk of 1 and 2 frames: {json.dumps(figures['first_chunk_decode_ms'])}",
              flush=True)
        for streams in levels:
            figures["chunk_decode_ms"][streams] = chunk_decode_ms(decoder, talker.groups, args.chunk_frames, timers,
                                                                  streams)
            print(f"code2wav, a chunk of {args.chunk_frames} frames for {streams} streams: "
                  f"{json.dumps(figures['chunk_decode_ms'][streams])}", flush=True)
    # the talker's step and the code predictor as CUDA graphs (the stage's default on a GPU), eager,
    # and compiled (the graphs' passes under torch.compile)
    for mode, options in modes(args, device).items():
        fused = fused_parts(args.fuse_projections) if mode == "compiled" else ()
        unfuse = fuse_projections(model, fused) if fused else None
        talker_regions.FEW_ROWS = 0 if mode == "baseline" and args.grouped_baseline else few_rows
        started = time.perf_counter()
        batcher = TalkerBatcher(talker, max(levels), **options)
        figures.setdefault("load_s", {})[mode] = time.perf_counter() - started
        print(f"{mode}: the talker's batcher built in {figures['load_s'][mode]:.1f} s", flush=True)
        timers.wrap(batcher, "_step", "step")
        timers.wrap(batcher, "_predict_residuals", "code predictor")
        timers.wrap(batcher, "_draw", "first code draw")
        timers.wrap(batcher, "_talker_forward", "talker forward")
        timers.wrap(batcher, "_join", "prefill")
        figures["modes"][mode] = {}
        try:
            found = first_frame(batcher, talker, tokenizer, timers, args.reply_tokens)
            figures["first_frame_ms"][mode] = found
            print(f"{mode}, one utterance's first frame: {json.dumps(found)}", flush=True)
            for rows in levels:
                found = step_batch(batcher, talker, tokenizer, timers, rows, args.steps, args.reply_tokens)
                # a second of audio per row: a step a frame, and (code2wav's) a batched decode a chunk
                chunk = figures["chunk_decode_ms"][rows]["together"] if decoder is not None else 0.0
                found["rtf_floor"] = (found["step_ms"] * per_second + chunk * per_second / args.chunk_frames) / 1000
                figures["modes"][mode][rows] = found
                print(f"{mode}, {rows} rows: {json.dumps(found)}", flush=True)
        finally:
            batcher.stop()
            if unfuse is not None:
                unfuse()
            talker_regions.FEW_ROWS = few_rows
    for faster, slower in (("cuda graphs", "eager"), ("compiled", "cuda graphs"), ("compiled", "baseline")):
        if faster in figures["modes"] and slower in figures["modes"]:
            print_ratios(figures["modes"][faster], figures["modes"][slower], f"{faster} / {slower}", levels)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    if args.profile:
        batcher = TalkerBatcher(talker, max(*levels, args.profile), cuda_graphs=device.type == "cuda",
                                compile=compile_parts(args.compile) if args.compile else ())
        try:
            print(profile_steps(batcher, talker, tokenizer, args.profile, 8, args.reply_tokens), flush=True)
        finally:
            batcher.stop()


if __name__ == "__main__":
    main()
