"""``/v1/images/generations`` and ``/v1/images/edits`` on the image models.

Which inputs a model takes follows from its config, read once per model:
an ensemble (``text_to_image``) takes ``text_input``, the ``omni`` scheduler
takes its own request and makes ``n`` images in one request, the
``diffusion`` stage takes ``prompt``. ``n`` images from a batched model are
``n`` requests sent together, so that Triton batches them; with a ``seed``,
image ``i`` uses ``seed + i``, and the same request always gives the same
images.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from typing import Any

import numpy as np
from PIL import Image

from triton_omni_gateway.errors import OpenAIError, model_not_found
from triton_omni_gateway.requests import ImageEditRequest, ImageRequest, table_options
from triton_omni_gateway.triton import Triton, first

NOT_MAKING = {"images": "not_an_image_model", "videos": "not_a_video_model"}  # a refusal's code, by what was asked
# a model's input -> the API's field: an error names the field the user sent
API_FIELDS = {"height": "size", "width": "size", "num_images": "n", "text_input": "prompt"}


class ImageModels:
    def __init__(self, triton: Triton, png_compress_level: int):
        self.triton = triton
        self.png_compress_level = png_compress_level
        self._kinds: dict[str, str] = {}

    async def kind(self, model: str, media: str = "images") -> str:
        """``ensemble`` | ``omni`` | ``diffusion``, from the model's config; another model is refused
        as not making ``media`` (what the request asked it for)."""
        if model not in self._kinds:
            try:
                config = (await self.triton.client.get_model_config(model, as_json=True))["config"]
            except Exception:
                raise model_not_found(model) from None
            backend = config.get("backend", "")
            if config.get("platform") == "ensemble":
                self._kinds[model] = "ensemble"
            elif backend == "omni_scheduler":
                self._kinds[model] = "omni"
            elif backend == "omni_diffusion":
                self._kinds[model] = "diffusion"
            else:
                raise OpenAIError(400, f"model '{model}' does not make {media} (try text_to_image, omni or "
                                  "diffusion)", param="model", code=NOT_MAKING[media])
        return self._kinds[model]

    async def generate(self, request: ImageRequest, inputs: list[bytes] | None = None) -> dict:
        """``n`` images; ``inputs``: the input image files of an edit (every kind takes them)."""
        kind = await self.kind(request.model)
        options = _options(request) | ({"images": inputs} if inputs else {})
        if kind == "omni":
            images, revised = await self._omni(request, options)
        else:
            # an absent negative prompt stays absent: it is not "" (docs/pipelines.md)
            prompt = {"text_input" if kind == "ensemble" else "prompt": request.prompt,
                      "negative_prompt": request.negative_prompt}
            images = await asyncio.gather(*(self._one(request.model, prompt | _seeded(options, i))
                                            for i in range(request.n)))
            revised = None
        # PNG encoding takes milliseconds per image: off the event loop, which keeps serving the other requests
        encoded = await asyncio.gather(*(asyncio.to_thread(png, image, self.png_compress_level) for image in images))
        return {"created": int(time.time()),
                "data": [{"b64_json": data} | ({"revised_prompt": revised} if revised else {}) for data in encoded]}

    async def edit(self, request: ImageEditRequest) -> dict:
        """``n`` images from the prompt and the input images: ``diffusion``, ``text_to_image`` or ``omni``."""
        return await self.generate(request, request.images)

    async def _one(self, model: str, values: dict[str, Any]) -> np.ndarray:
        try:
            result = await self.triton.infer(model, values)
        except OpenAIError as error:
            raise _in_api_terms(error) from None
        return result.as_numpy("image")[0]

    async def _omni(self, request: ImageRequest, options: dict[str, Any]) -> tuple[list[np.ndarray], str | None]:
        values = {"text_input": request.prompt, "modalities": ["image"], "stream": False, "num_images": request.n,
                  "negative_prompt": request.negative_prompt, "enhance_prompt": request.enhance_prompt, **options}
        images, revised = [], None
        try:
            # not streaming: one response, with every image
            async for result in self.triton.stream(request.model, values, lambda result: True):
                batch = result.as_numpy("image")
                if batch is not None:
                    images.extend(batch)
                revised = first(result, "enhanced_prompt") or revised
        except OpenAIError as error:
            raise _in_api_terms(error) from None
        return images, revised


def _options(request: ImageRequest) -> dict[str, Any]:
    values = table_options(request, video=False) | {"guidance_scale": request.guidance()}
    size = request.dimensions()
    if size is not None:
        values["width"], values["height"] = size
    return {key: value for key, value in values.items() if value is not None}


def _seeded(options: dict[str, Any], index: int) -> dict[str, Any]:
    return options | {"seed": options["seed"] + index} if "seed" in options else options


def _in_api_terms(error: OpenAIError) -> OpenAIError:
    """A model's refusal of ``height`` is the API's refusal of ``size``, of ``text_input`` of ``prompt``,
    of ``images[1]`` of ``image[1]`` (the form's files)."""
    param = error.param or ""
    field = API_FIELDS.get(param) or ("image" + param.removeprefix("images") if param.startswith("images") else None)
    if field is not None:
        error.message = f"{field}: {error.message}"
        error.param = field
    return error


def png(image: np.ndarray, compress_level: int) -> str:
    """The image as a base64 PNG file (lossless at every level; the level trades time for bytes)."""
    return base64.b64encode(png_bytes(image, compress_level)).decode()


def png_bytes(image: np.ndarray, compress_level: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=compress_level)
    return buffer.getvalue()
