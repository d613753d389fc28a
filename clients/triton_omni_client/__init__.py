"""Python client for triton-omni, built on ``tritonclient`` (gRPC) and
Triton's HTTP ``generate`` endpoints."""

from triton_omni_protocol import InputValueError  # a value an input tensor cannot hold, raised before sending

from triton_omni_client.client import OmniClient, OmniError, OmniEvent, TextChunk, Video

__all__ = ["InputValueError", "OmniClient", "OmniError", "OmniEvent", "TextChunk", "Video"]
