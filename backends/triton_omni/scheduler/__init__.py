"""The ``omni`` BLS scheduler's Triton-free half: request, routes, admission."""

from triton_omni.scheduler.budget import BudgetConfig, EmbedsBudget
from triton_omni.scheduler.request import OmniRequest, SchedulerLimits
from triton_omni.scheduler.scheduler import (
    AudioChunk,
    EnhanceConfig,
    EnhancedPrompt,
    Event,
    ImageResult,
    OmniScheduler,
    Progress,
    Reply,
    Stages,
    TextDelta,
)

__all__ = [
    "AudioChunk",
    "BudgetConfig",
    "EmbedsBudget",
    "EnhanceConfig",
    "EnhancedPrompt",
    "Event",
    "ImageResult",
    "OmniRequest",
    "OmniScheduler",
    "Progress",
    "Reply",
    "SchedulerLimits",
    "Stages",
    "TextDelta",
]
