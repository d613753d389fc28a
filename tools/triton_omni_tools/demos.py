"""`omni-triton serve --demo FAMILY`: which model family the demo models are.

Every family keeps the public contract (the same models, tensors and
pipelines); what changes is what `ar_encoder` and `diffusion` load: a tiny
random-weight pipeline of that family, built locally, and the text-encoding
recipe that pipeline uses; step batching drives every family's denoising
loop (``triton_omni.diffusion.denoisers``).
"""

from __future__ import annotations

from typing import Any

DEMOS: dict[str, dict[str, dict[str, Any]]] = {
    "sd": {},  # the repositories as they are: demo:tiny-sd and the AR model's last hidden state
    "qwen-image": {
        "ar_encoder": {"parameters": {"model": "demo:tiny-qwen-image", "recipe": "qwen_image"}},
        "diffusion": {"parameters": {"model": "demo:tiny-qwen-image"}},
    },
    "z-image": {
        "ar_encoder": {"parameters": {"model": "demo:tiny-z-image", "recipe": "z_image"}},
        "diffusion": {"parameters": {"model": "demo:tiny-z-image"}},
    },
}


def demo_edits(demo: str) -> dict[str, dict[str, Any]]:
    """``repository.copy_repositories``'s edits that make the demo models ``demo``'s family."""
    if demo not in DEMOS:
        raise ValueError(f"--demo must be one of {', '.join(DEMOS)}, got {demo!r}")
    return DEMOS[demo]
