"""The ``omni`` scheduler's Triton contract: tensor tables, config completion, settings."""

from __future__ import annotations

from dataclasses import dataclass

from triton_omni.scheduler import BudgetConfig, EnhanceConfig, SchedulerLimits
from triton_omni.triton.params import model_parameters
from triton_omni.triton.tensors import TensorSpec, complete_config

INPUTS = [
    TensorSpec("text_input", "TYPE_STRING", optional=False),
    TensorSpec("modalities", "TYPE_STRING", dims=(-1,), kind="list"),
    TensorSpec("enhance_prompt", "TYPE_BOOL"),
    TensorSpec("stream", "TYPE_BOOL"),
    TensorSpec("num_images", "TYPE_INT32"),
    TensorSpec("parameters", "TYPE_STRING"),  # JSON: any option below, and the text options
    # text options (as `ar` takes them)
    TensorSpec("max_tokens", "TYPE_INT32"),
    TensorSpec("temperature", "TYPE_FP32"),
    TensorSpec("top_p", "TYPE_FP32"),
    TensorSpec("top_k", "TYPE_INT32"),
    # image options (as `diffusion` takes them); `seed` seeds both stages
    TensorSpec("negative_prompt", "TYPE_STRING"),
    TensorSpec("num_inference_steps", "TYPE_INT32"),
    TensorSpec("guidance_scale", "TYPE_FP32"),
    TensorSpec("height", "TYPE_INT32"),
    TensorSpec("width", "TYPE_INT32"),
    TensorSpec("seed", "TYPE_INT64"),
]
# A streamed response carries the outputs of one event; the non-streaming
# response carries them all.
OUTPUTS = [
    TensorSpec("text_output", "TYPE_STRING", dims=(-1,)),
    TensorSpec("finish_reason", "TYPE_STRING", dims=(-1,)),
    TensorSpec("enhanced_prompt_delta", "TYPE_STRING", dims=(-1,)),
    TensorSpec("enhanced_prompt", "TYPE_STRING", dims=(-1,)),
    TensorSpec("stage", "TYPE_STRING", dims=(-1,)),
    TensorSpec("step", "TYPE_INT32", dims=(-1,)),
    TensorSpec("total_steps", "TYPE_INT32", dims=(-1,)),
    TensorSpec("image", "TYPE_UINT8", dims=(-1, -1, -1, 3)),  # [num_images, H, W, 3]
    TensorSpec("image_index", "TYPE_INT32", dims=(-1,)),
    # The image's shape again: Triton's HTTP /generate flattens tensors to JSON lists.
    TensorSpec("image_shape", "TYPE_INT32", dims=(4,)),
]


def auto_complete(config):
    complete_config(config, INPUTS, OUTPUTS)
    config.set_model_transaction_policy({"decoupled": True})
    return config


@dataclass(frozen=True)
class SchedulerSettings:
    ar_model: str
    encoder_model: str
    diffusion_model: str
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
