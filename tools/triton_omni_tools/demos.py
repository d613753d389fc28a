"""`omni-triton serve --demo FAMILY`: which model family the demo models are.

Every family keeps the public contract (the same models, tensors and
pipelines); what changes is what `ar_encoder` and `diffusion` load: a tiny
random-weight pipeline of that family, built locally, and the text-encoding
recipe that pipeline uses (its family's module, ``triton_omni.families``,
declares both); step batching drives every family's denoising loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The speech stage's repository, added by a speech demo: ar serves the checkpoint's thinker, speech
# its talker and codec decoder; the image models stay Stable Diffusion's.
SPEECH_REPOSITORY = Path(__file__).resolve().parents[2] / "speech_repository"
SPEECH_DEMOS = {"qwen3-omni": "demo:tiny-qwen3-omni", "qwen2.5-omni": "demo:tiny-qwen2.5-omni"}


class DemoError(ValueError):
    """``--demo`` names no family's demo."""


def demo_repositories(demo: str) -> list[Path]:
    """The repositories a demo adds to the default ones."""
    return [SPEECH_REPOSITORY] if demo in SPEECH_DEMOS else []


def demo_edits(demo: str) -> dict[str, dict[str, Any]]:
    """``repository.copy_repositories``'s edits that make the demo models ``demo``'s family (the
    default, Stable Diffusion's, is the repositories as they are)."""
    from triton_omni.demo_models import DIFFUSION_DEMO
    from triton_omni.families import DEMOS, FAMILIES

    if demo in SPEECH_DEMOS:
        from triton_omni.speech.demos import THINKER_CONTEXT, THINKER_CONTEXT_25

        model = SPEECH_DEMOS[demo]
        qwen25 = demo == "qwen2.5-omni"
        context = str(THINKER_CONTEXT_25 if qwen25 else THINKER_CONTEXT)
        # Qwen2.5-Omni's talker reads the thinker's states at every token: the transformers engine hands them on
        thinker = {"engine": "transformers"} if qwen25 else {}
        return {"ar": {"parameters": {"model": model, "max_model_len": context, "max_tokens_limit": context,
                                      **thinker}},
                "speech": {"parameters": {"model": model, **({"talker_max_len": context} if qwen25 else {})}},
                "omni": {"parameters": {"speech_checkpoint": model}}}
    if demo not in DEMOS:
        raise DemoError(f"--demo must be one of {', '.join([*DEMOS, *SPEECH_DEMOS])}, got {demo!r}")
    if DEMOS[demo].model == DIFFUSION_DEMO:  # what model_repository/ serves already
        return {}
    [family] = [family for family in FAMILIES.values() if family.demo is DEMOS[demo]]
    model = f"demo:{DEMOS[demo].model}"
    edits: dict[str, dict[str, Any]] = {"diffusion": {"parameters": {"model": model}}}
    if DEMOS[demo].encoder:
        edits["ar_encoder"] = {"parameters": {"model": model, "recipe": family.recipe.name}}
    if family.output.video:  # text_to_image ends in what the family makes
        edits["text_to_image"] = {"media": "video"}
    return edits
