"""A small client for the triton-omni models.

gRPC goes through ``tritonclient.grpc`` streaming (decoupled models need it).
HTTP uses Triton's ``/generate`` and ``/generate_stream`` (server-sent events)
endpoints, because Triton's HTTP ``/infer`` does not serve decoupled models.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import threading
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from triton_omni_protocol import (
    ADMIN_HEADER,
    AR_GENERATE_INPUTS,
    OMNI_INPUTS,
    InputValueError,
    diffusion_inputs,
    parse_status,
    scalar_inputs,
)

from triton_omni_client.shared_memory import Regions

Protocol = Literal["grpc", "http"]

# Every scalar input of the models, from the protocol: its Triton and NumPy types, and its range.
SCALAR_INPUTS = scalar_inputs()
# The options each kind of call takes as keyword arguments: its model's inputs (``generate_text``: the
# one-value ones, which it sends as they are; the media calls: ``diffusion``'s, and ``text_input`` for
# the ``text_to_image`` ensemble)
TEXT_OPTIONS = frozenset(spec.name for spec in AR_GENERATE_INPUTS if spec.kind == "scalar") - {"text_input"}
OMNI_OPTIONS = frozenset(spec.name for spec in OMNI_INPUTS) - {"text_input", "modalities", "enhance_prompt", "stream",
                                                               "parameters", "options"}  # its own arguments
MEDIA_OPTIONS = frozenset(spec.name for spec in diffusion_inputs()) | {"text_input"}
FLOAT_TYPES = {"FP16", "BF16", "FP32", "FP64"}


class OmniError(RuntimeError):
    """A request failed; ``status`` is Triton's code (e.g. ``INVALID_ARG``)."""

    def __init__(self, status: str, message: str):
        self.status = status
        super().__init__(f"[{status}] {message}")


@dataclass
class Video:
    """A video model's answer: its frames and the rate they play at."""

    frames: np.ndarray  # [F, H, W, 3] uint8
    fps: float


@dataclass
class OmniEvent:
    """One response of the ``omni`` scheduler; only the fields it carries are set.

    Streaming sends one event per text delta, rewrite delta, progress tick or
    image; the non-streaming response carries the whole text, the rewritten
    prompt and every image at once.
    """

    text: str | None = None  # text_output
    finish_reason: str | None = None
    enhanced_prompt_delta: str | None = None
    enhanced_prompt: str | None = None
    stage: str | None = None  # progress: "encode" | "diffusion"
    step: int | None = None
    total_steps: int | None = None
    image: np.ndarray | None = None  # [num_images, H, W, 3] uint8
    image_index: list[int] | None = None  # which of num_images (images or videos)
    video: np.ndarray | None = None  # a video model's: [num_images, F, H, W, 3] uint8
    fps: float | None = None
    audio: np.ndarray | None = None  # modalities with "audio": the next samples of the spoken reply, float32
    sample_rate: int | None = None
    audio_codes: np.ndarray | None = None  # the codec frames those samples end, [codebooks, frames]

    @classmethod
    def from_outputs(cls, get) -> OmniEvent:
        """``get(name)`` returns an output as an array, or None when absent."""
        def text(name):
            value = get(name)
            return None if value is None else "".join(_as_text(v) for v in np.ravel(value))

        image, index, video = _shaped(get, "image"), get("image_index"), _shaped(get, "video")
        return cls(text=text("text_output"), finish_reason=text("finish_reason"),
                   enhanced_prompt_delta=text("enhanced_prompt_delta"), enhanced_prompt=text("enhanced_prompt"),
                   stage=text("stage"), step=_first(get, "step", int), total_steps=_first(get, "total_steps", int),
                   image=None if image is None else np.asarray(image, dtype=np.uint8),
                   image_index=None if index is None else [int(i) for i in np.ravel(index)],
                   video=None if video is None else np.asarray(video, dtype=np.uint8),
                   fps=_first(get, "fps", float),
                   audio=None if get("audio") is None else np.asarray(get("audio"), dtype=np.float32).reshape(-1),
                   sample_rate=_first(get, "sample_rate", int), audio_codes=get("audio_codes"))


def _media(model: str, values: list, names: tuple[str, ...]) -> list:
    """A call's outputs ``names``; a model that made the other kind (an image for a video, or the
    reverse) is named in the error."""
    if values[0] is None:
        other = "generate_image" if names[0] == "video" else "generate_video"
        raise OmniError("INVALID_ARG", f"'{model}' returned no {names[0]}: it makes "
                        f"{'images' if names[0] == 'video' else 'videos'} (call {other})")
    return values


def _shaped(get, name: str) -> Any:
    """Output ``name`` in its shape (``<name>_shape``): HTTP JSON sends it flat."""
    value, shape = get(name), get(f"{name}_shape")
    if value is not None and shape is not None:
        value = np.reshape(value, [int(n) for n in np.ravel(shape)])
    return value


@dataclass
class TextChunk:
    """One ``ar`` response. The optional fields are set when asked for
    (``return_*=True``); ``num_output_tokens`` counts this response's new
    tokens, ``cumulative_logprob`` the whole completion's so far, and
    ``logprobs`` has one ``{token_id: {logprob, rank, decoded_token}}`` per
    new token (Triton's vLLM backend's semantics)."""

    text: str
    finish_reason: str | None = None
    num_output_tokens: int | None = None
    num_input_tokens: int | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[str, dict[str, Any]]] | None = None


class OmniClient:
    def __init__(self, url: str | None = None, protocol: Protocol = "grpc", shared_memory: bool = False,
                 admin_key: str | None = None):
        """``shared_memory``: send embeddings through system shared memory (a client on the server's
        own host: shared_memory.py) instead of in the request body, and receive the image the
        same way when the call gives its ``height`` and ``width``. The regions stay registered
        between calls, one set per call in flight, until ``close()`` (or the end of a ``with``
        block, or of the client). Registering a region is one of Triton's restricted APIs: it
        takes the server's ``admin_key`` (``omni-triton serve`` prints where it is;
        ``TRITON_OMNI_ADMIN_KEY`` by default)."""
        self.protocol = protocol
        self.url = url or ("localhost:8001" if protocol == "grpc" else "localhost:8000")
        self.shared_memory = shared_memory
        admin_key = admin_key or os.environ.get("TRITON_OMNI_ADMIN_KEY")
        header = f"triton-grpc-protocol-{ADMIN_HEADER}" if protocol == "grpc" else ADMIN_HEADER
        self._admin_headers = {header: admin_key} if admin_key else None
        self._input_types: dict[str, dict[str, str]] = {}  # model -> its inputs' datatypes (metadata, read once)
        self._sessions = _Sessions(self.url, protocol)
        weakref.finalize(self, self._sessions.close)

    def close(self) -> None:
        """Unregisters and frees the shared memory regions this client keeps (none without
        ``shared_memory``); the client stays usable."""
        self._sessions.close()

    def __enter__(self) -> OmniClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- text ------------------------------------------------------------------

    def generate_text(self, prompt: str, *, stream: bool = False, model: str = "ar",
                      sampling_parameters: dict[str, Any] | None = None, stop: list[str] | None = None,
                      **options: Any) -> Iterator[TextChunk]:
        """Yield text as it arrives (one chunk when ``stream`` is false).

        ``options``: the scalar inputs of ``ar`` (``max_tokens``, ``seed``,
        ``return_logprobs``, ..., ``lora``: one of its LoRA adapters); ``sampling_parameters``: any
        vLLM sampling key. The last chunk carries ``finish_reason`` unless
        ``return_finish_reason=False``."""
        check_options("generate_text", options, TEXT_OPTIONS)
        options = {"stream": stream, "return_finish_reason": True, **options}
        if self.protocol == "http":
            yield from self._generate_http(model, prompt, options, sampling_parameters, stop)
        else:
            yield from self._generate_grpc(model, prompt, options, sampling_parameters, stop)

    def _generate_grpc(self, model, prompt, options, sampling_parameters, stop) -> Iterator[TextChunk]:
        import tritonclient.grpc as grpcclient

        inputs = [_bytes_input(grpcclient, "text_input", [prompt])]
        for name, value in options.items():
            if isinstance(value, str):  # a text input (`lora`)
                inputs.append(_bytes_input(grpcclient, name, [value]))
                continue
            tensor = grpcclient.InferInput(name, [1], SCALAR_INPUTS[name].wire_type)
            tensor.set_data_from_numpy(SCALAR_INPUTS[name].scalar(value))
            inputs.append(tensor)
        if sampling_parameters is not None:
            inputs.append(_bytes_input(grpcclient, "sampling_parameters", [json.dumps(sampling_parameters)]))
        if stop:
            inputs.append(_bytes_input(grpcclient, "stop", stop))
        for result in stream_infer(self.url, model, inputs):
            yield _chunk(result)

    def _generate_http(self, model, prompt, options, sampling_parameters, stop) -> Iterator[TextChunk]:
        check_scalars(options)
        body: dict[str, Any] = {"text_input": prompt, **options}
        if sampling_parameters is not None:
            body["sampling_parameters"] = json.dumps(sampling_parameters)
        if stop:
            body["stop"] = stop
        endpoint = "generate_stream" if options.get("stream") else "generate"
        request = urllib.request.Request(f"http://{self.url}/v2/models/{model}/{endpoint}",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request) as response:
                if endpoint == "generate":
                    yield _http_chunk(json.load(response))
                    return
                for line in response:
                    if line.startswith(b"data: "):
                        event = json.loads(line[len(b"data: "):])
                        if "error" in event:
                            raise _http_error(400, event["error"])
                        yield _http_chunk(event)
        except urllib.error.HTTPError as exc:
            message = json.loads(exc.read() or b"{}").get("error", exc.reason)
            raise _http_error(exc.code, message) from None

    # -- the omni scheduler ---------------------------------------------------------

    def generate(self, prompt: str, *, modalities: tuple[str, ...] | list[str] = ("text",),
                 enhance_prompt: bool = False, stream: bool = True, model: str = "omni",
                 parameters: dict[str, Any] | None = None, timeout_s: float | None = None,
                 **options: Any) -> Iterator[OmniEvent]:
        """Run one ``omni`` request; yields its events (one when ``stream`` is
        false). ``options``: text options (max_tokens, temperature, top_p,
        top_k), image options (negative_prompt, num_inference_steps,
        guidance_scale, height, width; ``images``: input image files, for a family that reads them, or
        with ``modalities`` ``["text"]`` or ``["text", "audio"]`` for a thinker that sees them (a Qwen-Omni
        thinker's on the transformers engine), before the prompt in its user turn), seed, num_images;
        ``input_audio``: audio files the thinker hears (a Qwen-Omni thinker), before the prompt in its
        user turn; with ``"audio"`` in ``modalities``, the
        speech options (``voice``, the talker's ``talker_temperature``, ``talker_max_tokens``, ...: the
        protocol's SPEECH_OPTIONS),
        and the events carry the audio as it streams. ``timeout_s``
        (gRPC): the longest wait for the next event, past which the request
        is cancelled and ``TimeoutError`` raised."""
        check_options("generate", options, OMNI_OPTIONS)
        values = {"text_input": prompt, "modalities": list(modalities), "enhance_prompt": enhance_prompt,
                  "stream": stream, **options}
        if parameters:
            # Triton's HTTP /generate keeps the key `parameters` for request parameters
            values["options" if self.protocol == "http" else "parameters"] = json.dumps(parameters)
        if self.protocol == "http":
            if stream:
                raise ValueError("omni over HTTP is non-streaming (Triton's /generate); use gRPC to stream")
            check_scalars(values)
            yield OmniEvent.from_outputs(self._post_generate(model, values).get)
            return
        import tritonclient.grpc as grpcclient

        for result in stream_infer(self.url, model, omni_inputs(grpcclient, values), timeout_s=timeout_s):
            yield OmniEvent.from_outputs(result.as_numpy)

    def _post_generate(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(f"http://{self.url}/v2/models/{model}/generate",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            message = json.loads(exc.read() or b"{}").get("error", exc.reason)
            raise _http_error(exc.code, message) from None

    # -- embeddings --------------------------------------------------------------

    def encode(self, prompt: str, model: str = "ar_encoder") -> np.ndarray:
        """Prompt embeddings ``[num_tokens, hidden]`` from the AR encoder."""
        client_module = _client_module(self.protocol)
        with client_module.InferenceServerClient(self.url) as client:
            try:
                result = client.infer(model, batched_inputs(client_module, text_input=prompt))
            except Exception as exc:
                raise as_omni_error(exc) from None
            return result.as_numpy("prompt_embeds")[0]

    def encode_with_negative(self, prompt: str, negative_prompt: str | None = None,
                             model: str = "ar_encoder") -> tuple[np.ndarray, np.ndarray]:
        """The prompt's embeddings and its negative prompt's, in one request, as the family's
        pipeline conditions on them. ``negative_prompt`` None is an absent negative prompt: the
        encoder answers what the pipeline uses without one, the encoding of ``""`` (Z-Image, SD)
        or zero tokens (Qwen-Image, which then runs without true CFG). Both go to ``diffusion``
        as ``prompt_embeds`` and ``negative_prompt_embeds``, as ``text_to_image`` sends them."""
        conditioning = self.encode_conditioning(prompt, negative_prompt, model)
        return conditioning["prompt_embeds"], conditioning["negative_prompt_embeds"]

    def encode_conditioning(self, prompt: str, negative_prompt: str | None = None,
                            model: str = "ar_encoder", images: list | None = None) -> dict[str, np.ndarray]:
        """Everything ``diffusion`` is conditioned on for this prompt, as keyword arguments of
        ``generate_image``: ``prompt_embeds``, ``negative_prompt_embeds`` (as
        ``encode_with_negative``) and, for a family whose DiT reads one (FLUX.1's CLIP vector),
        ``pooled_prompt_embeds``. ``images`` (as ``edit_image``'s): an edit family's encoder reads
        the prompt with them (Qwen-Image-Edit); send the same images to ``edit_image`` then."""
        client_module = _client_module(self.protocol)
        names = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds")
        files = None if images is None else [_encoded(image) for image in images]
        with client_module.InferenceServerClient(self.url) as client:
            try:
                result = client.infer(model, batched_inputs(client_module, text_input=prompt,
                                                            negative_prompt=negative_prompt, images=files),
                                      outputs=[client_module.InferRequestedOutput(name) for name in names])
            except Exception as exc:
                raise as_omni_error(exc) from None
        conditioning = {name: result.as_numpy(name)[0] for name in names}
        if conditioning["pooled_prompt_embeds"].size == 0:  # the family reads none
            del conditioning["pooled_prompt_embeds"]
        return conditioning

    # -- images ----------------------------------------------------------------

    def generate_image(self, prompt: str | None = None, *, prompt_embeds: np.ndarray | None = None,
                       negative_prompt: str | None = None, negative_prompt_embeds: np.ndarray | None = None,
                       pooled_prompt_embeds: np.ndarray | None = None, model: str = "diffusion",
                       **options: Any) -> np.ndarray:
        """An image ``[H, W, 3]`` uint8. ``options``: num_inference_steps,
        guidance_scale, height, width, seed. ``model``: ``diffusion`` (or a
        copy of it), or the ``text_to_image`` ensemble, whose text input is
        ``text_input``. ``pooled_prompt_embeds``: beside ``prompt_embeds`` for a family whose
        DiT reads one (FLUX.1; ``encode_conditioning`` gives all three). ``negative_prompt``:
        None leaves it out, which is not ``""``: each means what it means to the family's
        pipeline (docs/pipelines.md). A value its input cannot hold (a seed past INT64) raises
        ``InputValueError`` naming it, before sending."""
        check_options("generate_image", options, MEDIA_OPTIONS)
        client_module = _client_module(self.protocol)
        embeds = {"prompt_embeds": prompt_embeds, "negative_prompt_embeds": negative_prompt_embeds,
                  "pooled_prompt_embeds": pooled_prompt_embeds}
        call = self._generate_shared if self.shared_memory else self._infer_media
        return call(client_module, model, prompt, negative_prompt, embeds, options, "image")[0][0]

    def generate_video(self, prompt: str | None = None, *, prompt_embeds: np.ndarray | None = None,
                       negative_prompt: str | None = None, negative_prompt_embeds: np.ndarray | None = None,
                       model: str = "diffusion", **options: Any) -> Video:
        """A video model's frames ``[F, H, W, 3]`` uint8 and their frame rate. ``options``:
        ``generate_image``'s, ``num_frames`` (1 + a multiple of the model's VAE's temporal
        factor: 1 + 4k for Wan; the model's default when left out) or ``seconds``, and for a model
        with two experts (Wan 2.2 A14B) ``guidance_scale_2``, the low-noise expert's scale."""
        check_options("generate_video", options, MEDIA_OPTIONS)
        client_module = _client_module(self.protocol)
        embeds = {"prompt_embeds": prompt_embeds, "negative_prompt_embeds": negative_prompt_embeds}
        call = self._generate_shared if self.shared_memory else self._infer_media
        frames, fps = call(client_module, model, prompt, negative_prompt, embeds, options, "video", "fps")
        return Video(frames[0], float(np.ravel(fps)[0]))

    def _infer_media(self, client_module, model: str, prompt, negative_prompt, embeds: dict, options: dict,
                     *names: str) -> list[np.ndarray]:
        """One call's outputs ``names`` (an image, or a video's frames and frame rate); a model that
        makes the other kind is named in the error."""
        with client_module.InferenceServerClient(self.url) as client:
            inputs = self._image_inputs(client, client_module, None, model, prompt, negative_prompt, embeds, options)
            try:
                result = client.infer(model, inputs)
            except Exception as exc:
                raise as_omni_error(exc) from None
        return _media(model, [result.as_numpy(name) for name in names], names)

    def _image_inputs(self, client, client_module, shared: list | None, model: str, prompt, negative_prompt,
                      embeds: dict, options: dict) -> list:
        text = {"prompt": prompt, "negative_prompt": negative_prompt}
        if prompt is not None and "text_input" in self._input_types_of(client, model):
            text = {"text_input": prompt, "negative_prompt": negative_prompt}
        # embeddings go as the model declares them (its embeds_dtype), whatever float type they come in
        declared = self._input_types_of(client, model) if any(v is not None for v in embeds.values()) else {}
        return batched_inputs(client_module, shared, declared, **embeds, **text, **options)

    def _generate_shared(self, client_module, model: str, prompt, negative_prompt, embeds: dict,
                         options: dict, *names: str) -> list[np.ndarray]:
        """``_infer_media`` through this client's kept regions. A server restarted since they were
        registered refuses them by name: they are registered afresh and the call made once more."""
        args = (client_module, model, prompt, negative_prompt, embeds, options, *names)
        try:
            return self._infer_shared(*args)
        except OmniError as error:
            if not _FORGOTTEN_REGION.search(str(error)):
                raise
        self._sessions.close()  # every idle session's regions belong to a server that has forgotten them
        return self._infer_shared(*args)

    def _infer_shared(self, client_module, model: str, prompt, negative_prompt, embeds: dict,
                      options: dict, *names: str) -> list[np.ndarray]:
        """The embeddings, and the image (or the video's frames) when its size is known before the
        call, through a session's regions; the other outputs ``names`` (a frame rate) in the response."""
        height, width = options.get("height"), options.get("width")
        frames = options.get("num_frames") if names[0] == "video" else 1
        sized = height is not None and width is not None and frames is not None
        with self._sessions.session(self._admin_headers) as (client, regions):
            shared: list = []
            inputs = self._image_inputs(client, client_module, shared, model, prompt, negative_prompt, embeds,
                                        options)
            try:
                for tensor, array in shared:
                    regions.send(client, tensor, array)
                outputs = [client_module.InferRequestedOutput(name) for name in names]
                if sized:
                    regions.receive(client, outputs[0], int(frames) * int(height) * int(width) * 3)
                result = client.infer(model, inputs, outputs=outputs if sized else None)
                made = sized and result.get_output(names[0]) is not None  # (else the model makes the other kind)
                media = regions.read(result, names[0]) if made else result.as_numpy(names[0])
                return _media(model, [media, *(result.as_numpy(name) for name in names[1:])], names)
            except OmniError:
                raise
            except Exception as exc:
                raise as_omni_error(exc) from None

    def edit_image(self, prompt: str | None, images: list, *, model: str = "diffusion",
                   **options: Any) -> np.ndarray:
        """An image from ``prompt`` and input images (FLUX.2's reference images, the image
        Qwen-Image-Edit edits), ``[H, W, 3]`` uint8. ``images``: encoded files (PNG, JPEG or WebP,
        as bytes or paths) or RGB pixel arrays ``[H, W, 3]`` uint8 (sent as PNG); ``options`` as
        ``generate_image``'s (``prompt_embeds`` from ``encode_conditioning`` with the same images,
        in place of ``prompt``). Without ``height`` and ``width`` the output takes the size the
        pipeline takes from the images."""
        check_options("edit_image", options, MEDIA_OPTIONS)
        return self.generate_image(prompt, images=[_encoded(image) for image in images], model=model, **options)

    def _input_types_of(self, client, model: str) -> dict[str, str]:
        """``model``'s inputs' datatypes by name (``FP32``, ``BF16``, ...), from its metadata (asked
        once per client and model)."""
        if model not in self._input_types:
            try:
                metadata = client.get_model_metadata(model, **({"as_json": True} if self.protocol == "grpc"
                                                               else {}))
            except Exception as exc:
                raise as_omni_error(exc) from None
            self._input_types[model] = {tensor["name"]: tensor["datatype"] for tensor in metadata.get("inputs", [])}
        return self._input_types[model]

    def stream_image(self, prompt: str | None = None, *, model: str = "diffusion_stream",
                     on_progress: Callable[[int, int], None] | None = None, **options: Any) -> np.ndarray:
        """An image from a decoupled diffusion model, over a gRPC stream:
        ``on_progress(step, total_steps)`` as each denoising step ends (a
        slow reader gets the latest step), then the image ``[H, W, 3]``.
        ``options``: as ``generate_image``."""
        return self._stream_media(model, on_progress, prompt, options, "image")[0][0]

    def stream_video(self, prompt: str | None = None, *, model: str = "diffusion_stream",
                     on_progress: Callable[[int, int], None] | None = None, **options: Any) -> Video:
        """``stream_image`` for a video model: progress per step, then the frames and their rate.
        ``options``: as ``generate_video``."""
        frames, fps = self._stream_media(model, on_progress, prompt, options, "video", "fps")
        return Video(frames[0], float(np.ravel(fps)[0]))

    def _stream_media(self, model: str, on_progress, prompt, options: dict, *names: str) -> list[np.ndarray]:
        import tritonclient.grpc as grpcclient

        check_options(f"stream_{names[0]}", options, MEDIA_OPTIONS)

        for result in stream_infer(self.url, model, batched_inputs(grpcclient, prompt=prompt, **options)):
            media, step = [result.as_numpy(name) for name in names], result.as_numpy("step")
            if media[0] is not None or step is None:  # the last response (another kind's: named in the error)
                return _media(model, media, names)
            if on_progress is not None:
                on_progress(int(step[0, 0]), int(result.as_numpy("total_steps")[0, 0]))
        raise OmniError("INTERNAL", f"'{model}' ended its stream without a {names[0]}")


def batched_inputs(client_module, shared: list | None = None, declared: dict[str, str] | None = None,
                   **values: Any) -> list:
    """Input tensors of a batched model (``ar_encoder``, ``diffusion``,
    ``text_to_image``), with a batch dimension of 1: text as BYTES, prompt
    embeddings as float arrays, scalars with their declared types. ``shared``: the embeddings'
    tensors are left without data, and each ``(tensor, array)`` appended to it (for shared memory).
    ``declared``: the model's inputs' datatypes; an embedding whose float type differs is cast to
    its input's (a model with ``embeds_dtype: bfloat16`` takes bf16, half float32's bytes, so an
    array already in bf16, as ``encode`` returns it from such an ``ar_encoder``, goes unchanged)."""
    from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

    declared = declared or {}
    inputs = []
    for name, value in values.items():
        if value is None:
            continue
        if name in SCALAR_INPUTS:
            array, type_name = SCALAR_INPUTS[name].scalar(value)[None], SCALAR_INPUTS[name].wire_type
        elif isinstance(value, str):
            array, type_name = np.array([[value.encode()]], dtype=np.object_), "BYTES"
        elif isinstance(value, list):  # encoded files (input images)
            if not all(isinstance(item, bytes | bytearray | memoryview) for item in value):
                raise InputValueError(name, f"takes a list of encoded files (bytes), not {value!r:.80}")
            array, type_name = np.array([[bytes(item) for item in value]], dtype=np.object_), "BYTES"
        else:  # embeddings [tokens, hidden], a pooled embedding [width], pixels [H, W, 3]: a batch dimension added
            if not isinstance(value, np.ndarray):
                raise InputValueError(name, f"takes text, a list of files or a NumPy array, not {type(value).__name__}")
            unbatched = 3 if value.dtype == np.uint8 else 2  # pixels [H, W, 3]; embeddings [T, H] or [P]
            array = np.ascontiguousarray(value)
            array = array[None] if array.ndim <= unbatched else array
            type_name = np_to_triton_dtype(array.dtype)  # FP32, FP16, BF16 (ml_dtypes' bfloat16); UINT8: pixels
            if type_name in FLOAT_TYPES and declared.get(name, type_name) in FLOAT_TYPES - {type_name}:
                type_name = declared[name]
                array = array.astype(triton_to_np_dtype(type_name))
        tensor = client_module.InferInput(name, list(array.shape), type_name)
        if shared is not None and type_name in FLOAT_TYPES and name not in SCALAR_INPUTS:
            shared.append((tensor, array))
        else:
            tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _encoded(image: Any) -> bytes:
    """An input image as an encoded file's bytes: bytes as given, a path's contents, pixels as PNG."""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if isinstance(image, np.ndarray):
        import io

        from PIL import Image

        out = io.BytesIO()
        Image.fromarray(image).save(out, format="PNG")
        return out.getvalue()
    with open(image, "rb") as file:  # a path
        return file.read()


def check_options(method: str, options: dict[str, Any], taken: frozenset[str]) -> None:
    """``TypeError`` for a keyword option that no input of the call's model takes, as Python's own
    for an unexpected keyword argument, naming those it takes: before anything is built or sent (a
    misspelt ``steps`` would otherwise fail inside tensor building, or as the server's refusal)."""
    unknown = sorted(set(options) - taken)
    if unknown:
        raise TypeError(f"OmniClient.{method}() got unexpected option(s) {', '.join(map(repr, unknown))}; "
                        f"it takes {', '.join(sorted(taken))}")


def check_scalars(values: dict[str, Any]) -> None:
    """``InputValueError`` for the first scalar input whose value its tensor cannot hold (for the
    HTTP paths, which send JSON; the gRPC paths check as they build each tensor)."""
    for name, value in values.items():
        if name in SCALAR_INPUTS and value is not None:
            SCALAR_INPUTS[name].scalar(value)


def omni_inputs(client_module, values: dict[str, Any]) -> list:
    """Input tensors of the ``omni`` model (no batch dimension)."""
    inputs = []
    for name, value in values.items():
        if value is None:
            continue
        if name in SCALAR_INPUTS:
            tensor = client_module.InferInput(name, [1], SCALAR_INPUTS[name].wire_type)
            tensor.set_data_from_numpy(SCALAR_INPUTS[name].scalar(value))
            inputs.append(tensor)
        elif isinstance(value, np.ndarray) and value.dtype != np.object_:  # a numeric tensor as it is
            tensor = client_module.InferInput(name, list(value.shape), _WIRE_TYPES[value.dtype])
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        else:
            inputs.append(_bytes_input(client_module, name, [value] if isinstance(value, str) else value))
    return inputs


_WIRE_TYPES = {np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32",
               np.dtype(np.uint8): "UINT8", np.dtype(np.bool_): "BOOL"}


def _as_text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def stream_infer(url: str, model: str, inputs, request_id: str = "",
                 parameters: dict[str, Any] | None = None, timeout_s: float | None = None) -> Iterator:
    """One request over a gRPC stream; yields results until the final one.

    Leaving early (closing the generator, Ctrl-C) cancels the request on the
    server; a stream that ended on its own is closed without a cancel.
    ``timeout_s``: the longest wait for the next response; past it the
    request is cancelled and ``TimeoutError`` raised (a server that lost the
    request, e.g. with a stub that died, never answers it).
    """
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        ended = False
        try:
            client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True,
                                      parameters=parameters)
            while not ended:
                try:
                    result, error = results.get(timeout=timeout_s)
                except queue.Empty:
                    raise TimeoutError(f"no response from '{model}' in {timeout_s} s") from None
                if error is not None:
                    ended = True
                    raise as_omni_error(error)
                ended = result.get_response().parameters["triton_final_response"].bool_param
                if result.get_response().outputs:
                    yield result
        finally:
            client.stop_stream(cancel_requests=not ended)


def _chunk(result) -> TextChunk:
    return _text_chunk(result.as_numpy)


def _http_chunk(event: dict) -> TextChunk:
    return _text_chunk(event.get)


def _text_chunk(get) -> TextChunk:
    """From ``get(name)``: an output as an array (gRPC) or JSON value (HTTP), None when absent."""
    logprobs = _first(get, "logprobs", _as_text)
    return TextChunk(
        text=_first(get, "text_output", _as_text) or "",
        finish_reason=_first(get, "finish_reason", _as_text) or None,
        num_output_tokens=_first(get, "num_output_tokens", int),
        num_input_tokens=_first(get, "num_input_tokens", int),
        cumulative_logprob=_first(get, "cumulative_logprob", float),
        logprobs=None if logprobs is None else json.loads(logprobs),
    )


def _first(get, name: str, kind):
    """The first element of output ``name`` as ``kind``, None when the response lacks it."""
    value = get(name)
    return None if value is None else kind(np.ravel(value)[0])


def _bytes_input(module, name: str, values: list[str | bytes]):
    """A BYTES tensor of texts (UTF-8) or files (as they are: input images)."""
    if not isinstance(values, list | tuple | np.ndarray) or not all(isinstance(v, str | bytes) for v in values):
        raise InputValueError(name, f"takes text or a list of texts or files, not {values!r:.80}")
    tensor = module.InferInput(name, [len(values)], "BYTES")
    tensor.set_data_from_numpy(np.array([v if isinstance(v, bytes) else v.encode() for v in values],
                                        dtype=np.object_))
    return tensor


# Triton's answer to a request naming a region it does not know (NOT_FOUND; registering: INVALID_ARG)
_FORGOTTEN_REGION = re.compile(r"unable to find (system )?shared memory region", re.IGNORECASE)


class _Sessions:
    """An ``OmniClient``'s shared memory sessions: each a set of kept ``Regions`` and, over gRPC, a
    kept client (its channel), lent to one call at a time and taken back when the call succeeds,
    so there are as many as calls were ever in flight at once. A call that fails gives its
    session's regions back to the server and drops it: the server may still write into an
    abandoned output region. HTTP's client is made per call (gevent's sockets stay on the thread
    that made them)."""

    def __init__(self, url: str, protocol: Protocol) -> None:
        self.url, self.protocol = url, protocol
        self._idle: list[tuple[object | None, Regions]] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def session(self, headers: dict[str, str] | None) -> Iterator[tuple[object, Regions]]:
        with self._lock:
            idle = self._idle.pop() if self._idle else None
        kept, regions = idle if idle is not None else (self._kept_client(), Regions(headers))
        client = self._client(kept)
        try:
            yield client, regions
        except BaseException:
            regions.close(client)
            client.close()
            raise
        if kept is None:
            client.close()
        with self._lock:
            self._idle.append((kept, regions))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for kept, regions in idle:
            client = self._client(kept)
            with contextlib.suppress(Exception):
                regions.close(client)
            client.close()

    def _kept_client(self):
        """A new session's own client: gRPC's, kept with it; none for HTTP's (made per call)."""
        return _client_module("grpc").InferenceServerClient(self.url) if self.protocol == "grpc" else None

    def _client(self, kept):
        return kept if kept is not None else _client_module(self.protocol).InferenceServerClient(self.url)


def _client_module(protocol: Protocol):
    if protocol == "http":
        import tritonclient.http as module
    else:
        import tritonclient.grpc as module
    return module


_GRPC_STATUS = {
    "StatusCode.INVALID_ARGUMENT": "INVALID_ARG",
    "StatusCode.UNAVAILABLE": "UNAVAILABLE",
    "StatusCode.CANCELLED": "CANCELLED",
    "StatusCode.INTERNAL": "INTERNAL",
    "StatusCode.NOT_FOUND": "NOT_FOUND",
}


# On a gRPC stream Triton sends errors without a status code. This project's
# backends tag their messages ("[INVALID_ARG] ...", triton_omni_protocol.status);
# Triton's own input checks (dtype, shape, required inputs) reject a request
# before it reaches a backend, untagged: they are INVALID_ARG too.
_CORE_INPUT_ERRORS = re.compile(
    r"data-type is '\w+', but model|unexpected shape for input|expected \d+ inputs but got"
    r"|unexpected inference input|missing required input"
)


def as_omni_error(exc) -> OmniError:
    status = exc.status() if hasattr(exc, "status") else None
    tagged, message = parse_status(exc.message() if hasattr(exc, "message") else str(exc))
    if status is not None:
        return OmniError(_GRPC_STATUS.get(str(status)) or _http_status(status), message)
    if tagged:
        return OmniError(tagged, message)
    return OmniError("INVALID_ARG" if _CORE_INPUT_ERRORS.search(message) else "UNKNOWN", message)


def _http_error(code, message: str) -> OmniError:
    """An HTTP error's ``OmniError``: the status the server's message is tagged with (once, not
    again in front of its tag), else the HTTP code's."""
    tagged, text = parse_status(message)
    return OmniError(tagged or _http_status(code), text)


def _http_status(code) -> str:
    return {"400": "INVALID_ARG", "503": "UNAVAILABLE", "499": "CANCELLED", "500": "INTERNAL"}.get(
        str(code), str(code))
