"""Wan 2.2 A14B: two experts of Wan 2.1 14B's shape, ``transformer`` for the high-noise steps (a
timestep at or above ``boundary_ratio x 1000``) and ``transformer_2`` for the rest, over Wan 2.1's
VAE. Text-to-video (``WanPipeline``, T2V-A14B) and image-to-video (``WanImageToVideoPipeline``,
I2V-A14B: the DiT reads the noise beside a mask of the given first frame and the VAE latents of
that image followed by black frames). Text and UMT5 as Wan 2.1 (wan.py); 81 frames by default, at
16 per second.

The pipelines are the reference. Every mode that wraps the denoiser wraps both experts (compile,
FP8, the attention kernel), the step cache keeps a state per expert, as diffusers' hooks on each
expert do, and the parallel modes' workers hold both (CFG parallel, sequence parallel). A LoRA
adapter comes as a pair, a file per expert (``{"transformer": ..., "transformer_2": ...}`` in
``lora_adapters``), as its users load it with ``load_lora_weights`` and
``load_into_transformer_2=True``; one request's adapter applies to each expert's steps."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import torch

from triton_omni.families.base import Capabilities, Guidance
from triton_omni.families.wan import (
    SHAPES,
    Wan,
    WanSteps,
    flow_scheduler,
    realistic_transformer,
    tiny_text_encoder,
    tiny_transformer,
    tiny_vae,
)

# the pipelines' boundaries (their model_index.json): T2V switches experts at timestep 875, I2V at 900
T2V_BOUNDARY, I2V_BOUNDARY = 0.875, 0.9
I2V_CHANNELS = 36  # the I2V DiT's input: 16 noise channels, 4 of the first-frame mask, 16 of the image's latents


class WanI2VSteps(WanSteps):
    """``WanImageToVideoPipeline``'s loop (``expand_timesteps`` off): each request's noise and its
    condition (mask and image latents) from the pipeline's own ``prepare_latents``, read by the DiT
    beside the noise, channel after channel."""

    def start_latents(self, job) -> None:
        pipeline = self.pipeline
        image = pipeline.video_processor.preprocess(job.images[0], height=job.height, width=job.width)
        job.latents, job.step_kwargs["condition"] = pipeline.prepare_latents(
            image.to(self.device, dtype=torch.float32), 1, pipeline.vae.config.z_dim, job.height, job.width,
            job.frames, torch.float32, self.device, job.generator)

    def model_input(self, job) -> torch.Tensor:
        return torch.cat([job.latents, job.step_kwargs["condition"]], dim=1)

    def final_latents(self, job) -> torch.Tensor:
        return job.latents


def build_tiny(out: Path) -> None:
    """T2V-A14B at the tiny Wan's shape: two DiTs drawn from different seeds (experts that agreed
    could not show which one ran), Wan 2.1's VAE, the pipeline's boundary."""
    from diffusers import WanPipeline

    tokenizer, text_encoder = tiny_text_encoder(out)
    WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_vae(), scheduler=flow_scheduler(),
                transformer=tiny_transformer(), transformer_2=tiny_transformer(seed=1),
                boundary_ratio=T2V_BOUNDARY).save_pretrained(out)


def build_tiny_i2v(out: Path) -> None:
    """I2V-A14B at the tiny Wan's shape: two DiTs reading 36 channels, no CLIP image encoder (Wan
    2.2's DiTs read none)."""
    from diffusers import WanImageToVideoPipeline

    tokenizer, text_encoder = tiny_text_encoder(out)
    WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_vae(),
                            scheduler=flow_scheduler(5.0), transformer=tiny_transformer(I2V_CHANNELS, 16),
                            transformer_2=tiny_transformer(I2V_CHANNELS, 16, seed=1),
                            boundary_ratio=I2V_BOUNDARY).save_pretrained(out)


def build_realistic(device, dtype, image_to_video: bool = False):
    """T2V-A14B (or I2V-A14B) at its real shape: two 14B experts, Wan 2.1's VAE, UniPC with the
    model card's shift (12.0 for T2V, 5.0 for I2V), random weights; no text encoder."""
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline

    from triton_omni.demo_models import built_as

    channels = I2V_CHANNELS if image_to_video else 16
    with built_as(device, dtype):
        experts = [realistic_transformer(channels, 16, **SHAPES["14b"]) for _ in range(2)]
        vae = AutoencoderKLWan()
    if image_to_video:
        return WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae.to(torch.float32),
                                       transformer=experts[0], transformer_2=experts[1],
                                       scheduler=flow_scheduler(5.0), boundary_ratio=I2V_BOUNDARY)
    return WanPipeline(tokenizer=None, text_encoder=None, vae=vae.to(torch.float32), transformer=experts[0],
                       transformer_2=experts[1], scheduler=flow_scheduler(12.0), boundary_ratio=T2V_BOUNDARY)


def build_realistic_i2v(device, dtype):
    return build_realistic(device, dtype, image_to_video=True)


class Wan22A14B(Wan):
    name = "wan2.2_a14b"
    capabilities = Capabilities(Guidance.CFG, cfg_parallel=True, step_cache=True, sequence_parallel=True,
                                compile=True, lora=True, fused_projections=True)
    demo = None
    demo_folders: ClassVar[dict] = {"tiny-wan2.2-a14b": build_tiny}
    realistic: ClassVar[dict] = {"demo:realistic-wan2.2-t2v-a14b": build_realistic}

    @classmethod
    def serves(cls, pipeline) -> bool:
        """Wan 2.2's experts (Wan 2.1's image-to-video, one DiT reading a CLIP image encoder's
        states, is not served)."""
        return pipeline.config.get("boundary_ratio") is not None and not pipeline.config.get("expand_timesteps")


class Wan22I2VA14B(Wan22A14B):
    name = "wan2.2_i2v_a14b"
    pipeline_class = "WanImageToVideoPipeline"
    capabilities = replace(Wan22A14B.capabilities, images=1, edits=True)
    step_adapter = WanI2VSteps
    demo_folders: ClassVar[dict] = {"tiny-wan2.2-i2v-a14b": build_tiny_i2v}
    realistic: ClassVar[dict] = {"demo:realistic-wan2.2-i2v-a14b": build_realistic_i2v}
