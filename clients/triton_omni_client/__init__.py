"""Python client for triton-omni, built on ``tritonclient`` (gRPC) and
Triton's HTTP ``generate`` endpoints."""

from triton_omni_client.client import OmniClient, OmniError, TextChunk

__all__ = ["OmniClient", "OmniError", "TextChunk"]
