"""What every pipeline family is made of, and the parts families share.

A family (one module beside this one) is all the runtime knows of a diffusers
pipeline class:

- its **capabilities** (``Capabilities``): its guidance kind, and which of the
  serving modes it takes (step cache, CFG parallel, sequence parallel, CUDA
  graphs, ``compile: blocks``); the runner, the step engine, ``ar_encoder``
  and the launcher read these and never probe a pipeline themselves;
- its **request batching** (``Family``): how its pipeline encodes a prompt on
  its own, when a request is guided, and the keyword arguments of one batched
  ``__call__`` given each request's embeddings;
- its **step adapter** (``StepAdapter``): its denoising loop cut into steps
  for the step engine (``diffusion/steps.py``), following the pipeline's own
  ``__call__`` line by line, so that a request stepped in any company gives
  the image of that call;
- its **text recipe** (``EncoderRecipe``): what ``ar_encoder`` computes so
  that its embeddings are the pipeline's own ``encode_prompt``;
- its **output** (``Output``): an image ``[H, W, 3]``, or a video's frames
  ``[F, H, W, 3]`` at a frame rate; the runner, the step engine's work
  accounting and the Triton adapter follow it;
- its **demo builders**: a tiny random-weight pipeline for the CPU and the
  tests, and the real shapes (random weights) for GPU benchmarks.

The pipeline stays the reference: a family never re-implements what the
pipeline does, it hands the pipeline (or its network, step by step) what the
pipeline would have computed itself.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import fnmatch
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from triton_omni.errors import RequestValidationError

# A step's rows padded up to this count (a bucket): (real rows) -> padded rows
PadTo = Callable[[int], int]


class Guidance(enum.Enum):
    """How a family's pipeline guides with its scale."""

    CFG = "cfg"  # a negative pass whenever the scale is above the threshold (the encoding of "" by default)
    TRUE_CFG = "true_cfg"  # a negative pass only when given a negative prompt, rescaled to the prompt's norm
    DISTILLED = "distilled"  # the scale is an input of the network: no negative pass
    NONE = "none"


@dataclass(frozen=True)
class Capabilities:
    guidance: Guidance
    guides_above: float = 1.0  # a scale above this guides (Z-Image's CFG: above 0)
    step_cache: bool = False  # First Block Cache per request (step_cache.py): a DiT's blocks to skip
    cfg_parallel: bool = False  # the negatives' pass on a second GPU (cfg_parallel.py)
    sequence_parallel: bool = False  # the network's tokens split over GPUs (sequence_parallel.py)
    cuda_graphs: bool = False  # the denoiser's steps replayed as CUDA graphs (cuda_graphs.py; a DiT's compiled)
    compile: bool = False  # `compile: blocks`: the DiT's repeated blocks under torch.compile
    vae_compile: bool = False  # `compile: vae`: the VAE's decoder under torch.compile (its decode measured faster)
    images: int = 0  # input images a request may give (FLUX.2's reference images); 0: none
    edits: bool = False  # every request gives an input image: the pipeline edits it (Qwen-Image-Edit)
    lora: bool = False  # LoRA adapters per request on the denoiser's linear layers (lora.py)
    # `fuse_projections`: diffusers' fused attention projections (one linear layer for q, k and v)
    fused_projections: bool = False


@dataclass(frozen=True)
class Output:
    """What a family's pipeline makes: one image (``[H, W, 3]`` uint8, the ``image`` output), or a
    video (``[F, H, W, 3]`` uint8 frames, the ``video`` output, played at ``fps``). A video's frame
    count is ``1 + k x frames_step`` (its VAE compresses ``frames_step`` frames into one latent
    frame after the first); ``default_frames`` is its pipeline's default."""

    name: str = "image"  # the diffusion model's output tensor: "image" or "video"
    fps: float = 0.0
    default_frames: int = 0
    max_side: int = 0  # a video's largest side its model card makes (Wan: 1280 for 720p); 0: the default limit

    @property
    def video(self) -> bool:
        return self.name == "video"

    def limits(self) -> dict[str, int]:
        """The request limits a video's model card needs (its default frame count, its 720p side),
        which the model's ``limits`` parameter may lower."""
        if not self.video:
            return {}
        return {"max_frames": max(81, self.default_frames)} | ({"max_size": self.max_side} if self.max_side else {})


IMAGE = Output()


@dataclass(frozen=True)
class EncoderRecipe:
    """What ``ar_encoder`` computes for a family: the text its encoder reads (the raw prompt, or
    the prompt in a template), which layers' hidden states are taken (several are joined per token,
    layer after layer, as FLUX.2's pipelines stack them), how many leading tokens (the template's)
    are dropped, and the length every prompt is padded to where the pipeline pads (the padding's
    states are part of the embedding: the DiT reads them)."""

    name: str
    render: Callable[[object, str], str]  # (tokenizer, prompt) -> the text the encoder reads
    layers: tuple[int, ...] = (-1,)  # indices into the model's hidden states (-1: the last, after the final norm)
    dropped: int = 0  # leading tokens of the rendered text left out of the output
    # What the pipeline encodes for a negative prompt it was not given: "" (the empty prompt's
    # encoding), or None: nothing, it runs without a negative (zero tokens leave the encoder).
    absent_negative: str | None = ""
    padded_to: int | None = None  # every prompt's tokens padded to this many, unattended (None: no padding)
    # whether the tokenizer adds its special tokens (a BOS) to the rendered text: the pipelines that
    # tokenize a chat template's output through apply_chat_template do not (the template has them)
    special_tokens: bool = True
    # True: the text encoders are not one causal LM (FLUX.1's CLIP and T5): ar_encoder loads the
    # pipeline without its DiT and VAE and encodes through its own encode_prompt (the family's
    # ``encode_batch``), on the transformers engine
    by_pipeline: bool = False
    tokenizer: str = "tokenizer"  # the pipeline's tokenizer whose tokens a prompt's length is counted in
    # how many input images the encoder reads with the prompt (a vision-language model's vision
    # tower, as Qwen-Image-Edit's pipeline runs it); 0: a request's images, if any, are the DiT's alone
    images: int = 0

    def select(self, hidden: torch.Tensor) -> torch.Tensor:
        """One prompt's ``[num_tokens, hidden]`` of the recipe's layers, template tokens dropped."""
        return hidden[self.dropped :]


# The raw prompt's last hidden state: Stable Diffusion's CLIP, and any text model as a demo encoder.
LAST_HIDDEN_STATE = EncoderRecipe("last_hidden_state", lambda tokenizer, prompt: prompt)


@dataclass(frozen=True)
class Demo:
    """``omni-triton serve --demo NAME``: the tiny pipeline it serves as ``diffusion`` (and, when the
    family's encoder is the pipeline's own, as ``ar_encoder`` with the family's recipe)."""

    name: str  # the --demo value
    model: str  # the demo model's name (``demo:<model>``)
    build: Callable[[Path], None]  # writes the tiny pipeline into a folder
    encoder: bool = True  # ar_encoder loads the pipeline's text encoder with the family's recipe


class Family:
    """A pipeline family's request batching. Subclasses set the class attributes and override
    what their pipeline does differently from Stable Diffusion's shape."""

    name: ClassVar[str]
    pipeline_class: ClassVar[str]  # the diffusers pipeline's class name: the registry's key
    capabilities: ClassVar[Capabilities]
    recipe: ClassVar[EncoderRecipe] = LAST_HIDDEN_STATE
    step_adapter: ClassVar[type[StepAdapter]]
    output: ClassVar[Output] = IMAGE
    # whether a request's input images enter the output's own latents (Wan's first frame) rather than
    # tokens beside them: sequence parallel, which splits the output's tokens, then takes them too
    images_in_latents: ClassVar[bool] = False
    # request batching: CFG runs the prompt and its negative as rows of one batch (one token count)
    negatives_in_one_batch: ClassVar[bool] = False
    demo: ClassVar[Demo | None] = None
    # more demo folders it builds (``demo:<name>``, resolved by ``demo_models.resolve_model``) -> builder(folder)
    demo_folders: ClassVar[dict[str, Callable[[Path], None]]] = {}
    # real shapes, random weights, built in memory on the GPU: ``demo:<name>`` -> builder(device, dtype)
    realistic: ClassVar[dict[str, Callable[[Any, Any], Any]]] = {}
    # the denoiser's layers (name prefixes) whose input holds every row's tokens at once, not a row
    # per request: adapters per request cannot apply there, and an adapter targeting them is refused
    lora_flattened: ClassVar[tuple[str, ...]] = ()
    # `quantization: fp8`: the linear layers of the repeated blocks this family keeps in bf16 (fnmatch
    # patterns of their names from the network's root; the model's `fp8_kept` parameter overrides)
    fp8_kept: ClassVar[tuple[str, ...]] = ()
    # which tokens each linear layer of the repeated blocks reads, for ``forward_flops``: (pattern of the
    # layer's name from the network's root, stream); the first match wins, and unmatched layers read both
    # streams' tokens ("joint"). An attention spans the tokens of its ``attention_streams`` entry (matched
    # on its own name; "cross": the image's tokens attending to the text's).
    flop_streams: ClassVar[tuple[tuple[str, str], ...]] = ()
    attention_streams: ClassVar[tuple[tuple[str, str], ...]] = ()
    # the DiT's attention may take a padding mask: requests of different text lengths share a pass
    # (`attention_backend: auto` then times kernels that take one; the others' passes never pad)
    attention_masked: ClassVar[bool] = False

    def __init__(self, pipeline):
        self.pipeline = pipeline

    @classmethod
    def serves(cls, pipeline) -> bool:
        """Whether this family serves ``pipeline`` (of its ``pipeline_class``): a class whose models
        differ in their loop (Wan 2.2's experts, or its first-frame conditioning) has a family per
        kind, each reading the pipeline's own config."""
        return True

    @property
    def network(self) -> torch.nn.Module:
        """The denoising network: a UNet or a diffusion transformer (the first, where there are several)."""
        return self.pipeline.transformer

    @property
    def networks(self) -> tuple[torch.nn.Module, ...]:
        """Every denoising network (Wan 2.2 A14B's two experts): what compile, FP8, the attention
        kernel and the step cache wrap, each of them."""
        return (self.network,)

    def hidden_size(self) -> int:
        raise NotImplementedError

    def size_multiple(self) -> int:
        """Height and width must be multiples of this: the VAE's factor times the DiT's patch."""
        raise NotImplementedError

    def frames_step(self) -> int:
        """A video family's frame counts are ``1 + k x`` this (its VAE's temporal factor); 0: images."""
        return 0

    def size_kwargs(self, height: int, width: int, frames: int) -> dict[str, Any]:
        """One batched ``__call__``'s output size (a video's frame count too)."""
        return {"height": height, "width": width} | ({"num_frames": frames} if self.output.video else {})

    def call(self, kwargs: dict[str, Any]) -> Any:
        """One batched ``__call__`` (request batching): the pipeline's own; a family whose input image
        is read by another pipeline class over the same components (Wan 2.2 TI2V's first frame)
        calls that one."""
        return self.pipeline(**kwargs)

    def call_output(self, result: Any) -> torch.Tensor:
        """One ``__call__``'s output (``output_type="pt"``) as ``[N, 3, H, W]`` images or
        ``[N, F, 3, H, W]`` videos in [0, 1]."""
        return result.images

    def uses_guidance(self, guidance_scale: float, has_negative: bool) -> bool:
        """Whether a request runs a negative pass, by the pipeline's own rule."""
        kind = self.capabilities.guidance
        if kind in (Guidance.DISTILLED, Guidance.NONE) or guidance_scale <= self.capabilities.guides_above:
            return False
        return has_negative or kind is Guidance.CFG

    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        """One prompt alone, as the pipeline encodes it: ``[num_tokens, hidden]``."""
        raise NotImplementedError

    def pooled_size(self) -> int:
        """The width of the pooled embedding the DiT reads beside the sequence (FLUX.1's CLIP
        vector); 0: none."""
        return 0

    def encode_prompt(self, prompt: str, device: torch.device,
                      images: list = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One prompt alone: its sequence and, where the family reads one, its pooled embedding
        (``images``: the request's input images, for a family whose encoder reads them)."""
        return self.encode(prompt, device), None

    def encode_batch(self, prompts: list[str], device: torch.device,
                     images: list[list] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """ar_encoder's batch for a recipe ``by_pipeline``: each prompt's sequence and pooled embedding
        (``images``: each prompt's input images, where the recipe reads them)."""
        raise NotImplementedError

    def has_text_encoder(self) -> bool:
        return getattr(self.pipeline, "text_encoder", None) is not None

    def require_text_encoder(self) -> None:
        """A pipeline built without its text encoder (the realistic GPU presets) takes embeddings only."""
        if not self.has_text_encoder():
            raise RequestValidationError("prompt", "this model has no text encoder: send prompt_embeds "
                                         "(text_to_image and omni do)", None, show_value=False)

    def call_kwargs(self, conds: list[torch.Tensor], unconds: list[torch.Tensor] | None,
                    guidance_scale: float) -> dict[str, Any]:
        """One batched call's conditioning: rows of one token count (the runner groups them so)."""
        raise NotImplementedError

    def check_images(self, images: list, field: str = "images") -> tuple[int, int] | None:
        """Refuse input images the pipeline refuses (``RequestValidationError`` naming the image, in
        ``field``: ``image`` or ``images``);
        the output's (height, width) the pipeline takes from them when the request gives none (None:
        the pipeline's size does not follow its input image)."""
        raise NotImplementedError

    def image_kwargs(self, images: list) -> dict[str, Any]:
        """One batched call's input images (every row's the same: the runner batches them so)."""
        return {"image": images}

    def pooled_kwargs(self, pooled: list[torch.Tensor]) -> dict[str, Any]:
        """One batched call's pooled embeddings (rows as ``call_kwargs``'), where the family reads them."""
        return {}

    def check_sequence_parallel(self, request, ranks: int, on_cpu: bool) -> None:
        """Refuse a request size sequence parallel cannot split (``RequestValidationError``). The
        default is diffusers' own plans' need: they split the output's tokens (and the text's: 512
        from ar_encoder for FLUX, which 2, 4 or 8 ranks divide) at the transformer's entry, and on
        the CPU gloo gathers equal shares only (the runner refuses input images whose tokens would
        sit beside the output's: ``images_in_latents``)."""
        tokens = self.image_tokens(request.height, request.width, request.num_frames)
        if on_cpu and tokens % ranks:
            patch = self.size_multiple()
            what = "video's" if self.output.video else "image's"
            raise RequestValidationError("height", f"sequence parallel on the CPU shares the {what} {tokens} "
                                         f"patches ({patch}x{patch} pixels each) evenly over {ranks} processes: "
                                         f"height x width must make a multiple of {ranks} patches",
                                         f"{request.height}x{request.width}")

    def attention_shape(self) -> tuple[int, int]:
        """(heads, head size) of the DiT's attention: the shape ``attention_backend: auto`` times."""
        config = self.network.config
        return int(config.num_attention_heads), int(config.attention_head_dim)

    def attention_tokens(self) -> int:
        """The tokens of one request's attention call at a typical output, which ``attention_backend:
        auto`` times the kernels on: a 1024² image and 256 text tokens; a video's 832x480 frames at
        its pipeline's default count (32,760 for Wan 2.1, where the kernels rank otherwise than at
        an image's few thousand)."""
        if self.output.video:
            return self.image_tokens(480, 832, self.output.default_frames)
        return self.image_tokens(1024, 1024) + 256

    def image_tokens(self, height: int, width: int, frames: int = 1) -> int:
        """The DiT's image tokens for an output of this size (its patches; a video's, of every
        latent frame)."""
        latent_frames = 1 if not self.frames_step() else (frames - 1) // self.frames_step() + 1
        return latent_frames * (height // self.size_multiple()) * (width // self.size_multiple())

    def forward_flops(self, image_tokens: int, text_tokens: int, rows: int = 1) -> int:
        """Floating-point operations of one forward pass of the DiT's repeated blocks over ``rows``
        rows (``forward_flops`` of the network, with this family's streams)."""
        return forward_flops(self.network, self.flop_streams, self.attention_streams, image_tokens, text_tokens, rows)

    def forward_flop_parts(self, image_tokens: int, text_tokens: int, rows: int = 1) -> tuple[int, int]:
        """``forward_flops`` as (linear layers', attention's)."""
        return forward_flop_parts(self.network, self.flop_streams, self.attention_streams, image_tokens, text_tokens,
                                  rows)

    @staticmethod
    def sequence_parallel_plan(transformer: Any) -> tuple[dict, int] | None:
        """Our context-parallel plan for a transformer diffusers ships none for, and the multiple
        its split sequence is padded to; None: diffusers' own plan (``_cp_plan``)."""
        return None


def forward_flops(network: torch.nn.Module, streams, attention_streams, image_tokens: int, text_tokens: int,
                  rows: int = 1) -> int:
    """Floating-point operations of one forward pass of a DiT's repeated blocks: each linear layer's
    2 x in x out per token it reads, and each block's attention 4 x tokens² x (heads x head size)
    (the scores' matmul and the values'). A layer reads the tokens of its stream: "image", "text",
    "joint" (both) or "row" (one per row: the modulations, computed from the timestep alone). What
    lies outside the blocks (the embedders, the final projection) is left out: well under 1 % of a
    forward at the real shapes. A cross-attention ("cross": Wan's, the image's tokens reading the
    text's) is 4 x image x text x (heads x head size). The MFU the benchmarks print divides this
    by the GPU's peak."""
    return sum(forward_flop_parts(network, streams, attention_streams, image_tokens, text_tokens, rows))


def forward_flop_parts(network: torch.nn.Module, streams, attention_streams, image_tokens: int,
                       text_tokens: int, rows: int = 1) -> tuple[int, int]:
    """``forward_flops`` as (linear layers', attention's): FP8 speeds up only the first, so a
    forward's lower bound takes each at its own peak."""
    tokens = {"image": image_tokens, "text": text_tokens, "joint": image_tokens + text_tokens, "row": 1}

    def stream(name: str, table, default: str = "joint") -> str:
        return next((kind for pattern, kind in table if fnmatch.fnmatchcase(name, pattern)), default)

    linear = attention = 0
    for block_name, block in network.named_modules():
        if type(block).__name__ not in getattr(network, "_repeated_blocks", ()):
            continue
        for name, module in block.named_modules(prefix=block_name):
            if isinstance(module, torch.nn.Linear):
                linear += 2 * module.in_features * module.out_features * tokens[stream(name, streams)]
            elif hasattr(module, "heads") and hasattr(module, "inner_dim"):  # diffusers' attention
                kind = stream(name, attention_streams)
                if kind == "cross":
                    attention += 4 * image_tokens * text_tokens * module.inner_dim
                else:
                    attention += 4 * tokens[kind] * tokens[kind] * module.inner_dim
    return linear * rows, attention * rows


# -- what the step adapters share ------------------------------------------------------------


def pad_rows(rows: list[torch.Tensor], size: int) -> list[torch.Tensor]:
    """Padding rows repeat the last real row; their outputs are dropped."""
    return rows + [rows[-1]] * (size - len(rows))


def flow_schedule(pipeline, job, device: torch.device, image_seq_len: int, sigmas, mu: float | None = None) -> None:
    """A flow-matching request's scheduler copy, set as its pipeline sets it: the shift ``mu``
    given, or following the image's token count (diffusers' ``calculate_shift``)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    scheduler = copy.deepcopy(pipeline.scheduler)
    config = scheduler.config
    if mu is None:
        mu = calculate_shift(image_seq_len, config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
    timesteps, _ = retrieve_timesteps(scheduler, job.steps, device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    job.scheduler, job.timesteps, job.schedule = scheduler, timesteps, list(timesteps)


class StepAdapter:
    """What the step engine needs of a family: a request's starting state (its scheduler copy,
    timesteps and noise, drawn as the pipeline draws them), its group (requests that can share a
    forward pass), one guided prediction for every request of a group in shared forward passes,
    a scheduler step, and the decode."""

    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype):
        self.pipeline, self.device, self.dtype = pipeline, device, dtype
        self.lora_rows = None  # the model's AdapterRows (lora.py), set by the runner where it has adapters
        self.input_latents = InputLatents()  # an edit's input images, encoded once for every request giving them

    def adapted(self, rows: list, size: int | None = None) -> contextlib.AbstractContextManager:
        """Around a forward pass whose row ``i`` runs ``rows[i]``'s adapter (a job's ``lora``: (slot,
        scale), or None: none), padded to ``size`` rows (whose output is thrown away)."""
        return contextlib.nullcontext() if self.lora_rows is None else self.lora_rows.bind(rows, self.device, size)

    def group(self, job) -> tuple:
        raise NotImplementedError

    def start(self, job) -> None:
        raise NotImplementedError

    def predict(self, jobs: list, pad_to: PadTo) -> list[torch.Tensor]:
        raise NotImplementedError

    def graphable(self) -> bool:
        """Whether the forward pass running now may replay a CUDA graph (cuda_graphs.py)."""
        return True

    def step(self, job, pred: torch.Tensor) -> None:
        job.latents = job.scheduler.step(pred, job.schedule[job.done], job.latents, return_dict=False)[0]

    def decode(self, jobs: list) -> torch.Tensor:
        raise NotImplementedError


class InputLatents:
    """The VAE latents of the last few input images a step adapter read, so that requests giving
    the same images (OpenAI's ``n`` edits of one picture, a user's successive edits of it, a
    benchmark's batch) encode them once, as a pipeline encodes its one image for its whole batch.

    Exact by construction: an entry serves only images equal pixel for pixel to the ones it was
    encoded from (a cheap fingerprint finds the candidate, a full comparison confirms it), and the
    pipelines read their input images in ``argmax`` mode, so the latents never depend on the
    request's generator. What an entry holds is shared by the requests that read it: the step
    adapters only ever read it."""

    def __init__(self, entries: int = 8):
        self.entries = entries
        self._cache: OrderedDict[tuple, tuple[tuple, Any]] = OrderedDict()  # fingerprints -> (images, value)
        self.hits = 0

    def get(self, images: Sequence, encode: Callable[[], Any], *key) -> Any:
        """``encode()``'s value for ``images`` (PIL images) and ``key`` (what else the value depends
        on, such as a dtype): from an earlier call with equal images, or computed now."""
        fingerprint = (*key, *(_fingerprint(image) for image in images))
        entry = self._cache.get(fingerprint)
        if entry is not None and all(kept is image or kept.tobytes() == image.tobytes()
                                     for kept, image in zip(entry[0], images, strict=True)):
            self._cache.move_to_end(fingerprint)
            self.hits += 1
            return entry[1]
        value = encode()
        self._cache[fingerprint] = (tuple(images), value)
        self._cache.move_to_end(fingerprint)
        while len(self._cache) > self.entries:
            self._cache.popitem(last=False)
        return value


def _fingerprint(image, grid: int = 8) -> tuple:
    """An image's mode, size and a grid of its pixels: cheap (no copy of the pixels), and equal for
    equal images; ``InputLatents`` compares the pixels themselves before it trusts a match."""
    width, height = image.size
    return image.mode, image.size, tuple(image.getpixel((width * (2 * i + 1) // (2 * grid),
                                                         height * (2 * j + 1) // (2 * grid)))
                                         for i in range(grid) for j in range(grid))


class FlowStepAdapter(StepAdapter):
    """What the flow-matching DiTs share: a prompt and its negative keep their own text lengths
    (both are part of the group), a plain scheduler step on the velocity, and step caching per
    request (step_cache.py)."""

    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype):
        super().__init__(pipeline, device, dtype)
        # the step cache's hooks, per denoising network, installed when a request first asks for them
        self._step_caches: dict[int, Any] = {}
        self.cfg_parallel = None  # a CfgParallel, where the family takes it: where the negatives' passes run

    def start_cache(self, job, passes: tuple[str, ...], network: torch.nn.Module | None = None) -> None:
        """The job's passes' cache state (fresh: a network's first step computes), where it asked for
        step caching; ``network``: the one its next passes run (the pipeline's transformer by default)."""
        from triton_omni.diffusion.step_cache import FirstBlockCache, PassCache

        if job.step_cache is None or not job.step_cache.on:
            return
        network = self.pipeline.transformer if network is None else network
        if id(network) not in self._step_caches:
            cache = FirstBlockCache(network)
            if self.lora_rows is not None:  # the rows that compute the remaining blocks keep their adapters
                cache.narrow = self.lora_rows.narrowed
            self._step_caches[id(network)] = cache
        job.cache = {name: PassCache(job.step_cache.threshold) for name in passes}

    def graphable(self) -> bool:
        # the step cache's hooks decide per request from the first block's output, read on the host
        return all(cache.rows is None for cache in self._step_caches.values())

    def cached(self, rows: list, network: torch.nn.Module | None = None) -> contextlib.AbstractContextManager:
        """Around a forward pass of ``network`` (the pipeline's transformer by default) whose row ``i``
        is ``rows[i]``'s (a PassCache, or None)."""
        cache = self._step_caches.get(id(self.pipeline.transformer if network is None else network))
        return contextlib.nullcontext() if cache is None else cache.passes(rows)

    @staticmethod
    def count_skips(jobs: list) -> None:
        for job in jobs:
            if job.cache is not None and not any(state.computed for state in job.cache.values()):
                job.steps_skipped += 1

    def group(self, job) -> tuple:
        return (job.height, job.width, job.cond.shape[0], 0 if job.uncond is None else job.uncond.shape[0],
                job.frames)


class TwoPassStepAdapter(FlowStepAdapter):
    """What the flow DiTs whose pipeline runs the prompts' pass and the negatives' pass apart share
    (Qwen-Image, FLUX.2): the two passes, each with its own text length and its own step-cache
    state (the pipeline's cache contexts "cond" and "uncond"), and CFG parallel (``cfg_parallel``,
    set by the runner): the negatives' pass runs on a second GPU, in a worker process
    (cfg_parallel.py), while the prompts' pass runs on the first; the same kernels on the same
    rows, so the image is the one GPU's. A family gives one pass's arguments and its guidance."""

    def start_passes(self, job, network: torch.nn.Module | None = None) -> None:
        self.start_cache(job, ("cond", "uncond") if job.uncond is not None else ("cond",), network)

    def arguments(self, jobs: list, embeds: torch.Tensor, size: int, branch: str) -> dict:
        """One pass's transformer arguments (``return_dict`` aside) for ``jobs``, padded to ``size``
        rows (``embeds``: their texts, padded too; ``branch``: "cond", the prompts' pass, or
        "uncond", the negatives', each with its own text length)."""
        raise NotImplementedError

    def guide(self, job, pred: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
        """A guided request's prediction from its prompt's and its negative's, by the pipeline's rule."""
        raise NotImplementedError

    def output_shape(self, kwargs: dict) -> tuple[int, ...]:
        """The shape of the transformer's output for a pass's arguments (CFG parallel receives it into
        a buffer of that shape): packed latents' tokens, each as wide as its final projection."""
        return (*kwargs["hidden_states"].shape[:-1], self.pipeline.transformer.proj_out.out_features)

    def _pass(self, jobs: list, embeds: list[torch.Tensor], pad_to: PadTo, branch: str) -> tuple[dict, list]:
        """One pass's transformer arguments, its rows padded, and each row's cache owner."""
        n = len(jobs)
        size = pad_to(n)
        kwargs = self.arguments(jobs, torch.stack(pad_rows(embeds, size)), size, branch) | {"return_dict": False}
        return kwargs, [job.cache and job.cache[branch] for job in jobs] + [None] * (size - n)

    def _forward(self, network: torch.nn.Module, jobs: list, embeds: list[torch.Tensor], pad_to: PadTo,
                 branch: str) -> torch.Tensor:
        kwargs, rows = self._pass(jobs, embeds, pad_to, branch)
        with self.cached(rows, network), \
                self.adapted([job.lora for job in jobs], len(rows)):
            return network(**kwargs)[0][: len(jobs)]

    def networks_of(self, jobs: list) -> list[tuple[torch.nn.Module, list]]:
        """The network each job's step runs, with its jobs: the pipeline's transformer for all,
        unless the family has several (Wan 2.2's experts, each for a part of the schedule)."""
        return [(self.pipeline.transformer, jobs)]

    def predict(self, jobs: list, pad_to: PadTo) -> list[torch.Tensor]:
        preds: dict[int, torch.Tensor] = {}
        for network, part in self.networks_of(jobs):
            preds.update(zip(map(id, part), self._predict(network, part, pad_to), strict=True))
        return [preds[id(job)] for job in jobs]

    def _predict(self, network: torch.nn.Module, jobs: list, pad_to: PadTo) -> list[torch.Tensor]:
        guided = [job for job in jobs if job.uncond is not None]
        negatives = [job.uncond for job in guided]
        remote = self._pass(guided, negatives, pad_to, "uncond") if guided and self.cfg_parallel else None
        if remote is not None:
            self.cfg_parallel.send(network, *remote)
        cond = self._forward(network, jobs, [job.cond for job in jobs], pad_to, "cond")
        if remote is not None:  # received after the prompts' pass is queued: that pass must not wait for it
            uncond = iter(self.cfg_parallel.receive(self.output_shape(remote[0]), remote[1])[: len(guided)])
        else:
            uncond = iter(self._forward(network, guided, negatives, pad_to, "uncond") if guided else ())
        self.count_skips(jobs)
        preds = []
        for job, pred in zip(jobs, cond, strict=True):
            pred = pred[None, : job.latents.shape[1]]  # the image's tokens (a pass may carry more after them)
            if job.uncond is not None:
                pred = self.guide(job, pred, next(uncond)[None, : job.latents.shape[1]])
            preds.append(pred)
        return preds


def ones_mask(embeds: list[torch.Tensor]) -> torch.Tensor:
    return torch.ones(len(embeds), embeds[0].shape[0], dtype=torch.long, device=embeds[0].device)
