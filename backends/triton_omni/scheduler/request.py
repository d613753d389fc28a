"""The typed ``omni`` request: what to produce, and the options per stage.

The scheduler validates only what it owns (prompt, modalities, routing flags,
image count) and converts option types. Range checks of text and image
options belong to the stages that use them (``ar``, ``diffusion``), which
return INVALID_ARG naming the parameter; the scheduler passes their message
on. So each parameter is validated once, by its owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from triton_omni_protocol import DIFFUSION_OPTIONS, SPEECH_OPTIONS, TALKER_PREFIX

from triton_omni.ar.sampling import SamplingOptions
from triton_omni.errors import RequestValidationError
from triton_omni.validation import (
    INT64_MAX,
    as_bool,
    as_float,
    as_int,
    as_int32,
    as_json_object,
    as_str,
    as_str_list,
    in_range,
    require,
)

# "image" and "video" both name the diffusion route; what comes back is what its model makes; "audio" the
# thinker's reply spoken by the speech stage
MODALITIES = ("text", "image", "video", "audio")
# The diffusion options forwarded to the diffusion stage (the protocol's table), each converted to
# (and bounded by) the type of the diffusion input it becomes.
CONVERTERS = {"TYPE_STRING": as_str, "TYPE_INT32": as_int32, "TYPE_INT64": as_int, "TYPE_FP32": as_float}
IMAGE_OPTIONS = {spec.name: CONVERTERS[spec.data_type] for spec in DIFFUSION_OPTIONS}
# The speech options, each by the speech stage's name (the talker's sampling without its prefix).
SPEECH_NAMES = {spec.name: spec.name.removeprefix(TALKER_PREFIX) for spec in SPEECH_OPTIONS}
SPEECH_CONVERTERS = {spec.name: CONVERTERS[spec.data_type] for spec in SPEECH_OPTIONS}
OWN_OPTIONS = {"modalities", "enhance_prompt", "num_images", "stream"}
# Sampling keys `ar` takes that the omni text route cannot return the result of.
TEXT_OPTIONS_REFUSED = {
    "n": "omni streams one completion per request; call `ar` for several",
    "logprobs": "omni has no logprobs output; call `ar` with return_logprobs",
}
TEXT_OPTIONS = set(SamplingOptions.names()) - set(TEXT_OPTIONS_REFUSED)


@dataclass(frozen=True)
class SchedulerLimits:
    max_images: int = 4
    max_prompt_chars: int = 10_000


@dataclass
class OmniRequest:
    prompt: str
    modalities: tuple[str, ...] = ("text",)
    enhance_prompt: bool = False
    num_images: int = 1
    stream: bool = False
    text_options: dict[str, Any] = field(default_factory=dict)  # TEXT_OPTIONS keys, for `ar` to validate
    image_options: dict[str, Any] = field(default_factory=dict)  # IMAGE_OPTIONS keys, for `diffusion`
    # input image files, for `diffusion` to decode and check where 'image' or 'video' is asked for, else for
    # `ar` (a thinker that sees them, its reply written or spoken)
    images: list[bytes] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)  # input audio files, for `ar` (the thinker) to hear
    speech_options: dict[str, Any] = field(default_factory=dict)  # by the speech stage's names, for it to validate

    @property
    def wants_text(self) -> bool:
        return "text" in self.modalities

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def wants_image(self) -> bool:
        """The diffusion route: an image, or a video's frames from a video model."""
        return "image" in self.modalities or "video" in self.modalities

    @property
    def seen(self) -> list[bytes]:
        """The input images the thinker reads (a written or spoken reply's), none where diffusion reads them."""
        return [] if self.wants_image else self.images

    @classmethod
    def from_inputs(cls, inputs: dict[str, Any], limits: SchedulerLimits,
                    request_parameters: dict[str, Any] | None = None) -> OmniRequest:
        """From decoded tensors and the request's parameters.

        Options come as a JSON object in the ``parameters`` input, or in its
        alias ``options`` (Triton's HTTP ``/generate`` reserves the key
        ``parameters`` for request parameters), or as request parameters
        (gRPC/HTTP ``parameters``, the extra keys of a ``/generate`` body); a
        tensor wins over the same key. Unknown keys are errors, wherever they come from."""
        if "parameters" in inputs and "options" in inputs:
            raise RequestValidationError("options", "is an alias of `parameters`; send one of them", None,
                                         show_value=False)
        name = "options" if "options" in inputs else "parameters"
        values = as_json_object(name, inputs.get(name)) | _checked(request_parameters or {}, "request parameters")
        _checked(values, name)
        values |= {k: v for k, v in inputs.items() if k not in ("parameters", "options", "images", "input_audio")}

        if "text_input" not in values:
            raise RequestValidationError("text_input", "is required", None, show_value=False)
        prompt = as_str("text_input", values["text_input"])
        require(prompt.strip() != "", "text_input", "must be a non-empty prompt", prompt)
        require(len(prompt) <= limits.max_prompt_chars, "text_input",
                f"is longer than {limits.max_prompt_chars} characters", len(prompt))

        modalities = tuple(as_str_list("modalities", values.get("modalities", ["text"])))
        require(len(modalities) > 0, "modalities", f"must name at least one of {list(MODALITIES)}", list(modalities))
        require(set(modalities) <= set(MODALITIES), "modalities", f"must be among {list(MODALITIES)}",
                list(modalities))
        require(len(set(modalities)) == len(modalities), "modalities", "must not repeat", list(modalities))
        require(not {"image", "video"} <= set(modalities), "modalities", "name the diffusion route once: 'image' "
                "or 'video' (its model makes one of them)", list(modalities))
        num_images = as_int("num_images", values.get("num_images", 1))
        in_range("num_images", num_images, 1, limits.max_images)
        seed = as_int("seed", values.get("seed", -1))
        # image i of several gets seed + i: each of those must be a valid seed too
        require(seed <= INT64_MAX - (num_images - 1), "seed",
                f"must be at most {INT64_MAX - (num_images - 1)} with num_images={num_images}", seed)

        images = list(inputs.get("images") or [])
        audio = list(inputs.get("input_audio") or [])
        require(not audio or {"text", "audio"} & set(modalities), "input_audio",
                "the thinker hears it: it needs modalities ['text'] or ['text', 'audio']", len(audio))

        return cls(
            prompt=prompt,
            modalities=modalities,
            enhance_prompt=as_bool("enhance_prompt", values.get("enhance_prompt", False)),
            num_images=num_images,
            stream=as_bool("stream", values.get("stream", False)),
            text_options={k: v for k, v in values.items() if k in TEXT_OPTIONS},
            image_options={k: IMAGE_OPTIONS[k](k, v) for k, v in values.items() if k in IMAGE_OPTIONS},
            images=images,
            audio=audio,
            speech_options={SPEECH_NAMES[k]: SPEECH_CONVERTERS[k](k, v) for k, v in values.items()
                            if k in SPEECH_NAMES},
        )

    def image_options_for(self, index: int) -> dict[str, Any]:
        """Image ``index`` of several gets seed + index, so a request's images differ but repeat."""
        options = dict(self.image_options)
        if index and options.get("seed", -1) >= 0:
            options["seed"] += index
        return options


def _checked(values: dict[str, Any], source: str) -> dict[str, Any]:
    for key in TEXT_OPTIONS_REFUSED.keys() & values.keys():
        raise RequestValidationError(key, TEXT_OPTIONS_REFUSED[key], values[key])
    unknown = sorted(set(values) - OWN_OPTIONS - set(IMAGE_OPTIONS) - TEXT_OPTIONS - set(SPEECH_NAMES))
    if unknown:
        raise RequestValidationError(source, f"unknown key(s) {unknown}", values, show_value=False)
    return values
