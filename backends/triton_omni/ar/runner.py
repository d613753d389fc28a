"""``ArRunner``: one AR engine, its event loop, and the checks that need the tokenizer.

The runner is Triton-free. It tokenizes each prompt once (the length check
needs the token count anyway) and hands token ids to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoTokenizer

from triton_omni.aio import EventLoopThread
from triton_omni.ar.audio_prompt import ears_of, has_ears
from triton_omni.ar.engine import ArEngine, Delta
from triton_omni.ar.engine_pipeline import PipelineTextEngine
from triton_omni.ar.language_model import architecture, has_language_model, is_omni, language_model
from triton_omni.ar.request import EncodeRequest, GenerateRequest
from triton_omni.ar.response import ArResponse, ResponseAssembler
from triton_omni.ar.sampling import ArLimits, SamplingOptions
from triton_omni.ar.shared_engine import EngineSeat
from triton_omni.ar.vision_prompt import VisionInputs, eyes_of, has_eyes
from triton_omni.audio import AudioLimits, decode_audio
from triton_omni.cpu_affinity import parse_cpus
from triton_omni.demo_models import resolve_model
from triton_omni.dtypes import torch_dtype
from triton_omni.errors import RequestValidationError
from triton_omni.families import EncoderRecipe, recipe
from triton_omni.gpu_memory import cap_torch
from triton_omni.images import ImageLimits
from triton_omni.validation import require

logger = logging.getLogger(__name__)

EngineName = Literal["auto", "vllm", "transformers"]
# Measured with vLLM 0.32 on the CPU: a request without an adapter that shares a step with one that has
# one, the first in its prefill and the other decoding, gets the adapter's tokens (vLLM's offline LLM,
# which prefills a batch together, and the same requests one at a time give the right ones)
VLLM_CPU_LORA = ("vLLM's CPU LoRA kernels give a request without an adapter another's tokens when their "
                 "prefill and decode share a step")
Side = tuple[str, list[int]]  # a text to encode and its token ids (none: zero tokens, the encoder not run)
Mode = Literal["generate", "encode"]
WARMUP_TOKENS = 4  # each warm-up request's tokens out: its prefill, then a few decode steps at its batch's size

__all__ = ["ArResponse", "ArRunner", "ArRunnerConfig", "Delta", "Embedding"]


@dataclass(frozen=True)
class ArRunnerConfig:
    model: str
    mode: Mode = "generate"
    engine: EngineName = "auto"
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    max_model_len: int = 1024
    embeds_dtype: str = "float32"  # dtype of ar_encoder's prompt_embeds output
    limits: ArLimits = field(default_factory=ArLimits)
    engine_args: dict[str, Any] = field(default_factory=dict)  # extra vLLM engine args
    # This model's share of its GPU (gpu_memory.py); None: the engine's default (vLLM: 0.9).
    gpu_memory_utilization: float | None = None
    engine_cpus: str = ""  # vLLM: the CPUs its engine core runs on (cpu_affinity.py); "": wherever the OS puts it
    # encode mode: the diffusion pipeline's text-encoding recipe (its family's, triton_omni.families)
    recipe: str = "last_hidden_state"
    # LoRA adapters a request may name: name -> PEFT folder; and how many stay on the device
    lora_adapters: dict[str, str] = field(default_factory=dict)
    max_loras: int = 4
    # "fp8": vLLM's own FP8 weights (its `quantization` engine argument, scales computed at load)
    quantization: str = "none"
    # the most audio clips one prompt holds, for a model that hears (a Qwen-Omni thinker); 0: it hears
    # none, and its audio tower is not loaded
    max_audio_clips: int = 8
    # the most images one prompt holds, for a model that sees (a Qwen-Omni thinker with its vision tower,
    # on the transformers engine: vLLM refuses them by name); 0: it sees none
    max_images: int = 8
    # generate mode: a burst of this many requests of `warmup_prompt_tokens` random token ids run as the
    # model loads, before it is ready (None: the vLLM engine's max_num_seqs on a GPU, none elsewhere)
    warmup_requests: int | None = None
    warmup_prompt_tokens: int = 128

    def __post_init__(self):
        if self.mode not in ("generate", "encode"):
            raise ValueError(f"mode must be 'generate' or 'encode', got {self.mode!r}")
        if self.engine not in ("auto", "vllm", "transformers"):
            raise ValueError(f"engine must be 'auto', 'vllm' or 'transformers', got {self.engine!r}")
        recipe(self.recipe)  # a name it does not know fails the load, naming the parameter
        if self.quantization not in ("none", "fp8"):
            raise ValueError(f"model parameter quantization must be 'none' or 'fp8', got {self.quantization!r}")
        if self.warmup_requests is not None and self.warmup_requests < 0:
            raise ValueError(f"model parameter warmup_requests must be 0 or more, got {self.warmup_requests}")
        if self.warmup_prompt_tokens < 1:
            raise ValueError(f"model parameter warmup_prompt_tokens must be 1 or more, got {self.warmup_prompt_tokens}")

    def resolved_engine(self) -> str:
        """The configured engine; ``auto``: vLLM when importable, except for an
        encoding recipe vLLM cannot run (then the transformers engine, said in the log)."""
        engine = self.engine if self.engine != "auto" else \
            "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
        if engine == "vllm" and self.lora_adapters and not torch.cuda.is_available():
            if self.engine == "vllm":
                raise ValueError(f"model parameter lora_adapters: {VLLM_CPU_LORA}; set engine 'transformers'")
            logger.warning("LoRA adapters run on the transformers engine here: %s", VLLM_CPU_LORA)
            return "transformers"
        if self.mode != "encode" or engine != "vllm":
            return engine
        reason = _vllm_cannot_encode(recipe(self.recipe), self.model)
        if reason is None:
            return engine
        if self.engine == "vllm":
            raise ValueError(f"recipe {self.recipe!r} cannot run on vLLM ({reason}); set engine 'transformers'")
        logger.warning("recipe %s runs on the transformers engine: vLLM cannot run it (%s)", self.recipe, reason)
        return "transformers"

    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype, self.device, cuda_default=torch.bfloat16)


@dataclass
class Embedding:
    """Per-token hidden states of one prompt, ``[num_tokens, hidden]``, and of its negative
    prompt when the request asked for that side (zero tokens: the pipeline runs without one)."""

    hidden_states: torch.Tensor
    negative_hidden_states: torch.Tensor | None = None
    pooled: torch.Tensor | None = None  # [P], the prompt's pooled embedding where the family reads one (FLUX.1)


class ArRunner:
    def __init__(self, config: ArRunnerConfig, seat: EngineSeat | None = None,
                 on_lora: Callable[[str, str], None] | None = None):
        """``seat``: a vLLM engine core shared with other instances (shared_engine.py);
        ``on_lora(event, adapter)``: each request with a LoRA adapter (``request``), and where the
        adapters are this process's (the transformers engine), each ``load`` and ``eviction``."""
        self.config = config
        self._on_lora = on_lora or (lambda event, adapter: None)
        self.seat = seat
        self.recipe: EncoderRecipe = recipe(config.recipe)
        # the input images an encoding recipe reads with the prompt (None: it reads none; see below for
        # a thinker's)
        self.image_limits = ImageLimits(max_images=self.recipe.images) \
            if config.mode == "encode" and self.recipe.images else None
        self.model_path, tokenizer_path = _encoder_paths(resolve_model(config.model), self.recipe.tokenizer)
        checkpoint = self.model_path
        self.engine_name = config.resolved_engine()
        if self.engine_name == "vllm" and has_language_model(self.model_path):
            self.model_path = language_model(self.model_path, tokenizer_path)
            logger.info("vLLM encodes with the language model of %s (%s)", config.model, self.model_path)
        elif is_omni(self.model_path):  # the thinker alone: the speech stage holds the talker and decoder
            self.model_path = language_model(self.model_path, tokenizer_path)
            logger.info("the thinker of %s, as a causal LM (%s)", config.model, self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self._token_ids = _token_ids_of(self.tokenizer, config.mode != "encode" or self.recipe.special_tokens)
        # what the thinker hears with (the prompt handed to the engine as embeddings), and how much
        hears = config.mode == "generate" and config.max_audio_clips > 0 and has_ears(checkpoint)
        self.ears = ears_of(checkpoint, torch.device(config.device), config.torch_dtype()) if hears else None
        self.audio_limits = AudioLimits() if self.ears is None else AudioLimits(
            max_clips=config.max_audio_clips, max_seconds=self.ears.max_seconds or AudioLimits.max_seconds)
        sees = config.mode == "generate" and config.max_images > 0 and has_eyes(checkpoint)
        # its vision tower where the engine reads images (vLLM refuses them by name: check_images)
        self.eyes = eyes_of(checkpoint, torch.device(config.device), config.torch_dtype(),
                            self.ears.embed_tokens if self.ears is not None else None) \
            if sees and self.engine_name == "transformers" else None
        if config.mode == "generate":  # the images the thinker sees (none: `images` refused by name)
            self.image_limits = ImageLimits(max_images=config.max_images if sees else 0)
        # the clips heard and the images seen one request at a time, off the engine's loop and Triton's thread
        self._hearing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-ar-senses") \
            if hears or sees else None
        self.loop = EventLoopThread(name=f"omni-ar-{config.mode}")
        # Engines are built on the loop thread: AsyncLLM binds its output
        # handler to the loop that is running when it is created.
        self.engine: ArEngine | PipelineTextEngine = self.loop.run(self._build_engine())
        self.warmed = 0  # the warm-up requests that ran
        if config.mode == "generate" and (burst := warmup_burst(config, self.engine_name,
                                                                 self.engine.max_num_seqs)) > 0:
            self.loop.run(self._warm_up(burst))
        logger.info("AR runner ready: model=%s engine=%s mode=%s%s", self.model_path, self.engine_name, config.mode,
                    f" recipe={self.recipe.name}" if config.mode == "encode" else "")


    async def _warm_up(self, requests: int) -> None:
        """One request alone, then ``requests`` together (the batch shapes of a quiet server and of a
        full one), each ``warmup_prompt_tokens`` random token ids and a few tokens out; their output is
        thrown away. A failure here fails the load: a model that cannot answer these cannot serve."""
        cfg = self.config
        tokens = min(cfg.warmup_prompt_tokens, cfg.max_model_len - WARMUP_TOKENS)  # room for its tokens out
        generator = torch.Generator().manual_seed(0)
        vocab = len(self.tokenizer)
        options = SamplingOptions(max_tokens=WARMUP_TOKENS, ignore_eos=True, temperature=0.0)
        started = time.monotonic()
        for burst in dict.fromkeys((1, requests)):  # in order, once each
            prompts = torch.randint(vocab, (burst, tokens), generator=generator).tolist()
            await asyncio.gather(*(self.engine.stream(ids, options, f"warmup-{burst}-{i}", None, lambda delta: None)
                                   for i, ids in enumerate(prompts)))
            self.warmed += burst
        logger.info("warm-up: %d requests of %d prompt tokens in %.1f s", self.warmed, tokens,
                    time.monotonic() - started)

    def _check_quantization(self) -> None:
        """``quantization: fp8`` is vLLM's FP8 on a GPU: refused by name on any other engine or host."""
        cfg = self.config
        if cfg.quantization == "none":
            return
        by_pipeline = cfg.mode == "encode" and self.recipe.by_pipeline
        engine = "the pipeline's encode_prompt" if by_pipeline else self.engine_name
        if engine != "vllm":
            raise ValueError(f"model parameter quantization {cfg.quantization!r} is vLLM's own FP8: this model runs "
                             f"on {engine} (set engine: vllm)")
        if not cfg.device.startswith("cuda"):
            raise ValueError(f"model parameter quantization {cfg.quantization!r} needs a GPU (vLLM's FP8 kernels); "
                             f"this instance runs on {cfg.device}")

    async def _build_engine(self) -> ArEngine | PipelineTextEngine:
        cfg = self.config
        self._check_quantization()
        if cfg.mode == "encode" and self.recipe.by_pipeline:
            if cfg.lora_adapters:
                raise ValueError(f"model parameter lora_adapters: recipe {self.recipe.name!r} encodes through its "
                                 "pipeline's own encode_prompt, which takes no LoRA adapters here")
            if cfg.gpu_memory_utilization is not None:
                cap_torch(cfg.gpu_memory_utilization, cfg.device)
            return PipelineTextEngine(self.model_path.parent, cfg.device, cfg.torch_dtype())
        if self.engine_name == "vllm":
            from triton_omni.ar.engine_vllm import VllmEngine

            dtype = str(cfg.torch_dtype()).removeprefix("torch.")
            if cfg.lora_adapters and dtype not in ("bfloat16", "float16"):
                raise ValueError(f"model parameter lora_adapters: vLLM's LoRA kernels take bfloat16 or float16, "
                                 f"not dtype {dtype}")
            share = {} if cfg.gpu_memory_utilization is None else {"gpu_memory_utilization": cfg.gpu_memory_utilization}
            cpus = parse_cpus(cfg.engine_cpus) if cfg.engine_cpus else None
            quantized = {"quantization": "fp8"} if cfg.quantization == "fp8" else {}
            heard = {"enable_prompt_embeds": True} if self.ears is not None else {}  # a prompt with audio
            if heard and cfg.engine_args.get("enable_prompt_embeds") is False:
                raise ValueError("model parameter engine_args: enable_prompt_embeds false, and this model hears "
                                 "audio (its prompts reach vLLM as embeddings); set max_audio_clips 0 instead")
            return VllmEngine(str(self.model_path), cfg.mode, dtype, cfg.max_model_len,
                              share | quantized | heard | cfg.engine_args,
                              self.seat, cpus, cfg.lora_adapters, cfg.max_loras)
        if self.seat is not None:
            raise ValueError("instances_per_engine > 1 needs the vLLM engine: the transformers engine is in-process")
        if cfg.engine_cpus:
            raise ValueError(f"engine_cpus {cfg.engine_cpus!r} pins vLLM's engine core process; the transformers "
                             "engine runs in the model's own process (set the server's CPUs instead: taskset)")
        from triton_omni.ar.engine_transformers import DEFAULT_MAX_NUM_SEQS, TransformersEngine

        if cfg.gpu_memory_utilization is not None:
            cap_torch(cfg.gpu_memory_utilization, cfg.device)

        # vLLM's name for the bound on sequences decoded together, read by both engines
        max_num_seqs = int(cfg.engine_args.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS))
        return TransformersEngine(str(self.model_path), cfg.device, cfg.torch_dtype(), max_num_seqs,
                                  encoder=cfg.mode == "encode", adapters=cfg.lora_adapters, max_loras=cfg.max_loras,
                                  on_lora=lambda event, adapter: event != "request" and self._on_lora(event, adapter))

    @property
    def hidden_size(self) -> int:
        """The width of an embedding: the model's hidden size, once per layer the recipe joins."""
        return self.engine.hidden_size * (len(self.recipe.layers) if self.config.mode == "encode" else 1)

    def tokenize(self, prompt: str, name: str = "text_input") -> list[int]:
        """Token ids of a prompt (rendered by the recipe when encoding),
        rejecting prompts the model cannot take (naming the input ``name``)."""
        encoding = self.config.mode == "encode"
        ids = self._token_ids(self.recipe.render(self.tokenizer, prompt) if encoding else prompt)
        allowed = self.config.max_model_len - 1  # leave room for at least one new token
        if encoding and self.config.limits.max_prompt_tokens is not None:  # the tokens that leave, template's aside
            allowed = min(allowed, self.config.limits.max_prompt_tokens + self.recipe.dropped)
        if encoding and self.recipe.padded_to is not None:  # where its pipeline would cut the prompt short
            allowed = min(allowed, self.recipe.padded_to)
        if len(ids) > allowed:
            raise RequestValidationError(
                name, f"prompt has {len(ids)} tokens; this model allows at most {allowed}",
                f"{prompt[:40]}...", show_value=True,
            )
        return ids

    def _perceive(self, prompt_ids: list[int], files: list[bytes],
                  images: list) -> tuple[list[int], torch.Tensor, VisionInputs | None]:
        """The prompt with its audio and images: its widened ids (leaving room for one new token), its
        embeddings (on the host for vLLM, whose engine core copies them to its device), and, with
        images, what the LM reads of them beyond the embeddings (its rotary positions, deepstack)."""
        room = self.config.max_model_len - 1
        embeds, frames = None, None
        if files:
            prompt_ids, embeds, frames = self.ears.prompt(prompt_ids, decode_audio(files, self.audio_limits),
                                                          max_tokens=room)
        if not images:
            return prompt_ids, embeds.cpu() if self.engine_name == "vllm" else embeds, None
        seen = self.eyes.prompt(prompt_ids, embeds, images, max_tokens=room)
        return seen.ids, seen.embeds, self.eyes.inputs(seen, frames)

    def check(self, request: GenerateRequest) -> None:
        """Engine-specific validation (vLLM's own ``SamplingParams`` checks,
        or the keys the transformers engine lacks); raises ``RequestValidationError``."""
        self.check_lora(request.lora, request.lora_field)
        self.engine.check(request.sampling, _logprobs_needed(request))
        if request.images:  # a model without a vision tower took none (image_limits); vLLM refuses them here
            self.engine.check_images("images")
        if request.outputs.heard_states:
            if self.ears is None or self.ears.talker_layer is None:
                raise RequestValidationError("return_heard_states", "this model hears no audio for a talker (a "
                                             "Qwen3-Omni checkpoint with its audio tower and talker does)", True)
            self.engine.check_states("return_heard_states")
        if request.outputs.thinker_states:
            require(request.sampling.n == 1, "return_thinker_states", "hands on one completion's states: n must "
                    "be 1", request.sampling.n)
            self.engine.check_states("return_thinker_states")

    def check_lora(self, name: str | None, field: str = "lora") -> None:
        """``name`` (a request's ``lora``, sent as ``field``) is one of this model's adapters."""
        adapters = self.config.lora_adapters
        if name is not None and name not in adapters:
            raise RequestValidationError(field, f"unknown adapter; this model serves {sorted(adapters)}" if adapters
                                         else "this model serves no LoRA adapters (its lora_adapters parameter "
                                         "names none)", name)

    async def stream(self, request: GenerateRequest, request_id: str, on_response: Callable[[ArResponse], None],
                     on_first_token: Callable[[], None] | None = None) -> None:
        """Generate, handing each response to ``on_response`` in order, on
        the loop's thread, as the engine produces it; the last one is final.
        ``on_first_token`` is called when the first token is out (streaming or not)."""
        prompt_ids = self.tokenize(request.prompt)
        embeds, vision = None, None
        if request.audio or request.images:  # decoded, and the thinker's towers run, off the loop
            prompt_ids, embeds, vision = await asyncio.get_running_loop().run_in_executor(
                self._hearing, self._perceive, prompt_ids, request.audio, request.images)
        states_at = None
        if request.outputs.heard_states:  # checked by check(): the ears and an engine that hands them on
            states_at = (self.ears.talker_layer, self._perceived_at(prompt_ids))
        # with the prompt's ids: a prompt with images, its rotary positions (a talker numbers its own from them)
        positions = vision.positions.cpu() if vision is not None else None
        heard = None
        if request.outputs.thinker_states:  # the prompt's states come on the first response, its ids with them
            heard = (prompt_ids, None, positions)
        states: list[torch.Tensor] = []  # the states read since the last response that left
        if request.lora is not None:
            self._on_lora("request", request.lora)
        assembler = ResponseAssembler(n=request.sampling.n, num_input_tokens=len(prompt_ids), stream=request.stream,
                                      prompt=request.prompt if request.include_prompt else "")

        def on_delta(delta: Delta) -> None:
            nonlocal on_first_token, heard
            if on_first_token is not None and (delta.num_tokens or delta.finish_reason):
                on_first_token()
                on_first_token = None
            if delta.prompt_states is not None:
                heard = (prompt_ids, delta.prompt_states, positions)
            if delta.states is not None:
                states.append(delta.states)
            response = assembler.add(delta)
            if response is not None:
                if heard is not None:  # on the first response that leaves
                    response.heard, heard = heard, None
                if states:
                    response.thinker_states = torch.cat(states)
                    states.clear()
                on_response(response)

        # a talker reading the thinker's states reads zeros at the audio and images in place of its layer-0 input
        unheard = None
        if embeds is not None and request.outputs.thinker_states:
            perceived = torch.zeros(len(prompt_ids), dtype=torch.bool, device=embeds.device)
            perceived[self._perceived_at(prompt_ids)] = True
            unheard = embeds.masked_fill(perceived[:, None], 0)
        await self.engine.stream(prompt_ids, request.sampling, request_id, _logprobs_needed(request), on_delta,
                                 request.lora, prompt_embeds=embeds, states_at=states_at,
                                 keep_states=request.outputs.thinker_states, states_input=unheard,
                                 vision=vision)

    def _perceived_at(self, prompt_ids: list[int]) -> list[int]:
        """The positions of the prompt's audio and image tokens, which the towers' embeddings fill: where a
        Qwen3-Omni talker reads the thinker's states, and a Qwen2.5-Omni one zeros of its layer-0 input."""
        markers = self.ears.perceived_ids if self.ears is not None else \
            (self.eyes.image_token_id,) if self.eyes is not None else ()
        return [i for i, token in enumerate(prompt_ids) if token in markers]

    async def generate(self, request: GenerateRequest, request_id: str) -> AsyncIterator[ArResponse]:
        """``stream``'s responses as an async iterator (for callers that
        pull). Leaving it early cancels the request in the engine."""
        responses: asyncio.Queue[ArResponse | None] = asyncio.Queue()
        streaming = asyncio.ensure_future(self.stream(request, request_id, responses.put_nowait))
        streaming.add_done_callback(lambda _: responses.put_nowait(None))
        try:
            while (response := await responses.get()) is not None:
                yield response
            await streaming  # its error, if it failed
        finally:
            if not streaming.done():
                streaming.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await streaming

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def encode(self, requests: list[EncodeRequest]) -> list[Embedding | RequestValidationError]:
        """Encode a batch in one engine call: each prompt, and its negative side where asked.

        A prompt the model cannot take gets its error in its own slot; the
        rest of the batch is encoded as usual. A text that renders to no
        tokens encodes to zero tokens without reaching the engine.
        """
        plans: list[tuple[Side, Side | None] | RequestValidationError] = []
        for request in requests:
            try:
                self.check_lora(request.lora)
                plans.append(((request.prompt, self.tokenize(request.prompt)), self._negative_side(request)))
            except RequestValidationError as exc:
                plans.append(exc)
        sides, images, loras = [], [], []  # each side to encode, its request's input images and adapter
        for request, plan in zip(requests, plans, strict=True):
            if not isinstance(plan, Exception):
                for side in plan:
                    if side and side[1]:
                        sides.append(side)
                        images.append(request.images)
                        loras.append(request.lora)
        for request, plan in zip(requests, plans, strict=True):
            if request.lora is not None and not isinstance(plan, Exception):
                self._on_lora("request", request.lora)
        encoded = iter(await self._encode_sides(sides, images, loras)) if sides else iter(())
        dtype = getattr(torch, self.config.embeds_dtype)

        def states(side: Side | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            if side is None:
                return None, None
            if not side[1]:
                return torch.empty(0, self.hidden_size, dtype=dtype), None
            hidden, pooled = next(encoded)
            return self.recipe.select(hidden).to(dtype), None if pooled is None else pooled.to(dtype)

        results: list[Embedding | RequestValidationError] = []
        for plan in plans:
            if isinstance(plan, Exception):
                results.append(plan)
                continue
            (hidden, pooled), (negative, _) = states(plan[0]), states(plan[1])
            results.append(Embedding(hidden, negative, pooled))
        return results

    async def _encode_sides(self, sides: list[Side], images: list[list], loras: list[str | None]) \
            -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each side's states (and pooled embedding, where the recipe's pipeline makes one);
        ``images``: each side's input images, which a recipe ``by_pipeline`` may read; ``loras``:
        each side's adapter."""
        if isinstance(self.engine, PipelineTextEngine):
            return await self.engine.encode_prompts([text for text, _ in sides], images)
        return [(hidden, None) for hidden in await self._encode_texts([ids for _, ids in sides], loras)]

    async def _encode_texts(self, texts: list[list[int]], loras: list[str | None]) -> list[torch.Tensor]:
        """Each text's states of the recipe's layers; padded to the recipe's length first where its
        pipeline pads (the padding unattended, its states kept)."""
        length = self.recipe.padded_to
        if length is None:
            return await self.engine.encode(texts, self.recipe.layers, loras=loras)
        pad = self.tokenizer.pad_token_id
        return await self.engine.encode([ids + [pad] * (length - len(ids)) for ids in texts], self.recipe.layers,
                                        attended=[len(ids) for ids in texts], loras=loras)

    def _negative_side(self, request: EncodeRequest) -> Side | None:
        """The negative side: its text's, the recipe's stand-in for an absent one, or none at all (no
        tokens) where the family's pipeline runs without a negative prompt."""
        if not request.with_negative:
            return None
        text = request.negative_prompt if request.negative_prompt is not None else self.recipe.absent_negative
        return ("", []) if text is None else (text, self.tokenize(text, "negative_prompt"))

    def close(self) -> None:
        try:
            self.loop.run(self.engine.shutdown(), timeout=60)
        finally:
            self.loop.stop()
            if self._hearing is not None:
                self._hearing.shutdown(wait=True)


def warmup_burst(config: ArRunnerConfig, engine: str, max_num_seqs: int) -> int:
    """How many requests the load's warm-up sends together (``warmup_requests``; by default, for
    vLLM on a GPU, its ``max_num_seqs``: a fresh engine compiles some kernels (Triton's, a MoE's
    experts' among them) at their first real call for each new batch shape, so a fresh server's
    first burst waited for those compiles; on a 30B-A3B thinker the first token of the first 64
    prompts together took twenty times the next bursts'). An encoder warms nothing."""
    if config.mode != "generate":
        return 0
    if config.warmup_requests is not None:
        return config.warmup_requests
    return max_num_seqs if engine == "vllm" and config.device.startswith("cuda") else 0


def _vllm_cannot_encode(encoding: EncoderRecipe, model: str) -> str | None:
    """Why vLLM cannot run this recipe on this model, or None: its pooling runner
    returns the last layer of a causal LM's attended tokens, not other layers nor
    padding; a pipeline's text encoder only where it is a vision-language model
    whose language model it can load (language_model.py)."""
    if encoding.images:
        return ("it reads the input image with the prompt (the vision tower), and vLLM's pooling runner returns "
                "no hidden states for multimodal input: it runs the pipeline's own encode_prompt")
    if encoding.by_pipeline:
        return "its text encoders are not one causal LM: it runs the pipeline's own encode_prompt"
    if encoding.layers != (-1,):
        return f"it needs hidden layers {', '.join(map(str, encoding.layers))}"
    if encoding.padded_to is not None:
        return f"it needs the states of unattended padding up to {encoding.padded_to} tokens"
    path = _encoder_paths(resolve_model(model))[0] if model else None
    if path is not None and path.name == "text_encoder" and not has_language_model(path):
        return f"the pipeline's text encoder ({architecture(path) or 'no config'}) is not a causal LM vLLM loads"
    return None


def _encoder_paths(path: str, tokenizer: str = "tokenizer") -> tuple[Path, Path]:
    """(model, tokenizer) folders: a diffusers pipeline's ``text_encoder`` and its tokenizer
    (``tokenizer``: the recipe's) when ``path`` is one (``model_index.json``), else ``path`` twice."""
    root = Path(path)
    if (root / "model_index.json").exists():
        return root / "text_encoder", root / tokenizer
    return root, root


def _token_ids_of(tokenizer, special_tokens: bool = True) -> Callable[[str], list[int]]:
    """How a prompt becomes token ids: the tokenizer's call, or, for a fast
    tokenizer, its Rust backend directly, with the ids the call gives
    (``special_tokens``: with the tokens the tokenizer adds, a BOS).

    Why: the call wraps the backend in several times its own cost in Python,
    on the event loop whose GIL bounds a busy stub, and its batch call releases the GIL, which a contended thread
    waits for to get back. One call first sets the backend as every call
    with these arguments sets it (no truncation, no padding, special tokens
    kept whole), and nothing changes it afterwards."""
    if not getattr(tokenizer, "is_fast", False):
        return lambda prompt: tokenizer(prompt, add_special_tokens=special_tokens)["input_ids"]
    tokenizer("", add_special_tokens=special_tokens)
    backend = tokenizer.backend_tokenizer
    return lambda prompt: backend.encode(prompt, add_special_tokens=special_tokens).ids


def _logprobs_needed(request: GenerateRequest) -> int | None:
    """The returned log probabilities need the engine to compute them, at
    least for the sampled token, even when ``logprobs`` was not asked for."""
    return 0 if request.outputs.needs_logprobs else None
