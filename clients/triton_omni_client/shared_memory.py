"""Array inputs through system shared memory, for a client on the server's own host.

A prompt's embeddings are megabytes (FLUX's 512 x 4096 float32: 8 MB); sent in the request body,
gRPC's Python serialization and the server's copies cost tens of milliseconds a request, which a
few-step image cannot hide. Through a shared memory region the request carries only the region's
name: Triton's own mechanism (``perf_analyzer --shared-memory system`` measures it the same way).
Each call gets its own regions, registered for the call and removed after it, so concurrent
calls never share one.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator

import numpy as np


@contextlib.contextmanager
def system_regions(client, tensors: list[tuple[object, np.ndarray]],
                   headers: dict[str, str] | None = None) -> Iterator[None]:
    """Each ``(InferInput, array)``'s data in a region of its own, registered with the server
    through ``client`` for the duration of the block (``headers``: the admin key's, the shared
    memory API being restricted)."""
    import tritonclient.utils.shared_memory as shm

    made: list = []  # the regions' handles
    registered: list[str] = []
    try:
        for tensor, array in tensors:
            name = f"omni-{os.getpid()}-{uuid.uuid4().hex[:16]}"
            handle = shm.create_shared_memory_region(name, "/" + name, array.nbytes)
            made.append(handle)
            shm.set_shared_memory_region(handle, [array])
            client.register_system_shared_memory(name, "/" + name, array.nbytes, headers=headers)
            registered.append(name)
            tensor.set_shared_memory(name, array.nbytes)
        yield
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
