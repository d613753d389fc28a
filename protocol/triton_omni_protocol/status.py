"""Typed errors on the wire: ``[STATUS] message``.

Triton 2.51 sends errors on a gRPC stream without a status code, and BLS
responses lose it; the backends therefore start every error message with
its status name in brackets, and both the scheduler (reading a stage's
error) and the client (reading the server's) parse it back here.
"""

from __future__ import annotations

import re

STATUS_NAMES = ("INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL", "NOT_FOUND", "UNSUPPORTED",
                "ALREADY_EXISTS", "UNKNOWN")
_TAG = re.compile(r"\[(" + "|".join(STATUS_NAMES) + r")\] ")


def tag_status(status: str, message: str) -> str:
    if status not in STATUS_NAMES:
        raise ValueError(f"unknown status {status!r}; expected one of {STATUS_NAMES}")
    return f"[{status}] {message}"


def parse_status(message: str) -> tuple[str | None, str]:
    """``(status, message without its tag)``; ``(None, message)`` when untagged.

    The tag may follow a prefix (Triton prepends the model's name in some paths)."""
    match = _TAG.search(message)
    if match is None:
        return None, message
    return match.group(1), message[:match.start()] + message[match.end():]
