"""The OpenAI request bodies the gateway accepts, and how each is checked.

Unknown fields are refused (as OpenAI does), and so are fields OpenAI
defines that these models cannot honour, each by name: a client never gets
an answer that silently ignored part of its request. Types are strict, as
OpenAI's are: ``"max_tokens": "5"`` is a 400 naming ``max_tokens``, not 5;
and every number must fit the tensor it travels in (a seed is an INT64,
steps and token counts INT32), so no value overflows on its way to Triton. Fields past OpenAI's
own are the extensions vLLM's and vLLM-Omni's servers accept, so that the
same client code drives all three.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)
from triton_omni_protocol import DIFFUSION_OPTIONS, VIDEO_OPTIONS

from triton_omni_gateway.errors import OpenAIError, invalid

MAX_IMAGES = 10  # OpenAI's own limit on `n` for images
MAX_CHOICES = 4  # the `ar` model's limit on completions per request
MAX_PROMPTS = 32  # /v1/completions' prompts in one request, each its own request to the model
MAX_SIDE = 4096
MAX_TEXT_CHARS = 100_000
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1

# The JSON numbers the API takes: an integer is never a string, a float, or a boolean, and fits
# the model's INT32 tensor (INT64 for seeds); a number is finite.
Int32 = Annotated[StrictInt, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Seed = Annotated[StrictInt, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
Number = Annotated[StrictFloat, Field(allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _nothing(value: Any) -> bool:
    return value in (None, False, [], {}, "")


NO_TOOLS = "tool calls are not made by the models this gateway serves"
# OpenAI's fields that ask for what this gateway does not do. Clients send several of them with values
# that ask for nothing (their defaults, or an earlier reply's message sent back as it came): those
# are accepted and dropped; a value that asks for something is refused by name, with the reason.
# field -> (whether a value asks for nothing, the refusal)
IDLE_TEXT_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store": (_nothing, "this gateway stores no completions"),
    "metadata": (lambda value: value is None or isinstance(value, dict), "must be an object of tags"),
    "service_tier": (lambda value: value in (None, "auto", "default"), "this server has one service tier"),
    "prompt_cache_key": (lambda value: value is None or isinstance(value, str), "must be a string"),
    "safety_identifier": (lambda value: value is None or isinstance(value, str), "must be a string"),
}
IDLE_CHAT_FIELDS = IDLE_TEXT_FIELDS | {
    "tools": (_nothing, NO_TOOLS),
    "functions": (_nothing, NO_TOOLS),
    "tool_choice": (lambda value: value in (None, "none", "auto"), NO_TOOLS),  # auto, with no tools: none
    "function_call": (lambda value: value in (None, "none"), NO_TOOLS),
    "parallel_tool_calls": (lambda value: value is None or isinstance(value, bool), NO_TOOLS),
    "response_format": (lambda value: value is None or value == {"type": "text"},
                        "structured output (JSON) is not constrained here: ask for JSON in the prompt"),
    "reasoning_effort": (_nothing, "the models this gateway serves have no reasoning setting"),
    "verbosity": (_nothing, "the models this gateway serves have no verbosity setting"),
    "prediction": (_nothing, "predicted outputs are not used here"),
    "web_search_options": (_nothing, "this gateway searches nothing"),
}
IDLE_COMPLETION_FIELDS = IDLE_TEXT_FIELDS | {
    "suffix": (_nothing, "the models this gateway serves do not fill in the middle"),
    "best_of": (lambda value: value in (None, 1), "is not taken here: use n"),
}
# in an assistant message sent back as an earlier reply came
IDLE_MESSAGE_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "refusal": (_nothing, "a refusal is not read back: send it as content"),
    "annotations": (_nothing, "annotations are not read back"),
    "tool_calls": (_nothing, NO_TOOLS),
    "function_call": (_nothing, NO_TOOLS),
    "audio": (_nothing, "an earlier reply's audio is not kept here: send its transcript as content"),
}


def _without_idle(values: Any, fields: dict[str, tuple[Callable[[Any], bool], str]], where: str = "") -> Any:
    """``values`` (a body, or a message: ``where`` its place) without the fields of ``fields`` whose
    value asks for nothing; one that asks for something is refused naming it."""
    if not isinstance(values, dict):
        return values
    kept = dict(values)
    for name, (idle, refusal) in fields.items():
        if name in kept:
            if not idle(kept[name]):
                raise invalid(f"{where}{name}", refusal)
            del kept[name]
    return kept


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    """What the chat and completion endpoints share: vLLM's sampling options."""

    model: StrictStr = "ar"
    max_tokens: Annotated[Int32, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    seed: Seed | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None  # an end-user id for the caller's own records; nothing to honour
    # vLLM's extensions, which benchmarks send
    ignore_eos: StrictBool | None = None
    min_tokens: Annotated[Int32, Field(ge=0)] | None = None
    top_k: Int32 | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None
    # token id (a string, as JSON keys are) -> a bias added to its logit, OpenAI's -100 to 100
    logit_bias: dict[StrictStr, Annotated[Number | StrictInt, Field(ge=-100, le=100)]] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias):
        for token in bias or {}:
            if not (token.isascii() and token.isdecimal()):
                raise ValueError(f"its keys are token ids, got {token!r:.40}")
        return bias

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > 8:
            raise ValueError("at most 8 stop sequences")
        return stop

    def sampling(self) -> dict[str, Any]:
        """vLLM's ``SamplingParams`` fields for the ``ar`` model's ``sampling_parameters``."""
        keys = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "ignore_eos",
                "min_tokens", "top_k", "min_p", "repetition_penalty")
        values = {key: getattr(self, key) for key in keys if getattr(self, key) is not None}
        if self.stop is not None:
            values["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.max_tokens is not None:
            values["max_tokens"] = self.max_tokens
        if self.logit_bias:  # the model names a token id past its vocabulary
            values["logit_bias"] = self.logit_bias
        return values

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class InputAudio(_Body):
    data: StrictStr  # base64
    format: Literal["wav", "mp3"]


class AudioPart(_Body):
    """OpenAI's ``input_audio`` part: a clip the model hears (a Qwen-Omni thinker), in a user message."""

    type: Literal["input_audio"]
    input_audio: InputAudio


class ImageUrl(_Body):
    url: StrictStr  # a data: URL (the gateway fetches nothing)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    """OpenAI's ``image_url`` part: an image the model sees (a Qwen-Omni thinker), in a user message."""

    type: Literal["image_url"]
    image_url: ImageUrl


class OtherPart(BaseModel):
    """A content part of OpenAI's other kinds: known, so that a request carrying one is refused by
    name (``ChatRequest``) rather than told its content should have been a string."""

    model_config = ConfigDict(extra="allow")
    type: Literal["file", "input_file", "refusal"]


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart | AudioPart | ImagePart | OtherPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def template_content(self) -> str | list[dict[str, str]]:
        """The content as a chat template reads it: the text, or, where the message holds audio or
        images, its parts in order (the template writes each clip's and image's marker)."""
        if not isinstance(self.content, list) or not any(isinstance(p, AudioPart | ImagePart) for p in self.content):
            return self.text()
        return [{"type": "text", "text": part.text} if isinstance(part, TextPart) else
                {"type": "audio" if isinstance(part, AudioPart) else "image"} for part in self.content]


class TalkerOptions(_Body):
    """This gateway's extension: the talker's sampling (the speech model's own defaults otherwise)."""

    temperature: Annotated[Number, Field(ge=0)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None
    max_tokens: Annotated[Int32, Field(ge=1)] | None = None
    min_tokens: Annotated[Int32, Field(ge=0)] | None = None
    seed: Seed | None = None

    def values(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class ChatAudio(_Body):
    """``audio`` of a chat request: the reply spoken in ``voice``, encoded as ``format``."""

    voice: StrictStr
    format: Literal["wav", "mp3", "flac", "opus", "aac", "pcm16"]


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]

    max_completion_tokens: Annotated[Int32, Field(ge=1)] | None = None
    modalities: Annotated[list[Literal["text", "audio"]], Field(min_length=1)] | None = None
    audio: ChatAudio | None = None
    talker: TalkerOptions | None = None  # this gateway's extension
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _idle(cls, values: Any) -> Any:
        values = _without_idle(values, IDLE_CHAT_FIELDS)
        if isinstance(values, dict) and isinstance(values.get("messages"), list):
            values["messages"] = [_without_idle(m, IDLE_MESSAGE_FIELDS, f"messages.{i}.")
                                  for i, m in enumerate(values["messages"])]
        return values

    @model_validator(mode="after")
    def _parts_read(self) -> ChatRequest:
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if isinstance(part, OtherPart):
                    raise invalid(f"messages.{i}.content.{j}.type", f"{part.type!r} parts are not read by the "
                                  "models this gateway serves: a message's content is text, and audio and images "
                                  "in a user message")
                if isinstance(part, AudioPart | ImagePart) and message.role != "user":
                    raise invalid(f"messages.{i}.content.{j}.type", f"{part.type!r} parts go in user messages")
        return self

    def audio_parts(self) -> list[str]:
        """Where each ``input_audio`` part is (``messages.0.content.1``), in order."""
        return self._parts(AudioPart)

    def image_parts(self) -> list[str]:
        """Where each ``image_url`` part is, in order."""
        return self._parts(ImagePart)

    def _parts(self, kind: type) -> list[str]:
        return [f"messages.{i}.content.{j}" for i, message in enumerate(self.messages)
                for j, part in enumerate(message.content if isinstance(message.content, list) else ())
                if isinstance(part, kind)]

    def part_of(self, param: str | None) -> str | None:
        """The part an ``ar`` refusal of ``input_audio`` or ``images`` (``input_audio[i]``: its i-th
        clip) is about, in this body's names; None for another parameter."""
        for tensor, parts in (("input_audio", self.audio_parts), ("images", self.image_parts)):
            if param and param.startswith(tensor):
                found = parts() or ["messages"]
                index = param.removeprefix(tensor).strip("[]")
                return found[int(index)] if index.isdigit() and int(index) < len(found) else found[0]
        return None

    def image_files(self) -> list[bytes]:
        """The ``image_url`` parts' files (each a base64 ``data:`` URL), in the order their markers
        appear in the prompt."""
        files = []
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if isinstance(part, ImagePart):
                    files.append(_data_url(part.image_url.url, f"messages.{i}.content.{j}.image_url.url"))
        return files

    def audio_clips(self) -> list[bytes]:
        """The ``input_audio`` parts' files, in the order their markers appear in the prompt."""
        clips = []
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if isinstance(part, AudioPart):
                    try:
                        clips.append(base64.b64decode(part.input_audio.data, validate=True))
                    except (binascii.Error, ValueError):
                        raise invalid(f"messages.{i}.content.{j}.input_audio.data", "is not base64") from None
        return clips

    def sampling(self) -> dict[str, Any]:
        values = super().sampling()
        if self.max_completion_tokens is not None:
            values["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            values["logprobs"] = self.top_logprobs or 0
        elif self.top_logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        return values

    def chat(self) -> list[dict[str, Any]]:
        """The messages as a chat template reads them (``developer`` is OpenAI's newer ``system``)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.template_content()}
                for m in self.messages]


    @property
    def speaks(self) -> bool:
        """Whether the reply is spoken too (OpenAI's ``modalities: ["text", "audio"]`` with ``audio``)."""
        if self.modalities is None or "audio" not in self.modalities:
            if self.audio is not None:
                raise invalid("audio", "needs modalities [\"text\", \"audio\"]")
            return False
        if self.audio is None:
            raise invalid("audio", "is required with modalities \"audio\": {\"voice\": ..., \"format\": ...}")
        if self.n != 1:
            raise invalid("n", "a spoken reply is one completion")
        if self.stream and self.audio.format != "pcm16":
            raise invalid("audio.format", "a streamed reply's audio is pcm16 (as OpenAI streams it)")
        return True


class SpeechRequest(_Body):
    """``/v1/audio/speech``: ``input`` spoken by the model's talker."""

    model: StrictStr = "speech"
    input: Annotated[StrictStr, Field(min_length=1, max_length=MAX_TEXT_CHARS)]
    voice: StrictStr
    response_format: Literal["wav", "mp3", "flac", "opus", "aac", "pcm"] = "mp3"
    speed: Number | None = None
    instructions: StrictStr | None = None
    stream_format: Literal["audio", "sse"] | None = None
    talker: TalkerOptions | None = None  # this gateway's extension

    @field_validator("input")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be text to speak, not blank")
        return value

    @field_validator("speed")
    @classmethod
    def _model_pace(cls, value: float | None) -> float | None:
        if value is not None and value != 1.0:
            raise ValueError("is not supported: the model speaks at its own pace (1.0)")
        return value

    @field_validator("instructions")
    @classmethod
    def _no_instructions(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("are not supported by this model's talker")
        return value


class InputText(_Body):
    type: Literal["input_text"]
    text: StrictStr


class OutputText(_Body):
    """An earlier response's text, sent back as it came."""

    type: Literal["output_text"]
    text: StrictStr
    annotations: list | None = None
    logprobs: list | None = None


class InputMessage(_Body):
    """A Responses API input message; an earlier response's output message (``id``, ``status``) too."""

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[InputText | OutputText]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class TextFormat(_Body):
    type: Literal["text"]


class ResponseText(_Body):
    format: TextFormat | None = None  # JSON output: refused, as for chat (a 400 naming text.format.type)
    verbosity: None = None


IDLE_RESPONSE_FIELDS = {name: IDLE_CHAT_FIELDS[name] for name in (
    "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "tools", "tool_choice",
    "parallel_tool_calls")} | {
    # stored or not, the response is the same; this gateway keeps none (GET /v1/responses/{id} is a 404)
    "store": (lambda value: value is None or isinstance(value, bool), "must be true or false"),
    "include": (_nothing, "nothing more is included in these responses"),
    "reasoning": (_nothing, "the models this gateway serves have no reasoning setting"),
    "background": (_nothing, "responses are not run in the background here: ask without it"),
    "truncation": (lambda value: value in (None, "disabled"), "the input is never truncated here"),
    "max_tool_calls": (_nothing, NO_TOOLS),
    "previous_response_id": (_nothing, "this gateway keeps no responses: send the conversation as input"),
    "conversation": (_nothing, "this gateway keeps no conversations: send the conversation as input"),
    "prompt": (_nothing, "this gateway keeps no prompt templates"),
    "top_logprobs": (_nothing, "log probabilities: use /v1/chat/completions"),
}


class ResponsesRequest(_Body):
    """OpenAI's Responses API on a text model: ``input`` as text or messages, ``instructions`` as
    the system turn, one output message back."""

    model: StrictStr = "ar"
    input: Annotated[StrictStr, Field(min_length=1)] | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[Int32, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    stream: StrictBool = False
    user: StrictStr | None = None
    text: ResponseText | None = None
    # vLLM's extension
    seed: Seed | None = None

    @model_validator(mode="before")
    @classmethod
    def _idle(cls, values: Any) -> Any:
        kept = _without_idle(values, IDLE_RESPONSE_FIELDS)
        if isinstance(kept, dict) and isinstance(kept.get("input"), list):
            kept["input"] = [_without_idle(m, IDLE_MESSAGE_FIELDS, f"input.{i}.") for i, m in enumerate(kept["input"])]
        return kept

    def sampling(self) -> dict[str, Any]:
        values = {key: getattr(self, key) for key in ("temperature", "top_p", "seed") if getattr(self, key) is not None}
        return values | ({"max_tokens": self.max_output_tokens} if self.max_output_tokens is not None else {})

    def chat(self) -> list[dict[str, str]]:
        """The conversation as a chat template reads it: the instructions as its system turn."""
        turns = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.input]
        return ([{"role": "system", "content": self.instructions}] if self.instructions else []) + turns


class CompletionRequest(_Sampling):
    """``prompt``: one, or several (each of their ``n`` completions a choice, prompt i's at ``i * n``)."""

    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS)]

    @model_validator(mode="before")
    @classmethod
    def _idle(cls, values: Any) -> Any:
        return _without_idle(values, IDLE_COMPLETION_FIELDS)
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: StrictBool = False

    def sampling(self) -> dict[str, Any]:
        values = super().sampling()
        if self.logprobs is not None:
            values["logprobs"] = self.logprobs
        return values

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_token_ids(cls, prompt):
        tokens = isinstance(prompt, list) and prompt and all(isinstance(p, int | list) for p in prompt)
        if tokens:  # OpenAI's prompt as token ids ([1, 2] or [[1, 2], [3]]): the model reads text
            raise ValueError("prompts as token ids are not taken here: send the text (a string, or a list of them)")
        return prompt

    def texts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt

    def prompt_of(self, index: int) -> str:
        """The prompt of choice ``index``."""
        return self.texts()[index // self.n]


class ImageRequest(_Body):
    prompt: Annotated[StrictStr, Field(min_length=1, max_length=MAX_TEXT_CHARS)]
    model: StrictStr = "text_to_image"
    n: Annotated[StrictInt, Field(ge=1, le=MAX_IMAGES)] = 1
    size: StrictStr | None = None
    response_format: Literal["b64_json"] = "b64_json"
    quality: Literal["auto", "standard"] | None = None
    style: StrictStr | None = None  # DALL-E 3's vivid/natural: these models have no such switch
    background: Literal["auto"] | None = None
    output_format: Literal["png"] | None = None
    user: StrictStr | None = None
    # the extensions vLLM-Omni and SGLang accept
    seed: Seed | None = None
    num_inference_steps: Annotated[Int32, Field(ge=1)] | None = None
    guidance_scale: Annotated[Number, Field(ge=0)] | None = None
    true_cfg_scale: Annotated[Number, Field(ge=0)] | None = None
    negative_prompt: StrictStr | None = None
    enhance_prompt: StrictBool | None = None  # the omni model's prompt rewrite
    step_cache: StrictStr | None = None  # the diffusion model's step cache (off, first_block[:THRESHOLD])
    lora: StrictStr | None = None  # a LoRA adapter the diffusion model serves, and its scale
    lora_scale: Number | StrictInt | None = None

    @field_validator("style")
    @classmethod
    def _no_style(cls, style):
        if style is not None:
            raise ValueError("these models have no style setting; describe the style in the prompt")
        return style

    def dimensions(self) -> tuple[int, int] | None:
        return dimensions(self.size)

    def guidance(self) -> float | None:
        if self.guidance_scale is not None and self.true_cfg_scale is not None:
            raise invalid("true_cfg_scale", "give guidance_scale or true_cfg_scale, not both")
        return self.true_cfg_scale if self.true_cfg_scale is not None else self.guidance_scale


def dimensions(size: str | None) -> tuple[int, int] | None:
    """``size`` ("WIDTHxHEIGHT") as (width, height); None for the model's default."""
    if size is None or size == "auto":
        return None
    width, x, height = size.partition("x")
    if not (x and width.isascii() and height.isascii() and width.isdecimal() and height.isdecimal()):
        raise invalid("size", f"must be WIDTHxHEIGHT (e.g. 512x512) or auto, got {size!r}")
    width, height = int(width), int(height)
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise invalid("size", f"each side must be between 1 and {MAX_SIDE}, got {size!r}")
    return width, height


class VideoRequest(_Body):
    """``POST /v1/videos``, as JSON or as the ``openai`` SDK sends it (multipart/form-data, with
    ``input_reference``, the first frame's image file, where given). ``seconds`` is a string in
    OpenAI's API ("4"); a number is taken too. The extensions are the image endpoints'."""

    prompt: Annotated[StrictStr, Field(min_length=1, max_length=MAX_TEXT_CHARS)]
    model: StrictStr = "text_to_image"
    seconds: StrictStr | Number | StrictInt | None = None
    size: StrictStr | None = None
    user: StrictStr | None = None
    seed: Seed | None = None
    num_inference_steps: Annotated[Int32, Field(ge=1)] | None = None
    guidance_scale: Annotated[Number, Field(ge=0)] | None = None
    guidance_scale_2: Annotated[Number, Field(ge=0)] | None = None  # Wan 2.2 A14B's low-noise expert's
    negative_prompt: StrictStr | None = None
    num_frames: Annotated[Int32, Field(ge=1)] | None = None
    step_cache: StrictStr | None = None
    lora: StrictStr | None = None
    lora_scale: Number | StrictInt | None = None
    _reference: bytes | None = PrivateAttr(None)  # input_reference's file, from a multipart form

    @property
    def input_reference(self) -> bytes | None:
        return self._reference

    def length(self) -> float | None:
        """``seconds`` as a number (the model turns it into frames at its frame rate)."""
        if self.seconds is None:
            return None
        try:
            seconds = float(self.seconds)
        except ValueError:
            raise invalid("seconds", f"must be a number of seconds, got {self.seconds!r:.40}") from None
        if not 0 < seconds < float("inf"):
            raise invalid("seconds", f"must be above 0, got {self.seconds!r:.40}")
        return seconds


class ImageEditRequest(ImageRequest):
    """``/v1/images/edits``: the generations' fields and extensions, sent as multipart/form-data
    beside the input images (``image``, or ``image[]`` for several, as the ``openai`` SDK sends
    them), which ``images`` holds as files. The model defaults to ``diffusion`` (``text_to_image``
    and ``omni`` take them too)."""

    model: StrictStr = "diffusion"
    images: list[bytes] = Field(default_factory=list, exclude=True)


# Form fields arrive as text: these are read as the JSON numbers the generations endpoint takes (the
# diffusion options' numbers, by the protocol's table; `seconds` is text in OpenAI's API, and `size`
# stands for the height and width)
FORM_NUMBERS = {"n": int, "true_cfg_scale": float} | {
    spec.name: spec.python_type for spec in DIFFUSION_OPTIONS
    if spec.python_type in (int, float) and spec.name not in ("height", "width", "seconds")}


def table_options(body: _Body, *, video: bool) -> dict[str, Any]:
    """The body's values of the protocol's diffusion options (a video's with ``video``), by name,
    but those the API shapes its own way (``size``, ``seconds``); None where not given."""
    skipped = {"height", "width", "seconds"} | (set() if video else VIDEO_OPTIONS)
    return {spec.name: getattr(body, spec.name) for spec in DIFFUSION_OPTIONS if spec.name not in skipped}
FORM_BOOLS = {"enhance_prompt"}


async def parse_edit(form) -> ImageEditRequest:
    """A multipart form (Starlette's) as an ``ImageEditRequest``, or a 400 naming the field at fault."""
    if "mask" in form:
        raise invalid("mask", "inpainting is not served: send the image to edit and describe the change")
    files = [*form.getlist("image"), *form.getlist("image[]")]
    if not files:
        raise invalid("image", "is required: one image file, or several as image[]")
    fields: dict[str, Any] = {}
    for name, value in form.multi_items():
        if name in ("image", "image[]"):
            continue
        if not isinstance(value, str):
            raise invalid(name, "must be a text field, not a file")
        if name in fields:
            raise invalid(name, "is given more than once")
        fields[name] = _form_value(name, value)
    images = []
    for file in files:
        if isinstance(file, str):
            raise invalid("image", "must be a file (multipart/form-data), not a text field")
        images.append(await file.read())
    request = parse(ImageEditRequest, json.dumps(fields).encode())
    request.images = images
    return request


async def parse_video_form(form) -> VideoRequest:
    """``POST /v1/videos`` as the ``openai`` SDK sends it: multipart/form-data, every field text but
    ``input_reference``, a file."""
    fields: dict[str, Any] = {}
    reference = None
    for name, value in form.multi_items():
        if name in fields or (name == "input_reference" and reference is not None):
            raise invalid(name, "is given more than once")
        if name == "input_reference":
            if isinstance(value, str):
                raise invalid(name, "must be an image file (multipart/form-data), not a text field")
            reference = await value.read()
        elif not isinstance(value, str):
            raise invalid(name, "must be a text field, not a file")
        else:
            fields[name] = _form_value(name, value)
    request = parse(VideoRequest, json.dumps(fields).encode())
    request._reference = reference
    return request


def parse_video_json(raw: bytes) -> VideoRequest:
    """``POST /v1/videos`` as JSON (no file: ``input_reference`` needs the multipart form)."""
    if b'"input_reference"' in raw:
        raise invalid("input_reference", "is an image file: send the request as multipart/form-data (the openai "
                      "SDK does)")
    return parse(VideoRequest, raw)


def _form_value(name: str, text: str) -> Any:
    if name in FORM_NUMBERS:
        try:
            number = FORM_NUMBERS[name](text)
        except ValueError:
            raise invalid(name, f"must be a number, got {text!r:.40}") from None
        return number
    if name in FORM_BOOLS:
        if text.lower() not in ("true", "false"):
            raise invalid(name, f"must be true or false, got {text!r:.40}")
        return text.lower() == "true"
    return text


def _union_member(part: int | str) -> bool:
    """Pydantic names the member of a union it tried (``stop.str``, ``stop.list[str]``, a model's class
    name): not a field (this API's fields are lower case)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part
                                      or part[:1].isupper() or part.startswith("constrained-"))


def parse(kind: type[_Body], raw: bytes) -> Any:
    """The body as ``kind``, or a 400 naming the first field at fault."""
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise OpenAIError(400, "The body is not valid UTF-8", code="invalid_json") from None
    except json.JSONDecodeError as error:
        raise OpenAIError(400, f"The body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "The body must be a JSON object", code="invalid_json")
    try:
        return kind.model_validate(data)
    except ValidationError as error:
        # a union names each member's error: the one that got furthest into the value says what is wrong
        # (a content part missing its text, not that the content should have been a string)
        first = max(error.errors(), key=lambda e: len([part for part in e["loc"] if not _union_member(part)]))
        param = ".".join(str(part) for part in first["loc"] if not _union_member(part)) or None
        reason = "unknown field (not part of this API)" if first["type"] == "extra_forbidden" else first["msg"]
        shown = "" if first["type"] in ("missing", "extra_forbidden") else f", got {first.get('input')!r:.80}"
        raise OpenAIError(400, f"{param}: {reason}{shown}", param=param, code="invalid_value") from None


def _data_url(url: str, field: str) -> bytes:
    """The bytes of a base64 ``data:`` URL (``data:image/png;base64,...``)."""
    header, _, data = url.partition(",")
    if not header.startswith("data:"):
        raise invalid(field, "must be a data: URL (data:image/png;base64,...): this gateway fetches nothing")
    if not header.endswith(";base64"):
        raise invalid(field, "must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(field, "is not base64") from None
