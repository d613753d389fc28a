"""The AR stage's Triton contract: tensor tables, config completion, runner config."""

from __future__ import annotations

from triton_omni.ar import ArLimits, ArRunnerConfig
from triton_omni.triton.params import instance_device, json_parameter, model_parameters
from triton_omni.triton.tensors import TensorSpec, complete_config

GENERATE_INPUTS = [
    TensorSpec("text_input", "TYPE_STRING", optional=False),
    TensorSpec("stream", "TYPE_BOOL"),
    TensorSpec("sampling_parameters", "TYPE_STRING"),
    TensorSpec("max_tokens", "TYPE_INT32"),
    TensorSpec("temperature", "TYPE_FP32"),
    TensorSpec("top_p", "TYPE_FP32"),
    TensorSpec("top_k", "TYPE_INT32"),
    TensorSpec("seed", "TYPE_INT64"),
    TensorSpec("stop", "TYPE_STRING", dims=(-1,), kind="list"),
    TensorSpec("exclude_input_in_output", "TYPE_BOOL"),
    TensorSpec("return_num_output_tokens", "TYPE_BOOL"),
]
GENERATE_OUTPUTS = [
    TensorSpec("text_output", "TYPE_STRING", dims=(-1,)),
    TensorSpec("finish_reason", "TYPE_STRING", dims=(-1,)),
    TensorSpec("num_output_tokens", "TYPE_INT32", dims=(-1,)),
]
ENCODE_INPUTS = [TensorSpec("text_input", "TYPE_STRING", optional=False)]

EMBEDS_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}


def encode_outputs(embeds_dtype: str) -> list[TensorSpec]:
    if embeds_dtype not in EMBEDS_TYPES:
        raise ValueError(f"model parameter 'embeds_dtype' must be one of {sorted(EMBEDS_TYPES)}, got {embeds_dtype!r}")
    return [
        TensorSpec("prompt_embeds", EMBEDS_TYPES[embeds_dtype], dims=(-1, -1)),
        TensorSpec("prompt_embeds_mask", "TYPE_INT32", dims=(-1,)),
    ]


def auto_complete(config):
    """``generate`` models are decoupled (streaming); ``encode`` models batch."""
    params = model_parameters(config.as_dict())
    if params.get("mode", "generate") == "encode":
        complete_config(config, ENCODE_INPUTS, encode_outputs(params.get("embeds_dtype", "float32")))
        if config.as_dict().get("max_batch_size", 0) == 0:
            config.set_max_batch_size(8)
        config.set_dynamic_batching()
    else:
        complete_config(config, GENERATE_INPUTS, GENERATE_OUTPUTS)
        config.set_model_transaction_policy({"decoupled": True})
    return config


def runner_config(model_config: dict, args: dict) -> ArRunnerConfig:
    params = model_parameters(model_config)
    limits = ArLimits(
        max_tokens=int(params.get("max_tokens_limit", ArLimits.max_tokens)),
        max_prompt_chars=int(params.get("max_prompt_chars", ArLimits.max_prompt_chars)),
    )
    return ArRunnerConfig(
        model=params.get("model", "demo:tiny-qwen2"),
        mode=params.get("mode", "generate"),  # type: ignore[arg-type]
        engine=params.get("engine", "auto"),  # type: ignore[arg-type]
        device=instance_device(args, params.get("device", "auto")),
        dtype=params.get("dtype", "auto"),
        max_model_len=int(params.get("max_model_len", 1024)),
        embeds_dtype=params.get("embeds_dtype", "float32"),
        limits=limits,
        engine_args=json_parameter(params, "engine_args"),
    )
