"""Triton, as the gateway reaches it: one asyncio gRPC client for every request.

A streamed request is one gRPC stream; leaving its iterator early (the HTTP
client went away) cancels the stream, and Triton then cancels the request in
the model (the ``ar`` model counts it as ``outcome="cancelled"``).
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from triton_omni_client.client import as_omni_error, batched_inputs, omni_inputs
from triton_omni_protocol import InputValueError
from tritonclient.utils import InferenceServerException

from triton_omni_gateway.errors import from_triton, invalid

# gRPC waits longer and longer between attempts to reach a server that is down (up to 2 min by
# default): after tritonserver restarts, the gateway would answer 503 for that long. One second at most.
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


ADAPTERS_TTL_S = 10.0


class Triton:
    def __init__(self, url: str):
        self.url = url
        self._client: aioclient.InferenceServerClient | None = None
        self._adapters: tuple[float, dict[str, str]] | None = None  # (when read, adapters)

    @property
    def client(self) -> aioclient.InferenceServerClient:
        if self._client is None:  # made on the server's event loop, at the first request
            self._client = aioclient.InferenceServerClient(self.url, channel_args=CHANNEL_ARGS)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def ready(self) -> bool:
        try:
            return await self.client.is_server_ready(client_timeout=2)
        except InferenceServerException:
            return False

    async def models(self) -> list[str]:
        """The models Triton serves now, by name: those it keeps statistics for (the repository
        index would say the same, but it is an admin API, closed to the gateway)."""
        try:
            statistics = await self.client.get_inference_statistics(as_json=True, client_timeout=5)
        except InferenceServerException as error:
            raise from_triton(as_omni_error(error), "") from None
        return sorted({m["name"] for m in statistics.get("model_stats", [])})

    async def adapters(self) -> dict[str, str]:
        """The LoRA adapters of the text models Triton serves: adapter name -> its model (the
        ``lora_adapters`` parameter of an ``ar`` model's config). As vLLM's server does, each is a
        model of its own to ``/v1/models`` and to a chat or completion request's ``model``. Read
        again at most every ``ADAPTERS_TTL_S``: every text request asks, and a model's
        configuration changes only when it is loaded again."""
        now = time.monotonic()
        if self._adapters is None or now - self._adapters[0] > ADAPTERS_TTL_S:
            self._adapters = (now, await self._read_adapters())
        return self._adapters[1]

    async def _read_adapters(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for model in await self.models():
            config = await self.config(model)  # {} for a model unloaded meanwhile: not omni_ar
            parameters = string_parameters(config)
            if config.get("backend") != "omni_ar" or parameters.get("mode", "generate") != "generate":
                continue
            try:
                names = json.loads(parameters.get("lora_adapters") or "{}")
            except json.JSONDecodeError:
                continue
            for name in names:
                found.setdefault(name, model)
        return found

    async def config(self, model: str) -> dict[str, Any]:
        """``model``'s configuration ({} where Triton serves no such model)."""
        try:
            return (await self.client.get_model_config(model, as_json=True))["config"]
        except InferenceServerException:
            return {}

    async def backend(self, model: str) -> str | None:
        """The backend serving ``model`` (``omni_speech``, ...; ``ensemble`` for an ensemble), or None
        where Triton serves no such model."""
        config = await self.config(model)
        return "ensemble" if config.get("platform") == "ensemble" else config.get("backend") or None

    async def parameters(self, model: str) -> dict[str, str]:
        """The ``parameters`` of ``model``'s configuration, as strings ({} where Triton gives none)."""
        return string_parameters(await self.config(model))

    async def infer(self, model: str, values: dict[str, Any]) -> grpcclient.InferResult:
        """One request to a batched model (``text_to_image``, ``diffusion``), batch dimension 1."""
        try:
            inputs = batched_inputs(grpcclient, **values)
        except InputValueError as error:  # the request's validation let through what its tensor cannot hold
            raise invalid(error.name, str(error).removeprefix(f"{error.name}: ")) from None
        try:
            return await self.client.infer(model, inputs)
        except InferenceServerException as error:
            raise from_triton(as_omni_error(error), model) from None

    async def stream(self, model: str, values: dict[str, Any],
                     is_last: Callable[[grpcclient.InferResult], bool]) -> AsyncIterator[grpcclient.InferResult]:
        """The responses of one request to a decoupled model (``ar``, ``omni``), up to the final one:
        Triton flags it, or ``is_last`` says so. (A final response without outputs would never
        arrive: asking for it, ``enable_empty_final_response``, is a ``triton_`` request parameter,
        which the asyncio client refuses; ``is_last`` knows the model's last response instead.)"""
        answered = asyncio.Event()
        try:
            inputs = omni_inputs(grpcclient, values)
        except InputValueError as error:
            raise invalid(error.name, str(error).removeprefix(f"{error.name}: ")) from None

        async def one_request():
            yield {"model_name": model, "inputs": inputs}
            await answered.wait()  # the stream stays open until the answer is in

        responses = self.client.stream_infer(one_request())
        last = False
        try:
            async for result, error in responses:
                if error is not None:
                    last = True
                    raise from_triton(as_omni_error(error), model)
                last = result.get_response().parameters["triton_final_response"].bool_param or is_last(result)
                yield result
                if last:
                    return
        except InferenceServerException as error:
            last = True
            raise from_triton(as_omni_error(error), model) from None
        finally:
            answered.set()
            if not last:  # the caller left early: Triton cancels the request
                responses.cancel()


def first(result: grpcclient.InferResult, name: str) -> Any:
    """The first element of output ``name`` (text decoded), None when the response lacks it."""
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return None
    value = np.ravel(array)[0]
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value.item()


NUMERIC = {"UINT32": "<u4", "INT32": "<i4", "INT64": "<i8", "FP32": "<f4", "BOOL": "?"}


# read with as_numpy, where they are wanted: never as a list of floats
LARGE_OUTPUTS = {"heard_states", "thinker_states"}


def outputs(result: grpcclient.InferResult) -> dict[str, list[Any]]:
    """Every output of a small response as a flat list (text decoded), read from the raw bytes;
    a large one (``LARGE_OUTPUTS``) only named, its value None.

    What a streamed token costs in the gateway: ``as_numpy`` for each output
    took several times as long as this one pass over the response."""
    response = result.get_response()
    found = {}
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        if output.name in LARGE_OUTPUTS:
            found[output.name] = None
        elif output.datatype == "BYTES":
            found[output.name] = _strings(raw)
        else:
            found[output.name] = np.frombuffer(raw, dtype=NUMERIC[output.datatype]).tolist()
    return found


def _strings(raw: bytes) -> list[str]:
    """Triton's BYTES layout: each element a 4-byte little-endian length, then the bytes."""
    values, offset = [], 0
    while offset < len(raw):
        (length,) = struct.unpack_from("<I", raw, offset)
        values.append(raw[offset + 4:offset + 4 + length].decode("utf-8", errors="replace"))
        offset += 4 + length
    return values


def string_parameters(config: dict[str, Any]) -> dict[str, str]:
    """A model configuration's ``parameters``, as strings."""
    return {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}
