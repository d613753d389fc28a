"""The one mapping from runner exceptions to Triton errors."""

from __future__ import annotations

import logging

import triton_python_backend_utils as pb_utils

from triton_omni.errors import RequestCancelledError, RequestRejectedError, RequestValidationError

logger = logging.getLogger(__name__)


def triton_error(exc: BaseException, context: str) -> pb_utils.TritonError:
    """Client errors keep their message; internal ones are logged with the
    traceback and reach the client as a short INTERNAL message."""
    if isinstance(exc, RequestValidationError):
        return pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
    if isinstance(exc, RequestRejectedError):
        return pb_utils.TritonError(str(exc), pb_utils.TritonError.UNAVAILABLE)
    if isinstance(exc, RequestCancelledError):
        return pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
    logger.error("Internal error in %s", context, exc_info=exc)
    return pb_utils.TritonError(f"internal error in {context}: {type(exc).__name__}: {exc}"[:500],
                                pb_utils.TritonError.INTERNAL)


def outcome(exc: BaseException | None) -> str:
    """A label for the requests counter."""
    if exc is None:
        return "success"
    return {
        RequestValidationError: "invalid",
        RequestRejectedError: "rejected",
        RequestCancelledError: "cancelled",
    }.get(type(exc), "error")


def error_response(exc: BaseException, context: str, metrics):
    """The response of a failed request, counted by outcome in ``metrics``."""
    metrics.finished(outcome(exc))
    return pb_utils.InferenceResponse(error=triton_error(exc, context))
