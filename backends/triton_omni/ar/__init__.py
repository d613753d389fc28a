"""The autoregressive (AR) stage: request types, engines and the runner."""

from triton_omni.ar.request import EncodeRequest, GenerateRequest, ReturnOptions
from triton_omni.ar.response import ArResponse
from triton_omni.ar.runner import ArRunner, ArRunnerConfig, Delta, Embedding
from triton_omni.ar.sampling import ArLimits, SamplingOptions

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
