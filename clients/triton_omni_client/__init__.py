"""Python client for triton-omni, built on ``tritonclient`` (gRPC) and
Triton's HTTP ``generate`` endpoints."""

from triton_omni_client.client import OmniClient, OmniError, OmniEvent, TextChunk

__all__ = ["OmniClient", "OmniError", "OmniEvent", "TextChunk"]
