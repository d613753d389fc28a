"""The AR stage's Triton contract: tensor tables, config completion, runner config, responses."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import triton_python_backend_utils as pb_utils
from triton_omni_protocol import AR_ENCODE_INPUTS, AR_GENERATE_INPUTS, AR_GENERATE_OUTPUTS, ar_encode_outputs

from triton_omni.ar import ArLimits, ArResponse, ArRunnerConfig, ReturnOptions
from triton_omni.ar.shared_engine import EngineSeat, take_seat
from triton_omni.processes import server_folder
from triton_omni.triton.params import (
    Placement,
    gpu_share,
    json_parameter,
    lora_settings,
    model_parameters,
    place_instance,
)
from triton_omni.triton.tensors import Outputs, complete_config

GENERATE_OUTPUTS = Outputs(AR_GENERATE_OUTPUTS)


def auto_complete(config):
    """``generate`` models are decoupled (streaming); ``encode`` models batch."""
    params = model_parameters(config.as_dict())
    if params.get("mode", "generate") == "encode":
        complete_config(config, AR_ENCODE_INPUTS, ar_encode_outputs(params.get("embeds_dtype", "float32")))
        if config.as_dict().get("max_batch_size", 0) == 0:
            config.set_max_batch_size(8)
        config.set_dynamic_batching()
    else:
        complete_config(config, AR_GENERATE_INPUTS, AR_GENERATE_OUTPUTS)
        config.set_model_transaction_policy({"decoupled": True})
    return config


def runner_config(model_config: dict, args: dict) -> tuple[ArRunnerConfig, Placement]:
    """The runner's config and where this instance runs. A vLLM engine spans
    the instance's GPUs, tensor parallel over them unless ``engine_args``
    says otherwise (Triton's vLLM backend: ``KIND_MODEL``, the size an
    engine argument)."""
    params = model_parameters(model_config)
    limits = ArLimits(
        max_tokens=int(params.get("max_tokens_limit", ArLimits.max_tokens)),
        max_prompt_chars=int(params.get("max_prompt_chars", ArLimits.max_prompt_chars)),
        max_n=int(params.get("max_n", ArLimits.max_n)),
        max_logprobs=int(params.get("max_logprobs", ArLimits.max_logprobs)),
        max_prompt_tokens=int(params["max_prompt_tokens"]) if params.get("max_prompt_tokens") else None,
    )
    lora = lora_settings(params, args)
    engine = ArRunnerConfig(model=params.get("model", "demo:tiny-qwen2"), mode=params.get("mode", "generate"),  # type: ignore[arg-type]
                            engine=params.get("engine", "auto"),  # type: ignore[arg-type]
                            recipe=params.get("recipe", "last_hidden_state"),
                            lora_adapters=lora["lora_adapters"]).resolved_engine()
    placement = place_instance(args, params, spans_gpus=engine == "vllm")
    engine_args = json_parameter(params, "engine_args")
    if engine == "vllm" and len(placement.gpus) > 1:
        engine_args.setdefault("tensor_parallel_size", len(placement.gpus))
    config = ArRunnerConfig(
        model=params.get("model", "demo:tiny-qwen2"),
        mode=params.get("mode", "generate"),  # type: ignore[arg-type]
        engine=engine,  # type: ignore[arg-type]
        device=placement.device,
        dtype=params.get("dtype", "auto"),
        max_model_len=int(params.get("max_model_len", 1024)),
        embeds_dtype=params.get("embeds_dtype", "float32"),
        limits=limits,
        engine_args=engine_args,
        quantization=params.get("quantization", "none"),
        gpu_memory_utilization=gpu_share(params),
        engine_cpus=params.get("engine_cpus", ""),
        recipe=params.get("recipe", "last_hidden_state"),
        max_audio_clips=int(params.get("max_audio_clips", ArRunnerConfig.max_audio_clips)),
        max_images=int(params.get("max_images", ArRunnerConfig.max_images)),
        warmup_requests=int(params["warmup_requests"]) if params.get("warmup_requests") not in (None, "") else None,
        warmup_prompt_tokens=int(params.get("warmup_prompt_tokens", ArRunnerConfig.warmup_prompt_tokens)),
        **lora,
    )
    return config, placement


def engine_seat(model_config: dict, config: ArRunnerConfig, placement: Placement) -> EngineSeat | None:
    """This instance's seat in front of a vLLM engine core it shares with
    ``instances_per_engine - 1`` sibling instances on the same GPUs
    (``triton_omni.ar.shared_engine``); None for an engine of its own."""
    raw = model_parameters(model_config).get("instances_per_engine", "1").strip() or "1"
    name = model_config.get("name", "?")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"model {name!r}: parameter 'instances_per_engine' must be a whole number >= 1, got {raw!r}")
    frontends = int(raw)
    if frontends == 1:
        return None
    if config.resolved_engine() != "vllm":
        raise ValueError(f"model {name!r}: instances_per_engine {frontends} needs the vLLM engine (instances share "
                         "one vLLM engine core); the transformers engine runs in each instance")
    for group in model_config.get("instance_group", []):
        if int(group.get("count", 1)) % frontends:
            raise ValueError(f"model {name!r}: instances_per_engine {frontends} needs an instance_group count (per "
                             f"GPU) that is a multiple of {frontends}; the config has count {group.get('count', 1)}")
    folder = server_folder(Path(tempfile.gettempdir()), "triton-omni-engines") / f"{name}-{placement.label}"
    return take_seat(folder, frontends)


def generate_response(response: ArResponse, wanted: ReturnOptions):
    """The tensors of one ``ar`` response: ``text_output`` always, the others
    when their ``return_*`` input asked for them (``finish_reason`` on the
    final response only)."""
    outputs = [GENERATE_OUTPUTS.tensor("text_output", response.texts)]
    if wanted.finish_reason and response.finish_reasons is not None:
        outputs.append(GENERATE_OUTPUTS.tensor("finish_reason", response.finish_reasons))
    if wanted.cumulative_logprob:
        values = [math.nan if v is None else v for v in response.cumulative_logprobs]
        outputs.append(GENERATE_OUTPUTS.tensor("cumulative_logprob", values))
    if wanted.logprobs:
        texts = [json.dumps(_logprobs_json(positions)) for positions in response.logprobs]
        outputs.append(GENERATE_OUTPUTS.tensor("logprobs", texts))
    if wanted.num_input_tokens:
        outputs.append(GENERATE_OUTPUTS.tensor("num_input_tokens", response.num_input_tokens))
    if wanted.num_output_tokens:
        outputs.append(GENERATE_OUTPUTS.tensor("num_output_tokens", response.num_output_tokens))
    if wanted.token_ids:
        outputs.append(GENERATE_OUTPUTS.tensor("token_ids", [i for ids in response.token_ids for i in ids]))
    if (wanted.heard_states or wanted.thinker_states) and response.heard is not None:
        prompt_ids, states, positions = response.heard
        outputs.append(GENERATE_OUTPUTS.tensor("prompt_token_ids", prompt_ids))
        if positions is not None:
            outputs.append(GENERATE_OUTPUTS.tensor("prompt_positions", positions.contiguous()))
        if states is not None:
            outputs.append(GENERATE_OUTPUTS.tensor("heard_states", states.contiguous()))
    if wanted.thinker_states and response.thinker_states is not None:
        outputs.append(GENERATE_OUTPUTS.tensor("thinker_states", response.thinker_states.contiguous()))
    return pb_utils.InferenceResponse(output_tensors=outputs)


def _logprobs_json(positions) -> list[dict[str, dict]] | None:
    """Triton's vLLM backend's shape: one object per token, mapping each
    candidate token id to its logprob, rank and decoded text."""
    if positions is None:
        return None
    return [{str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token, lp in position.items()} for position in positions]
