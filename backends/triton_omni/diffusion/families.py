"""What the diffusion runner needs to know of a pipeline family, one small
adapter each: how the pipeline encodes a text prompt on its own, when a
request runs classifier-free guidance, and the keyword arguments of one
batched ``__call__`` given each request's embeddings.

The pipeline stays the reference: a family never re-implements its
denoising loop for request batching, it only hands the pipeline the
embeddings it would have computed itself, so a served image equals the
pipeline's own ``__call__`` with the same inputs and generator.

- Stable Diffusion: CLIP's last hidden state; CFG when ``guidance_scale > 1``,
  against "" unless a negative prompt is given;
- Qwen-Image: Qwen2.5-VL, a system-prompt template, the last layer with the
  template's tokens dropped; true CFG when ``guidance_scale > 1`` and a
  negative prompt is given;
- Z-Image: Qwen3, its chat template, the second-to-last layer; CFG when
  ``guidance_scale > 0`` (``pos + g (pos - neg)``), against "" by default.
"""

from __future__ import annotations

from typing import Any

import torch

from triton_omni.diffusion.denoisers import QwenImageDenoiser, UNetDenoiser, ZImageDenoiser
from triton_omni.errors import RequestValidationError


class Family:
    """Stable Diffusion's shape, which the other families refine."""

    name = "stable_diffusion"
    # CFG runs the prompt and its negative as rows of one batch, so both need one token count
    cfg_in_one_batch = True
    step_adapter = UNetDenoiser  # its loop, for step batching (denoisers.py)

    def __init__(self, pipeline):
        self.pipeline = pipeline

    @property
    def denoiser(self):
        return getattr(self.pipeline, "unet", None) or self.pipeline.transformer

    def hidden_size(self) -> int:
        return int(self.denoiser.config.cross_attention_dim)

    def size_multiple(self) -> int:
        """Height and width must be multiples of this: 8, as the pipeline's own ``check_inputs``
        asks (a small VAE's factor is below it); the VAE's factor times the patch for a DiT."""
        return max(8, int(self.pipeline.vae_scale_factor))

    def uses_guidance(self, guidance_scale: float, has_negative: bool) -> bool:
        return guidance_scale > 1.0

    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        """One prompt alone, as the pipeline encodes it: ``[num_tokens, hidden]``."""
        self.require_text_encoder()
        embeds, _ = self.pipeline.encode_prompt(prompt, device, 1, False)
        return embeds[0]

    def has_text_encoder(self) -> bool:
        return getattr(self.pipeline, "text_encoder", None) is not None

    def require_text_encoder(self) -> None:
        """A pipeline built without its text encoder (the realistic GPU presets) takes embeddings only."""
        if not self.has_text_encoder():
            raise RequestValidationError("prompt", "this model has no text encoder: send prompt_embeds "
                                         "(text_to_image and omni do)", None, show_value=False)

    def call_kwargs(self, conds: list[torch.Tensor], unconds: list[torch.Tensor] | None,
                    guidance_scale: float) -> dict[str, Any]:
        """One batched call's conditioning: rows of one token count (the runner groups them so)."""
        kwargs: dict[str, Any] = {"prompt_embeds": torch.stack(conds), "guidance_scale": guidance_scale}
        if unconds is not None:
            kwargs["negative_prompt_embeds"] = torch.stack(unconds)
        return kwargs


class QwenImage(Family):
    name = "qwen_image"
    cfg_in_one_batch = False  # two forward passes, each with its own text mask
    step_adapter = QwenImageDenoiser

    def hidden_size(self) -> int:
        return int(self.denoiser.config.joint_attention_dim)

    def size_multiple(self) -> int:
        return int(self.pipeline.vae_scale_factor) * self.denoiser.config.patch_size

    def uses_guidance(self, guidance_scale: float, has_negative: bool) -> bool:
        # diffusers' rule: true CFG needs a scale above 1 and a negative prompt
        return guidance_scale > 1.0 and has_negative

    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        self.require_text_encoder()
        embeds, mask = self.pipeline.encode_prompt(prompt=prompt, device=device, num_images_per_prompt=1)
        return embeds[0] if mask is None else embeds[0][mask[0].bool()]

    def call_kwargs(self, conds, unconds, guidance_scale):
        kwargs: dict[str, Any] = {"prompt_embeds": torch.stack(conds), "true_cfg_scale": guidance_scale,
                                  "prompt_embeds_mask": _ones_mask(conds)}
        if unconds is not None:
            kwargs["negative_prompt_embeds"] = torch.stack(unconds)
            kwargs["negative_prompt_embeds_mask"] = _ones_mask(unconds)
        return kwargs


class ZImage(Family):
    name = "z_image"
    cfg_in_one_batch = False  # per-prompt embeddings of their own lengths
    step_adapter = ZImageDenoiser

    def hidden_size(self) -> int:
        return int(self.denoiser.config.cap_feat_dim)

    def size_multiple(self) -> int:
        return int(self.pipeline.vae_scale_factor) * self.denoiser.config.all_patch_size[0]

    def uses_guidance(self, guidance_scale: float, has_negative: bool) -> bool:
        # Z-Image's formula is pos + g * (pos - neg): any positive scale guides (Turbo runs at 0)
        return guidance_scale > 0.0

    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        self.require_text_encoder()
        [embeds] = self.pipeline._encode_prompt(prompt=prompt, device=device)
        return embeds

    def call_kwargs(self, conds, unconds, guidance_scale):
        # Z-Image takes a list of per-prompt embeddings, each its own length
        kwargs: dict[str, Any] = {"prompt_embeds": list(conds), "guidance_scale": guidance_scale}
        if unconds is not None:
            kwargs["negative_prompt_embeds"] = list(unconds)
        return kwargs


FAMILIES: dict[str, type[Family]] = {"QwenImagePipeline": QwenImage, "ZImagePipeline": ZImage}


def family_of(pipeline) -> Family:
    """The adapter for ``pipeline``; Stable Diffusion's for any UNet pipeline it does not name."""
    return FAMILIES.get(type(pipeline).__name__, Family)(pipeline)


def _ones_mask(embeds: list[torch.Tensor]) -> torch.Tensor:
    return torch.ones(len(embeds), embeds[0].shape[0], dtype=torch.long, device=embeds[0].device)
