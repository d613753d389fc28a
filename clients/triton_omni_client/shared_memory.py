"""Arrays in and out through system shared memory, for a client on the server's own host.

A prompt's embeddings are megabytes (FLUX's 512 x 4096 float32: 8 MB) and so is the image that
comes back (1024² RGB: 3 MB); in the request and response bodies, gRPC's Python serialization and
the server's copies cost tens of milliseconds a request, which a few-step image cannot hide.
Through a shared memory region the messages carry only the region's name: Triton's own mechanism
(``perf_analyzer --shared-memory system`` measures it the same way). Each call gets its own
regions, registered for the call and removed after it, so concurrent calls never share one.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator

import numpy as np


class Outputs:
    """The block's output regions: ``read(result, name)`` is a copy of what the server wrote
    there (the region is gone after the block)."""

    def __init__(self, handles: dict[str, object]) -> None:
        self._handles = handles  # output name -> its region's handle

    def read(self, result, name: str) -> np.ndarray:
        import tritonclient.utils.shared_memory as shm
        from tritonclient.utils import triton_to_np_dtype

        output = result.get_output(name)
        if isinstance(output, dict):  # HTTP's JSON header; gRPC's is a message
            datatype, shape = output["datatype"], output["shape"]
        else:
            datatype, shape = output.datatype, list(output.shape)
        return np.array(shm.get_contents_as_numpy(self._handles[name], triton_to_np_dtype(datatype), shape))


@contextlib.contextmanager
def system_regions(client, tensors: list[tuple[object, np.ndarray]], headers: dict[str, str] | None = None,
                   outputs: list[tuple[object, int]] = ()) -> Iterator[Outputs]:
    """Each ``(InferInput, array)``'s data in a region of its own, and a region of ``nbytes`` for
    each ``(InferRequestedOutput, nbytes)`` to receive, registered with the server through
    ``client`` for the duration of the block (``headers``: the admin key's, the shared memory API
    being restricted). An output larger than its region is the server's error, not a wrong read."""
    import tritonclient.utils.shared_memory as shm

    made: list = []  # the regions' handles
    registered: list[str] = []
    received: dict[str, object] = {}  # output name -> handle

    def region(nbytes: int) -> tuple[str, object]:
        name = f"omni-{os.getpid()}-{uuid.uuid4().hex[:16]}"
        handle = shm.create_shared_memory_region(name, "/" + name, nbytes)
        made.append(handle)
        return name, handle

    def register(name: str, nbytes: int) -> None:
        client.register_system_shared_memory(name, "/" + name, nbytes, headers=headers)
        registered.append(name)

    try:
        for tensor, array in tensors:
            name, handle = region(array.nbytes)
            shm.set_shared_memory_region(handle, [array])
            register(name, array.nbytes)
            tensor.set_shared_memory(name, array.nbytes)
        for output, nbytes in outputs:
            name, handle = region(nbytes)
            register(name, nbytes)
            output.set_shared_memory(name, nbytes)
            received[output.name()] = handle
        yield Outputs(received)
    finally:
        for name in registered:
            _unregister(client, name, headers)
        for handle in made:
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
