"""The diffusion stage: request type, its validation, and the runner."""

from triton_omni.diffusion.request import DiffusionLimits, DiffusionRequest
from triton_omni.diffusion.runner import DiffusionRunner, DiffusionRunnerConfig

__all__ = ["DiffusionLimits", "DiffusionRequest", "DiffusionRunner", "DiffusionRunnerConfig"]
