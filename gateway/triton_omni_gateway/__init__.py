"""An OpenAI-compatible HTTP API in front of the triton-omni models.

A thin async gateway: each OpenAI request becomes one request to Triton's gRPC
API (``tritonclient``'s asyncio client), and Triton's answer becomes OpenAI's
response shape. It holds no model code; the models stay in Triton, which
batches, schedules and measures them. ``omni-triton serve`` starts it on port
9000 (``--openai-port``).
"""

from triton_omni_gateway.app import GatewaySettings, create_app

__all__ = ["GatewaySettings", "create_app"]
