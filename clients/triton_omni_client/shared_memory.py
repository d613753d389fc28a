"""Arrays in and out through system shared memory, for a client on the server's own host.

A prompt's embeddings are megabytes (FLUX's 512 x 4096 float32: 8 MB) and so is the image that
comes back (1024² RGB: 3 MB); in the request and response bodies, gRPC's Python serialization and
the server's copies cost tens of milliseconds a request, which a few-step image cannot hide.
Through a shared memory region the messages carry only the region's name: Triton's own mechanism
(``perf_analyzer --shared-memory system`` measures it the same way).

``Regions`` holds one region per tensor and keeps it registered from one call to the next:
registering and unregistering a call's regions are four more requests to the server, which cost
a few-step image more than the copies do. A ``Regions`` serves one call at a time (``OmniClient``
gives each concurrent call its own); ``system_regions`` is the same for the length of one block.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator

import numpy as np


class Regions:
    """Registered regions, one per input and one per output tensor, each grown (replaced by a
    larger one) when a call needs more than it holds. ``headers``: the admin key's, the shared
    memory API being restricted. An output larger than its region is the server's error, not a
    wrong read."""

    def __init__(self, headers: dict[str, str] | None = None) -> None:
        self._headers = headers
        self._kept: dict[tuple[str, str], tuple[str, object, int]] = {}  # (in|out, tensor) -> (region, handle, bytes)

    def send(self, client, tensor, array: np.ndarray) -> None:
        """``array`` into ``tensor``'s (an ``InferInput``'s) region, the tensor pointed at it."""
        import tritonclient.utils.shared_memory as shm

        name, handle = self._region(client, ("in", tensor.name()), array.nbytes)
        shm.set_shared_memory_region(handle, [np.ascontiguousarray(array)])
        tensor.set_shared_memory(name, array.nbytes)

    def receive(self, client, output, nbytes: int) -> None:
        """``output`` (an ``InferRequestedOutput``) written by the server into a region of
        ``nbytes`` or more."""
        name, _ = self._region(client, ("out", output.name()), nbytes)
        output.set_shared_memory(name, nbytes)

    def read(self, result, name: str) -> np.ndarray:
        """A copy of what the server wrote into output ``name``'s region for ``result``."""
        import tritonclient.utils.shared_memory as shm
        from tritonclient.utils import triton_to_np_dtype

        output = result.get_output(name)
        if isinstance(output, dict):  # HTTP's JSON header; gRPC's is a message
            datatype, shape = output["datatype"], output["shape"]
        else:
            datatype, shape = output.datatype, list(output.shape)
        handle = self._kept["out", name][1]
        return np.array(shm.get_contents_as_numpy(handle, triton_to_np_dtype(datatype), shape))

    def close(self, client) -> None:
        """Every region unregistered (through ``client``) and freed."""
        for key in list(self._kept):
            self._drop(client, key)

    def _region(self, client, key: tuple[str, str], nbytes: int) -> tuple[str, object]:
        import tritonclient.utils.shared_memory as shm

        kept = self._kept.get(key)
        if kept is not None and kept[2] >= nbytes:
            return kept[0], kept[1]
        if kept is not None:
            self._drop(client, key)
        name = f"omni-{os.getpid()}-{uuid.uuid4().hex[:16]}"
        handle = shm.create_shared_memory_region(name, "/" + name, nbytes)
        try:
            client.register_system_shared_memory(name, "/" + name, nbytes, headers=self._headers)
        except BaseException:
            _destroy(handle)
            raise
        self._kept[key] = (name, handle, nbytes)
        return name, handle

    def _drop(self, client, key: tuple[str, str]) -> None:
        name, handle, _ = self._kept.pop(key)
        _unregister(client, name, self._headers)
        _destroy(handle)


@contextlib.contextmanager
def system_regions(client, tensors: list[tuple[object, np.ndarray]], headers: dict[str, str] | None = None,
                   outputs: list[tuple[object, int]] = ()) -> Iterator[Regions]:
    """Each ``(InferInput, array)``'s data in a region of its own, and a region of ``nbytes`` for
    each ``(InferRequestedOutput, nbytes)`` to receive, registered with the server through
    ``client`` for the duration of the block; ``read(result, name)`` inside it."""
    regions = Regions(headers)
    try:
        for tensor, array in tensors:
            regions.send(client, tensor, array)
        for output, nbytes in outputs:
            regions.receive(client, output, nbytes)
        yield regions
    finally:
        regions.close(client)


def _destroy(handle) -> None:
    """Frees a region's memory; its name may be gone already (a server's launcher unlinks what its
    stopped server had mapped), which leaves nothing to do."""
    import tritonclient.utils.shared_memory as shm

    with contextlib.suppress(shm.SharedMemoryException):
        shm.destroy_shared_memory_region(handle)


def _unregister(client, name: str, headers: dict[str, str] | None, attempts: int = 20) -> None:
    """Unregisters ``name``, waiting briefly while the server still holds it: Triton refuses to
    unregister a region in use, and a refused request's response can reach the client before the
    server has released the request that reads the region. Any other failure (the server gone)
    is left alone: the region is the client's to free either way."""
    for attempt in range(attempts):
        try:
            client.unregister_system_shared_memory(name, headers=headers)
            return
        except Exception as exc:
            if "in use" not in str(exc).lower() or attempt == attempts - 1:
                return
            time.sleep(0.05 * (attempt + 1))
