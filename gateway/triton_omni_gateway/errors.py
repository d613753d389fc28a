"""OpenAI's error object, and Triton's failures mapped onto it.

Every failure leaves the gateway as ``{"error": {"message", "type", "param",
"code"}}`` with the HTTP status OpenAI uses for it, so that the ``openai``
SDK raises its own typed exceptions (``BadRequestError``,
``NotFoundError``, ...)."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from triton_omni_client import OmniError

# OpenAI's `type` for each HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    501: "not_implemented",
    503: "service_unavailable",
    504: "timeout",
}
# Triton's status (the tag this project's models put on their errors, or gRPC's) -> HTTP status.
TRITON_STATUS = {
    "INVALID_ARG": 400,
    "NOT_FOUND": 404,
    "UNAVAILABLE": 503,
    "CANCELLED": 499,
    "DEADLINE_EXCEEDED": 504,
    "RESOURCE_EXHAUSTED": 503,
}


_INVALID_PARAMETER = re.compile(r"invalid `([\w.\[\]]+)`")  # images[1] too


class OpenAIError(Exception):
    """A request the gateway answers with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(param: str, message: str) -> OpenAIError:
    """A 400 naming the field at fault."""
    return OpenAIError(400, f"{param}: {message}", param=param, code="invalid_value")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model '{model}' does not exist or is not ready", param="model",
                       code="model_not_found")


def from_triton(error: OmniError, model: str) -> OpenAIError:
    """Triton's failure as OpenAI's; the model's own message, which names its parameter, is kept."""
    status = TRITON_STATUS.get(error.status, 500)
    message = str(error)
    if error.status == "NOT_FOUND" or "unknown model" in message.lower():
        return model_not_found(model)
    return OpenAIError(status, message, param=_named_parameter(message), code=error.status.lower())


def _named_parameter(message: str) -> str | None:
    """The models name the parameter at fault as ``invalid `<parameter>`: ...``."""
    found = _INVALID_PARAMETER.search(message)
    return found.group(1) if found else None
