"""The gateway's routes: OpenAI's paths, each a few lines over ``images.py`` and ``text.py``."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from triton_omni_client.video import PRESET, PRESETS

from triton_omni_gateway import responses
from triton_omni_gateway.audio import (
    MEDIA_TYPES,
    SPEECH_BACKEND,
    SPEECH_MODEL,
    Voices,
    encoded,
    no_speech_model,
    read_as_thinker,
    reads_states,
    speak,
    spoken_chat,
    sse,
)
from triton_omni_gateway.audio import whole as whole_audio
from triton_omni_gateway.errors import ERROR_TYPES, OpenAIError, invalid, model_not_found
from triton_omni_gateway.images import ImageModels
from triton_omni_gateway.metrics import GatewayMetrics
from triton_omni_gateway.requests import (
    ChatRequest,
    CompletionRequest,
    ImageRequest,
    ResponsesRequest,
    SpeechRequest,
    parse,
    parse_edit,
    parse_video_form,
    parse_video_json,
)
from triton_omni_gateway.templates import ChatTemplates
from triton_omni_gateway.text import chat_endpoint, completion_endpoint, deltas, events, joined, whole
from triton_omni_gateway.triton import Triton
from triton_omni_gateway.videos import VideoJobs

logger = logging.getLogger("triton_omni_gateway")
API_KEY_ENV = "TRITON_OMNI_API_KEY"
SETTINGS_ENV = "TRITON_OMNI_GATEWAY_SETTINGS"  # how the worker processes get their settings


@dataclass
class GatewaySettings:
    triton_url: str = "localhost:8001"  # Triton's gRPC endpoint
    api_key: str | None = None  # None: $TRITON_OMNI_API_KEY, and no key at all when that is unset too
    tokenizers: dict[str, str] = field(default_factory=dict)  # text model -> its tokenizer (chat templates)
    max_body_bytes: int = 4 * 2**20
    max_upload_bytes: int = 64 * 2**20  # /v1/images/edits: the images ride in the body
    # the images' PNG deflate level (0 to 9): a client waits for the encoding, and on photographs
    # level 1 encodes about twice as fast as zlib's usual 6 for some 15 % more bytes
    png_compress_level: int = 1
    workers: int = 1  # the processes answering (``--workers``): video jobs need one, whose memory holds them
    max_video_jobs: int = 32  # /v1/videos: jobs held at once (running and finished)
    video_keep_s: float = 3600.0  # a finished video is kept this long (or until deleted)
    video_preset: str = PRESET  # x264's speed preset for the MP4s (triton_omni_client.video: why this one)

    def __post_init__(self):
        if not 0 <= self.png_compress_level <= 9:
            raise ValueError(f"png_compress_level must be 0 to 9, got {self.png_compress_level}")
        if self.video_preset not in PRESETS:
            raise ValueError(f"video_preset must be one of x264's: {', '.join(PRESETS)}; got {self.video_preset!r}")

    @property
    def key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None


def app_from_environment() -> FastAPI:
    """The app of one worker process, its settings from ``$TRITON_OMNI_GATEWAY_SETTINGS`` (``__main__``)."""
    return create_app(GatewaySettings(**json.loads(os.environ[SETTINGS_ENV])))


def create_app(settings: GatewaySettings) -> FastAPI:
    triton = Triton(settings.triton_url)
    images = ImageModels(triton, settings.png_compress_level)
    videos = VideoJobs(images, settings.max_video_jobs, settings.video_keep_s, settings.video_preset)
    templates = ChatTemplates(settings.tokenizers)
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app):
        yield
        videos.close()
        await triton.close()

    app = FastAPI(title="triton-omni OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)

    async def body_of(request: Request, kind) -> Any:
        """The request, authorized and parsed; a body past the size limit is refused unread."""
        authorize(request, settings.key)
        return parse(kind, await raw_body(request, settings.max_body_bytes))

    async def raw_body(request: Request, limit: int) -> bytes:
        """The body, read up to ``limit`` bytes (past it: a 413, the rest unread)."""
        size = 0
        chunks = []
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise OpenAIError(413, f"The body is larger than {limit} bytes",
                                  code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def primed(stream: AsyncIterator) -> AsyncIterator:
        """``stream`` with its first item already come: that comes before the status line, so a
        refused request is a 4xx, not an event or a broken stream. Iterate what this returns; close
        ``stream`` itself (the response's background task), which closes the request upstream."""
        first = await anext(stream)

        async def replayed():
            yield first
            async for item in stream:
                yield item

        return replayed()

    async def unless_disconnected(request: Request, work: Awaitable) -> Any:
        """``work``, cancelled (and its Triton request with it) if the client goes away first."""
        task = asyncio.ensure_future(work)

        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            return await task
        finally:
            watcher.cancel()

    @app.post("/v1/images/generations")
    async def generate_images(request: Request):
        body = await body_of(request, ImageRequest)
        return await unless_disconnected(request, images.generate(body))

    @app.post("/v1/images/edits")
    async def edit_images(request: Request):
        """multipart/form-data: read whole within the body limit, then parsed as a form."""
        authorize(request, settings.key)
        # more files than a model takes reach the model, which names its limit
        body = await form_of(request, parse_edit, 16, "multipart/form-data with the image files")
        return await unless_disconnected(request, images.edit(body))

    async def form_of(request: Request, parse, max_files: int, what: str):
        """A multipart/form-data body, read whole within the upload limit, parsed by ``parse`` (its
        files closed after); one that is not multipart, or is malformed, is a 400 saying it is not
        ``what``."""
        request._body = await raw_body(request, settings.max_upload_bytes)  # the form parser reads it from here
        try:
            form = await request.form(max_files=max_files, max_fields=64)
        except Exception as error:  # Starlette's and python-multipart's own errors
            raise OpenAIError(400, f"The body is not {what}: {error}", code="invalid_multipart") from None
        try:
            return await parse(form)
        finally:
            await form.close()

    def video_jobs(request: Request) -> VideoJobs:
        """The jobs, for an authorized request to a gateway of one process (they live in its memory)."""
        authorize(request, settings.key)
        if settings.workers > 1:
            raise OpenAIError(501, f"video jobs live in one process's memory, and this gateway runs {settings.workers} "
                              "worker processes: serve /v1/videos from a gateway with --workers 1",
                              code="video_jobs_need_one_worker")
        return videos

    @app.post("/v1/videos")
    async def create_video(request: Request):
        """JSON, or multipart/form-data as the ``openai`` SDK sends it (``input_reference``: a file)."""
        jobs = video_jobs(request)
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            return await jobs.create(parse_video_json(await raw_body(request, settings.max_body_bytes)))
        return await jobs.create(await form_of(request, parse_video_form, 1, "valid multipart/form-data"))

    @app.get("/v1/videos")
    async def list_videos(request: Request):
        jobs, query = video_jobs(request), request.query_params
        limit = query.get("limit", "20")
        if not (limit.isascii() and limit.isdecimal()):
            raise OpenAIError(400, f"limit: must be a whole number, got {limit!r:.40}", param="limit",
                              code="invalid_value")
        return jobs.list(query.get("after"), int(limit), query.get("order", "desc"))

    @app.get("/v1/videos/{video_id}")
    async def retrieve_video(request: Request, video_id: str):
        return video_jobs(request).retrieve(video_id)

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(request: Request, video_id: str):
        return await video_jobs(request).delete(video_id)

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(request: Request, video_id: str):
        content, media_type = await video_jobs(request).content(video_id, request.query_params.get("variant", "video"))
        return Response(content, media_type=media_type)

    async def chat_prompt(name: str, model: str, messages: list[dict]) -> str:
        """``messages`` in the chat template of ``model`` (which the request named ``name``)."""
        try:
            return await templates.render(model, messages)
        except OpenAIError as error:
            if error.param == "model" and model not in await triton.models():
                raise model_not_found(name) from None
            raise

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request, ChatRequest)
        model, adapter = await served_by(body.model)
        prompt = await chat_prompt(body.model, model, body.chat())
        if body.speaks:
            return await spoken_response(request, body, prompt, model)
        return await text_response(request, body, chat_endpoint(body), prompt, model, adapter, body.audio_clips(),
                                   body.image_files())

    async def spoken_response(request: Request, body: ChatRequest, prompt: str, model: str):
        if SPEECH_MODEL not in await triton.models():
            raise no_speech_model(body.model)
        answer = spoken_chat(triton, model, prompt, body.sampling(), body.audio.voice, body.audio.format, body.stream,
                             body.talker.values() if body.talker else {}, audio=body.audio_clips(),
                             states=reads_states(templates.paths.get(SPEECH_MODEL)), images=body.image_files())
        try:
            if not body.stream:
                return await unless_disconnected(request, answer)
            events, close = await answer
        except OpenAIError as error:
            if error.param == "return_heard_states":  # the thinker's engine keeps its states to itself
                raise invalid((body.audio_parts() or body.image_parts())[0], "a spoken reply to audio or images "
                              "needs the thinker's hidden states at them, which this model's engine does not hand "
                              "on (a thinker served with engine: transformers does)") from None
            raise part_named(error, body) from None
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(close))

    @app.post("/v1/audio/speech")
    async def create_speech(request: Request):
        """``input`` spoken: the file whole, or streamed as it is made (``stream_format``: the bytes as
        they come, or ``sse`` events)."""
        body = await body_of(request, SpeechRequest)
        if await triton.backend(body.model) != SPEECH_BACKEND:  # a text or image model, or none: say which speak
            raise no_speech_model(body.model, [name for name in await triton.models()
                                               if await triton.backend(name) == SPEECH_BACKEND])
        tokenizer = await templates.tokenizer(body.model)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": body.input}], tokenize=False,
                                               add_generation_prompt=True)
        talker = body.talker.values() if body.talker else None
        if reads_states(templates.paths.get(body.model)):  # its talker reads the thinker's states at the input
            prompt_ids, reply, states = await read_as_thinker(triton, await thinker_of(body.model), prompt, body.input,
                                                              tokenizer)
            chunks = speak(triton, prompt, reply, body.voice, body.model, talker, states=(prompt_ids, states))
        else:
            reply = tokenizer(body.input, add_special_tokens=False)["input_ids"] + [
                tokenizer.convert_tokens_to_ids("<|im_end|>")]  # the end of the reply, as a thinker ends it
            chunks = speak(triton, prompt, reply, body.voice, body.model, talker)
        media_type = MEDIA_TYPES[body.response_format]
        if body.stream_format is None:
            return Response(await unless_disconnected(request, whole_audio(chunks, body.response_format)),
                            media_type=media_type)
        stream = encoded(chunks, body.response_format)
        replayed = await primed(stream)
        if body.stream_format == "sse":
            return StreamingResponse(sse(replayed), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"}, background=BackgroundTask(stream.aclose))
        return StreamingResponse(replayed, media_type=media_type, background=BackgroundTask(stream.aclose))

    @app.get("/v1/audio/voices")
    async def voices(request: Request):
        """The speech model's own voices (its talker's speakers)."""
        authorize(request, settings.key)
        return {"voices": Voices(templates.paths.get(SPEECH_MODEL)).names()}

    @app.post("/v1/responses")
    async def create_response(request: Request):
        """OpenAI's Responses API on a text model (``responses.py``)."""
        body = await body_of(request, ResponsesRequest)
        model, adapter = await served_by(body.model)
        prompt = await chat_prompt(body.model, model, body.chat())
        stream = deltas(triton, model, prompt, body.sampling() | ({"lora_name": adapter} if adapter else {}))
        if not body.stream:
            return await unless_disconnected(request, responses.whole(body, stream))
        return StreamingResponse(responses.events(body, await primed(stream)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=BackgroundTask(stream.aclose))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str):
        authorize(request, settings.key)
        raise OpenAIError(404, f"No response with id '{response_id:.64}': this gateway keeps no responses",
                          param="response_id", code="response_not_found")

    @app.post("/v1/completions")
    async def complete(request: Request):
        body = await body_of(request, CompletionRequest)
        return await text_response(request, body, completion_endpoint(body), body.texts(),
                                   *await served_by(body.model))

    def part_named(error: OpenAIError, body) -> OpenAIError:
        """``ar``'s refusal of a clip (``input_audio[i]``) or an image (``images[i]``) named by the
        chat's part it came from."""
        part = body.part_of(error.param) if isinstance(body, ChatRequest) else None
        if part is None:
            return error
        return OpenAIError(error.status, error.message.replace(f"`{error.param}`", f"`{part}`"), param=part,
                           code=error.code)

    async def thinker_of(speech_model: str) -> str:
        """The text model serving the same checkpoint as ``speech_model`` (its thinker): one served
        with ``engine: transformers`` where there is one, the engine that hands on the states its
        talker reads (another's refusal, by name, is the answer where there is none)."""
        folder = templates.paths.get(speech_model)
        serving = [name for name, path in templates.paths.items() if name != speech_model and path == folder]
        if not serving:
            raise OpenAIError(400, f"model '{speech_model}' reads its thinker's states, and this gateway knows no "
                              "text model serving its checkpoint", param="model", code="model_not_found")
        for name in serving:
            if (await triton.parameters(name)).get("engine") == "transformers":
                return name
        return serving[0]

    async def served_by(name: str) -> tuple[str, str | None]:
        """(the Triton model, the LoRA adapter or None) a request's ``model`` names: an adapter of a
        model (vLLM's convention: an adapter is a model of its own), else a model."""
        base = (await triton.adapters()).get(name)
        return (name, None) if base is None else (base, name)

    async def text_response(request: Request, body, endpoint, prompt: str | list[str], model: str,
                            adapter: str | None, audio: list[bytes] | None = None, images: list[bytes] | None = None):
        """``prompt``: one, or a completion's several (``joined``: their choices one after the other)."""
        sampling = body.sampling() | ({"lora_name": adapter} if adapter else {})
        prompts = [prompt] if isinstance(prompt, str) else prompt
        streams = [deltas(triton, model, text, sampling, audio=audio, images=images) for text in prompts]
        stream, choices = (streams[0], body.n) if len(streams) == 1 else (joined(streams, body.n),
                                                                          len(streams) * body.n)
        try:
            if not body.stream:
                return await unless_disconnected(request, whole(endpoint, body.model, stream, choices))
            replayed = await primed(stream)
        except OpenAIError as error:
            raise part_named(error, body) from None
        # A client that leaves mid-stream: Starlette stops iterating the events where they stand, each
        # generator suspended, and nothing would close Triton's stream until the garbage collector found
        # them (the model meanwhile generating on). The background task runs after a disconnect too.
        return StreamingResponse(events(endpoint, body.model, replayed, choices, body.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(stream.aclose))

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request, settings.key)
        adapters = await triton.adapters()
        return {"object": "list", "data": [_model(name) for name in await triton.models()] +
                [_model(name, parent) for name, parent in adapters.items()]}

    @app.get("/v1/models/{name}")
    async def model(request: Request, name: str):
        authorize(request, settings.key)
        if name in await triton.models():
            return _model(name)
        parent = (await triton.adapters()).get(name)
        if parent is None:
            raise model_not_found(name)
        return _model(name, parent)

    @app.get("/health")
    async def health():
        """Triton's readiness, as a load balancer or a Kubernetes probe reads it."""
        if await triton.ready():
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError):
        if error.status == 404 and error.param == "model" and not await triton.ready():
            error = OpenAIError(503, "Triton is not ready (starting or restarting); try again shortly",
                                code="not_ready")
        metrics.error(request.url.path, ERROR_TYPES.get(error.status, "server_error"))
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        message = "Unknown path" if error.status_code == 404 else str(error.detail)
        return await openai_error(request, OpenAIError(error.status_code, f"{message}: {request.method} "
                                                       f"{request.url.path}", code="unknown_path"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        logger.exception("unexpected failure answering %s", request.url.path)
        return await openai_error(request, OpenAIError(500, f"internal error: {type(error).__name__}"))

    app.add_middleware(_Measured, metrics=metrics)
    return app


class _Measured:
    """The metrics middleware, in the shape ``add_middleware`` takes."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.measured = metrics.middleware(app)

    async def __call__(self, scope, receive, send):
        await self.measured(scope, receive, send)


def authorize(request: Request, key: str | None) -> None:
    if key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise OpenAIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                          code="invalid_api_key")


def _model(name: str, parent: str | None = None) -> dict:
    """A model's entry; an adapter's names its model as ``parent`` (vLLM's field)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "triton-omni"} | \
        ({"parent": parent, "root": name} if parent else {})
