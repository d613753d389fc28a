"""Typed errors shared by every stage.

The adapters map these to Triton error codes in one place
(``triton_omni.triton.errors``): a validation error is the client's fault
(INVALID_ARG), a rejection is load shedding (UNAVAILABLE), a cancellation is
CANCELLED, anything else is INTERNAL.
"""

from __future__ import annotations

from typing import Any


class RequestValidationError(ValueError):
    """A request parameter is missing, malformed or out of range.

    The message always names the parameter and echoes the offending value so
    that a client can fix the request without reading server logs.
    """

    def __init__(self, parameter: str, reason: str, value: Any = None, *, show_value: bool = True):
        self.parameter = parameter
        self.value = value
        shown = f", got {_short_repr(value)}" if show_value else ""
        super().__init__(f"invalid `{parameter}`: {reason}{shown}")


class RequestCancelledError(Exception):
    """The client cancelled the request; work on it has stopped."""


class RequestRejectedError(Exception):
    """The server is over a configured budget and refuses the request.

    ``reason`` labels the rejection in metrics (e.g. ``embeds_budget``).
    """

    def __init__(self, message: str, reason: str = "overloaded"):
        self.reason = reason
        super().__init__(message)


class StageError(Exception):
    """A downstream stage (``ar``, ``ar_encoder``, ``diffusion``) failed a
    request the scheduler sent it. ``status`` is that stage's Triton status
    name, so the client gets the stage's own code and message."""

    def __init__(self, stage: str, status: str, message: str):
        self.stage = stage
        self.status = status
        super().__init__(f"{stage}: {message}")


class RemoteError(Exception):
    """A stage on another server (``remote.py``) failed a forwarded request: ``status`` is the one
    its caller gets (one of the protocol's names), the message as the stage there wrote it."""

    def __init__(self, status: str, message: str):
        self.status = status
        super().__init__(message)


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
