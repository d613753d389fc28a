"""The wire contract of the triton-omni models, written once.

Every model's inputs and outputs (name, type, shape, optional) and the
format of a typed error message. Standard library and NumPy only, so both
sides import it: the server (config completion, request decoding, response
encoding, in ``triton_omni.triton``) and the client (input building, error
parsing, in ``triton_omni_client``).
"""

from triton_omni_protocol.models import (
    AR_ENCODE_INPUTS,
    AR_GENERATE_INPUTS,
    AR_GENERATE_OUTPUTS,
    DIFFUSION_OPTIONS,
    OMNI_INPUTS,
    OMNI_OUTPUTS,
    RETURN_FLAGS,
    SPEECH_INPUTS,
    SPEECH_OPTIONS,
    SPEECH_OUTPUTS,
    TALKER_PREFIX,
    VIDEO_OPTIONS,
    ar_encode_outputs,
    diffusion_inputs,
    diffusion_outputs,
    scalar_inputs,
)
from triton_omni_protocol.status import STATUS_NAMES, parse_status, tag_status
from triton_omni_protocol.tensors import EMBEDS_TYPES, InputValueError, TensorSpec

# The header that carries the admin key to Triton's restricted APIs (model repository, shared
# memory, trace, logging); over gRPC Triton reads it as ``triton-grpc-protocol-<header>``.
ADMIN_HEADER = "omni-admin-key"

__all__ = [
    "ADMIN_HEADER",
    "AR_ENCODE_INPUTS",
    "AR_GENERATE_INPUTS",
    "AR_GENERATE_OUTPUTS",
    "DIFFUSION_OPTIONS",
    "EMBEDS_TYPES",
    "OMNI_INPUTS",
    "OMNI_OUTPUTS",
    "RETURN_FLAGS",
    "SPEECH_INPUTS",
    "SPEECH_OPTIONS",
    "SPEECH_OUTPUTS",
    "STATUS_NAMES",
    "TALKER_PREFIX",
    "VIDEO_OPTIONS",
    "InputValueError",
    "TensorSpec",
    "ar_encode_outputs",
    "diffusion_inputs",
    "diffusion_outputs",
    "parse_status",
    "scalar_inputs",
    "tag_status",
]
