"""The client's shared-memory regions are unregistered even when the server still holds one for a
moment after answering (Triton refuses to unregister a region in use)."""

from triton_omni_client.shared_memory import _unregister


class _Server:
    """Refuses to unregister while the region is 'in use' for the first ``busy`` calls."""

    def __init__(self, busy: int, error: str = "Cannot unregister shared memory region 'r', it is currently in use."):
        self.busy, self.error, self.calls = busy, error, 0

    def unregister_system_shared_memory(self, name, headers=None):
        self.calls += 1
        if self.calls <= self.busy:
            raise RuntimeError(self.error)


def test_a_region_in_use_is_unregistered_once_released():
    server = _Server(busy=3)
    _unregister(server, "r", None)
    assert server.calls == 4


def test_a_server_that_is_gone_is_not_retried():
    server = _Server(busy=10, error="failed to connect to all addresses")
    _unregister(server, "r", None)
    assert server.calls == 1
