"""Typed AR requests, validated once, where they are built.

``GenerateRequest`` follows the request contract of Triton's vLLM backend:

* sampling options come from the ``sampling_parameters`` JSON input, else
  from the request's parameters (gRPC/HTTP ``parameters``, and the extra keys
  of an HTTP ``/generate`` body); when both come they must agree, so neither
  is silently dropped. One tensor per option (``max_tokens``, ``temperature``,
  ... and the TensorRT-LLM names ``stop_words``, ``frequency_penalty``,
  ``presence_penalty``) wins over the same key in either;
* ``exclude_input_in_output``: absent means "include" without streaming and
  "exclude" while streaming; ``false`` while streaming is an error;
* ``return_*`` inputs switch the additional outputs on, one by one.

Values are normalised first (``seed=-1`` means none, ``stop`` string ->
list), then range checked; every failure names the parameter and echoes the
value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from triton_omni.ar.sampling import ArLimits, SamplingOptions
from triton_omni.audio import AudioLimits, check_clips
from triton_omni.errors import RequestValidationError
from triton_omni.images import ImageLimits, decode_images
from triton_omni.validation import as_bool, as_json_object, as_str, require

NO_AUDIO = AudioLimits()  # a model that hears nothing: `input_audio` is refused by name
NO_IMAGES = ImageLimits()  # a model that sees nothing: `images` is refused by name

# Input tensors that carry one sampling option each: tensor name -> option.
SAMPLING_TENSORS = {
    "max_tokens": "max_tokens",
    "min_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "stop_words": "stop",  # TensorRT-LLM's names (Triton's OpenAI frontend, genai-perf)
    "min_length": "min_tokens",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_p": "min_p",
}


@dataclass(frozen=True)
class ReturnOptions:
    """Which additional outputs a request asked for (all off by default)."""

    finish_reason: bool = False
    cumulative_logprob: bool = False
    logprobs: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    token_ids: bool = False
    heard_states: bool = False
    thinker_states: bool = False

    @classmethod
    def from_inputs(cls, inputs: dict[str, Any]) -> ReturnOptions:
        return cls(**{name: as_bool(f"return_{name}", inputs.get(f"return_{name}", False))
                      for name in cls.__dataclass_fields__})

    @property
    def needs_logprobs(self) -> bool:
        return self.cumulative_logprob or self.logprobs


def _verify_prompt(prompt: Any, limits: ArLimits, name: str = "text_input", blank: bool = False) -> str:
    """``blank``: an empty or blank text is a value (a negative prompt's), not a mistake."""
    prompt = as_str(name, prompt)
    require(blank or prompt.strip() != "", name, "must be a non-empty prompt", prompt)
    require(len(prompt) <= limits.max_prompt_chars, name,
            f"prompt is longer than {limits.max_prompt_chars} characters", len(prompt))
    return prompt


def sampling_values(inputs: dict[str, Any], request_parameters: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The sampling options a request carries, and where they came from.

    Triton's vLLM backend reads the ``sampling_parameters`` input, else the
    request parameters; its own sample client sends the same options both
    ways. So both may come, as long as the request parameters repeat the
    input: one that differs (or adds a key) would otherwise be dropped."""
    if "sampling_parameters" not in inputs:
        values, source = dict(request_parameters), "request parameters"
    else:
        values, source = as_json_object("sampling_parameters", inputs["sampling_parameters"]), "sampling_parameters"
        differing = sorted(k for k, v in request_parameters.items() if k not in values or values[k] != v)
        if differing:
            raise RequestValidationError(
                "sampling_parameters", f"request parameters {differing} differ from the `sampling_parameters` "
                "input; send sampling options one way (or the same both ways)", None, show_value=False)
    for tensor, key in SAMPLING_TENSORS.items():
        if tensor in inputs:
            values[key] = inputs[tensor]
    return values, source


@dataclass
class GenerateRequest:
    """One text-generation request for the ``ar`` model."""

    prompt: str
    sampling: SamplingOptions
    stream: bool = False
    include_prompt: bool = True  # prepend the prompt to the (non-streamed) text
    outputs: ReturnOptions = field(default_factory=ReturnOptions)
    lora: str | None = None  # the LoRA adapter it runs with, by name (None: the base weights)
    lora_field: str = "lora"  # where it came from: the `lora` input, or `lora_name` among the sampling options
    audio: list[bytes] = field(default_factory=list)  # the files the prompt's audio markers stand for
    images: list = field(default_factory=list)  # the RGB PIL images its image markers stand for

    @classmethod
    def from_inputs(cls, inputs: dict[str, Any], limits: ArLimits,
                    request_parameters: dict[str, Any] | None = None,
                    audio: AudioLimits = NO_AUDIO, images: ImageLimits = NO_IMAGES) -> GenerateRequest:
        """Build from decoded tensors (name -> Python value; absent optional
        inputs are left out) and the request's own parameters; ``audio``: the clips the model hears,
        ``images``: the images it sees (by default none: ``input_audio`` and ``images`` are refused by name)."""
        if "text_input" not in inputs:
            raise RequestValidationError("text_input", "is required", None, show_value=False)
        prompt = _verify_prompt(inputs["text_input"], limits)
        stream = as_bool("stream", inputs.get("stream", False))
        values, source = sampling_values(inputs, request_parameters or {})
        lora_field = "lora_name" if "lora" not in inputs and "lora_name" in values else "lora"
        lora = _lora(inputs.get("lora"), values.pop("lora_name", None))
        sampling = SamplingOptions.from_values(values, limits, source)
        outputs = ReturnOptions.from_inputs(inputs)
        # Log probabilities leave only through the `logprobs` output: asking for
        # them without it would compute them for nothing (a key silently ignored).
        require(sampling.logprobs is None or outputs.logprobs, "logprobs",
                "needs the `return_logprobs` input set to true (they come back on the `logprobs` output)",
                sampling.logprobs)
        return cls(prompt=prompt, sampling=sampling, stream=stream,
                   include_prompt=_include_prompt(inputs, stream), outputs=outputs, lora=lora, lora_field=lora_field,
                   audio=check_clips(inputs.get("input_audio"), audio),
                   images=decode_images(None, inputs.get("images"), images))


def _lora(tensor: Any, key: Any) -> str | None:
    """The ``lora`` input, or ``lora_name`` among the sampling options (Triton's vLLM backend's
    name); empty: none. Whether the model serves it is the runner's check."""
    names = [None if v is None else as_str(n, v).strip() or None for n, v in (("lora", tensor), ("lora_name", key))]
    if names[0] and names[1] and names[0] != names[1]:
        raise RequestValidationError("lora", f"the `lora` input and `lora_name` ({names[1]!r}) differ", names[0])
    return names[0] or names[1]


def _include_prompt(inputs: dict[str, Any], stream: bool) -> bool:
    if "exclude_input_in_output" not in inputs:
        return not stream
    exclude = as_bool("exclude_input_in_output", inputs["exclude_input_in_output"])
    require(exclude or not stream, "exclude_input_in_output",
            "must be true while streaming (the prompt is never streamed back)", exclude)
    return not exclude


@dataclass
class EncodeRequest:
    """A prompt to encode into per-token hidden states (``ar_encoder``), and
    its negative prompt when the caller wants that side too.

    ``negative_prompt`` is the text as sent: ``""`` and ``" "`` are texts,
    encoded as the family's pipeline encodes them. Absent (None) with
    ``with_negative``, the encoder returns what the pipeline conditions on
    without one (the recipe's ``absent_negative``): Z-Image's and Stable
    Diffusion's encoding of ``""``, or zero tokens for Qwen-Image, whose
    pipeline then runs without true CFG. This is how the ``text_to_image``
    ensemble tells an absent negative prompt from an empty one: its optional
    ``negative_prompt`` reaches this model as given, or not at all.
    """

    prompt: str
    negative_prompt: str | None = None
    with_negative: bool = False  # also encode the negative side (given, or asked for by its output)
    images: list = field(default_factory=list)  # input images (RGB PIL images) the encoder reads with both sides
    lora: str | None = None  # the text encoder's LoRA adapter, by name, for both sides

    @classmethod
    def from_inputs(cls, inputs: dict[str, Any], limits: ArLimits, negative_wanted: bool = False,
                    images: ImageLimits | None = None) -> EncodeRequest:
        """``negative_wanted``: the caller asked for the ``negative_prompt_embeds`` output;
        ``images``: the bounds of the input images the recipe reads (None: it reads none, and
        images sent along, the DiT's, are left alone). A recipe that reads them needs them."""
        if "text_input" not in inputs:
            raise RequestValidationError("text_input", "is required", None, show_value=False)
        prompt = _verify_prompt(inputs["text_input"], limits)
        negative = inputs.get("negative_prompt")
        if negative is not None:
            negative = _verify_prompt(negative, limits, "negative_prompt", blank=True)
        decoded = []
        if images is not None:
            decoded = decode_images(None, inputs.get("images"), images)
            if not decoded:
                raise RequestValidationError("images", "is required: this encoder reads the prompt with its input "
                                             "image", None, show_value=False)
        return cls(prompt, negative, with_negative=negative_wanted or negative is not None, images=decoded,
                   lora=_lora(inputs.get("lora"), None))
