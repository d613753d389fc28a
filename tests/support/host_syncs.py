"""GPU tests' check that code only queues work: a host-device sync in it raises there."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def no_host_syncs(owner, *names: str):
    """Meanwhile, ``owner``'s methods ``names`` run under torch's sync debug mode ``error``. Yields
    the errors they raised, for the test to assert there were none (the thread that called them,
    an engine's own, may have caught them)."""
    failures: list[RuntimeError] = []

    def checked(method):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return method(*args, **kwargs)
            except RuntimeError as exc:
                failures.append(exc)
                raise
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return run

    for name in names:
        setattr(owner, name, checked(getattr(owner, name)))
    try:
        yield failures
    finally:
        for name in names:
            delattr(owner, name)
