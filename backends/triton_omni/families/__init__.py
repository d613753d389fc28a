"""The pipeline families: one module each, and the registry, by family name. A pipeline's family
is the first whose pipeline class is the pipeline's and which ``serves`` it (Wan 2.2's models
share ``WanPipeline`` with Wan 2.1; their configs tell them apart). Everything the runtime knows
of a family is in its module (base.py says what that is); the runner, the step engine,
``ar_encoder`` and the launcher read a family's capabilities and never name a family or probe a
pipeline themselves (tests/unit/test_architecture.py holds it).

Adding a family: ARCHITECTURE.md, "Adding a family".
"""

from __future__ import annotations

import logging
from typing import Any

from triton_omni.families.base import (
    LAST_HIDDEN_STATE,
    Capabilities,
    Demo,
    EncoderRecipe,
    Family,
    Guidance,
    StepAdapter,
)
from triton_omni.families.flux1 import Flux1
from triton_omni.families.flux2 import Flux2Dev, Flux2Klein
from triton_omni.families.qwen_image import QwenImage
from triton_omni.families.qwen_image_edit import QwenImageEdit, QwenImageEditPlus
from triton_omni.families.stable_diffusion import StableDiffusion
from triton_omni.families.wan import Wan
from triton_omni.families.wan22_a14b import Wan22A14B, Wan22I2VA14B
from triton_omni.families.wan22_ti2v import Wan22TI2V
from triton_omni.families.z_image import ZImage

logger = logging.getLogger(__name__)

FAMILIES: dict[str, type[Family]] = {family.name: family for family in (
    StableDiffusion, QwenImage, QwenImageEdit, QwenImageEditPlus, ZImage, Flux2Klein, Flux2Dev, Flux1, Wan,
    Wan22TI2V, Wan22A14B, Wan22I2VA14B)}
RECIPES: dict[str, EncoderRecipe] = {LAST_HIDDEN_STATE.name: LAST_HIDDEN_STATE} | {
    family.recipe.name: family.recipe for family in FAMILIES.values()}
DEMOS: dict[str, Demo] = {family.demo.name: family.demo for family in FAMILIES.values() if family.demo}


def family_of(pipeline: Any) -> Family:
    """The family of ``pipeline``, by its class; a UNet pipeline no family names is taken for
    Stable Diffusion's shape (request batching; step batching checks its loop's parts)."""
    family = next((family for family in FAMILIES.values()
                   if family.pipeline_class == type(pipeline).__name__ and family.serves(pipeline)), None)
    if family is None:
        name = type(pipeline).__name__
        kin = [family.name for family in FAMILIES.values() if family.pipeline_class == name]
        if kin:  # the class is served, its config (Wan 2.1's image-to-video, say) is not
            raise ValueError(f"no family serves this {name}'s config (the families of its class: {', '.join(kin)})")
        if getattr(pipeline, "unet", None) is None:
            served = sorted({family.pipeline_class for family in FAMILIES.values()})
            raise ValueError(f"no family serves {name} (served: {', '.join(served)})")
        logger.warning("%s is served as a Stable Diffusion pipeline (a UNet conditioned on text embeddings)",
                       type(pipeline).__name__)
        family = StableDiffusion
    return family(pipeline)


def recipe(name: str) -> EncoderRecipe:
    """The text recipe ``name`` (the ``ar_encoder`` model parameter ``recipe``)."""
    if name not in RECIPES:
        raise ValueError(f"model parameter recipe must be one of {sorted(RECIPES)}, got {name!r}")
    return RECIPES[name]


def sequence_parallel_plan(transformer: Any) -> tuple[dict, int] | None:
    """A family's own context-parallel plan for ``transformer`` (and the multiple its sequence is
    padded to), where diffusers ships none; None: the transformer's own ``_cp_plan``, if any."""
    for family in FAMILIES.values():
        plan = family.sequence_parallel_plan(transformer)
        if plan is not None:
            return plan
    return None


def demo_folders() -> dict[str, Any]:
    """Every family's demo folders, by name: its tiny demo and any other it builds."""
    folders = {}
    for family in FAMILIES.values():
        if family.demo is not None:
            folders[family.demo.model] = family.demo.build
        folders |= family.demo_folders
    return folders


def realistic_builders() -> dict[str, Any]:
    """``demo:<name>`` -> builder(device, dtype) of every family's in-memory realistic pipelines."""
    return {name: build for family in FAMILIES.values() for name, build in family.realistic.items()}


__all__ = ["DEMOS", "FAMILIES", "RECIPES", "Capabilities", "EncoderRecipe", "Family", "Guidance", "StepAdapter",
           "demo_folders", "family_of", "realistic_builders", "recipe", "sequence_parallel_plan"]
