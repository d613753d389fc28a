"""The speech stage's Triton contract: config completion, runner config, responses."""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils
from triton_omni_protocol import SPEECH_INPUTS, SPEECH_OUTPUTS

from triton_omni.speech.request import SpeechLimits
from triton_omni.speech.runner import AudioChunk, SpeechConfig
from triton_omni.triton.params import Placement, model_parameters, place_instance
from triton_omni.triton.tensors import Outputs, complete_config

OUTPUTS = Outputs(SPEECH_OUTPUTS)


def auto_complete(config):
    """Decoupled: a request's audio streams in chunks."""
    complete_config(config, SPEECH_INPUTS, SPEECH_OUTPUTS)
    config.set_model_transaction_policy({"decoupled": True})
    return config


def runner_config(model_config: dict, args: dict) -> tuple[SpeechConfig, Placement]:
    params = model_parameters(model_config)
    placement = place_instance(args, params)
    limits = SpeechLimits(max_tokens=int(params.get("max_tokens_limit", SpeechLimits.max_tokens)))
    config = SpeechConfig(model=params.get("model", SpeechConfig.model), device=placement.device,
                          dtype=params.get("dtype", "auto"),
                          max_num_seqs=int(params.get("max_num_seqs", SpeechConfig.max_num_seqs)),
                          chunk_frames=int(params.get("chunk_frames", SpeechConfig.chunk_frames)),
                          first_chunk_frames=int(params.get("first_chunk_frames", SpeechConfig.first_chunk_frames)),
                          cuda_graphs=params.get("cuda_graphs", "true").lower() == "true",
                          compile=params.get("compile", SpeechConfig.compile),
                          fuse_projections=params.get("fuse_projections", SpeechConfig.fuse_projections),
                          talker_max_len=int(params.get("talker_max_len", SpeechConfig.talker_max_len)), limits=limits)
    return config, placement


def chunk_response(chunk: AudioChunk, sample_rate: int):
    """One chunk's response. NumPy arrays, not DLPack: the last chunk may hold no samples (its frames
    all sent), and Triton takes no zero-size DLPack tensor."""
    outputs = [pb_utils.Tensor("audio", np.ascontiguousarray(chunk.samples, dtype=np.float32)),
               OUTPUTS.tensor("sample_rate", sample_rate),
               pb_utils.Tensor("codes", np.ascontiguousarray(chunk.codes, dtype=np.int64))]
    if chunk.finish_reason is not None:
        outputs.append(OUTPUTS.tensor("finish_reason", [chunk.finish_reason]))
    return pb_utils.InferenceResponse(output_tensors=outputs)
