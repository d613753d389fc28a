"""The speech stage: a thinker's reply to a waveform, streamed in chunks.

``SpeechRunner`` holds a Qwen3-Omni checkpoint's talker, its ``code2wav`` and
the thinker's embedding table (the thinker itself is the ``ar`` stage's), or a
Qwen2.5-Omni checkpoint's talker, its ``token2wav``, voices and the same table
(its talker reads the thinker's states, which come with the reply). Each
request's utterance joins the talker's step batch (``TalkerBatcher``); its
frames are decoded on the codec thread every ``chunk_frames`` frames (the first chunk after
``first_chunk_frames``, fewer, so that the first audio leaves soon, and each after it at most
twice the one before), each
chunk the samples those frames settle (``Code2WavStream``), so audio leaves
while the talker is still speaking, and the decoder works beside the talker's
next steps rather than between them; the chunks of all utterances waiting are
decoded together (``Code2WavBatcher``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from triton_omni.aio import EventLoopThread
from triton_omni.ar.sampling import SamplingOptions
from triton_omni.channel import ReplyReader
from triton_omni.demo_models import resolve_model
from triton_omni.errors import RequestCancelledError
from triton_omni.speech.codec import Code2WavBatcher, StreamingCode2Wav, chunk_schedule
from triton_omni.speech.qwen25_talker import Qwen25Talker
from triton_omni.speech.request import SpeechLimits, SpeechRequest
from triton_omni.speech.talker import (
    COMPILE_PARTS,
    TALKER_MAX_LEN,
    Qwen3Talker,
    TalkerBatcher,
    Utterance,
)
from triton_omni.speech.token2wav import StreamingToken2Wav, Token2WavDecoder
from triton_omni.validation import require

logger = logging.getLogger(__name__)

SAMPLE_RATE = 24000  # Qwen-Omni's decoders' rate (the checkpoints do not state it; vLLM-Omni writes 24 kHz)
DEFAULT_CHUNK_FRAMES = 8  # Qwen3-Omni: 0.64 s of audio a chunk
# The first chunk sooner: its audio leaves after the prefill's frame, not eight steps later (the
# chunks still join into the whole decode's samples, whatever their sizes: codec.py). Each chunk
# after it is at most twice the one before (1, 2, 4, 8 frames), so that a chunk's audio lasts
# while the next one's frames are spoken: a stream that starts small does not stall.
DEFAULT_FIRST_CHUNK_FRAMES = 1
# how often a reply still being written is read: a thinker's token every few ms, a talker's step every 20 or so
REPLY_POLL_S = 0.002


@dataclass(frozen=True)
class SpeechConfig:
    model: str = "demo:tiny-qwen3-omni"
    device: str = "cpu"
    dtype: str = "auto"  # bfloat16 on a GPU, float32 on a CPU
    max_num_seqs: int = 64  # utterances spoken together
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    first_chunk_frames: int = DEFAULT_FIRST_CHUNK_FRAMES
    # on a GPU, the talker's step and the code predictor's frame as CUDA graphs (Qwen2.5-Omni: token2wav's ODE)
    cuda_graphs: bool = True
    # the parts whose captured passes run torch.compile's kernels ("predictor", "talker"; "off"): on a GPU only
    compile: str = "predictor,talker"
    # the parts of a Qwen3-Omni talker whose q/k/v projections are one matmul and whose dense MLPs' gate/up
    # are one ("predictor", "talker"; "off"; "true" is both). The code predictor's fused frame is faster
    # at one utterance and at 64 alike; the talker's fused forward only at one (benchmarks/speech_step.py)
    fuse_projections: str = "predictor"
    talker_max_len: int = TALKER_MAX_LEN  # an utterance's prompt and codes at most (its KV cache's columns)
    limits: SpeechLimits = field(default_factory=SpeechLimits)

    def __post_init__(self):
        # a bad default would fail every request that leaves the option out, naming the client's field
        for name in ("chunk_frames", "first_chunk_frames"):
            value = getattr(self, name)
            if not 1 <= value <= self.limits.max_chunk_frames:
                raise ValueError(f"model parameter {name} must be in [1, {self.limits.max_chunk_frames}], "
                                 f"got {value}")
        unknown = set(self.compile_parts()) - set(COMPILE_PARTS)
        if unknown:
            raise ValueError(f"model parameter compile must name parts of {', '.join(COMPILE_PARTS)} "
                             f"(comma-separated) or be off, got {self.compile!r}")
        unknown = set(self.fused_parts()) - set(COMPILE_PARTS)
        if unknown:
            raise ValueError(f"model parameter fuse_projections must name parts of {', '.join(COMPILE_PARTS)} "
                             f"(comma-separated), or be true or off, got {self.fuse_projections!r}")
        if self.talker_max_len < 2:
            raise ValueError(f"model parameter talker_max_len must be at least 2, got {self.talker_max_len}")

    def compile_parts(self) -> tuple[str, ...]:
        return _parts(self.compile)

    def fused_parts(self) -> tuple[str, ...]:
        """The parts ``fuse_projections`` names (the talker's own layers, its code predictor's)."""
        return COMPILE_PARTS if self.fuse_projections.strip().lower() == "true" else _parts(self.fuse_projections)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)


def _parts(value: str) -> tuple[str, ...]:
    """A comma-separated list of parts; "off" or "false" (or nothing) is none."""
    return () if value.strip().lower() in ("", "off", "false") else tuple(p.strip() for p in value.split(","))


@dataclass
class AudioChunk:
    samples: np.ndarray  # float32 in [-1, 1], the next samples of the waveform
    codes: np.ndarray  # int64 [codebooks, frames]: the frames whose decode ended with these samples
    finish_reason: str | None = None  # on the last chunk: "stop" (end of speech) or "length"
    # on the first chunk: where its wait went, in seconds (FIRST_AUDIO_PHASES)
    phases: dict[str, float] | None = None


# A first chunk's wait, in order: the talker's prompt built; its utterance in the talker's step batch
# (waiting for the running step, then its prefill); its first frame (its reply's next tokens, the
# step); the rest of the frames its samples need (the talker's steps, each waiting for its reply's
# next state where the thinker is behind; for token2wav, the context after them too); their decode
# (waiting for the codec thread's batch).
FIRST_AUDIO_PHASES = ("prompt", "join", "first_frame", "frames", "decode")


class SpeechRunner:
    def __init__(self, config: SpeechConfig):
        from transformers import AutoConfig, AutoTokenizer

        self.config = config
        folder = Path(resolve_model(config.model))
        model_config = AutoConfig.from_pretrained(folder)
        if model_config.model_type not in ("qwen3_omni_moe", "qwen2_5_omni"):
            raise ValueError(f"model parameter model {config.model!r}: the speech stage speaks Qwen3-Omni and "
                             f"Qwen2.5-Omni checkpoints, not {model_config.model_type!r}")
        self.device = torch.device(config.device)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        qwen3 = model_config.model_type == "qwen3_omni_moe"
        if qwen3:
            talker, code2wav, embedding = load_qwen3_speech(folder, model_config, self.device, config.torch_dtype())
            if fused := config.fused_parts():
                from triton_omni.speech.fused_projections import fuse_projections

                fuse_projections(talker, fused)
            self.talker = Qwen3Talker(talker, embedding, model_config)
            self.decoder = StreamingCode2Wav(code2wav)
        else:
            talker, token2wav, embedding, speakers = load_qwen25_speech(folder, model_config, self.device,
                                                                        config.torch_dtype())
            self.talker = Qwen25Talker(talker, embedding, speakers, model_config)
            if config.fused_parts():
                logger.info("fuse_projections ignored: only a Qwen3-Omni talker's projections are fused")
            self.decoder = StreamingToken2Wav(token2wav)
            if config.cuda_graphs and self.device.type == "cuda":  # its ODE's usual windows, captured now
                try:
                    self.decoder.capture([self.talker.voice_conditioning(v) for v in self.talker.voices],
                                         config.max_num_seqs)
                except RuntimeError as exc:  # a capture this host refuses: the stage serves, eagerly
                    logger.warning("token2wav's ODE runs eagerly: its CUDA graphs could not be captured (%s)", exc)
                    self.decoder.graphs = None
        # the width of the thinker's states a reply brings (a Qwen2.5-Omni talker reads them), else None
        self.states_width = None if qwen3 else self.talker.width
        self.voices = self.talker.voices
        self.talker.end_state  # noqa: B018 - made once now, not on the loop at the first reply's end
        self.default_voice = self.talker.default_voice
        self.batcher = TalkerBatcher(self.talker, config.max_num_seqs, config.cuda_graphs, config.talker_max_len,
                                     compile=config.compile_parts() if qwen3 else ())
        self.loop = EventLoopThread(name="omni-speech")
        # on a GPU, every convolution shape the default chunks meet planned now, not mid-stream
        warm = (config.max_num_seqs, config.first_chunk_frames, config.chunk_frames) \
            if self.device.type == "cuda" else None
        try:
            self.codec = Code2WavBatcher(self.decoder, warm) if qwen3 else Token2WavDecoder(self.decoder)
        except BaseException:  # the load fails: nothing of it left running
            self.batcher.stop()
            self.loop.stop()
            raise
        # the talker's prompts are built off the event loop, one at a time
        self._prompts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-speech-prompt")
        self._lock = threading.Lock()
        self._following: dict[Utterance, ReplyReader] = {}  # replies still being written (the loop's)
        self._follower: asyncio.Task | None = None
        self.counters = {"started": 0, "finished": 0, "cancelled": 0, "chunks": 0}
        logger.info("speech runner ready: model=%s (%s) device=%s voices=%s, %d codec shapes planned", folder,
                    model_config.model_type, self.device, sorted(self.voices), len(self.codec.warmed_shapes))

    def parse(self, inputs: dict) -> SpeechRequest:
        request = SpeechRequest.from_inputs(inputs, self.config.limits, self.voices, self.default_voice,
                                            self.talker.defaults, self.config.chunk_frames,
                                            self.config.first_chunk_frames)
        self.talker.check_request(request, self.config.talker_max_len)
        return request

    def prompt_ids(self, prompt: str) -> list[int]:
        """The prompt's token ids as the thinker (``ar``) read them: the same tokenizer, its special tokens."""
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    async def speak(self, request: SpeechRequest, on_chunk: Callable[[AudioChunk], None],
                    reply: ReplyReader | None = None) -> None:
        """Speak ``request`` on this runner's loop, handing each chunk to ``on_chunk`` as it is
        decoded; cancelled, the talker drops the utterance at its next step. ``reply``: the rest
        of a reply still being written (``request.reply_ids`` its first tokens), read as it comes."""
        loop = asyncio.get_running_loop()
        if self.states_width is not None and reply is None and len(request.reply_ids) < 2:
            # a reply of one token (its end): the model's own generate has nothing to read after it and
            # fails; there is nothing to speak
            on_chunk(AudioChunk(np.zeros(0, np.float32), np.zeros((self.talker.groups, 0), np.int64), "stop"))
            self._count("finished")
            return
        frames: asyncio.Queue = asyncio.Queue()
        marks = [time.monotonic()]  # FIRST_AUDIO_PHASES' ends, after the start
        try:
            prompt = await loop.run_in_executor(
                self._prompts, lambda: self.talker.prompt(request.prompt_ids or self.prompt_ids(request.prompt),
                                                          request.reply_ids, request.voice, whole=reply is None,
                                                          heard=request.heard, states=request.states,
                                                          positions=request.positions))
            marks.append(time.monotonic())
            options = self._bounded(request, len(prompt.embeds))
            utterance = Utterance(prompt, options, lambda item: loop.call_soon_threadsafe(frames.put_nowait, item),
                                  prompt_ids=prompt.prompt_codes)
            self.batcher.submit(utterance)
        except BaseException:
            if reply is not None:
                reply.close()
            raise
        stream = self._decoder_stream(request)
        self._count("started")
        if reply is not None:
            self._follow(reply, utterance)
        try:
            pending: list[list[int]] = []
            # frames decoded whose samples have not all left (a decoder that waits for context: token2wav)
            held = torch.zeros(self.talker.groups, 0, dtype=torch.long)
            samples_sent = codes_sent = 0
            sizes = chunk_schedule(request.first_chunk_frames, request.chunk_frames)
            wanted = next(sizes)
            while True:
                item = await frames.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None and utterance.reason == "abort":  # its reply aborted, or the stage stopping
                    raise RequestCancelledError("the speech was stopped before its end")
                if item is not None:
                    if len(marks) == 2:  # the first frame
                        marks += [utterance.joined_at or time.monotonic(), time.monotonic()]
                    pending.append(item)
                    if len(pending) < wanted:
                        continue
                final = item is None
                if pending or final:
                    codes = torch.tensor(pending, dtype=torch.long).reshape(-1, self.talker.groups).T.contiguous()
                    # a chunk short of chunk_frames is one of the first: little audio plays before it
                    urgent = wanted < request.chunk_frames
                    handed = time.monotonic()  # the frames are all there: what follows is their decode
                    samples = await asyncio.wrap_future(self.codec.decode(stream, codes, urgent, final))
                    held, samples_sent = torch.cat([held, codes], dim=1), samples_sent + len(samples)
                    pending, wanted = [], next(sizes)
                    if len(samples) == 0 and not final:  # the decoder waits for what follows these frames
                        continue
                    # the frames these samples end: all of them, but where the decoder's samples lag its codes
                    ended = held.shape[1] if final or not self.decoder.lags \
                        else samples_sent // self.decoder.samples_per_code - codes_sent
                    codes, held = held[:, :ended], held[:, ended:]
                    codes_sent += ended
                    phases = None
                    if len(marks) == 4:  # the first chunk
                        marks += [handed, time.monotonic()]
                        phases = dict(zip(FIRST_AUDIO_PHASES, np.diff(marks).tolist(), strict=True))
                    on_chunk(AudioChunk(samples, codes.numpy(), utterance.reason if final else None, phases))
                    self._count("chunks")
                if final:
                    self._count("finished")
                    return
        except asyncio.CancelledError:
            utterance.cancel()
            self._count("cancelled")
            raise
        finally:
            if reply is not None:
                self._following.pop(utterance, None)
                reply.close()

    def _decoder_stream(self, request: SpeechRequest):
        """A new stream of this model's decoder for ``request`` (Qwen2.5-Omni's in its voice, its noise
        from a generator seeded by the request's seed, as the model's own decode draws it)."""
        if self.states_width is None:
            return self.decoder.stream()
        generator = torch.Generator()
        if request.talker.seed is not None:
            generator.manual_seed(request.talker.seed)
        else:
            generator.seed()
        return self.decoder.stream(*self.talker.voice_conditioning(request.voice), generator)

    def _follow(self, reply: ReplyReader, utterance: Utterance) -> None:
        """Read ``reply`` into ``utterance``'s prompt as it is written (on this loop, one task for
        every reply still being written)."""
        self._following[utterance] = reply
        if self._follower is None or self._follower.done():
            self._follower = asyncio.create_task(self._follow_all())

    async def _follow_all(self) -> None:
        """Every ``REPLY_POLL_S``, the new tokens of each reply still being written into its
        utterance's prompt (all replies' projected in one pass, on the prompts' thread), then its
        end; an aborted reply (the thinker failed) cancels its utterance. The talker is woken
        where a reply grew."""
        loop = asyncio.get_running_loop()
        while self._following:
            read: dict[Utterance, tuple[list[int], np.ndarray | None]] = {}
            for utterance, reply in list(self._following.items()):
                try:
                    ids = reply.read()
                    states = reply.read_states() if self.states_width is not None else None
                    if ids or (states is not None and len(states)):
                        self.talker.check_ids("omni_reply", ids)  # one bad reply cannot fail the others' pass
                        read[utterance] = ids, states
                except Exception:  # an unreadable reply: its utterance cannot go on, the others can
                    logger.exception("speech: reading a reply failed; its utterance is cancelled")
                    self._abort(utterance, reply)
            if read:
                try:
                    ids, states = zip(*read.values(), strict=True)
                    grown = await loop.run_in_executor(self._prompts, self.talker.reply_states, list(ids),
                                                       list(states))
                    for utterance, more in zip(read, grown, strict=True):
                        utterance.prompt.extend(more)
                except Exception:  # the device failed the pass: none of these replies can go on
                    logger.exception("speech: projecting the replies' tokens failed; their utterances are cancelled")
                    for utterance in read:  # one that ended during the pass is no longer followed
                        utterance.cancel()
                        if (reply := self._following.get(utterance)) is not None:
                            reply.state = "abort"
            changed = bool(read)
            for utterance, reply in list(self._following.items()):
                if reply.state == "end":
                    utterance.prompt.finish(self.talker.end_state)
                elif reply.state == "abort":
                    utterance.cancel()
                if reply.state or utterance.done:
                    self._following.pop(utterance, None)
                    changed = True
            if changed:
                self.batcher.wake()
            await asyncio.sleep(REPLY_POLL_S)

    def _abort(self, utterance: Utterance, reply: ReplyReader) -> None:
        utterance.cancel()
        reply.state = "abort"

    def _bounded(self, request: SpeechRequest, prompt_length: int) -> SamplingOptions:
        """The talker's options with room for the prompt and ``max_tokens`` in ``talker_max_len``
        (vLLM's ``max_model_len``): a default ``max_tokens`` bounded to the room left, a
        request's own refused when it does not fit."""
        limit = self.config.talker_max_len
        room = limit - prompt_length
        require(room > 0, "text_input" if request.prompt_ids is None else "prompt_ids", f"makes a talker prompt of "
                f"{prompt_length} positions, more than this model's talker_max_len {limit} leaves room for",
                request.prompt[:80])
        if request.talker.max_tokens <= room:
            return request.talker
        require(not request.max_tokens_given, "max_tokens", f"and the talker prompt's {prompt_length} positions "
                f"exceed this model's talker_max_len {limit}: at most {room} here", request.talker.max_tokens)
        return replace(request.talker, max_tokens=room)

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def close(self) -> None:
        self.loop.run(self._stop_following(), timeout=30)
        self.batcher.stop()
        self.codec.stop()
        self._prompts.shutdown(wait=False)
        self.loop.stop()

    async def _stop_following(self) -> None:
        self._following.clear()
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)


def load_qwen3_speech(folder: Path, config, device: torch.device, dtype: torch.dtype):
    """The talker, ``code2wav`` and the thinker's embedding table of a Qwen3-Omni checkpoint, and
    nothing of the thinker besides: each built empty on ``device`` and given its tensors, shard by
    shard (the experts' per-expert tensors fused as transformers' modules hold them)."""
    from transformers.initialization import no_init_weights
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeCode2Wav,
        Qwen3OmniMoeTalkerForConditionalGeneration,
    )

    with torch.device(device), no_init_weights():
        talker = Qwen3OmniMoeTalkerForConditionalGeneration(config.talker_config)
        code2wav = Qwen3OmniMoeCode2Wav(config.code2wav_config)
        embedding = torch.nn.Embedding(config.thinker_config.text_config.vocab_size,
                                       config.thinker_config.text_config.hidden_size)
    parts = _read_parts(folder, ("talker.", "code2wav.", "thinker.model.embed_tokens."))
    for module, state in ((talker, _fuse_experts(parts["talker."])), (code2wav, parts["code2wav."]),
                          (embedding, parts["thinker.model.embed_tokens."])):
        module.load_state_dict(state, strict=True)
        module.to(device, dtype).eval()
    code2wav.float()  # the decoder in float32, as the model's generate runs it (its samples are float32)
    return talker, code2wav, embedding


def load_qwen25_speech(folder: Path, config, device: torch.device, dtype: torch.dtype):
    """The talker, ``token2wav``, the thinker's embedding table and the voices (``spk_dict.pt``) of a
    Qwen2.5-Omni checkpoint, and nothing of the thinker besides; ``token2wav`` in float32, as the
    model's ``generate`` runs it."""
    from transformers.initialization import no_init_weights
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniTalkerForConditionalGeneration,
        Qwen2_5OmniToken2WavModel,
    )

    with torch.device(device), no_init_weights():
        talker = Qwen2_5OmniTalkerForConditionalGeneration(config.talker_config)
        token2wav = Qwen2_5OmniToken2WavModel(config.token2wav_config)
        text = config.thinker_config.text_config
        embedding = torch.nn.Embedding(text.vocab_size, text.hidden_size)
    parts = _read_parts(folder, ("talker.", "token2wav.", "thinker.model.embed_tokens."))
    for module, state in ((talker, parts["talker."]), (token2wav, parts["token2wav."]),
                          (embedding, parts["thinker.model.embed_tokens."])):
        module.load_state_dict(state, strict=True)
        module.to(device, dtype).eval()
    token2wav.float()
    speakers = torch.load(folder / "spk_dict.pt", map_location="cpu", weights_only=True)
    return talker, token2wav, embedding, speakers


def _read_parts(folder: Path, prefixes: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """A checkpoint's tensors under each of ``prefixes`` (the prefix taken off), shard by shard."""
    from safetensors import safe_open

    parts: dict[str, dict[str, torch.Tensor]] = {prefix: {} for prefix in prefixes}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as source:
            for key in source.keys():  # noqa: SIM118 - a safetensors file is not iterable
                prefix = next((p for p in prefixes if key.startswith(p)), None)
                if prefix is not None:
                    parts[prefix][key.removeprefix(prefix)] = source.get_tensor(key)
    return parts


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def _fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``experts.N.{gate,up,down}_proj.weight`` (how checkpoints store them) as the
    modules' ``experts.gate_up_proj`` [experts, 2 x inner, width] and ``experts.down_proj``."""
    fused: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, tensor in state.items():
        match = _EXPERT.fullmatch(key)
        if match is None:
            fused[key] = tensor
        else:
            experts.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = tensor
    for prefix, by_index in experts.items():
        ordered = [by_index[i] for i in range(len(by_index))]
        fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([e["gate"], e["up"]]) for e in ordered])
        fused[f"{prefix}.down_proj"] = torch.stack([e["down"] for e in ordered])
    return fused
