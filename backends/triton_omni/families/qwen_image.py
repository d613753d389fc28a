"""Qwen-Image: Qwen2.5-VL reads the prompt in a system-prompt template, its last layer with the
template's 34 tokens dropped conditions a 20 B MMDiT (packed latents, flow matching); true CFG
only with a negative prompt (``""`` and ``" "`` included: ``" "`` is the model card's way to turn
it on) and a scale above 1, in two passes, rescaled to the prompt's norm. ``QwenImagePipeline``
is the reference."""

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
    ones_mask,
    pad_rows,
)

# QwenImagePipeline.prompt_template_encode and prompt_template_encode_start_idx (diffusers 0.42)
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROPPED = 34
# The pipeline runs true CFG only when given a negative prompt: an absent one encodes to nothing.
RECIPE = EncoderRecipe("qwen_image", lambda tokenizer, prompt: TEMPLATE.format(prompt), dropped=DROPPED,
                       absent_negative=None)


class QwenImageSteps(TwoPassStepAdapter):
    """The MMDiT's loop: packed latents, the prompt and its negative in two passes, each with its
    own text length, combined with true CFG and rescaled to the prompt's norm."""

    def start(self, job) -> None:
        pipeline = self.pipeline
        factor = pipeline.vae_scale_factor
        job.step_kwargs = {"img_shapes": [(1, job.height // factor // 2, job.width // factor // 2)]}
        job.latents = self.noise(job, pipeline.transformer.config.in_channels // 4)
        flow_schedule(pipeline, job, self.device, job.latents.shape[1], np.linspace(1.0, 1 / job.steps, job.steps))
        self.start_passes(job)

    def noise(self, job, channels: int) -> torch.Tensor:
        """The request's starting latents, drawn as its pipeline draws them."""
        return self.pipeline.prepare_latents(1, channels, job.height, job.width, job.cond.dtype, self.device,
                                             job.generator)

    def group(self, job) -> tuple:
        """Requests share a pass when their sequences have one layout (an edit's image latents too)."""
        return (*super().group(job), tuple(job.step_kwargs["img_shapes"]))

    def arguments(self, jobs: list, embeds: torch.Tensor, size: int, branch: str) -> dict:
        # an edit's image latents follow the output's in the sequence (the prediction keeps the output's)
        rows = [torch.cat([job.latents, job.step_kwargs["references"]], dim=1) if "references" in job.step_kwargs
                else job.latents for job in jobs]
        timesteps = torch.cat(pad_rows([job.schedule[job.done].expand(1).to(job.latents.dtype) for job in jobs],
                                       size))
        return {"hidden_states": torch.cat(pad_rows(rows, size)), "timestep": timesteps / 1000, "guidance": None,
                "encoder_hidden_states_mask": None, "encoder_hidden_states": embeds,
                "img_shapes": [jobs[0].step_kwargs["img_shapes"]] * size}

    def guide(self, job, pred: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
        combined = negative + job.guidance_scale * (pred - negative)
        return combined * (torch.norm(pred, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def decode(self, jobs: list) -> torch.Tensor:
        pipeline, vae = self.pipeline, self.pipeline.vae
        latents = torch.cat([pipeline._unpack_latents(job.latents, job.height, job.width, pipeline.vae_scale_factor)
                             for job in jobs]).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                           latents.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                              latents.dtype)
        images = vae.decode(latents / std + mean, return_dict=False)[0][:, :, 0]
        return (images / 2 + 0.5).clamp(0, 1)


def tiny_transformer(text_width: int):
    """The tiny demos' MMDiT, at the shape of diffusers' pipeline test, reading ``text_width``."""
    from diffusers import QwenImageTransformer2DModel

    from triton_omni.demo_models import amplify

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=text_width, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )
    # the blocks after the first: the step cache compares the first block's output between steps,
    # and keeps the decisions it made on the model as built
    amplify(transformer, 6.0, lambda name: name.startswith("transformer_blocks.") and
            not name.startswith("transformer_blocks.0."))
    return transformer


def build_tiny(out: Path) -> None:
    """A ``QwenImagePipeline`` at the shape of diffusers' pipeline test: a Qwen2.5-VL text encoder,
    an MMDiT, Qwen-Image's VAE and flow-matching scheduler. Its text encoder's hidden size is 64
    wide here (head_dim 32), so that the same checkpoint also loads as ``ar_encoder``."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from triton_omni.demo_models import AR_SHAPE, build_tokenizer

    hidden = 64
    # QwenImagePipeline drops its template's first 34 tokens, Qwen2.5-VL's count for its system prompt
    tokenizer = build_tokenizer(out / "tokenizer", AR_SHAPE["vocab_size"], chat=True, template=TEMPLATE.format(""))
    prefix = TEMPLATE[: TEMPLATE.index("{}")]
    assert len(tokenizer(prefix).input_ids) == DROPPED, "the template's prefix must be what is dropped"
    transformer = tiny_transformer(hidden)
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"hidden_size": hidden, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": AR_SHAPE["vocab_size"],
                     "rope_scaling": {"mrope_section": [4, 6, 6], "rope_type": "default", "type": "default"},
                     "rope_theta": 1000000.0},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": hidden},
        vocab_size=AR_SHAPE["vocab_size"], vision_start_token_id=AR_SHAPE["vocab_size"] - 3,
        vision_end_token_id=AR_SHAPE["vocab_size"] - 2, vision_token_id=AR_SHAPE["vocab_size"] - 1,
    )).eval()
    pipeline = QwenImagePipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                                 text_encoder=text_encoder, tokenizer=tokenizer)
    pipeline.save_pretrained(out)


def build_realistic(device, dtype):
    """The 20.4 B MMDiT (diffusers' class defaults) and Qwen-Image's VAE and scheduler, random
    weights, in memory on ``device``; no text encoder (it serves ``prompt_embeds``)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    from triton_omni.demo_models import built_as

    with built_as(device, dtype):  # in dtype directly: an fp32 build of the 20 B DiT fills an 80 GB GPU
        scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler_config.json
            base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
            shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True)
        return QwenImagePipeline(transformer=QwenImageTransformer2DModel(), vae=AutoencoderKLQwenImage(),
                                 scheduler=scheduler, text_encoder=None, tokenizer=None)


class QwenImage(Family):
    name = "qwen_image"
    pipeline_class = "QwenImagePipeline"
    capabilities = Capabilities(Guidance.TRUE_CFG, guides_above=1.0, step_cache=True, cfg_parallel=True,
                                sequence_parallel=True, compile=True, cuda_graphs=True, lora=True)
    recipe = RECIPE
    step_adapter = QwenImageSteps
    demo = Demo("qwen-image", "tiny-qwen-image", build_tiny)
    realistic: ClassVar[dict] = {"demo:realistic-qwen-image": build_realistic}
    # `quantization: fp8` takes every block layer: measured at 1024², keeping the image stream's MLP in
    # bf16 (as vLLM-Omni does, for the real weights' quality) left FP8 no faster than bf16, since that
    # MLP holds two thirds of the image stream's FLOPs; with random weights FP8 was as near bf16
    # either way. With the real weights, `fp8_kept: "*.img_mlp.*"` trades the speed back.
    fp8_kept = ()
    flop_streams = (("*.img_mod.*", "row"), ("*.txt_mod.*", "row"), ("*.attn.add_*", "text"),
                    ("*.attn.to_add_out", "text"), ("*.txt_mlp.*", "text"), ("*", "image"))

    def hidden_size(self) -> int:
        return int(self.network.config.joint_attention_dim)

    def size_multiple(self) -> int:
        return int(self.pipeline.vae_scale_factor) * self.network.config.patch_size

    def encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        self.require_text_encoder()
        embeds, mask = self.pipeline.encode_prompt(prompt=prompt, device=device, num_images_per_prompt=1)
        return embeds[0] if mask is None else embeds[0][mask[0].bool()]

    def call_kwargs(self, conds, unconds, guidance_scale) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"prompt_embeds": torch.stack(conds), "true_cfg_scale": guidance_scale,
                                  "prompt_embeds_mask": ones_mask(conds)}
        if unconds is not None:
            kwargs["negative_prompt_embeds"] = torch.stack(unconds)
            kwargs["negative_prompt_embeds_mask"] = ones_mask(unconds)
        return kwargs

