"""The typed diffusion request, validated before anything is allocated.

Prompt embeddings are checked from their metadata first (dtype, rank, hidden
size, token count, byte count), so an oversized tensor is refused before it is
copied or converted; only then are the values checked for NaN/inf. Nothing a
client sends is unpickled or ``torch.load``-ed: embeddings arrive as tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from triton_omni.diffusion.step_cache import StepCacheConfig, parse_step_cache
from triton_omni.errors import RequestValidationError
from triton_omni.images import ImageLimits, decode_images
from triton_omni.validation import as_float, as_int, as_str, in_range, require

ALLOWED_EMBEDS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_LORA_SCALE = 10.0  # |lora_scale| at most: far past any adapter's useful range (0 to about 2)


@dataclass(frozen=True)
class DiffusionLimits:
    """Server-side bounds, from model parameters."""

    hidden_size: int
    min_size: int = 32
    max_size: int = 1024
    max_steps: int = 100
    max_guidance: float = 30.0
    max_embeds_tokens: int = 512
    # None: max_embeds_tokens rows of the model's width in float32 (FLUX.2 [dev]'s 512 x 15360: 31 MB)
    max_embeds_bytes: int | None = None
    max_prompt_chars: int = 10_000
    size_multiple: int = 8  # the VAE's factor, times the patch for a DiT (families.py)
    # a video family's frame counts are 1 + k x frames_step, at most max_frames; 0: an image model
    frames_step: int = 0
    max_frames: int = 81
    default_frames: int = 0
    fps: float = 0.0  # a video's frame rate: `seconds` x fps + 1 frames
    pooled_size: int = 0  # the pooled embedding's width the family reads beside the sequence (FLUX.1); 0: none
    # input images (images.py): how many the family takes (0: none), and each one's bounds
    max_images: int = 0
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    min_image_side: int = 1

    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.max_images, self.max_image_bytes, self.max_image_pixels, self.min_image_side)

    def __post_init__(self):
        if self.max_embeds_bytes is None:
            object.__setattr__(self, "max_embeds_bytes", self.max_embeds_tokens * self.hidden_size * 4)


@dataclass
class DiffusionRequest:
    prompt: str | None
    prompt_embeds: torch.Tensor | None
    negative_prompt: str | None
    negative_prompt_embeds: torch.Tensor | None
    num_inference_steps: int
    guidance_scale: float
    height: int
    width: int
    seed: int | None
    step_cache: StepCacheConfig | None = None  # None: the model's (step_cache.py)
    pooled_prompt_embeds: torch.Tensor | None = None  # [P], beside prompt_embeds where the family reads one
    images: list = field(default_factory=list)  # input images (RGB PIL images), for a family that takes them
    sized: tuple[bool, bool] = (True, True)  # whether height and width were given (else the images' may be taken)
    images_field: str = "images"  # the input the images came in: "image" (pixels) or "images" (files)
    lora: str | None = None  # the LoRA adapter it runs with (lora.py), by name; None: the base weights
    lora_scale: float = 1.0
    num_frames: int = 1  # a video's frame count; 1 for an image model
    # the second denoiser's scale (Wan 2.2 A14B's low-noise expert); None: guidance_scale's
    guidance_scale_2: float | None = None

    @property
    def has_negative(self) -> bool:
        """A negative prompt was given: a text (``""`` and ``" "`` included), or embeddings of at
        least one token (zero tokens are an encoder's answer for "none", ar_encoder's for Qwen-Image)."""
        embeds = self.negative_prompt_embeds
        return self.negative_prompt is not None or (embeds is not None and embeds.shape[0] > 0)

    @classmethod
    def from_inputs(cls, inputs: dict[str, Any], limits: DiffusionLimits,
                    defaults: dict[str, Any] | None = None) -> DiffusionRequest:
        values = {"num_inference_steps": 20, "guidance_scale": 7.5, "height": 64, "width": 64} | (defaults or {})
        values |= inputs
        # 1. Exactly one conditioning source per side (none at all on the negative side is fine).
        prompt, embeds = _one_of(values, "prompt", "prompt_embeds", limits, required=True)
        negative, negative_embeds = _one_of(values, "negative_prompt", "negative_prompt_embeds", limits,
                                            required=False)
        pooled = _pooled(values.get("pooled_prompt_embeds"), embeds is not None, limits)
        images = decode_images(values.get("image"), values.get("images"), limits.image_limits())
        # 2. Scalar options.
        steps = as_int("num_inference_steps", values["num_inference_steps"])
        in_range("num_inference_steps", steps, 1, limits.max_steps)
        guidance = as_float("guidance_scale", values["guidance_scale"])
        in_range("guidance_scale", guidance, 0.0, limits.max_guidance)
        guidance_2 = values.get("guidance_scale_2")
        if guidance_2 is not None:
            guidance_2 = as_float("guidance_scale_2", guidance_2)
            in_range("guidance_scale_2", guidance_2, 0.0, limits.max_guidance)
        height, width = (_image_side(name, values[name], limits) for name in ("height", "width"))
        seed = values.get("seed")
        seed = None if seed is None or as_int("seed", seed) < 0 else as_int("seed", seed)
        step_cache = values.get("step_cache")
        if step_cache is not None:
            try:
                step_cache = parse_step_cache(as_str("step_cache", step_cache))
            except ValueError as exc:
                raise RequestValidationError("step_cache", str(exc), step_cache) from None
        lora, lora_scale = _lora(values.get("lora"), values.get("lora_scale"))
        frames = _frames(inputs.get("num_frames"), values.get("num_frames"), inputs.get("seconds"), limits)
        return cls(prompt, embeds, negative, negative_embeds, steps, guidance, height, width, seed, step_cache,
                   pooled, images, ("height" in inputs, "width" in inputs),
                   "image" if values.get("image") is not None else "images", lora, lora_scale, frames,
                   guidance_2)


def _frames(given: Any, value: Any, seconds: Any, limits: DiffusionLimits) -> int:
    """A video's ``num_frames`` (the model's default unless given), or ``seconds`` at the model's
    frame rate (``seconds x fps + 1`` frames: the first frame is time 0): ``1 + k x frames_step``,
    as its VAE takes it (the pipeline would round another count with a warning; a request is
    refused, naming the counts or lengths it could give). An image model refuses both."""
    if not limits.frames_step:
        for name, sent in (("num_frames", given), ("seconds", seconds)):
            require(sent is None, name, f"this model makes images ({name} is a video model's)", sent)
        return 1
    if seconds is not None:
        return _frames_of_seconds(as_float("seconds", seconds), given, limits)
    name, step = "num_frames", limits.frames_step
    if value is None:  # the model's default, within its max_frames (an operator may have lowered it)
        return min(limits.default_frames, (limits.max_frames - 1) // step * step + 1)
    frames = as_int(name, value)
    in_range(name, frames, 1, limits.max_frames)
    if (frames - 1) % step:
        below = (frames - 1) // step * step + 1
        raise RequestValidationError(name, f"must be 1 + a multiple of {step} (this model's VAE takes {step} frames "
                                     f"into one after the first): {below} or {below + step}", frames)
    return frames


def _frames_of_seconds(seconds: float, given: Any, limits: DiffusionLimits) -> int:
    fps, step = limits.fps, limits.frames_step
    longest = (limits.max_frames - 1) / fps
    require(0 < seconds <= longest, "seconds", f"must be above 0 and at most {longest:g} (this model's "
            f"{limits.max_frames} frames at {fps:g} a second)", seconds)
    frames = round(seconds * fps) + 1
    if given is not None and as_int("num_frames", given) != frames:
        raise RequestValidationError("seconds", f"{seconds:g} s at {fps:g} frames a second is {frames} frames, and "
                                     f"num_frames is {given}: give one of them", seconds)
    if (frames - 1) % step:
        below = max((frames - 1) // step * step, step)  # (0 s is one frame: not a video's length)
        raise RequestValidationError("seconds", f"must make 1 + a multiple of {step} frames at {fps:g} a second "
                                     f"({frames} here): {below / fps:g} s or {(below + step) / fps:g} s", seconds)
    return frames


def _lora(name: Any, scale: Any) -> tuple[str | None, float]:
    """``lora`` (empty: none) and ``lora_scale``, which needs it; whether the model serves the
    adapter is the runner's check."""
    name = None if name is None else as_str("lora", name).strip() or None
    if scale is None:
        return name, 1.0
    scale = as_float("lora_scale", scale)
    require(name is not None, "lora_scale", "goes with lora (the adapter it scales)", scale)
    in_range("lora_scale", scale, -MAX_LORA_SCALE, MAX_LORA_SCALE)
    return name, scale


def _pooled(pooled: Any, with_embeds: bool, limits: DiffusionLimits) -> torch.Tensor | None:
    """``pooled_prompt_embeds``: ``[P]`` (or ``[1, P]``) beside ``prompt_embeds`` for a family that
    reads one (``limits.pooled_size``); zero values, as ar_encoder sends for a family that reads
    none, mean none."""
    name = "pooled_prompt_embeds"
    if pooled is not None and not (isinstance(pooled, torch.Tensor) and pooled.dtype in ALLOWED_EMBEDS_DTYPES):
        raise RequestValidationError(name, "must be a tensor of "
                                     f"{[str(d).removeprefix('torch.') for d in ALLOWED_EMBEDS_DTYPES]}",
                                     str(getattr(pooled, "dtype", type(pooled).__name__)))
    if pooled is not None and pooled.numel() == 0:
        pooled = None
    if pooled is None:
        if with_embeds and limits.pooled_size:
            raise RequestValidationError(name, "is required with prompt_embeds: this model reads a pooled "
                                         f"embedding of {limits.pooled_size} values beside them (ar_encoder "
                                         "returns both)", None, show_value=False)
        return None
    if not with_embeds:
        raise RequestValidationError(name, "goes with prompt_embeds (a text prompt is encoded here, its pooled "
                                     "embedding included)", None, show_value=False)
    require(limits.pooled_size > 0, name, "this model reads no pooled embedding", list(pooled.shape))
    shape = tuple(pooled.shape)
    require(shape in ((limits.pooled_size,), (1, limits.pooled_size)), name,
            f"must be [{limits.pooled_size}]", list(shape))
    pooled = pooled.reshape(limits.pooled_size)
    require(all_finite(pooled), name, "must hold only finite values (no NaN/inf)", "non-finite values")
    return pooled


def _one_of(values, text_name: str, embeds_name: str, limits: DiffusionLimits, required: bool):
    text, embeds = values.get(text_name), values.get(embeds_name)
    if text is not None and embeds is not None:
        raise RequestValidationError(text_name, f"give either `{text_name}` or `{embeds_name}`, not both",
                                     None, show_value=False)
    if required and text is None and embeds is None:
        raise RequestValidationError(text_name, f"one of `{text_name}` or `{embeds_name}` is required",
                                     None, show_value=False)
    if text is not None:
        text = as_str(text_name, text)
        require(text.strip() != "" or not required, text_name, "must be a non-empty prompt", text)
        require(len(text) <= limits.max_prompt_chars, text_name,
                f"is longer than {limits.max_prompt_chars} characters", len(text))
    if embeds is not None:  # zero negative tokens: an encoder's "no negative prompt" (runner.py)
        embeds = check_embeds(embeds_name, embeds, limits, min_tokens=1 if required else 0)
    return text, embeds


def all_finite(values: torch.Tensor) -> bool:
    """Whether every value is finite, in one pass where they are: a sum is finite only if every
    term is (a NaN or an infinity carries through it), so a finite sum settles it; a sum past the
    dtype's range (finite values, large) falls back to the element-wise check.
    ``torch.isfinite(values).all()`` alone makes four passes on the CPU, and an embedding of
    FLUX.2 [klein] (512 x 7680) is checked in the request's path before its first step. float16's
    sum is taken in float32: its own range (65504) is past for most embeddings' sums."""
    total = values.sum(dtype=torch.float32 if values.dtype == torch.float16 else None)
    return bool(torch.isfinite(total)) or bool(torch.isfinite(values).all())


def check_embeds(name: str, embeds: torch.Tensor, limits: DiffusionLimits, min_tokens: int = 1) -> torch.Tensor:
    """Metadata checks first (no copy), then values. Accepts ``[T, H]`` or a
    batch dimension of 1 (``[1, T, H]``, as batched Triton models send)."""
    if not isinstance(embeds, torch.Tensor):
        raise RequestValidationError(name, "must be a tensor", type(embeds).__name__)
    require(embeds.dtype in ALLOWED_EMBEDS_DTYPES, name,
            f"dtype must be one of {[str(d).removeprefix('torch.') for d in ALLOWED_EMBEDS_DTYPES]}",
            str(embeds.dtype).removeprefix("torch."))
    shape = tuple(embeds.shape)
    if len(shape) == 3 and shape[0] == 1:
        shape = shape[1:]
    require(len(shape) == 2, name, "must be 2-D [num_tokens, hidden]", list(embeds.shape))
    tokens, hidden = shape
    require(hidden == limits.hidden_size, name, f"hidden size must be {limits.hidden_size}", hidden)
    require(min_tokens <= tokens <= limits.max_embeds_tokens, name,
            f"token count must be in [{min_tokens}, {limits.max_embeds_tokens}]", tokens)
    nbytes = embeds.numel() * embeds.element_size()
    require(nbytes <= limits.max_embeds_bytes, name, f"is larger than {limits.max_embeds_bytes} bytes", nbytes)
    embeds = embeds.reshape(shape)
    require(all_finite(embeds), name, "must hold only finite values (no NaN/inf)",
            "non-finite values")
    return embeds


def _image_side(name: str, value: Any, limits: DiffusionLimits) -> int:
    side = as_int(name, value)
    in_range(name, side, limits.min_size, limits.max_size)
    require(side % limits.size_multiple == 0, name, f"must be a multiple of {limits.size_multiple}", side)
    return side
