"""The autoregressive (AR) stage: request types, engines and the runner."""

from triton_omni.ar.request import ArLimits, EncodeRequest, GenerateRequest, SamplingOptions
from triton_omni.ar.runner import ArRunner, ArRunnerConfig, Delta, Embedding

__all__ = [
    "ArLimits",
    "ArRunner",
    "ArRunnerConfig",
    "Delta",
    "Embedding",
    "EncodeRequest",
    "GenerateRequest",
    "SamplingOptions",
]
