"""Stable Diffusion (the small demo): CLIP's last hidden state, a UNet, DDIM-style schedulers,
CFG when ``guidance_scale > 1`` against ``""`` unless a negative prompt is given (the prompt and
its negative as rows of one UNet batch). ``StableDiffusionPipeline`` is the reference."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar

import torch

from triton_omni.families.base import Capabilities, Demo, Family, Guidance, PadTo, StepAdapter, pad_rows


class StableDiffusionSteps(StepAdapter):
    """The UNet's loop: DDIM-style schedulers, CFG rows (uncond, cond) in one batch."""

    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype):
        if not hasattr(pipeline, "prepare_extra_step_kwargs"):  # a UNet pipeline no family names
            raise ValueError(f"step batching does not know {type(pipeline).__name__}'s denoising loop "
                             "(use batching 'request')")
        super().__init__(pipeline, device, dtype)

    def group(self, job) -> tuple:
        return job.height, job.width, job.cond.shape[0]

    def start(self, job) -> None:
        from triton_omni.transfers import to_device

        scheduler = copy.deepcopy(self.pipeline.scheduler)
        # The scheduler keeps its timesteps on the CPU and gets them as ints: its tables live
        # there, and indexing them with a device tensor (DDIM does it three times a step) waits
        # for the GPU to drain, once per request per step. Only the UNet needs them on the device.
        scheduler.set_timesteps(job.steps, device="cpu")
        job.scheduler, job.schedule = scheduler, scheduler.timesteps.tolist()
        job.timesteps = to_device(scheduler.timesteps, self.device)
        factor = self.pipeline.vae_scale_factor
        shape = (1, self.pipeline.unet.config.in_channels, job.height // factor, job.width // factor)
        noise = torch.randn(shape, generator=job.generator, device=self.device, dtype=self.dtype)
        job.latents = noise * scheduler.init_noise_sigma
        job.step_kwargs = self.pipeline.prepare_extra_step_kwargs(job.generator, 0.0)

    def predict(self, jobs: list, pad_to: PadTo) -> list[torch.Tensor]:
        """One UNet forward for every row of ``jobs``: each job's guided noise prediction."""
        samples, timesteps, embeds = [], [], []
        for job in jobs:
            x = job.scheduler.scale_model_input(job.latents, job.schedule[job.done])
            rows = [job.uncond, job.cond] if job.uncond is not None else [job.cond]
            samples += [x] * len(rows)
            timesteps += [job.timesteps[job.done]] * len(rows)
            embeds += rows
        n = len(samples)
        size = pad_to(n)
        out = self.pipeline.unet(torch.cat(pad_rows(samples, size)), torch.stack(pad_rows(timesteps, size)),
                                 encoder_hidden_states=torch.stack(pad_rows(embeds, size)), return_dict=False)[0][:n]
        preds, row = [], 0
        for job in jobs:
            if job.uncond is None:
                preds.append(out[row : row + 1])
                row += 1
            else:
                uncond, cond = out[row : row + 1], out[row + 1 : row + 2]
                preds.append(uncond + job.guidance_scale * (cond - uncond))
                row += 2
        return preds

    def step(self, job, pred: torch.Tensor) -> None:
        job.latents = job.scheduler.step(pred, job.schedule[job.done], job.latents, **job.step_kwargs,
                                         return_dict=False)[0]

    def decode(self, jobs: list) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = torch.cat([job.latents for job in jobs]) / vae.config.scaling_factor
        return (vae.decode(latents, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)


def build_tiny(out: Path) -> None:
    """The tiny demo pipeline: its cross-attention width equals the demo AR model's hidden size,
    so ``ar_encoder``'s embeddings condition it directly."""
    from triton_omni.demo_models import AR_SHAPE, UNET_TINY, VAE_TINY

    build_pipeline(out, AR_SHAPE, UNET_TINY, VAE_TINY, tiny=True)


def build_realistic(out: Path) -> None:
    """Stable Diffusion 1.5's UNet (860 M) and VAE, random weights, conditioned at the realistic AR
    model's width (its ``ar_encoder`` beside it in GPU benchmarks)."""
    from triton_omni.demo_models import AR_REALISTIC_SHAPE, UNET_SD15, VAE_SD15

    build_pipeline(out, AR_REALISTIC_SHAPE, UNET_SD15, VAE_SD15, tiny=False)


def build_pipeline(out: Path, ar_shape: dict, unet_shape: dict, vae_shape: dict, tiny: bool) -> None:
    """A StableDiffusionPipeline whose cross-attention width equals ``ar_shape``'s hidden size; its
    own small CLIP text encoder takes text prompts. ``tiny``: its cross-attention amplified, so
    that its image follows the prompt (demo_models.amplify)."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from triton_omni.demo_models import AR_SHAPE, amplify, build_tokenizer

    hidden = ar_shape["hidden_size"]
    tokenizer = build_tokenizer(out / "tokenizer", AR_SHAPE["vocab_size"], max_length=77)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(in_channels=4, out_channels=4, cross_attention_dim=hidden, attention_head_dim=8,
                                norm_num_groups=32, **unet_shape)
    if tiny:
        amplify(unet, 2.0, lambda name: ".attn2." in name)  # the cross-attention: the text's way in
    blocks = len(vae_shape["block_out_channels"])
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks, norm_num_groups=32, **vae_shape,
    )
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=AR_SHAPE["vocab_size"], hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
    ))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False)
    pipeline = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipeline.save_pretrained(out)


class StableDiffusion(Family):
    name = "stable_diffusion"
    pipeline_class = "StableDiffusionPipeline"
    capabilities = Capabilities(Guidance.CFG, guides_above=1.0, cuda_graphs=True)
    step_adapter = StableDiffusionSteps
    negatives_in_one_batch = True  # CFG runs the prompt and its negative as rows of one UNet batch
    # The demo's ar_encoder is the demo LLM (its last hidden state), not the pipeline's CLIP.
    demo = Demo("sd", "tiny-sd", build_tiny, encoder=False)
    demo_folders: ClassVar[dict] = {"realistic-sd": build_realistic}

    @property
    def network(self) -> torch.nn.Module:
        return self.pipeline.unet

    def hidden_size(self) -> int:
        return int(self.network.config.cross_attention_dim)

    def size_multiple(self) -> int:
        """8, as the pipeline's own ``check_inputs`` asks (a small VAE's factor is below it)."""
        return max(8, int(self.pipeline.vae_scale_factor))

    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        self.require_text_encoder()
        embeds, _ = self.pipeline.encode_prompt(prompt, device, 1, False)
        return embeds[0]

    def call_kwargs(self, conds, unconds, guidance_scale) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"prompt_embeds": torch.stack(conds), "guidance_scale": guidance_scale}
        if unconds is not None:
            kwargs["negative_prompt_embeds"] = torch.stack(unconds)
        return kwargs
