"""The one mapping from runner exceptions to Triton errors.

Every message starts with the status name in brackets (``[INVALID_ARG] ...``,
the format of ``triton_omni_protocol.status``).
Triton 2.51 sends errors on a gRPC stream without a status code, and its
``triton_grpc_error`` mode, which would add one, crashes the server under
load (a cancellation race fixed in 24.12, server PR #7840); the tag keeps the
error typed for streaming clients on every Triton version.
"""

from __future__ import annotations

import logging

import triton_python_backend_utils as pb_utils
from triton_omni_protocol import tag_status

from triton_omni.errors import (
    RemoteError,
    RequestCancelledError,
    RequestRejectedError,
    RequestValidationError,
    StageError,
)

logger = logging.getLogger(__name__)


def triton_error(exc: BaseException, context: str) -> pb_utils.TritonError:
    """Client errors keep their message; internal ones are logged with the
    traceback and reach the client as a short INTERNAL message."""
    if isinstance(exc, RequestValidationError):
        return _tagged(str(exc), "INVALID_ARG")
    if isinstance(exc, RequestRejectedError):
        return _tagged(str(exc), "UNAVAILABLE")
    if isinstance(exc, RequestCancelledError):
        return _tagged("request cancelled", "CANCELLED")
    if isinstance(exc, StageError | RemoteError):  # a downstream or remote stage's own code and message
        return _tagged(str(exc), exc.status)
    logger.error("Internal error in %s", context, exc_info=exc)
    return _tagged(f"internal error in {context}: {type(exc).__name__}: {exc}"[:500], "INTERNAL")


def _tagged(message: str, status: str) -> pb_utils.TritonError:
    return pb_utils.TritonError(tag_status(status, message), getattr(pb_utils.TritonError, status))


def outcome(exc: BaseException | None) -> str:
    """A label for the requests counter."""
    if exc is None:
        return "success"
    return {
        RequestValidationError: "invalid",
        RequestRejectedError: "rejected",
        RequestCancelledError: "cancelled",
    }.get(type(exc), "stage_error" if isinstance(exc, StageError) else "error")


def error_response(exc: BaseException, context: str, metrics, started: float | None = None):
    """The response of a failed request, counted by outcome (and rejection
    reason) in ``metrics``; ``started`` adds its duration."""
    metrics.finished(outcome(exc), started)
    if isinstance(exc, RequestRejectedError):
        metrics.rejected(exc.reason)
    return pb_utils.InferenceResponse(error=triton_error(exc, context))
