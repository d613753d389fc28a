"""The ``omni`` scheduler's Triton contract: tensor tables, config completion, settings."""

from __future__ import annotations

from dataclasses import dataclass

from triton_omni_protocol import OMNI_INPUTS, OMNI_OUTPUTS

from triton_omni.scheduler import BudgetConfig, EnhanceConfig, SchedulerLimits
from triton_omni.triton.params import model_parameters
from triton_omni.triton.tensors import complete_config


def auto_complete(config):
    complete_config(config, OMNI_INPUTS, OMNI_OUTPUTS)
    config.set_model_transaction_policy({"decoupled": True})
    return config


@dataclass(frozen=True)
class SchedulerSettings:
    ar_model: str
    encoder_model: str
    diffusion_model: str
    speech_model: str
    speech_checkpoint: str  # the speaking model's checkpoint, whose chat template the audio route renders
    limits: SchedulerLimits
    budget: BudgetConfig
    enhance: EnhanceConfig


def settings(model_config: dict) -> SchedulerSettings:
    params = model_parameters(model_config)
    default_budget, default_enhance = BudgetConfig(), EnhanceConfig()
    return SchedulerSettings(
        ar_model=params.get("ar_model", "ar"),
        encoder_model=params.get("encoder_model", "ar_encoder"),
        diffusion_model=params.get("diffusion_model", "diffusion"),
        speech_model=params.get("speech_model", "speech"),
        speech_checkpoint=params.get("speech_checkpoint", ""),
        limits=SchedulerLimits(max_images=int(params.get("max_images", SchedulerLimits.max_images))),
        budget=BudgetConfig(
            max_bytes=int(params.get("max_embeds_bytes_in_flight", default_budget.max_bytes)),
            policy=params.get("admission_policy", default_budget.policy),
            max_wait_s=float(params.get("admission_max_wait_s", default_budget.max_wait_s)),
        ),
        enhance=EnhanceConfig(
            template=params.get("enhance_template", default_enhance.template),
            max_tokens=int(params.get("enhance_max_tokens", default_enhance.max_tokens)),
        ),
    )
