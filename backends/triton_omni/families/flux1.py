"""FLUX.1 (``FluxPipeline``): two text encoders, neither a causal LM. T5's last hidden states,
every prompt padded to 512 tokens (the padding's states included: the DiT reads all 512 rows),
are the sequence the DiT attends to; CLIP's pooled output, one vector a prompt, goes into the
DiT's modulation beside the timestep (``pooled_projections``). A Flux MMDiT (double-stream
blocks, then single-stream ones; packed 2x2 latents with position ids; flow matching).

- FLUX.1 [dev]: guidance-distilled; the scale is an input of the DiT (``guidance``), one pass a
  step, so requests of any scale share a step.
- FLUX.1 [schnell]: no guidance at all (its DiT has no guidance input), a few steps.

The pipeline runs a negative pass only for ``true_cfg_scale`` above 1 with a negative prompt,
which the served contract does not expose (its one scale is FLUX.1's distilled guidance): a
negative prompt is ignored, as the pipeline ignores it by default.

The pipeline is the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from triton_omni.families.base import (
    Capabilities,
    Demo,
    EncoderRecipe,
    Family,
    Guidance,
    TwoPassStepAdapter,
    flow_schedule,
    pad_rows,
)

MAX_TOKENS = 512  # the pipeline's max_sequence_length: T5's prompts are padded to it
CLIP_TOKENS = 77  # CLIP's window: the pipeline cuts a longer prompt short there (T5 still reads it all)

# The pipeline's own encode_prompt, on its CLIP and T5 (ar_encoder loads the pipeline without its
# DiT and VAE). No negative: the pipeline encodes none by default.
RECIPE = EncoderRecipe("flux1", lambda tokenizer, prompt: prompt, padded_to=MAX_TOKENS, absent_negative=None,
                       by_pipeline=True, tokenizer="tokenizer_2")


class Flux1Steps(TwoPassStepAdapter):
    """The Flux DiT's loop: packed latents with their position ids, zero text ids, each row's
    pooled CLIP vector, and the scale per row into a guidance-distilled DiT. One pass a step:
    the family never guides with a negative (``TwoPassStepAdapter`` runs the prompts' pass only)."""

    def start(self, job) -> None:
        pipeline = self.pipeline
        channels = pipeline.transformer.config.in_channels // 4
        job.latents, image_ids = pipeline.prepare_latents(1, channels, job.height, job.width, job.cond.dtype,
                                                          self.device, job.generator)
        sigmas = None if pipeline.scheduler.config.get("use_flow_sigmas") else \
            np.linspace(1.0, 1 / job.steps, job.steps)
        flow_schedule(pipeline, job, self.device, job.latents.shape[1], sigmas)
        job.step_kwargs = {"img_ids": image_ids,
                           "txt_ids": torch.zeros(job.cond.shape[0], 3, device=self.device, dtype=job.cond.dtype)}
        if pipeline.transformer.config.guidance_embeds:  # [dev]: the scale is an input, per row
            job.step_kwargs["guidance"] = torch.full([1], job.guidance_scale, device=self.device, dtype=torch.float32)
        self.start_passes(job)

    def arguments(self, jobs: list, embeds: torch.Tensor, size: int, branch: str) -> dict:
        first = jobs[0].step_kwargs  # one group: one size and one text length, so one set of ids
        return {"hidden_states": torch.cat(pad_rows([job.latents for job in jobs], size)),
                "timestep": torch.cat(pad_rows([job.schedule[job.done].expand(1).to(job.latents.dtype)
                                                for job in jobs], size)) / 1000,
                "guidance": None if "guidance" not in first else
                torch.cat(pad_rows([job.step_kwargs["guidance"] for job in jobs], size)),
                "pooled_projections": torch.stack(pad_rows([job.pooled for job in jobs], size)),
                "encoder_hidden_states": embeds, "txt_ids": first["txt_ids"], "img_ids": first["img_ids"]}

    def decode(self, jobs: list) -> torch.Tensor:
        pipeline, vae = self.pipeline, self.pipeline.vae
        latents = torch.cat([pipeline._unpack_latents(job.latents, job.height, job.width, pipeline.vae_scale_factor)
                             for job in jobs])
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (images / 2 + 0.5).clamp(0, 1)


def build_tiny(out: Path, guidance_embeds: bool = True) -> None:
    """A ``FluxPipeline`` at about the shape of diffusers' pipeline test: a CLIP text model (77
    positions, 32 wide: the pooled vector) and a T5 encoder (32 wide: the sequence), each with a
    tokenizer built here that adds the special tokens the real ones add (CLIP: BOS and EOS, the
    pooled output read at the EOS; T5: EOS); one double-stream and two single-stream blocks; a
    two-level VAE with FLUX.1's scaling and shift (32² pixels: 8² packed latents); the
    flow-matching scheduler with FLUX's dynamic shift. ``guidance_embeds``: [dev]'s guidance
    input (off: [schnell])."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from triton_omni.demo_models import AR_SHAPE, amplify, build_tokenizer

    vocab, width = AR_SHAPE["vocab_size"], 32
    clip_tokenizer = build_tokenizer(out / "tokenizer", vocab, max_length=CLIP_TOKENS, bos="<|startoftext|>",
                                     eos_after=True)
    t5_tokenizer = build_tokenizer(out / "tokenizer_2", vocab, max_length=MAX_TOKENS, eos_after=True)
    ids = {"bos_token_id": clip_tokenizer.bos_token_id, "eos_token_id": clip_tokenizer.eos_token_id,
           "pad_token_id": clip_tokenizer.pad_token_id}
    torch.manual_seed(0)
    clip = CLIPTextModel(CLIPTextConfig(hidden_size=width, intermediate_size=37, num_hidden_layers=2,
                                        num_attention_heads=4, vocab_size=vocab, max_position_embeddings=CLIP_TOKENS,
                                        projection_dim=width, **ids)).eval()
    torch.manual_seed(0)
    t5 = T5EncoderModel(T5Config(d_model=width, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=vocab,
                                 eos_token_id=t5_tokenizer.eos_token_id, pad_token_id=t5_tokenizer.pad_token_id,
                                 decoder_start_token_id=t5_tokenizer.pad_token_id)).eval()
    # T5 reads its 512 rows unmasked: at random init every padding row is nearly the same, and the
    # DiT, whose attention spreads over them all, barely sees the prompt (another prompt's sequence
    # moved the image by 2 levels). Sharper attention in T5 carries the prompt into the padding's
    # rows (36 levels; tests/unit/test_demo_sensitivity.py)
    amplify(t5, 6.0, lambda name: name.endswith((".SelfAttention.q", ".SelfAttention.k")))
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=width,
                                         pooled_projection_dim=width, guidance_embeds=guidance_embeds,
                                         axes_dims_rope=(4, 4, 8))
    # At random init the tiny DiT barely reads its text: the attention, where the text meets the
    # image, the single-stream blocks and the pooled vector's projection are scaled so that another
    # prompt, pooled vector or guidance moves the image by tens of levels
    amplify(transformer, 6.0, lambda name: name.startswith("single_transformer_blocks.") or
            (name.startswith("transformer_blocks.") and ".attn." in name))
    amplify(transformer, 2.0, lambda name: name.startswith("time_text_embed.text_embedder."))
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1,
                        latent_channels=4, norm_num_groups=16, sample_size=32, scaling_factor=0.3611,
                        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                max_shift=1.15, shift=3.0, use_dynamic_shifting=True)
    FluxPipeline(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=clip, tokenizer=clip_tokenizer,
                 text_encoder_2=t5, tokenizer_2=t5_tokenizer).save_pretrained(out)


def build_tiny_schnell(out: Path) -> None:
    build_tiny(out, guidance_embeds=False)


def build_realistic(device, dtype, guidance_embeds: bool = True):
    """FLUX.1 [dev]'s DiT (19 double-stream and 38 single-stream blocks, 24 heads of 128, reading
    T5-XXL's 4096 and CLIP-L's pooled 768: diffusers' defaults) and its VAE and scheduler, random
    weights, in memory on ``device``; no text encoders (it serves ``prompt_embeds`` with
    ``pooled_prompt_embeds``). ``guidance_embeds`` off: [schnell], with its scheduler (a shift of 1,
    none dynamic)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from triton_omni.demo_models import built_as

    with built_as(device, dtype):
        transformer = FluxTransformer2DModel(guidance_embeds=guidance_embeds)
        vae = realistic_vae()
        scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                    max_shift=1.15, shift=3.0, use_dynamic_shifting=True) \
            if guidance_embeds else FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
        return FluxPipeline(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=None, tokenizer=None,
                            text_encoder_2=None, tokenizer_2=None)


def realistic_vae():
    """FLUX.1's VAE at its real shape (16 latent channels, 128 to 512 wide), random weights."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                         down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         block_out_channels=(128, 256, 512, 512), layers_per_block=2, sample_size=1024,
                         scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)


def build_realistic_schnell(device, dtype):
    return build_realistic(device, dtype, guidance_embeds=False)


class Flux1(Family):
    name = "flux1"
    pipeline_class = "FluxPipeline"
    # [dev]'s scale goes into the DiT ([schnell]'s nowhere): one pass, nothing for CFG parallel to move
    capabilities = Capabilities(Guidance.DISTILLED, step_cache=True, sequence_parallel=True, compile=True,
                                cuda_graphs=True, vae_compile=True, lora=True, fused_projections=True)
    recipe = RECIPE
    step_adapter = Flux1Steps
    demo = Demo("flux1-dev", "tiny-flux1-dev", build_tiny)
    demo_folders: ClassVar[dict] = {"tiny-flux1-schnell": build_tiny_schnell}
    realistic: ClassVar[dict] = {"demo:realistic-flux1-dev": build_realistic,
                                 "demo:realistic-flux1-schnell": build_realistic_schnell}
    # the double blocks keep a stream each (the single blocks read both, joined)
    flop_streams = (("*.norm1.linear", "row"), ("*.norm1_context.linear", "row"), ("*.norm.linear", "row"),
                    ("*.attn.add_*", "text"), ("*.attn.to_added_qkv", "text"), ("*.attn.to_add_out", "text"),
                    ("*.ff_context.*", "text"),
                    ("transformer_blocks.*", "image"))

    def hidden_size(self) -> int:
        """T5's width: the DiT's, or (ar_encoder loads the pipeline without its DiT) the encoder's."""
        if self.pipeline.transformer is not None:
            return int(self.network.config.joint_attention_dim)
        return int(self.pipeline.text_encoder_2.config.d_model)

    def pooled_size(self) -> int:
        if self.pipeline.transformer is not None:
            return int(self.network.config.pooled_projection_dim)
        return int(self.pipeline.text_encoder.config.hidden_size)

    def size_multiple(self) -> int:
        return int(self.pipeline.vae_scale_factor) * 2  # the VAE's factor, then 2x2 latents packed into one token

    def encode_prompt(self, prompt: str, device: torch.device,
                      images: list = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        [(embeds, pooled)] = self.encode_batch([prompt], device)
        return embeds, pooled

    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        return self.encode_prompt(prompt, device)[0]

    def encode_batch(self, prompts: list[str], device: torch.device,
                     images: list[list] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each prompt's T5 sequence and CLIP vector, by the pipeline's own ``encode_prompt`` (every
        row padded to the same length, unmasked: a row's states do not depend on its company)."""
        self.require_text_encoder()
        embeds, pooled, _ = self.pipeline.encode_prompt(prompts, prompt_2=None, device=device)
        return list(zip(embeds, pooled, strict=True))

    def call_kwargs(self, conds, unconds, guidance_scale) -> dict[str, Any]:
        return {"prompt_embeds": torch.stack(conds), "guidance_scale": guidance_scale}

    def pooled_kwargs(self, pooled: list[torch.Tensor]) -> dict[str, Any]:
        return {"pooled_prompt_embeds": torch.stack(pooled)}
