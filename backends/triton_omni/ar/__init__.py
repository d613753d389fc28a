"""The autoregressive (AR) stage: request types, engines and the runner.

The names load on first use (PEP 562): the `omni` scheduler reads only
``triton_omni.ar.sampling``, and importing the runner would pull transformers
into its stub (seconds of a start and a few hundred MiB it never uses)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from triton_omni.ar.request import EncodeRequest, GenerateRequest, ReturnOptions
    from triton_omni.ar.response import ArResponse
    from triton_omni.ar.runner import ArRunner, ArRunnerConfig, Delta, Embedding
    from triton_omni.ar.sampling import ArLimits, SamplingOptions

_HOMES = {
    "EncodeRequest": "request", "GenerateRequest": "request", "ReturnOptions": "request",
    "ArResponse": "response",
    "ArRunner": "runner", "ArRunnerConfig": "runner", "Delta": "runner", "Embedding": "runner",
    "ArLimits": "sampling", "SamplingOptions": "sampling",
}
__all__ = [
    "ArLimits",
    "ArResponse",
    "ArRunner",
    "ArRunnerConfig",
    "Delta",
    "Embedding",
    "EncodeRequest",
    "GenerateRequest",
    "ReturnOptions",
    "SamplingOptions",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
