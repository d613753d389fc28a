"""``/v1/videos``: OpenAI's video jobs over a video model (``text_to_image``, ``diffusion`` or
``omni`` serving a video family).

A job is a task on the gateway's event loop that asks Triton for the video and keeps its frames;
``create`` answers at once (``queued``), the client polls ``retrieve`` (the ``openai`` SDK's
``create_and_poll``) and fetches ``content``: an MP4 (H.264, encoded once, from the moment the
frames arrive, so that the encode runs while the client is between polls), its
first frame as a PNG (``thumbnail``), or the frames as served, losslessly (``frames``: a NumPy
``.npy`` file, this gateway's extension). Jobs live in this process's memory: at most ``max_jobs``
at once, and a finished one is kept for ``keep_s`` after it ends (or until deleted); a restart
loses them all. Deleting a running job cancels its Triton request, which frees its rows in the
diffusion model's step engine at the next step.

What is checked before the job starts (the body, ``size``, ``seconds``) is a 400; what only the
model can judge (a frame count its VAE cannot take, ``seconds`` and ``num_frames`` that disagree,
an ``input_reference`` given to a text-only model) fails the job, with OpenAI's error object in the
video's ``error``, naming the field."""

from __future__ import annotations

import asyncio
import io
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from triton_omni_client.video import PRESET, encode_mp4

from triton_omni_gateway.errors import OpenAIError
from triton_omni_gateway.images import ImageModels, png_bytes
from triton_omni_gateway.requests import VideoRequest, dimensions, table_options

logger = logging.getLogger("triton_omni_gateway")
# a model's input -> the API's field, where they differ: an error names the field the user sent
VIDEO_FIELDS = {"height": "size", "width": "size", "text_input": "prompt", "images": "input_reference",
                "images[0]": "input_reference", "image": "input_reference"}
MAX_LIST = 100  # `limit` of a list, at most (OpenAI's)
VARIANTS = ("video", "thumbnail", "frames")


@dataclass
class VideoJob:
    id: str
    model: str
    prompt: str
    size: str
    seconds: str
    created_at: int
    status: str = "queued"  # queued | in_progress | completed | failed
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict | None = None
    frames: np.ndarray | None = None  # [F, H, W, 3] uint8, once completed
    fps: float | None = None
    mp4: asyncio.Future | None = None  # its MP4's bytes: encoded once, as the frames arrive
    task: asyncio.Task | None = field(default=None, repr=False)

    def body(self) -> dict[str, Any]:
        """OpenAI's Video object."""
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": self.expires_at, "prompt": self.prompt, "seconds": self.seconds, "size": self.size,
                "error": self.error, "remixed_from_video_id": None}


class VideoJobs:
    def __init__(self, images: ImageModels, max_jobs: int = 32, keep_s: float = 3600.0, preset: str = PRESET):
        self.images, self.triton = images, images.triton
        self.max_jobs, self.keep_s, self.preset = max_jobs, keep_s, preset
        self._jobs: dict[str, VideoJob] = {}  # in creation order

    async def create(self, request: VideoRequest) -> dict:
        values = self._values(request)
        kind = await self.images.kind(request.model, "videos")
        self._expire()
        if len(self._jobs) >= self.max_jobs:
            raise OpenAIError(429, f"this gateway keeps at most {self.max_jobs} video jobs and holds as many: "
                              "delete finished ones (DELETE /v1/videos/{id}) or wait for them to expire",
                              code="too_many_video_jobs")
        size = request.size or "auto"
        job = VideoJob(f"video_{secrets.token_hex(12)}", request.model, request.prompt, size,
                       "" if request.seconds is None else str(request.seconds), int(time.time()))
        self._jobs[job.id] = job
        job.task = asyncio.create_task(self._run(job, kind, values))
        return job.body()

    def retrieve(self, video_id: str) -> dict:
        return self._job(video_id).body()

    def list(self, after: str | None, limit: int, order: str) -> dict:
        self._expire()
        if not 1 <= limit <= MAX_LIST:
            raise OpenAIError(400, f"limit: must be 1 to {MAX_LIST}, got {limit}", param="limit",
                              code="invalid_value")
        if order not in ("asc", "desc"):
            raise OpenAIError(400, f"order: must be asc or desc, got {order!r}", param="order", code="invalid_value")
        jobs = list(self._jobs.values()) if order == "asc" else list(reversed(self._jobs.values()))
        if after is not None:
            ids = [job.id for job in jobs]
            if after not in ids:
                raise OpenAIError(400, f"after: no video {after!r} (deleted or expired?)", param="after",
                                  code="invalid_value")
            jobs = jobs[ids.index(after) + 1:]
        page = jobs[:limit]
        return {"object": "list", "data": [job.body() for job in page], "has_more": len(jobs) > limit,
                "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}

    async def delete(self, video_id: str) -> dict:
        """The job forgotten; a running one's Triton request cancelled (its rows freed at the next step)."""
        job = self._job(video_id)
        del self._jobs[video_id]
        if job.task is not None and not job.task.done():
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    async def content(self, video_id: str, variant: str) -> tuple[bytes, str]:
        """(the file, its media type): ``video`` an MP4, ``thumbnail`` the first frame as a PNG,
        ``frames`` the frames as served (``.npy``)."""
        if variant not in VARIANTS:
            raise OpenAIError(400, f"variant: must be {', '.join(VARIANTS)} (frames: this gateway's lossless "
                              f"extension), got {variant!r:.40}", param="variant", code="invalid_value")
        job = self._job(video_id)
        if job.status != "completed":
            raise OpenAIError(400, f"video {video_id} is {job.status}: its content is there once it is completed",
                              param="video_id", code="video_not_ready")
        # each off the event loop: an 81-frame video is about 100 MB of pixels
        if variant == "video":
            return await asyncio.shield(job.mp4), "video/mp4"
        if variant == "thumbnail":
            return await asyncio.to_thread(png_bytes, job.frames[0], self.images.png_compress_level), "image/png"
        return await asyncio.to_thread(npy, job.frames), "application/x-npy"

    def close(self) -> None:
        for job in self._jobs.values():
            if job.task is not None:
                job.task.cancel()

    # -- the job -------------------------------------------------------------------------

    def _values(self, request: VideoRequest) -> dict[str, Any]:
        """The model's inputs (checked here where they can be: ``size``, ``seconds``)."""
        values = table_options(request, video=True) | {"seconds": request.length()}
        size = dimensions(request.size)
        if size is not None:
            values["width"], values["height"] = size
        if request.input_reference is not None:
            values["images"] = [request.input_reference]
        return {"prompt": request.prompt} | {key: value for key, value in values.items() if value is not None}

    async def _run(self, job: VideoJob, kind: str, values: dict[str, Any]) -> None:
        """The job, ended ``completed`` or ``failed`` whatever happens (but a delete's cancellation,
        which has forgotten it already)."""
        job.status = "in_progress"
        try:
            frames, fps = await self._generate(job.model, kind, values, job)
            count, height, width, _ = frames.shape
            job.size, job.seconds = f"{width}x{height}", f"{(count - 1) / fps:g}"
            job.frames, job.fps, job.progress = frames, fps, 100
            job.mp4 = asyncio.ensure_future(asyncio.to_thread(encode_mp4, frames, fps, preset=self.preset))
            self._end(job, "completed")
        except OpenAIError as error:
            error = _in_video_terms(error)
            job.error = {"code": error.code or "failed", "message": error.message, "param": error.param}
            self._end(job, "failed")
        except Exception as error:  # a job fails alone, and says why
            logger.exception("video job %s failed", job.id)
            job.error = {"code": "internal_error", "message": f"internal error: {type(error).__name__}"}
            self._end(job, "failed")

    def _end(self, job: VideoJob, status: str) -> None:
        job.status, job.completed_at = status, int(time.time())
        job.expires_at = job.completed_at + int(self.keep_s)

    async def _generate(self, model: str, kind: str, values: dict[str, Any],
                        job: VideoJob) -> tuple[np.ndarray, float]:
        """The frames and their rate; through ``omni``, the job's ``progress`` follows its denoising
        steps (an ensemble's or a batched model's answer comes whole: 0, then 100)."""
        prompt = values.pop("prompt")
        if kind == "omni":
            # streamed: a response per denoising step, then the video (or an image model's image)
            request = {"text_input": prompt, "modalities": ["video"], "stream": True, **values}
            async for result in self.triton.stream(model, request, _media_made):
                video = result.as_numpy("video")
                if video is not None:
                    return _shaped(video, result.as_numpy("video_shape"))[0], float(result.as_numpy("fps").ravel()[0])
                job.progress = max(job.progress, _progress(result))
            raise OpenAIError(400, f"model '{model}' makes images, not videos: use /v1/images/generations",
                              param="model", code="not_a_video_model")
        request = {"text_input" if kind == "ensemble" else "prompt": prompt, **values}
        result = await self.triton.infer(model, request)
        video = result.as_numpy("video")
        if video is None:
            raise OpenAIError(400, f"model '{model}' makes images, not videos: use /v1/images/generations",
                              param="model", code="not_a_video_model")
        return video[0], float(result.as_numpy("fps").ravel()[0])

    def _job(self, video_id: str) -> VideoJob:
        self._expire()
        job = self._jobs.get(video_id)
        if job is None:
            raise OpenAIError(404, f"No video with id '{video_id}' (never created, deleted, or expired)",
                              param="video_id", code="video_not_found")
        return job

    def _expire(self) -> None:
        now = time.time()
        for video_id in [i for i, job in self._jobs.items() if job.expires_at is not None and job.expires_at <= now]:
            del self._jobs[video_id]


def _media_made(result) -> bool:
    """``omni``'s last response to a streamed video request: the video, or an image model's image."""
    return result.as_numpy("video") is not None or result.as_numpy("image") is not None


def _progress(result) -> int:
    """An ``omni`` progress event's share of the denoising in percent, below 100 (that is the
    finished video's); 0 for any other event."""
    stage, step, total = (result.as_numpy(name) for name in ("stage", "step", "total_steps"))
    if stage is None or step is None or total is None or stage.ravel()[0] != b"diffusion":
        return 0
    return min(99, int(100 * int(step.ravel()[0]) / max(1, int(total.ravel()[0]))))


def npy(frames: np.ndarray) -> bytes:
    """The frames as a NumPy ``.npy`` file: ``numpy.load`` reads them back as they were served."""
    buffer = io.BytesIO()
    np.save(buffer, frames)
    return buffer.getvalue()


def _shaped(array: np.ndarray, shape: np.ndarray | None) -> np.ndarray:
    return array if shape is None else array.reshape([int(n) for n in shape.ravel()])


def _in_video_terms(error: OpenAIError) -> OpenAIError:
    """A model's refusal of ``height`` is the API's of ``size``, of ``images`` of ``input_reference``."""
    field_name = VIDEO_FIELDS.get(error.param or "")
    if field_name is None:
        return error
    error.message = f"{field_name}: {error.message}"
    error.param = field_name
    return error
