"""Wan 2.1 text-to-video (``WanPipeline``): UMT5 reads the raw prompt, its last hidden states,
cut to the prompt's tokens and padded with zero rows to 512, condition a video DiT (3D patches of
1x2x2 latents, self-attention over every frame's tokens, cross-attention to the text); flow
matching stepped by UniPC; CFG above 1, against ``""`` unless a negative prompt is given, in two
passes. Its VAE folds four frames into one latent frame after the first, so a video has
``1 + 4k`` frames (81 by default, played at 16 per second).

The pipeline is the reference."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar

import torch

from triton_omni.families.base import (
    Capabilities,
    Demo,
    EncoderRecipe,
    Family,
    Guidance,
    Output,
    TwoPassStepAdapter,
    pad_rows,
)

MAX_TOKENS = 512  # the pipeline's max_sequence_length: every prompt's states padded with zeros to it
FPS = 16  # the frame rate Wan 2.1's videos are made for (its model cards export at 16)

# The pipeline's own encoding (UMT5 is no causal LM: ar_encoder loads the pipeline without its DiT and
# VAE); an absent negative prompt encodes "", as the pipeline's does.
RECIPE = EncoderRecipe("wan", lambda tokenizer, prompt: prompt, padded_to=MAX_TOKENS, by_pipeline=True)


class WanSteps(TwoPassStepAdapter):
    """The video DiT's loop: float32 latents ``[1, C, F', H', W']`` handed to the DiT in its dtype,
    the timestep as the scheduler gives it, the prompts' pass and the negatives' pass apart, and
    each request's own copy of the (multistep) scheduler."""

    def start(self, job) -> None:
        pipeline = self.pipeline
        job.latents = pipeline.prepare_latents(1, pipeline.transformer.config.in_channels, job.height, job.width,
                                               job.frames, torch.float32, self.device, job.generator)
        scheduler = copy.deepcopy(pipeline.scheduler)
        scheduler.set_timesteps(job.steps, device=self.device)
        scheduler.set_begin_index(0)
        job.scheduler, job.timesteps, job.schedule = scheduler, scheduler.timesteps, list(scheduler.timesteps)
        self.start_passes(job)

    def arguments(self, jobs: list, embeds: torch.Tensor, size: int, branch: str) -> dict:
        dtype = self.pipeline.transformer.dtype
        return {"hidden_states": torch.cat(pad_rows([job.latents.to(dtype) for job in jobs], size)),
                "timestep": torch.cat(pad_rows([job.schedule[job.done].expand(1) for job in jobs], size)),
                "encoder_hidden_states": embeds.to(dtype)}

    def guide(self, job, pred: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
        return negative + job.guidance_scale * (pred - negative)

    def output_shape(self, kwargs: dict) -> tuple[int, ...]:
        """The DiT unpatchifies its output: latents of every frame, ``out_channels`` deep."""
        rows, _, *frames_and_sides = kwargs["hidden_states"].shape
        return rows, int(self.pipeline.transformer.config.out_channels), *frames_and_sides

    def decode(self, jobs: list) -> torch.Tensor:
        pipeline, vae = self.pipeline, self.pipeline.vae
        latents = torch.cat([job.latents for job in jobs]).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                           latents.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                              latents.dtype)
        video = vae.decode(latents / std + mean, return_dict=False)[0]
        return pipeline.video_processor.postprocess_video(video, output_type="pt")  # [N, F, 3, H, W] in [0, 1]


def build_tiny(out: Path) -> None:
    """A ``WanPipeline`` at the shape of diffusers' pipeline test: a UMT5 encoder (32 wide) with a
    tokenizer built here that ends every text with its EOS, as UMT5's does; a two-block video DiT;
    Wan's VAE at its smallest (4x temporal, 8x spatial); UniPC on flow sigmas, as Wan 2.1 ships."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from triton_omni.demo_models import AR_SHAPE, amplify, build_tokenizer

    vocab, width = AR_SHAPE["vocab_size"], 32
    tokenizer = build_tokenizer(out / "tokenizer", vocab, max_length=MAX_TOKENS, eos_after=True)
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(
        d_model=width, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=vocab,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        decoder_start_token_id=tokenizer.pad_token_id)).eval()
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=16, out_channels=16, text_dim=width, freq_dim=256, ffn_dim=32,
                                        num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                        rope_max_seq_len=32)
    # At random init the tiny models barely carry the prompt (another prompt moved the frames by 1
    # level): sharper attention in UMT5, and a stronger cross-attention and second block in the DiT,
    # make each input move them by tens of levels (tests/unit/test_demo_sensitivity.py)
    amplify(text_encoder, 6.0, lambda name: name.endswith((".SelfAttention.q", ".SelfAttention.k")))
    amplify(transformer, 6.0, lambda name: ".attn2." in name or name.startswith("blocks.1."))
    amplify(transformer, 8.0, lambda name: name.startswith("condition_embedder.text_embedder."))
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    with torch.no_grad():  # a VAE this small decodes to nearly flat grey: three times the contrast
        vae.decoder.conv_out.weight.mul_(3.0)
        vae.decoder.conv_out.bias.mul_(3.0)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                transformer=transformer).save_pretrained(out)


# Wan 2.1 T2V's DiTs (their config.json): 1.3B and 14B
SHAPES = {"1.3b": {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
          "14b": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}}


def build_realistic(device, dtype, size: str = "1.3b", flow_shift: float = 3.0):
    """Wan 2.1 T2V's DiT at ``size``'s real shape, Wan's VAE (diffusers' defaults are Wan 2.1's) and
    UniPC with the model card's shift (3.0 for 480p, 5.0 for 720p), random weights, in memory on
    ``device``; no text encoder (it serves ``prompt_embeds``: UMT5-XXL's 4096 wide)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    from triton_omni.demo_models import built_as

    with built_as(device, dtype):
        transformer = WanTransformer3DModel(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16,
                                            out_channels=16, text_dim=4096, freq_dim=256, cross_attn_norm=True,
                                            qk_norm="rms_norm_across_heads", eps=1e-6, **SHAPES[size])
        vae = AutoencoderKLWan()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=flow_shift)
    return WanPipeline(tokenizer=None, text_encoder=None, vae=vae.to(torch.float32), scheduler=scheduler,
                       transformer=transformer)


def build_realistic_14b(device, dtype):
    return build_realistic(device, dtype, "14b", flow_shift=5.0)


class Wan(Family):
    name = "wan"
    pipeline_class = "WanPipeline"
    # the prompts' and the negatives' passes apart: CFG parallel; First Block Cache on its blocks, as
    # diffusers' hook runs them; its blocks compiled; LoRA adapters per request. Not yet: CUDA graphs,
    # sequence parallel
    capabilities = Capabilities(Guidance.CFG, cfg_parallel=True, step_cache=True, compile=True, lora=True)
    # self-attention and the feed-forward read the video's tokens; the cross-attention's keys and values
    # the text's; the modulation is a learnt table, no layer
    flop_streams = (("*.attn2.to_k", "text"), ("*.attn2.to_v", "text"), ("blocks.*", "image"))
    attention_streams = (("*.attn1", "image"), ("*.attn2", "cross"))
    recipe = RECIPE
    step_adapter = WanSteps
    output = Output("video", fps=FPS, default_frames=81)
    demo = Demo("wan", "tiny-wan", build_tiny)
    realistic: ClassVar[dict] = {"demo:realistic-wan2.1-1.3b": build_realistic,
                                 "demo:realistic-wan2.1-14b": build_realistic_14b}

    def hidden_size(self) -> int:
        """UMT5's width: the DiT's, or (ar_encoder loads the pipeline without its DiT) the encoder's."""
        if self.pipeline.transformer is not None:
            return int(self.network.config.text_dim)
        return int(self.pipeline.text_encoder.config.d_model)

    def size_multiple(self) -> int:
        return int(self.pipeline.vae_scale_factor_spatial) * int(self.network.config.patch_size[1])

    def frames_step(self) -> int:
        return int(self.pipeline.vae_scale_factor_temporal)

    def attention_shape(self) -> tuple[int, int]:
        config = self.network.config
        return int(config.num_attention_heads), int(config.attention_head_dim)

    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        [(embeds, _)] = self.encode_batch([prompt], device)
        return embeds

    def encode_batch(self, prompts: list[str], device: torch.device,
                     images: list[list] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each prompt's UMT5 states, by the pipeline's own encoding: cut to its tokens, zero rows up
        to 512 (the encoder's attention is masked: a row's states do not depend on its company)."""
        self.require_text_encoder()
        embeds = self.pipeline._get_t5_prompt_embeds(prompts, max_sequence_length=MAX_TOKENS, device=device)
        return [(row, None) for row in embeds]

    def call_kwargs(self, conds, unconds, guidance_scale) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"prompt_embeds": torch.stack(conds), "guidance_scale": guidance_scale}
        if unconds is not None:
            kwargs["negative_prompt_embeds"] = torch.stack(unconds)
        return kwargs

    def call_output(self, result: Any) -> torch.Tensor:
        return result.frames
