"""Wan 2.2 TI2V-5B (``WanPipeline`` with ``expand_timesteps``): one video DiT over Wan 2.2's VAE (48
channels, 16x spatial), a timestep per token, and, given a first image, that image's latents in
place of the first latent frame's at timestep 0 (as ``WanImageToVideoPipeline`` runs the same
components). Text and UMT5 as Wan 2.1 (wan.py); videos of ``1 + 4k`` frames, 121 by default,
played at 24 per second.

The pipelines are the reference: ``WanPipeline`` for a prompt alone, ``WanImageToVideoPipeline``
over the same components for a prompt and a first image."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from triton_omni.families.base import Demo, Output
from triton_omni.families.wan import (
    Wan,
    flow_scheduler,
    realistic_transformer,
    tiny_text_encoder,
    tiny_transformer,
    tiny_vae,
)

FPS = 24  # TI2V-5B's videos are made for 24 frames a second (its model card exports at 24)
# Wan 2.2's VAE at diffusers' test shape: 48 latent channels, 2x2 pixel patches folded in, 16x spatial
TINY_VAE = {"z_dim": 48, "in_channels": 12, "out_channels": 12, "is_residual": True, "patch_size": 2,
            "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48, "scale_factor_spatial": 16,
            "scale_factor_temporal": 4}


def build_tiny(out: Path) -> None:
    """Wan 2.2 TI2V at the shape of diffusers' test: the tiny Wan's UMT5 and DiT (48 channels in
    and out), Wan 2.2's VAE at its smallest, ``expand_timesteps``."""
    from diffusers import WanPipeline

    tokenizer, text_encoder = tiny_text_encoder(out)
    transformer = tiny_transformer(channels=48)
    WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_vae(**TINY_VAE), transformer=transformer,
                scheduler=flow_scheduler(), expand_timesteps=True).save_pretrained(out)


def build_realistic(device, dtype):
    """TI2V-5B's DiT (24 heads of 128, 30 layers) and Wan 2.2's VAE at their real shapes, random
    weights, UniPC with the model card's shift 5.0; no text encoder (it serves ``prompt_embeds``)."""
    from diffusers import AutoencoderKLWan, WanPipeline

    from triton_omni.demo_models import built_as

    with built_as(device, dtype):
        transformer = realistic_transformer(48, 48, num_attention_heads=24, ffn_dim=14336, num_layers=30)
        vae = AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4],
                               num_res_blocks=2, temperal_downsample=[False, True, True], is_residual=True,
                               in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                               scale_factor_temporal=4, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
    return WanPipeline(tokenizer=None, text_encoder=None, vae=vae.to(torch.float32), transformer=transformer,
                       scheduler=flow_scheduler(5.0), expand_timesteps=True)


class Wan22TI2V(Wan):
    name = "wan2.2_ti2v"
    # Wan 2.1's modes, and a first image per request (optional)
    capabilities = replace(Wan.capabilities, images=1)
    output = Output("video", fps=FPS, default_frames=121, max_side=1280)
    demo = Demo("wan2.2", "tiny-wan2.2", build_tiny)
    realistic: ClassVar[dict] = {"demo:realistic-wan2.2-ti2v-5b": build_realistic}

    @classmethod
    def serves(cls, pipeline) -> bool:
        return pipeline.config.get("boundary_ratio") is None and bool(pipeline.config.get("expand_timesteps"))

    def call(self, kwargs: dict[str, Any]) -> Any:
        """A first image is read by ``WanImageToVideoPipeline`` over this pipeline's components."""
        return (self.image_to_video if "image" in kwargs else self.pipeline)(**kwargs)

    @functools.cached_property
    def image_to_video(self):
        """``WanImageToVideoPipeline`` over this pipeline's modules (made once: it shares them)."""
        from diffusers import WanImageToVideoPipeline

        return WanImageToVideoPipeline.from_pipe(self.pipeline, image_encoder=None, image_processor=None)
